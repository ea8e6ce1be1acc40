"""A stage's run on the pipeline's tracker: a child of the pipeline's run, named `<stage>-<key[:10]>`.

    with tracking.stage_run("rl", out.path) as run:      # records the run in out.path/tracking.json
        ...
        tracking.log_step(row)                           # anywhere below: a metrics.jsonl row, same names
    handoff = run.handoff()                              # env + names for LLaMA-Factory's / verl's own logger

Opened only when the stage computes (a cached stage opens nothing: the pipeline's end links the run recorded in its
folder, stages.core.tracking.pipeline). Without a pipeline run (a stage run alone, a unit test) or with the tracker
off or dead, every call is a no-op; nothing here raises unless `tracking.required` is true.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stages.core.atomic import write_json
from stages.core.tracking.backends import Tracker, tracker_for
from stages.core.tracking.context import RECORD_FILE, TrackingContext, numeric, stage_run_name


@dataclass(frozen=True)
class Handoff:
    """What another process's own logger needs to write into a stage's run: `env` for its environment,
    `report_to` for Hugging Face / LLaMA-Factory ("none": nothing to report to), `verl_logger` for verl's
    trainer.logger (None: add none), `project` and `name` for verl's trainer.project_name / experiment_name."""

    env: dict[str, str] = field(default_factory=dict)
    report_to: str = "none"
    verl_logger: str | None = None
    project: str = ""
    name: str = ""


class StageRun:
    """One stage's child run (or nothing: `run_id` None). Its methods never raise unless tracking.required."""

    def __init__(self, tracker: Tracker | None = None, run_id: str | None = None, name: str = "",
                 tags: Mapping[str, str] | None = None) -> None:
        self.tracker, self.run_id, self.name, self.tags = tracker, run_id, name, dict(tags or {})
        self.nested: list[str] = []

    @property
    def active(self) -> bool:
        return self.tracker is not None and self.run_id is not None and self.tracker.alive

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        if self.active:
            self.tracker.log_metrics(self.run_id, metrics, step)

    def log_summary(self, metrics: Mapping[str, float]) -> None:
        if self.active:
            self.tracker.log_summary(self.run_id, metrics)

    def log_artifact(self, path: Path) -> None:
        if self.active:
            self.tracker.log_artifact(self.run_id, path)

    def handoff(self, nested: str | None = None) -> Handoff:
        """Hand this run (or, with `nested`, a new run nested in it, `<name>-<nested>`) to another process's own
        logger. An inactive run hands nothing (`report_to: none`)."""
        if not self.active:
            return Handoff()
        run_id, name = self.run_id, self.name
        if nested:
            name = f"{self.name}-{nested}"
            run_id = self.tracker.start_run(name, {**self.tags, "arpo.logger": nested}, self.run_id)
            if run_id is None:
                return Handoff()
            self.nested.append(run_id)
        env = self.tracker.handoff_env(run_id, name)
        if not env:
            return Handoff()
        line = self.tracker.line
        return Handoff(env=env, report_to=line.report_to, verl_logger=line.verl_logger,
                       project=self.tracker.ctx.experiment, name=name)

    def close(self, failed: bool = False) -> None:
        if self.tracker is None:
            return
        for run_id in (*self.nested, self.run_id):
            self.tracker.end_run(run_id, failed)
        self.run_id, self.nested = None, []


NO_RUN = StageRun()
_current: contextvars.ContextVar[StageRun] = contextvars.ContextVar("arpo_stage_run", default=NO_RUN)


def open_stage_run(stage: str, folder: Path, key: str | None = None, ctx: TrackingContext | None = None,
                   label: str | None = None) -> StageRun:
    """The child run of stage `stage` computing into `folder` (its key: the folder's name; `label`: what tells its
    runs apart, e.g. the benchmark of a score stage), recorded in `folder/tracking.json` so a later run that reuses
    the folder links it instead of logging again."""
    ctx = ctx if ctx is not None else TrackingContext.from_env()
    if ctx is None or not ctx.active:
        return StageRun()
    key = key or Path(folder).name
    tracker = tracker_for(ctx)
    name = stage_run_name(f"{stage}-{label}" if label else stage, key)
    tags = {**ctx.tags, "arpo.stage": stage, "arpo.stage_key": key, "arpo.stage_dir": str(folder),
            **({"arpo.label": label} if label else {})}
    run_id = tracker.start_run(name, tags, ctx.parent_id)
    if run_id is None:
        return StageRun(tracker)
    write_json(Path(folder) / RECORD_FILE, {"backend": ctx.backend, "uri": ctx.uri, "experiment": ctx.experiment,
                                           "run_id": run_id, "name": name, "parent_id": ctx.parent_id,
                                           "parent_name": ctx.parent_name, "stage": stage, "key": key})
    return StageRun(tracker, run_id, name, tags)


@contextmanager
def stage_run(stage: str, folder: Path, key: str | None = None, ctx: TrackingContext | None = None,
              label: str | None = None) -> Iterator[StageRun]:
    """Open the stage's run for the block (`current()` inside it), end it after (failed when the block raised)."""
    run = open_stage_run(stage, folder, key, ctx, label)
    token = _current.set(run)
    failed = True
    try:
        yield run
        failed = False
    finally:
        _current.reset(token)
        run.close(failed)


def current() -> StageRun:
    """The run of the stage running in this thread (a no-op run outside `stage_run`)."""
    return _current.get()


def log_step(row: Mapping[str, Any]) -> None:
    """One metrics.jsonl row into the current stage's run, at its `step`, under the row's own names."""
    run = current()
    if run.active:
        run.log_metrics(numeric(dict(row)), step=int(row["step"]) if "step" in row else None)


def read_record(folder: Path) -> dict[str, Any] | None:
    """The run recorded in a stage folder (`tracking.json`), or None."""
    import json

    try:
        return json.loads((Path(folder) / RECORD_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
