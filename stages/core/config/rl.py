from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from stages.core.algorithm_spec import ALGORITHMS, foreign_settings
from stages.core.config.generation import DEFAULT_GENERATE_TIMEOUT_S, GenerationSettings
from stages.core.config.rl_engine import VerlSection
from stages.core.config.section import Section, registry, used_when
from stages.core.engine_spec import ENGINES


class RolloutSection(Section):
    """Multi-turn tool rollouts (ARPO defaults from the 7B reasoning script). How the groups grow (independent
    samples or a tree, and its branch rule) is `rl.algorithm`'s (stages/core/algorithm_spec.py), not a key here."""

    backend: str = Field("transformers", description="generation backend: transformers | vllm",
                         json_schema_extra=registry("generation backend"))
    n: int = Field(16, ge=1, description="trajectories per prompt (GRPO group size, total budget)")
    initial_rollouts: int = Field(8, ge=1, description="root trajectories per prompt")
    beam_size: int = Field(2, ge=1, description="a trajectory makes at most beam_size-1 copies per round")
    branch_probability: float = Field(0.5, ge=0, le=1, description="tau, the branch rules' threshold (docs/rollout.md)")
    entropy_weight: float = Field(0.2, description="w, dH's weight in the branch rules")
    entropy_window: Literal["paper", "reference"] = Field(
        "reference", description="reference (the ARPO code): every segment measured, the decision one round late, "
        "copies take their own baseline; paper: the segment after each result, fork at its start")
    entropy_aggregation: Literal["sum", "mean"] = Field(
        "sum", description="a segment's H from its first entropy_tokens token entropies: sum (the reference; tau "
        "and w were tuned on it) or mean (dH ~k times smaller)")
    entropy_tokens: int = Field(20, ge=1, description="k: tokens of a segment that are measured")
    entropy_quantity: str = Field("topk", description="per-token entropy (stages/generation/token_entropy.py): "
                                  "topk (the reference) | full (whole vocabulary, transformers backend only) | "
                                  "surprisal (-log p of the sampled token; rl.engine verl: the stock server, topk: "
                                  "our top-k server replica)", json_schema_extra=registry("entropy quantity"))
    entropy_topk: int = Field(10, ge=1, description="k of the topk entropy (the reference asks vLLM for 10)",
                              json_schema_extra=used_when(entropy_quantity="topk"))
    call_limit: int = Field(3, ge=0, description="tool calls per trajectory")
    max_prompt_length: int = Field(1536, ge=1, description="prompt tokens (see prompt_overflow)")
    max_response_length: int = Field(4096, ge=1, description="response tokens per trajectory, tool results included")
    temperature: float = Field(1.0, ge=0, description="sampling temperature of the rollouts (0 = greedy)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling of the rollouts (1 = off); below 1 the "
                         "sampler's log-probs are those of the truncated distribution (see trainer.old_logprobs)")
    top_k: int = Field(-1, ge=-1, description="-1 = off")
    dynamic_rollouts: bool = Field(False, description="AEPO entropy pre-monitoring for initial_rollouts")
    dynamic_beta: float = Field(0.5, description="beta of the pre-monitoring sigmoid",
                                json_schema_extra=used_when(dynamic_rollouts=True))
    probe_tokens: int = Field(50, ge=1, description="tokens of each pre-monitoring probe",
                              json_schema_extra=used_when(dynamic_rollouts=True))
    branch_penalty: float = Field(0.0, ge=0, description="p, AEPO's consecutive-branch penalty in its "
                                  "branch rule (docs/rollout.md); unset or null = rl.algorithm's default (stages/core/"
                                  "algorithm_spec.py)")
    penalty_counter: Literal["consecutive_rounds", "branches"] = Field(
        "consecutive_rounds", description="AEPO's c: consecutive_rounds (the reference: rounds in a row that added "
        "copies or fresh roots to the prompt, constant within a round, 0 after a round that added none) or "
        "branches (every copy the prompt made this rollout, same-round copies included; an earlier reading)")
    fresh_fill: Literal["one", "all"] = Field(
        "one", description="a group with no active trajectory left starts one fresh root per round (reference) "
        "or fills its whole leftover budget at once")
    prompt_overflow: Literal["error", "truncate_left", "skip"] = Field(
        "error", description="a prompt longer than max_prompt_length: fail naming the row, keep its last "
        "max_prompt_length tokens, or leave the row out with a warning")
    kv_reuse: bool = Field(True, description="transformers backend: keep KV caches across rounds and share "
                           "them with branches; false re-prefills every context each round (the plain path)",
                           json_schema_extra=used_when(backend="transformers"))
    schedule: Literal["rounds", "early_tools", "async"] = Field(
        "rounds", description="how a round's work is ordered (docs/rollout.md, Schedules): rounds = every "
        "generation of the round, then every tool call; early_tools = each tool call starts as soon as its own "
        "generation returns (verl's server answers requests one by one), branch draws still at the round's end: "
        "the same trees bit for bit, less tool time on the critical path; async = every trajectory runs ahead on "
        "its own (draws at each group's logical round close, on snapshots of that boundary), requests batched "
        "whenever the model is idle, counter-based seeds: the same distribution of trees (the realised trees "
        "change once)")
    generate_timeout_s: float | None = Field(
        DEFAULT_GENERATE_TIMEOUT_S, gt=0,
        description="a generate request with no answer this long is an infrastructure failure. verl: the request's "
        "tree is dropped and counted (rollout/trees_dropped_infra); local engine: the step stops "
        "with the error and every thread's stack in the stage folder (re-running resumes). Above a whole "
        "response's decode time (max_response_length tokens); None = wait forever")

    @model_validator(mode="after")
    def _budget(self) -> RolloutSection:
        if self.initial_rollouts > self.n:
            raise ValueError(f"rl.rollout.initial_rollouts={self.initial_rollouts} exceeds rl.rollout.n={self.n}; "
                             "lower initial_rollouts or raise n")
        if self.entropy_quantity == "full" and self.backend == "vllm":
            raise ValueError("rl.rollout.entropy_quantity=full needs the whole distribution, but the vllm backend "
                             "returns top-k log-probs only; use entropy_quantity=topk or backend=transformers")
        return self

    def generation(self) -> GenerationSettings:
        """What stages.generation reads of this section (the tree's own settings stay here)."""
        return GenerationSettings(
            n=self.n, call_limit=self.call_limit, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            max_prompt_length=self.max_prompt_length, max_response_length=self.max_response_length,
            prompt_overflow=self.prompt_overflow, backend=self.backend, kv_reuse=self.kv_reuse,
            entropy_quantity=self.entropy_quantity, entropy_topk=self.entropy_topk,
            generate_timeout_s=self.generate_timeout_s)


