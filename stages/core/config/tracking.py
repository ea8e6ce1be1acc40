"""The tracking section: where every stage's curves go besides metrics.jsonl (stages/core/tracking/, docs/ui.md
"Where the curves go").

The flow reads it once: it opens the pipeline's run (stages.core.tracking.pipeline) and hands the run to the stages
through the environment (`ARPO_TRACKING`), so no stage's key covers this section: switching trackers, or pointing at
another server, recomputes nothing.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from stages.core.config.section import Section, registry, used_when


class TrackingSection(Section):
    """One tracker for the whole run: a parent run per pipeline run and a child run per stage."""

    backend: str = Field(
        "mlflow", json_schema_extra=registry("tracking backend"),
        description="none | mlflow | wandb | tensorboard (stages/core/tracking/backends.py). The same backend is "
                    "verl's trainer.logger (rl.engine: verl) and LLaMA-Factory's report_to (SFT, DPO)")
    tracking_uri: str | None = Field(
        None, description="mlflow: a tracking server (http://host:5000) or a store URI (sqlite:///path/mlflow.db); "
                          "wandb: the folder its runs are written to; tensorboard: the log folder. None = under "
                          "run.output_root: mlflow/mlflow.db (a local store `mlflow ui --backend-store-uri "
                          "sqlite:///outputs/mlflow/mlflow.db` reads; no server), wandb/, tensorboard/")
    experiment: str | None = Field(
        None, description="the MLflow experiment, W&B project or TensorBoard folder every run goes to; None = "
                          "arpo-<profile>")
    required: bool = Field(
        False, description="true: a tracker that cannot be reached (or fails while logging) fails the run or stage "
                           "with the reason; false: one warning, then the run goes on without it (metrics.jsonl and "
                           "the Prefect artifacts keep every number)")
    wandb_mode: Literal["offline", "online"] = Field(
        "offline", json_schema_extra=used_when(backend="wandb"),
        description="offline: runs are written under tracking_uri and uploaded later with `wandb sync <folder>`; "
                    "online: streamed to W&B (needs WANDB_API_KEY and network)")
    tags: dict[str, str] = Field(
        default_factory=dict, description="extra tags on every run, beside those set for you (arpo.profile, "
                                          "arpo.algorithm, arpo.engine, arpo.commit, arpo.stage, arpo.stage_key)")
