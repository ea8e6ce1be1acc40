"""The RL engines, one line each: what each can do. Every other statement of an engine's capabilities is derived
from this table instead of asking `rl.engine == "verl"`.

Read by the config (stages/core/config/rl.py: the settings an engine cannot run, refused when the config loads;
stages/core/config/root.py: the one-device memory check), the RL stage (stages/rl/engines.py: the package and version
its interpreter must have, which the RL key records), the cost estimate and the memory model (stages/cost: devices,
whether its per-GPU peak is priced), the recipe table (stages/core/recipes.py) and the rehearsal rule
(stages/rehearse/rule.py: a cluster engine is shrunk to one CPU process per role).

    spec = ENGINES.get(cfg.rl.engine)
    spec.devices(cfg.rl)        # 1, or rl.verl.nnodes x rl.verl.n_gpus_per_node
    spec.refused(cfg.rl)        # [why, ...]: settings this engine cannot run

Adding an engine: one line here, its function registered under the same name in stages/rl/engines.py
(RL_ENGINES) and what it trains with in stages/rl/card.py (TRAINED). This module is pure data: it imports no config
model and no stage code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stages.core.algorithm_spec import Setting, value_at
from stages.core.registry import Registry


@dataclass(frozen=True)
class Refusal:
    """Settings under `rl` an engine cannot run: refused when every one of `when` is on, with `why` (the fix)."""

    when: tuple[Setting, ...]
    why: str

    def applies(self, rl: Any) -> bool:
        return all(s.is_on(value_at(rl, s.key)) for s in self.when)


@dataclass(frozen=True, kw_only=True)
class EngineSpec:
    """name: `rl.engine`. cluster: it trains over Ray on rl.verl.nnodes x rl.verl.n_gpus_per_node GPUs (else on one
    device of the stage's own process, whose memory is checked when the config loads). package / version: what the
    stage's interpreter must have installed ("" = nothing beyond this project); the RL key records the installed
    version. priced: the memory model (stages/cost/memory.py) prices its per-GPU peak before a run. refuses: the
    settings it cannot run."""

    name: str
    cluster: bool = False
    package: str = ""
    version: str = ""
    priced: bool = False
    refuses: tuple[Refusal, ...] = ()

    def devices(self, rl: Any) -> int:
        """The devices a run of the RL section `rl` trains on."""
        return rl.verl.nnodes * rl.verl.n_gpus_per_node if self.cluster else 1

    def refused(self, rl: Any) -> list[str]:
        return [r.why for r in self.refuses if r.applies(rl)]


# The verl release this project runs on: the one statement in code. requirements/verl-gpu.txt and verl-test.txt pin
# the same (tests/unit/test_algorithm_spec.py checks), scripts/setup-verl.sh checks the installed one; messages and
# docstrings read it from here or say "verl".
VERL_VERSION = "0.9.1"

SPECS: tuple[EngineSpec, ...] = (
    EngineSpec(name="local"),
    EngineSpec(
        name="verl", cluster=True, package="verl", version=VERL_VERSION, priced=True, refuses=(
            Refusal((Setting("rollout.entropy_quantity", "full"),),
                    "rl.rollout.entropy_quantity=full needs the whole distribution, which verl's servers do not "
                    "return; with rl.engine=verl use topk (our top-k server replica) or surprisal (the stock server)"),
            Refusal((Setting("trainer.old_logprobs", "rollout"),),
                    f"rl.trainer.old_logprobs=rollout runs on the local engine only: verl {VERL_VERSION}'s trainer "
                    "always recomputes the old log-probs (its compute_log_prob pass). Use old_logprobs=auto "
                    "(recompute under verl) with rl.engine=verl, or rl.engine=local"),
            Refusal((Setting("loss.aggregation", "micro_token_mean"),),
                    "rl.loss.aggregation=micro_token_mean (the reference's per-micro-batch token mean) runs on the "
                    f"local engine only: verl {VERL_VERSION} normalises a token mean over the global mini-batch "
                    "(agg_loss with batch_num_tokens of all ranks) and has no per-micro-batch mode. Use "
                    "aggregation=token_mean with rl.engine=verl, or rl.engine=local"),
            Refusal((Setting("advantage.entropy_aware", True), Setting("advantage.entropy_scope", "micro_batch")),
                    f"rl.advantage.entropy_scope=micro_batch runs on the local engine only: verl {VERL_VERSION} "
                    "hands a policy loss no entropies (workers/utils/losses.py ppo_loss), so the current policy's "
                    "entropy cannot reach the advantage inside the loss. Use entropy_scope=step (the old policy's "
                    "entropies over the step, from verl's old-log-prob pass)"),
        )),
)

ENGINES: Registry[EngineSpec] = Registry("engine capability", {spec.name: spec for spec in SPECS})

__all__ = ["ENGINES", "SPECS", "VERL_VERSION", "EngineSpec", "Refusal"]