class AdvantageSection(Section):
    """How each trajectory's reward becomes per-token advantages (stages/rl/advantages.py, docs/rl.md)."""

    estimator: str = Field("grpo", description="advantage estimator", json_schema_extra=registry("advantage estimator"))
    attribution: Literal["soft", "hard"] = Field(
        "soft", description="credit of a token that several trajectories of a tree share (the prefix before a fork): "
        "soft (the reference code) = every row keeps its own trajectory's advantage, so a shared prefix gets the "
        "copies' combined signal through the loss; hard (the paper's alternative) = the mean advantage of every "
        "trajectory sharing the token (needs a branching rl.algorithm)")
    entropy_aware: bool = Field(False, description="AEPO A * (1 + alpha * sg(H_std)); unset = rl.algorithm's "
                                "default (stages/core/algorithm_spec.py)")
    entropy_alpha: float = Field(0.2, ge=0, description="alpha of the entropy-aware advantage",
                                 json_schema_extra=used_when(entropy_aware=True))
    entropy_scope: Literal["step", "micro_batch"] = Field(
        "step", description="entropy-aware advantage: step (the paper's method as described: the rollout policy's "
        "token entropies standardised over the whole step) or micro_batch (the reference code's: the current "
        "policy's entropies standardised per micro-batch inside the loss; local engine only)")
    eps: float = Field(1e-6, gt=0, description="added to the group std")


