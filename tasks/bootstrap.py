from __future__ import annotations

from stages.core.config.model import ModelSection
from stages.core.refs import ModelRef
from tasks.common import call_entry, stage_task


@stage_task("bootstrap", retries=2)
def bootstrap_task(cfg: ModelSection, output_root: str, cache_root: str) -> ModelRef:
    return call_entry(cfg=cfg, output_root=output_root, cache_root=cache_root)
