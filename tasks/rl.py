"""RL and merge tasks: cached stage calls; RL publishes its curves and a sample of rollouts.

`python` runs the stage under another interpreter (config `run.interpreters`); it is not part of the cache key.
"""

from __future__ import annotations

from pathlib import Path

from stages.core.config.agent import AgentSection
from stages.core.config.rl import MergeSection, RLSection
from stages.core.refs import CheckpointRef, DatasetRef, ModelRef
from stages.rl.metrics import rollout_sample_markdown
from tasks.artifacts import publish_image, publish_markdown, publish_table
from tasks.common import call_stage, stage_task
from tasks.secrets import export_search_key


@stage_task("rl", "stages.rl", "stages.agent")
def rl_task(cfg: RLSection, agent: AgentSection, policy: ModelRef | CheckpointRef, data: DatasetRef,
            output_root: str, cache_root: str, seed: int = 0, dtype: str = "float32", python: str | None = None,
            force: bool = False) -> CheckpointRef:
    export_search_key(agent)
    ref = call_stage("stages.rl.trainer:run_rl", python, cfg=cfg, agent=agent, policy=policy, data=data,
                     output_root=output_root, cache_root=cache_root, seed=seed, force=force, dtype=dtype)
    if ref.format == "trainer":
        publish_image("rl-curves", ref.meta["curves"], f"{cfg.algorithm}: reward, accuracy, entropy, tool calls")
        publish_markdown("rl-rollouts", rollout_sample_markdown(Path(ref.meta["rollouts"])),
                         f"{cfg.algorithm}: sample of the last step's rollouts")
    return ref


@stage_task("merge", "stages.rl")
def merge_task(cfg: MergeSection, ckpt: CheckpointRef, output_root: str, python: str | None = None,
               force: bool = False) -> ModelRef:
    model = call_stage("stages.rl.merge:merge_checkpoint", python, cfg=cfg, ckpt=ckpt, output_root=output_root,
                       force=force)
    publish_table("merge-parity", [{"source": ckpt.path, "format": ckpt.format, "merged": model.path,
                                    "dtype": cfg.dtype, "max_abs_diff": model.meta.get("max_abs_diff"),
                                    "parity_atol": model.meta.get("parity_atol")}], "merge parity probe")
    return model