class LossSection(Section):
    """The per-token policy loss, its KL and entropy terms and how tokens are weighed (stages/rl/losses.py)."""

    policy_loss: str = Field("ppo_dual_clip", description="policy loss; unset = rl.algorithm's default (stages/core/"
                             "algorithm_spec.py)", json_schema_extra=registry("policy loss"))
    aggregation: str = Field(
        "token_mean", description="token_mean: every valid token of the mini-batch weighs the same (verl's token-mean); "
        "micro_token_mean: the reference's token mean per micro-batch scaled by its share of sequences (local "
        "engine only); seq_mean_token_mean; seq_mean_token_sum_norm (Dr. GRPO)",
        json_schema_extra=registry("loss aggregation"))
    clip_ratio_low: float = Field(0.2, ge=0, description="epsilon_low: the probability ratio is clipped below at "
                                  "1 - clip_ratio_low (the published runs: 0.2)")
    clip_ratio_high: float = Field(0.2, ge=0, description="epsilon_high: the ratio is clipped above at 1 + "
                                   "clip_ratio_high; aepo_balanced_clip keeps the gradient above it (the published "
                                   "runs: 0.2)")
    clip_ratio_c: float = Field(3.0, gt=1, description="dual-clip bound for negative advantages (must exceed 1)")
    kl_coef: float = Field(0.0, ge=0, description="0 = no reference model is loaded")
    kl_type: Literal["k1", "k3"] = Field(
        "k3", description="estimator of KL(pi || pi_ref) when kl_coef > 0: k1 = log pi - log pi_ref; k3 = verl's "
        "low_var_kl, clamped to [-10, 10] as the reference and verl do (the published runs' type, at "
        "coefficient 0)")
    entropy_coef: float = Field(0.0, ge=0, description="weight of the entropy bonus subtracted from the per-token "
                                "loss (the current policy's entropies, with gradient); 0 = none, as in the published "
                                "runs")


class OptimSection(Section):
    """AdamW at a constant learning rate, no warm-up, on both engines (stages/rl/trainer.py `make_optimizer`; verl's
    actor optimizer with lr_scheduler_type=constant)."""

    lr: float = Field(1e-6, ge=0, description="AdamW learning rate; 0 makes a control run: every step, save and "
                      "reload as usual, the weights unchanged (the learning bench's lr = 0 control)")
    weight_decay: float = Field(0.01, ge=0, description="AdamW's decoupled weight decay")
    grad_clip: float = Field(1.0, gt=0, description="the gradient's global norm is clipped to this before each "
                             "optimizer update (Tool-Star's fork: 1.0)")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW's (beta1, beta2): decay rates of the "
                                       "gradient's first and second moment estimates")


AlarmName = Literal["tool_collapse", "tool_unused", "entropy_collapse", "format_errors_rising", "reward_at_floor",
                   "no_signal_groups", "reward_collapse", "formed_but_wrong", "nonfinite_loss", "infra_failures",
                   "trees_dropped", "sampler_drift"]


