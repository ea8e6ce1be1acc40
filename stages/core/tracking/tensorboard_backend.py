"""TensorBoard: one event-file folder per run, a stage's inside its pipeline run's:
`<tracking_uri>/<experiment>/<pipeline run>/<stage>-<key>/`, so `tensorboard --logdir <tracking_uri>/<experiment>`
lists every pipeline run with its stages and overlays any of them step by step.

Event files are written with TensorBoard's own writer and protos (no torch, no TensorFlow). Params and artifacts are
files beside the events (`params.json`, the artifact itself). Another process writes into a run's folder through
TENSORBOARD_LOGGING_DIR (Hugging Face's TensorBoardCallback: LLaMA-Factory's report_to) and TENSORBOARD_DIR (verl's
tensorboard logger, verl/utils/tracking.py _TensorboardAdapter).
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stages.core.tracking.backends import Backend
from stages.core.tracking.context import TrackingContext

_FOLDER = re.compile(r"[^\w.\-]+")


class TensorboardBackend(Backend):
    def __init__(self, ctx: TrackingContext) -> None:
        super().__init__(ctx)
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.writer_class = EventFileWriter
        self.root = Path(ctx.uri).resolve() / _FOLDER.sub("_", ctx.experiment)
        self.writers: dict[str, Any] = {}

    def folder(self, run_id: str) -> Path:
        return self.root / run_id

    def start_run(self, name: str, tags: Mapping[str, str], parent_id: str | None) -> str:
        run_id = f"{parent_id}/{_FOLDER.sub('_', name)}" if parent_id else _FOLDER.sub("_", name)
        folder = self.folder(run_id)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "tags.json").write_text(json.dumps(dict(tags), indent=1, sort_keys=True))
        return run_id

    def _writer(self, run_id: str) -> Any:
        if run_id not in self.writers:
            self.writers[run_id] = self.writer_class(str(self.folder(run_id)))
        return self.writers[run_id]

    def log_metrics(self, run_id: str, metrics: Mapping[str, float], step: int | None) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=k, simple_value=float(v)) for k, v in metrics.items()]
        writer = self._writer(run_id)
        writer.add_event(Event(wall_time=time.time(), step=int(step or 0), summary=Summary(value=values)))
        writer.flush()

    def log_params(self, run_id: str, params: Mapping[str, str]) -> None:
        (self.folder(run_id) / "params.json").write_text(json.dumps(dict(params), indent=1, sort_keys=True))

    def log_artifact(self, run_id: str, path: Path) -> None:
        shutil.copy2(path, self.folder(run_id) / Path(path).name)

    def set_tags(self, run_id: str, tags: Mapping[str, str]) -> None:
        file = self.folder(run_id) / "tags.json"
        old = json.loads(file.read_text()) if file.is_file() else {}
        file.write_text(json.dumps(old | dict(tags), indent=1, sort_keys=True))

    def end_run(self, run_id: str, failed: bool = False) -> None:
        writer = self.writers.pop(run_id, None)
        if writer is not None:
            writer.close()
        if failed:
            self.set_tags(run_id, {"arpo.status": "FAILED"})

    def handoff_env(self, run_id: str, name: str) -> dict[str, str]:
        folder = str(self.folder(run_id))
        return {"TENSORBOARD_LOGGING_DIR": folder, "TENSORBOARD_DIR": folder}

    def close(self) -> None:
        for run_id in list(self.writers):
            self.end_run(run_id)


BACKEND = TensorboardBackend
