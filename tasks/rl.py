"""RL and merge tasks: cached stage calls. RL publishes its progress, curves, rollout sample and alarms while it
runs (stages.core.reporter -> tasks/live.py), so the task itself only calls the stage.

`python` runs the stage under another interpreter (config `run.interpreters`); it is not part of the cache key,
and neither are the RL settings that only watch the run (stages.rl.trainer.training_identity).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefect.cache_policies import CachePolicy
from prefect.context import TaskRunContext

from stages.core.config.agent import AgentSection
from stages.core.config.rl import MergeSection, RLSection
from stages.core.fingerprint import hash_value
from stages.core.refs import CheckpointRef, DatasetRef, ModelRef
from stages.rl.trainer import training_identity
from tasks.artifacts import publish_table
from tasks.common import call_stage, stage_cache, stage_task
from tasks.secrets import export_search_key


@dataclass
class TrainingIdentity(CachePolicy):
    """Keys on the RL section minus its alarm and reporting settings, as the stage folder key does."""

    def compute_key(self, task_ctx: TaskRunContext, inputs: dict[str, Any], flow_parameters: dict[str, Any],
                    **kwargs: Any) -> str:
        return hash_value(training_identity(inputs["cfg"]))


@stage_task("rl", "stages.rl", "stages.agent")
def _rl(cfg: RLSection, agent: AgentSection, policy: ModelRef | CheckpointRef, data: DatasetRef,
        output_root: str, cache_root: str, seed: int = 0, dtype: str = "float32", python: str | None = None,
        force: bool = False) -> CheckpointRef:
    export_search_key(agent)
    return call_stage("stages.rl.trainer:run_rl", python, cfg=cfg, agent=agent, policy=policy, data=data,
                      output_root=output_root, cache_root=cache_root, seed=seed, force=force, dtype=dtype)


rl_task = _rl.with_options(cache_policy=stage_cache("rl", "stages.rl", "stages.agent") - "cfg" + TrainingIdentity())


@stage_task("merge", "stages.rl")
def merge_task(cfg: MergeSection, ckpt: CheckpointRef, output_root: str, python: str | None = None,
               force: bool = False) -> ModelRef:
    model = call_stage("stages.rl.merge:merge_checkpoint", python, cfg=cfg, ckpt=ckpt, output_root=output_root,
                       force=force)
    publish_table("merge-parity", [{"source": ckpt.path, "format": ckpt.format, "merged": model.path,
                                    "dtype": cfg.dtype, "max_abs_diff": model.meta.get("max_abs_diff"),
                                    "parity_atol": model.meta.get("parity_atol")}], "merge parity probe")
    return model