class AlarmSection(Section):
    """Collapse alarms, checked after every RL step (stages/rl/alarms.py): a warning in the log, `alarm/<name>` in
    metrics.jsonl, a Prefect event `arpo.rl.alarm.<name>` and the `rl-alarms` artifact; `stop_on` ends the run."""

    enabled: bool = Field(True, description="check the alarms after every step; false = none is checked and none "
                          "stops the run")
    stop_on: tuple[AlarmName, ...] = Field(
        ("nonfinite_loss", "sampler_drift"), description="alarms that stop the run (a non-retried error; the step "
        "is not saved); [] = only warn. sampler_drift is in by default: a rollout engine that does not sample from "
        "the policy makes every later step wrong, silently")
    tool_drop_ratio: float = Field(0.1, ge=0, description="tool_collapse: tool calls per trajectory below this "
                                   "fraction of their best earlier value, once that was >= tool_min_peak")
    tool_min_peak: float = Field(0.5, ge=0, description="tool_collapse watches only once tool calls per trajectory "
                                 "have reached this at some earlier step (a policy that never used its tools cannot "
                                 "stop using them)")
    entropy_drop_ratio: float = Field(0.1, ge=0, description="entropy_collapse: mean token entropy below this "
                                      "fraction of the first step's, or below entropy_floor")
    entropy_floor: float = Field(1e-3, ge=0, description="entropy_collapse: mean token entropy below this, whatever "
                                 "the first step's")
    format_error_rise: float = Field(0.3, ge=0, description="format_errors_rising: the format-error rate averaged "
                                     "over the last `window` steps this much above the lowest earlier such average")
    reward_floor: float = Field(-1.0, description="reward_at_floor: the lowest reward the reward function gives "
                                "(-1 = format error under the reference reward) ...")
    reward_floor_tol: float = Field(0.02, ge=0, description="... mean reward within this of it for `window` steps")
    no_signal_fraction: float = Field(0.8, ge=0, le=1, description="no_signal_groups: this fraction of groups or "
                                      "more had all-equal rewards (zero advantage) for `window` steps in a row")
    reward_drop: float = Field(0.5, ge=0, description="reward_collapse: mean reward this far below its best earlier "
                               "value")
    formed_max_format_error: float = Field(0.25, ge=0, le=1, description="formed_but_wrong compares only steps "
                                           "whose format-error rate is at most this (mostly well-formed answers) ...")
    formed_accuracy_drop: float = Field(0.5, ge=0, le=1, description="... and fires when such a step's accuracy "
                                        "among well-formed answers is this far below the best of an earlier one")
    window: int = Field(3, ge=1, description="steps the sustained alarms look at (format errors, floor, no signal)")
    infra_share: float = Field(0.2, ge=0, le=1, description="infra_failures: at least this share of a step's "
                               "trajectories was touched by a tool infrastructure failure (search provider, "
                               "retrieval server, sandbox) and left out of the loss")
    trees_dropped_share: float = Field(0.1, ge=0, le=1, description="trees_dropped (verl engine): at least this "
                                       "share of a step's trees raised and were dropped whole (rollout/"
                                       "trees_dropped; the infra-caused ones counted apart)")
    drift_ratio: float = Field(10.0, gt=1, description="sampler_drift: the rollout engine's vs the trainer's log-probs "
                               "of the sampled tokens (rollout/logp_mismatch) at this multiple of the first step's "
                               "value or more (the first step's sampler was loaded from the same files: its mismatch "
                               "is the numerical floor) ...")
    drift_floor: float = Field(1e-4, ge=0, description="... and above this (per token; fp32 on CPU measures ~4e-6, "
                               "bf16 on GPU ~3e-2; a stale tied head at lr 3e-6 on the chain bench: 1.9e-4 at step "
                               "2: docs/rl.md, The sampler is the policy)")
    drift_max: float = Field(0.5, gt=0, description="sampler_drift at any step, the first included: the mismatch "
                             "above this (the sampler and the trainer hold different models)")


