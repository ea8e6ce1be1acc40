from __future__ import annotations

from stages.bootstrap import bootstrap_model
from stages.core.config.model import ModelSection
from stages.core.refs import ModelRef
from tasks.common import forced, stage_task


@stage_task("bootstrap", retries=2)
def bootstrap_task(cfg: ModelSection, output_root: str, cache_root: str) -> ModelRef:
    return bootstrap_model(cfg, output_root, cache_root, force=forced())
