from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from stages.core.config.rl_engine import VerlSection
from stages.core.config.section import Section


class RolloutSection(Section):
    """Multi-turn tool rollouts (ARPO defaults from the 7B reasoning script)."""

    strategy: str = Field("arpo", description="rollout strategy registry name (grpo | arpo | aepo); in a run config "
                          "rl.algorithm sets it: leave it unset")
    backend: Literal["transformers", "vllm"] = "transformers"
    n: int = Field(16, ge=1, description="trajectories per prompt (GRPO group size, total budget)")
    initial_rollouts: int = Field(8, ge=1, description="root trajectories per prompt")
    beam_size: int = Field(2, ge=1, description="a trajectory makes at most beam_size-1 copies per round")
    branch_probability: float = Field(0.5, ge=0, le=1, description="tau")
    entropy_weight: float = Field(0.2, description="w in P = clip(tau + w * dH)")
    entropy_window: Literal["paper", "reference"] = Field(
        "reference", description="reference (the ARPO code): every segment measured, the decision one round late, "
        "copies take their own baseline; paper: the segment after each result, fork at its start")
    entropy_aggregation: Literal["sum", "mean"] = Field(
        "sum", description="a segment's H from its first entropy_tokens token entropies: sum (the reference; tau "
        "and w were tuned on it) or mean (dH ~k times smaller)")
    entropy_tokens: int = Field(20, ge=1, description="k: tokens of a segment that are measured")
    entropy_quantity: str = Field("topk", description="per-token entropy, registry stages.generation.token_entropy: "
                                  "topk (the reference) | full (whole vocabulary, transformers backend only) | "
                                  "surprisal (-log p of the sampled token; rl.engine verl: the stock server, topk: "
                                  "our top-k server replica)")
    entropy_topk: int = Field(10, ge=1, description="k of the topk entropy (the reference asks vLLM for 10)")
    call_limit: int = Field(3, ge=0, description="tool calls per trajectory")
    max_prompt_length: int = 1536
    max_response_length: int = 4096
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    dynamic_rollouts: bool = Field(False, description="AEPO entropy pre-monitoring for initial_rollouts")
    dynamic_beta: float = 0.5
    probe_tokens: int = 50
    branch_penalty: float = Field(0.0, ge=0, description="AEPO consecutive-branch penalty per branch; unset = 0.05 "
                                  "under the aepo strategy (the reference), else 0")
    fresh_fill: Literal["one", "all"] = Field(
        "one", description="a group with no active trajectory left starts one fresh root per round (reference) "
        "or fills its whole leftover budget at once")
    prompt_overflow: Literal["error", "truncate_left", "skip"] = Field(
        "error", description="a prompt longer than max_prompt_length: fail naming the row, keep its last "
        "max_prompt_length tokens, or leave the row out with a warning")
    kv_reuse: bool = Field(True, description="transformers backend: keep KV caches across rounds and share "
                           "them with branches; false re-prefills every context each round (baseline)")

    @model_validator(mode="before")
    @classmethod
    def _strategy_defaults(cls, data: Any) -> Any:
        """An unset (or null) branch_penalty is AEPO's 0.05 under the aepo strategy, else 0."""
        if isinstance(data, dict) and data.get("branch_penalty") is None:
            data = {k: v for k, v in data.items() if k != "branch_penalty"}
            if data.get("strategy") == "aepo":
                data["branch_penalty"] = 0.05
        return data

    @model_validator(mode="after")
    def _budget(self) -> RolloutSection:
        if self.initial_rollouts > self.n:
            raise ValueError(f"rl.rollout.initial_rollouts={self.initial_rollouts} exceeds rl.rollout.n={self.n}; "
                             "lower initial_rollouts or raise n")
        if self.entropy_quantity == "full" and self.backend == "vllm":
            raise ValueError("rl.rollout.entropy_quantity=full needs the whole distribution, but the vllm backend "
                             "returns top-k log-probs only; use entropy_quantity=topk or backend=transformers")
        return self