class TrainerSection(Section):
    """Steps, batch sizes, checkpoints and what a step records, on either engine (docs/rl.md "Config mapping")."""

    total_steps: int | None = Field(None, ge=1, description="None = epochs over the train set")
    epochs: int = Field(2, ge=1, description="passes over the RL train set when total_steps is None: epochs x "
                        "(rows // train_batch_size) steps, the last incomplete batch dropped as the reference does")
    train_batch_size: int = Field(128, ge=1, description="prompts per step")
    ppo_mini_batch_size: int = Field(16, ge=1, description="prompts per optimizer update")
    micro_batch_size: int = Field(4, ge=1, description="trajectories per forward/backward")
    ppo_epochs: int = Field(1, ge=1, description="passes of optimizer updates over each step's rollouts "
                            "(Tool-Star's fork: 1); above 1, old_logprobs=auto recomputes the old log-probs")
    save_every: int = Field(5, ge=1, description="a checkpoint every N steps and at the last; a crashed run resumes "
                            "from the newest (verl: trainer.save_freq)")
    report_every: int = Field(1, ge=1, description="refresh the curves and rollout-sample artifacts every N steps "
                              "(and at the last step)")
    keep_checkpoints: int = Field(1, ge=1, description="complete checkpoints kept (older ones are deleted, across "
                                  "attempts: a resumed verl run's older global_step_* folders too; stages/rl/"
                                  "retention.py); the newest is the one a crashed run resumes from")
    keep_optimizer_state: bool = Field(False, description="keep the final checkpoint's optimizer state when the "
                                       "stage finishes (twice the model in fp32 AdamW; only continuing the run by "
                                       "hand needs it)")
    reward: str = Field("reference", description="reward function: reference | math_equiv | format_only (the "
                        "format penalty alone, no correctness: the learning bench's control arm)",
                        json_schema_extra=registry("reward function"))
    gradient_checkpointing: bool = Field(False, description="recompute activations in the backward pass instead of "
                                         "keeping them: less memory, a slower update (verl: "
                                         "actor_rollout_ref.model.enable_gradient_checkpointing; `arpo plan`'s "
                                         "memory model counts it)")
    dump_rollouts: bool = Field(True, description="write every step's trajectories to rollouts/step_<n>.jsonl in the "
                                "stage folder, the source of the rollout-sample artifact and the tree pages; false = "
                                "neither")
    old_logprobs: Literal["auto", "recompute", "rollout"] = Field(
        "auto", description="the old policy's log-probs: recompute (a no-grad pass over every trajectory), rollout "
        "(the sampler's own log-probs; only rows with a forced EOS are recomputed) or auto = rollout where that "
        "cannot change the loss (ppo_epochs 1, float32 compute, no top-k/top-p truncation, no entropy-aware "
        "advantage, which needs the pass's entropies), else recompute")
    shared_prompt: bool = Field(True, description="in the update and the old-log-prob pass, run each distinct "
                                "prompt of a micro-batch once and its responses over that prompt's KV cache (same "
                                "log-probs and gradients; off = every trajectory re-reads its prompt)")


def _component_keys() -> dict[str, set[str]]:
    """{subsection: its keys} that some algorithm's component sets (stages/core/algorithm_spec.py). Null there means
    "the algorithm's default", so a profile can hand a component back to whichever algorithm an override picks."""
    found: dict[str, set[str]] = {}
    for spec in ALGORITHMS.values():
        for c in spec.components:
            section, _, key = c.setting.key.rpartition(".")
            found.setdefault(section, set()).add(key)
    return found


def _fill_unset(section: Any, implied: dict[str, Any], nullable: set[str]) -> Any:
    given = section.model_dump(exclude_unset=True) if isinstance(section, BaseModel) else dict(section or {})
    given = {key: value for key, value in given.items() if not (key in nullable and value is None)}
    return {**given, **{key: value for key, value in implied.items() if key not in given}}


