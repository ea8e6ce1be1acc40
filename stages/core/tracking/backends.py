"""The tracking backends (one line each) and `Tracker`, the guarded face every caller uses.

A backend (mlflow_backend.py, wandb_backend.py, tensorboard_backend.py) only talks to its library and may raise
anywhere. `Tracker` wraps it: with `tracking.required` false the first failure (the import, the server's health
check, any call) is one warning and every later call is a no-op, so a dead tracker never fails a stage and loses
nothing (metrics.jsonl and the Prefect artifacts are written as before); with `required` true the failure is raised
as `TrackerUnavailable`, naming the tracker and the fix. Backend modules are imported only when a run uses them.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from stages.core.log import get_logger
from stages.core.registry import Registry
from stages.core.tracking.context import TrackerUnavailable, TrackingContext

log = get_logger(__name__)
T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class BackendLine:
    """name: the config value; module: the module holding its `Backend` class (imported when used); verl_logger:
    its name in verl's trainer.logger (verl/utils/tracking.py Tracking.supported_backend), None when verl has none;
    report_to: its name in Hugging Face's `report_to` (LLaMA-Factory's train.yaml); local_folder: its store under
    run.output_root when tracking_uri is unset."""

    name: str
    module: str | None
    verl_logger: str | None
    report_to: str
    local_folder: str = ""


TRACKING_BACKENDS: Registry[BackendLine] = Registry("tracking backend")
for _line in (BackendLine(name="none", module=None, verl_logger=None, report_to="none"),
              BackendLine(name="mlflow", module="stages.core.tracking.mlflow_backend", verl_logger="mlflow",
                          report_to="mlflow", local_folder="mlflow"),
              BackendLine(name="wandb", module="stages.core.tracking.wandb_backend", verl_logger="wandb",
                          report_to="wandb", local_folder="wandb"),
              BackendLine(name="tensorboard", module="stages.core.tracking.tensorboard_backend",
                          verl_logger="tensorboard", report_to="tensorboard", local_folder="tensorboard")):
    TRACKING_BACKENDS.register(_line.name)(_line)


class Backend:
    """One tracker's calls; run ids are the backend's own strings. Every method may raise (Tracker guards them)."""

    def __init__(self, ctx: TrackingContext) -> None:
        self.ctx = ctx

    def start_run(self, name: str, tags: Mapping[str, str], parent_id: str | None) -> str:
        raise NotImplementedError

    def log_metrics(self, run_id: str, metrics: Mapping[str, float], step: int | None) -> None:
        raise NotImplementedError

    def log_summary(self, run_id: str, metrics: Mapping[str, float]) -> None:
        self.log_metrics(run_id, metrics, None)

    def log_params(self, run_id: str, params: Mapping[str, str]) -> None:
        raise NotImplementedError

    def log_artifact(self, run_id: str, path: Path) -> None:
        raise NotImplementedError

    def set_tags(self, run_id: str, tags: Mapping[str, str]) -> None:
        raise NotImplementedError

    def end_run(self, run_id: str, failed: bool = False) -> None:
        raise NotImplementedError

    def handoff_env(self, run_id: str, name: str) -> dict[str, str]:
        """The environment that makes another process's logger (LLaMA-Factory's report_to, verl's trainer.logger)
        write into the run `run_id` named `name`."""
        raise NotImplementedError

    def close(self) -> None:
        """Flush and release what the backend holds (the process is about to end or the tests to tear down)."""


class Tracker:
    """A backend behind the guard: never raises while `ctx.required` is false (one warning, then no-ops)."""

    def __init__(self, ctx: TrackingContext) -> None:
        self.ctx = ctx
        self.line = TRACKING_BACKENDS.get(ctx.backend)
        self.dead: str | None = ctx.disabled
        self.backend: Backend | None = None
        self.lock = threading.RLock()  # stages in threads (the eval fan-out) share one tracker
        if ctx.active and self.line.module:
            self.backend = self._call("start", lambda: _backend_class(self.line.module)(ctx))

    @property
    def alive(self) -> bool:
        return self.backend is not None and self.dead is None

    def _call(self, what: str, fn: Callable[[], T]) -> T | None:
        with self.lock:
            return self._guarded(what, fn)

    def _guarded(self, what: str, fn: Callable[[], T]) -> T | None:
        if self.dead is not None:
            return None
        try:
            return fn()
        except Exception as err:  # noqa: BLE001 - any failure of a tracker: one warning, or the required error
            reason = f"{type(err).__name__}: {err}".splitlines()[0][:400]
            if self.ctx.required:
                raise TrackerUnavailable(self.ctx.explain(what, reason)) from err
            self.dead = reason
            log.warning("tracking: the %s tracker failed to %s (%s); this run goes on without it: metrics.jsonl and "
                        "the Prefect artifacts keep every number (tracking.required=true would stop here)",
                        self.ctx.backend, what, reason)
            return None

    def call(self, what: str, fn: Callable[[Backend], T]) -> T | None:
        """`fn(backend)` behind the guard; None when off or failed."""
        backend = self.backend
        if backend is None:
            return None
        return self._call(what, lambda: fn(backend))

    def start_run(self, name: str, tags: Mapping[str, str], parent_id: str | None) -> str | None:
        return self.call(f"start the run {name!r}", lambda b: b.start_run(name, dict(tags), parent_id))

    def log_metrics(self, run_id: str | None, metrics: Mapping[str, float], step: int | None = None) -> None:
        if run_id and metrics:
            self.call("log metrics", lambda b: b.log_metrics(run_id, dict(metrics), step))

    def log_summary(self, run_id: str | None, metrics: Mapping[str, float]) -> None:
        if run_id and metrics:
            self.call("log summary metrics", lambda b: b.log_summary(run_id, dict(metrics)))

    def log_params(self, run_id: str | None, params: Mapping[str, str]) -> None:
        if run_id and params:
            self.call("log params", lambda b: b.log_params(run_id, dict(params)))

    def log_artifact(self, run_id: str | None, path: Path) -> None:
        if run_id and Path(path).is_file():
            self.call(f"store {Path(path).name}", lambda b: b.log_artifact(run_id, Path(path)))

    def set_tags(self, run_id: str | None, tags: Mapping[str, str]) -> None:
        if run_id and tags:
            self.call("set tags", lambda b: b.set_tags(run_id, dict(tags)))

    def end_run(self, run_id: str | None, failed: bool = False) -> None:
        if run_id:
            self.call("end a run", lambda b: b.end_run(run_id, failed))

    def handoff_env(self, run_id: str | None, name: str) -> dict[str, str]:
        if not run_id:
            return {}
        return self.call("hand a run to another process", lambda b: b.handoff_env(run_id, name)) or {}


def _backend_class(module: str) -> type[Backend]:
    found = importlib.import_module(module)
    return found.BACKEND


_TRACKERS: dict[tuple[str, str, str, bool], Tracker] = {}


def tracker_for(ctx: TrackingContext, fresh: bool = False) -> Tracker:
    """One tracker per backend and store in a process (so a dead one warns once, and clients are reused); `fresh`:
    a new one (a pipeline run starting checks its tracker again)."""
    key = (ctx.backend, ctx.uri, ctx.experiment, ctx.required)
    tracker = _TRACKERS.get(key)
    if fresh or tracker is None or (ctx.disabled and tracker.dead is None):
        if tracker is not None:
            _close(tracker)
        tracker = _TRACKERS[key] = Tracker(ctx)
    return tracker


def _close(tracker: Tracker) -> None:
    if tracker.backend is not None:
        try:
            tracker.backend.close()
        except Exception as err:  # noqa: BLE001 - closing a tracker never fails a run
            log.debug("tracking: closing %s: %s", tracker.ctx.backend, err)


def close_trackers() -> None:
    """Release every tracker of this process (tests; the end of a pipeline run)."""
    while _TRACKERS:
        _close(_TRACKERS.popitem()[1])