class AdvantageSection(Section):
    estimator: str = Field("grpo", description="advantage registry name")
    attribution: Literal["soft", "hard"] = "soft"
    entropy_aware: bool = Field(False, description="AEPO A * (1 + alpha * sg(H_std)); rl.algorithm=aepo turns it on")
    entropy_alpha: float = 0.2
    eps: float = 1e-6


class LossSection(Section):
    policy_loss: str = Field("ppo_dual_clip", description="policy loss registry name; rl.algorithm=aepo makes it "
                             "aepo_balanced_clip")
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = "token_mean"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    kl_coef: float = Field(0.0, ge=0, description="0 = no reference model is loaded")
    kl_type: Literal["k1", "k3"] = "k3"
    entropy_coef: float = 0.0


class OptimSection(Section):
    lr: float = 1e-6
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    betas: tuple[float, float] = (0.9, 0.999)


AlarmName = Literal["tool_collapse", "entropy_collapse", "format_errors_rising", "reward_at_floor",
                   "no_signal_groups", "reward_collapse", "nonfinite_loss"]


class AlarmSection(Section):
    """Collapse alarms, checked after every RL step (stages/rl/alarms.py): a warning in the log, `alarm/<name>` in
    metrics.jsonl, a Prefect event `arpo.rl.alarm.<name>` and the `rl-alarms` artifact; `stop_on` ends the run."""

    enabled: bool = True
    stop_on: tuple[AlarmName, ...] = Field(
        ("nonfinite_loss",), description="alarms that stop the run (a non-retried error; the step is not saved); "
        "[] = only warn")
    tool_drop_ratio: float = Field(0.1, ge=0, description="tool_collapse: tool calls per trajectory below this "
                                   "fraction of their best earlier value, once that was >= tool_min_peak")
    tool_min_peak: float = Field(0.5, ge=0)
    entropy_drop_ratio: float = Field(0.1, ge=0, description="entropy_collapse: mean token entropy below this "
                                      "fraction of the first step's, or below entropy_floor")
    entropy_floor: float = Field(1e-3, ge=0)
    format_error_rise: float = Field(0.3, ge=0, description="format_errors_rising: the format-error rate averaged "
                                     "over the last `window` steps this much above the lowest earlier such average")
    reward_floor: float = Field(-1.0, description="reward_at_floor: the lowest reward the reward function gives "
                                "(-1 = format error under the reference reward) ...")
    reward_floor_tol: float = Field(0.02, ge=0, description="... mean reward within this of it for `window` steps")
    no_signal_fraction: float = Field(0.8, ge=0, le=1, description="no_signal_groups: this fraction of groups or "
                                      "more had all-equal rewards (zero advantage) for `window` steps in a row")
    reward_drop: float = Field(0.5, ge=0, description="reward_collapse: mean reward this far below its best earlier "
                               "value")
    window: int = Field(3, ge=1, description="steps the sustained alarms look at (format errors, floor, no signal)")


class TrainerSection(Section):
    total_steps: int | None = Field(None, ge=1, description="None = epochs over the train set")
    epochs: int = 2
    train_batch_size: int = Field(128, ge=1, description="prompts per step")
    ppo_mini_batch_size: int = Field(16, ge=1, description="prompts per optimizer update")
    micro_batch_size: int = Field(4, ge=1, description="trajectories per forward/backward")
    ppo_epochs: int = 1
    save_every: int = Field(5, ge=1)
    report_every: int = Field(1, ge=1, description="refresh the curves and rollout-sample artifacts every N steps "
                              "(and at the last step)")
    keep_checkpoints: int = Field(1, ge=1, description="complete checkpoints kept (older ones are deleted); "
                                  "the newest is the one a crashed run resumes from")
    reward: str = Field("reference", description="reward registry name: reference | math_equiv")
    gradient_checkpointing: bool = False
    dump_rollouts: bool = True