class RLSection(Section):
    """The RL stage: which engine trains, the algorithm, and its subsections (docs/rl.md)."""

    enabled: bool = Field(True, description="false = the RL stage hands the policy on unchanged (as an hf "
                          "checkpoint), so merge and evaluation run on the SFT policy")
    engine: str = Field(
        "local", description="local: one-process trainer on one device; verl: verl's FSDP over Ray (paper "
        "profiles)", json_schema_extra=registry("RL engine"))
    local_memory_gb: float = Field(80.0, gt=0, description="memory of the one device the local engine trains on; "
                                   "a policy that cannot fit is refused before any work (stages/core/config/"
                                   "rl_engine.py)", json_schema_extra=used_when(engine="local"))
    verl: VerlSection = Field(VerlSection(), description="verl engine settings (rl.engine=verl; a paper profile "
                              "keeps its block when switched to the local engine)")
    algorithm: str = Field(
        "arpo", description=f"{' | '.join(ALGORITHMS.ordered())}, the one source of the algorithm: its line in "
        "stages/core/algorithm_spec.py says how the rollout grows (independent samples or an entropy-guided tree) "
        "and the defaults it implies; a setting only another algorithm turns on is an error",
        json_schema_extra=registry("algorithm"))
    reference_setting: str | None = Field(
        None, description="the published training run the algorithm card compares this run with (stages/rl/"
        "reference_code.py); None = the algorithm's own (its `reference` in stages/core/algorithm_spec.py). Only "
        "the card reads it (not part of the stage key)",
        json_schema_extra=registry("reference setting"))
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
        algorithm = data.get("algorithm", cls.model_fields["algorithm"].default)
        known = isinstance(algorithm, str) and algorithm in ALGORITHMS  # else the after-validator names it
        implied = ALGORITHMS.get(algorithm).implied() if known else {}
        return {**data, **{name: _fill_unset(data.get(name), implied.get(name, {}), keys)
                           for name, keys in _component_keys().items()}}

    @model_validator(mode="after")
    def _engine_supports(self) -> RLSection:
        """Combinations an engine cannot run are refused here, before any work: its line's `refuses` in
        stages/core/engine_spec.py (an unknown engine is named by the registry check)."""
        refused = ENGINES.get(self.engine).refused(self) if self.engine in ENGINES else []
        if refused:
            raise ValueError(refused[0])
        return self

    @model_validator(mode="after")
    def _one_algorithm(self) -> RLSection:
        if self.trainer.old_logprobs == "rollout":
            self._check_rollout_logprobs()
        algo = self.algorithm
        if algo not in ALGORITHMS:  # a config loaded from YAML was checked against the table already (names.py)
            raise ValueError(f"rl.algorithm: unknown algorithm {algo!r}; known: {ALGORITHMS.ordered()}")
        foreign = foreign_settings(ALGORITHMS, algo, self)
        if foreign:
            owner, settings = next(iter(foreign.items()))
            raise ValueError(f"{', '.join(settings)}: {owner.upper()} setting(s) under rl.algorithm={algo}. Set "
                             f"rl.algorithm={owner} (it turns the {owner.upper()} defaults on) or remove them")
        if self.reference_setting is not None and not self.reference_setting.startswith(f"{algo}-"):
            raise ValueError(f"rl.reference_setting={self.reference_setting} is a published run of another "
                             f"algorithm than rl.algorithm={algo}; pick one of the {algo}-* settings or leave it "
                             "unset")
        if self.advantage.entropy_scope == "micro_batch" and not self.advantage.entropy_aware:
            raise ValueError("rl.advantage.entropy_scope=micro_batch scales the entropy-aware advantage, which "
                             "rl.advantage.entropy_aware=false turns off; remove one of the two")
        return self

    def _check_rollout_logprobs(self) -> None:
        if self.advantage.entropy_aware:
            raise ValueError("rl.trainer.old_logprobs=rollout skips the pass whose entropies rl.advantage."
                             "entropy_aware=true (AEPO) scales the advantage with; use old_logprobs=auto or recompute")
        truncated = self.rollout.top_p < 1 or self.rollout.top_k > 0
        if truncated and self.rollout.backend == "vllm":
            raise ValueError("rl.trainer.old_logprobs=rollout with rl.rollout.backend=vllm and top-k/top-p "
                             "truncation: vLLM's processed log-probs are those of the truncated distribution, not "
                             "the trainer's softmax(logits / T); use old_logprobs=auto or recompute, or top_p=1, "
                             "top_k=-1")

