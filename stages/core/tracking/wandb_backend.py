"""Weights & Biases: one W&B run per stage, grouped by the pipeline's run (W&B has groups, not nested runs).

Offline by default (`tracking.wandb_mode`): each run is a folder `<tracking_uri>/wandb/offline-run-<time>-<id>/`
that `wandb sync <folder>` uploads later. The pipeline's own run (job type `pipeline`) holds the resolved config and
the algorithm card; a stage's run is `job_type=<stage>`. A run is created when it first logs, so a stage that hands
its run to another process (LLaMA-Factory's report_to: wandb, through WANDB_RUN_ID and the other WANDB_* variables
wandb.init reads) leaves the writing to that process; what this process would log into it afterwards is dropped
(one W&B run has one writer).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stages.core.log import get_logger
from stages.core.tracking.backends import Backend
from stages.core.tracking.context import TrackingContext

log = get_logger(__name__)


class WandbBackend(Backend):
    def __init__(self, ctx: TrackingContext) -> None:
        super().__init__(ctx)
        import wandb

        self.wandb = wandb
        self.folder = Path(ctx.uri).resolve()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.pending: dict[str, dict[str, Any]] = {}   # run id -> wandb.init arguments, until it first logs
        self.runs: dict[str, Any] = {}
        self.handed: set[str] = set()                 # runs another process writes

    def start_run(self, name: str, tags: Mapping[str, str], parent_id: str | None) -> str:
        run_id = uuid.uuid4().hex[:12]
        self.pending[run_id] = {
            "id": run_id, "name": name, "project": self.ctx.experiment, "group": self.ctx.parent_name or name,
            "job_type": tags.get("arpo.stage", "pipeline"), "config": {"tags": dict(tags)},
            "tags": [f"{k.removeprefix('arpo.')}:{v}"[:64] for k, v in tags.items()]}
        return run_id

    def _run(self, run_id: str) -> Any:
        if run_id in self.handed:
            return None
        if run_id not in self.runs:
            args = self.pending.pop(run_id)
            self.runs[run_id] = self.wandb.init(
                **args, dir=str(self.folder), mode=self.ctx.wandb_mode, reinit="create_new",
                settings=self.wandb.Settings(silent=True, console="off", x_disable_stats=True))
        return self.runs[run_id]

    def log_metrics(self, run_id: str, metrics: Mapping[str, float], step: int | None) -> None:
        run = self._run(run_id)
        if run is not None:
            run.log(dict(metrics), step=step)

    def log_summary(self, run_id: str, metrics: Mapping[str, float]) -> None:
        run = self._run(run_id)
        if run is not None:
            run.summary.update(dict(metrics))

    def log_params(self, run_id: str, params: Mapping[str, str]) -> None:
        run = self._run(run_id)
        if run is not None:
            run.config.update(dict(params), allow_val_change=True)

    def log_artifact(self, run_id: str, path: Path) -> None:
        run = self._run(run_id)
        if run is not None:
            run.save(str(path), base_path=str(Path(path).parent), policy="now")

    def set_tags(self, run_id: str, tags: Mapping[str, str]) -> None:
        run = self._run(run_id)
        if run is not None:
            run.tags = (*run.tags, *(f"{k.removeprefix('arpo.')}:{v}"[:64] for k, v in tags.items()))

    def end_run(self, run_id: str, failed: bool = False) -> None:
        run = self.runs.pop(run_id, None)
        self.pending.pop(run_id, None)
        if run is not None:
            run.finish(exit_code=1 if failed else 0)

    def handoff_env(self, run_id: str, name: str) -> dict[str, str]:
        args = self.pending.get(run_id)
        if args is None:
            raise RuntimeError(f"the W&B run {name} already logged here: it cannot be handed to another process")
        self.handed.add(run_id)
        return {"WANDB_MODE": self.ctx.wandb_mode, "WANDB_DIR": str(self.folder), "WANDB_RUN_ID": run_id,
                "WANDB_NAME": name, "WANDB_PROJECT": self.ctx.experiment, "WANDB_RUN_GROUP": args["group"],
                "WANDB_JOB_TYPE": args["job_type"], "WANDB_SILENT": "true", "WANDB_DISABLED": "false"}

    def close(self) -> None:
        for run_id in list(self.runs):
            self.end_run(run_id)


BACKEND = WandbBackend