# What rl.algorithm sets where the config leaves a key unset (or null); AEPO as the reference AEPO script runs it
# (research/arpo.md 3: entropy-balanced clipping and advantage on, dynamic rollouts off, branch penalty 0.05 via
# the aepo strategy).
IMPLIED_BY_ALGORITHM: dict[str, dict[str, dict[str, Any]]] = {
    "grpo": {"rollout": {"strategy": "grpo"}},
    "arpo": {"rollout": {"strategy": "arpo"}},
    "aepo": {"rollout": {"strategy": "aepo"}, "loss": {"policy_loss": "aepo_balanced_clip"},
             "advantage": {"entropy_aware": True}},
}


def _fill_unset(section: Any, implied: dict[str, Any]) -> Any:
    given = section.model_dump(exclude_unset=True) if isinstance(section, BaseModel) else dict(section or {})
    return {**given, **{key: value for key, value in implied.items() if given.get(key) is None}}


class RLSection(Section):
    enabled: bool = True
    engine: Literal["local", "verl"] = Field(
        "local", description="local: one-process trainer on one device; verl: verl 0.9.1 FSDP over Ray (paper "
        "profiles); names of stages.rl.engines.RL_ENGINES")
    local_memory_gb: float = Field(80.0, gt=0, description="memory of the one device the local engine trains on; "
                                   "a policy that cannot fit is refused before any work (stages/core/config/"
                                   "rl_engine.py)")
    verl: VerlSection = VerlSection()
    algorithm: Literal["grpo", "arpo", "aepo"] = Field(
        "arpo", description="the one source of the algorithm: it sets rollout.strategy and, for aepo, the AEPO "
        "defaults (balanced clip, entropy-aware advantage, branch penalty 0.05); contradicting settings are errors")
    rollout: RolloutSection = RolloutSection()
    advantage: AdvantageSection = AdvantageSection()
    loss: LossSection = LossSection()
    optim: OptimSection = OptimSection()
    alarms: AlarmSection = AlarmSection()
    trainer: TrainerSection = TrainerSection()

    @model_validator(mode="before")
    @classmethod
    def _implied_by_algorithm(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        implied = IMPLIED_BY_ALGORITHM.get(data.get("algorithm", "arpo"), {})
        return {**data, **{name: _fill_unset(data.get(name), values) for name, values in implied.items()}}

    @model_validator(mode="after")
    def _one_algorithm(self) -> RLSection:
        if self.engine == "verl" and self.rollout.entropy_quantity == "full":
            raise ValueError("rl.rollout.entropy_quantity=full needs the whole distribution, which verl's servers do "
                             "not return; with rl.engine=verl use topk (our top-k server replica) or surprisal "
                             "(the stock server)")
        algo = self.algorithm
        if self.rollout.strategy != algo:
            raise ValueError(f"rl.rollout.strategy={self.rollout.strategy} contradicts rl.algorithm={algo}: the "
                             f"algorithm picks the rollout strategy. Set rl.algorithm={self.rollout.strategy} and "
                             "leave rl.rollout.strategy unset")
        if algo != "aepo":
            aepo_only = [text for text, on in (
                ("rl.loss.policy_loss=aepo_balanced_clip", self.loss.policy_loss == "aepo_balanced_clip"),
                ("rl.advantage.entropy_aware=true", self.advantage.entropy_aware),
                (f"rl.rollout.branch_penalty={self.rollout.branch_penalty}", self.rollout.branch_penalty > 0),
                ("rl.rollout.dynamic_rollouts=true", self.rollout.dynamic_rollouts)) if on]
            if aepo_only:
                raise ValueError(f"{', '.join(aepo_only)}: AEPO setting(s) under rl.algorithm={algo}. Set "
                                 "rl.algorithm=aepo (it turns the AEPO defaults on) or remove them")
        return self


class MergeSection(Section):
    """Trainer checkpoint -> plain HF safetensors folder, checked by a log-prob parity probe."""

    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    parity_atol: float = Field(1e-4, gt=0, description="max |logp merged - logp trainer| on probe tokens")
