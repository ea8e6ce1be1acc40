from __future__ import annotations

from stages.core.config.data import DataSection
from stages.core.refs import DatasetRef
from tasks.artifacts import publish_table
from tasks.common import call_entry, stage_task


@stage_task("data")
def data_task(cfg: DataSection, output_root: str) -> DatasetRef:
    ref = call_entry(cfg=cfg, output_root=output_root)
    publish_table("data-files", [{"role": role, "path": path} for role, path in ref.files.items()],
                  f"Data ({cfg.source}) in {ref.path}")
    return ref
