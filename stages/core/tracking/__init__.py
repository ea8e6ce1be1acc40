"""Experiment tracking (MLflow, W&B, TensorBoard) from every stage: config section `tracking:`, docs/ui.md "Where
the curves go".

One parent run per pipeline run (opened by the flow: stages.core.tracking.pipeline, which only the task layer
imports), a child run per stage that computes (stages.core.tracking.stage), the context between them in the
environment (stages.core.tracking.context). The backends are a registry (stages.core.tracking.backends) and are
imported only when used. A tracker never fails a stage unless `tracking.required` is true: one warning, then no-ops;
metrics.jsonl and the Prefect artifacts are written as before.

What a stage uses is re-exported here; the pipeline side is not (it reads the config's tracking section, which no
stage's key may cover).
"""

from stages.core.tracking.context import TRACKING_ENV, TrackerUnavailable, TrackingContext, numeric
from stages.core.tracking.stage import Handoff, StageRun, current, log_step, read_record, stage_run

__all__ = ["TRACKING_ENV", "Handoff", "StageRun", "TrackerUnavailable", "TrackingContext", "current", "log_step",
           "numeric", "read_record", "stage_run"]
