"""SFT and self-critic DPO tasks: cached stage calls that publish the loss curve and the metrics table."""

from __future__ import annotations

from stages.core.config.agent import AgentSection
from stages.core.config.sft import SFTSection
from stages.core.refs import CheckpointRef, DatasetRef, ModelRef
from stages.sft import run_sft
from stages.sft.dpo import run_dpo
from tasks.artifacts import publish_image, publish_table
from tasks.common import stage_task


def _publish(stage: str, ref: CheckpointRef) -> None:
    if ref.meta.get("loss_png"):
        publish_image(f"{stage}-loss", ref.meta["loss_png"], f"{stage}: LLaMA-Factory training loss")
    metrics = ref.meta.get("metrics") or {}
    publish_table(f"{stage}-metrics", [{"metric": k, "value": v} for k, v in metrics.items()],
                  f"{stage}: training and data metrics ({ref.path})")


@stage_task("sft", "stages.sft", "stages.agent")
def sft_task(cfg: SFTSection, agent: AgentSection, model: ModelRef, data: DatasetRef, output_root: str,
             cache_root: str, force: bool = False) -> CheckpointRef:
    ref = run_sft(cfg, agent, model, data, output_root, cache_root, force=force)
    _publish("sft", ref)
    return ref


@stage_task("dpo", "stages.sft", "stages.agent", "stages.rl")
def dpo_task(cfg: SFTSection, agent: AgentSection, checkpoint: CheckpointRef, data: DatasetRef, output_root: str,
             cache_root: str, force: bool = False) -> CheckpointRef:
    ref = run_dpo(cfg, agent, checkpoint, data, output_root, cache_root, force=force)
    if ref is not checkpoint:
        _publish("dpo", ref)
    return ref
