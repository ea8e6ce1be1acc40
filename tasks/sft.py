"""SFT and self-critic DPO tasks: cached stage calls that publish the loss curve and the metrics table.

`python` runs the stage under another interpreter (config `run.interpreters`, filled in by the flow's
tasks.common.StageRunner); it is not part of the cache key, which is the stage's own (`sft_key`, `dpo_key`). The
entry points are the stage table's (stages/core/stage_spec.py), called by `call_entry`.
"""

from __future__ import annotations

from stages.core.config.agent import AgentSection
from stages.core.config.sft import SFTSection
from stages.core.refs import CheckpointRef, DatasetRef, ModelRef
from tasks.artifacts import publish_image, publish_table
from tasks.common import call_entry, stage_task
from tasks.secrets import export_search_key


def _publish(stage: str, ref: CheckpointRef) -> None:
    if ref.meta.get("loss_png"):
        publish_image(f"{stage}-loss", ref.meta["loss_png"], f"{stage}: LLaMA-Factory training loss")
    metrics = ref.meta.get("metrics") or {}
    publish_table(f"{stage}-metrics", [{"metric": k, "value": v} for k, v in metrics.items()],
                  f"{stage}: training and data metrics ({ref.path})")


@stage_task("sft")
def sft_task(cfg: SFTSection, agent: AgentSection, model: ModelRef, data: DatasetRef, output_root: str,
             cache_root: str, python: str | None = None) -> CheckpointRef:
    export_search_key(agent)
    ref = call_entry(python, cfg=cfg, agent=agent, model=model, data=data, output_root=output_root,
                     cache_root=cache_root)
    _publish("sft", ref)
    return ref


@stage_task("dpo")
def dpo_task(cfg: SFTSection, agent: AgentSection, checkpoint: CheckpointRef, data: DatasetRef, output_root: str,
             cache_root: str, python: str | None = None) -> CheckpointRef:
    export_search_key(agent)
    ref = call_entry(python, cfg=cfg, agent=agent, checkpoint=checkpoint, data=data, output_root=output_root,
                     cache_root=cache_root)
    if ref.path != checkpoint.path:
        _publish("dpo", ref)
    return ref
