"""A running stage, live in the Prefect UI: its log lines in the task run's logs, its reporter messages as artifacts.

`install()` (tasks/stage_tasks.py calls it on import) attaches two things that stay inert outside a Prefect run:
- `RunLogForwarder`, a handler on the `arpo` logger that sends each record, with its level, to the current task
  run (or flow run): the stage's own lines, its ETA lines, and what it relays from subprocesses and from a
  child interpreter (stages/core/streams.py, stages/core/reporter.py);
- `PrefectReporter`, the stages.core.reporter seam's Prefect side: progress messages become one progress
  artifact per (run, key) updated in place, markdown / table / image messages become keyed artifacts (a new
  version each time), events become Prefect events related to the flow and task run.
The run is found from the context of the thread that logs or reports; stage threads that relay (isolate, log
followers) copy that context, so their messages land in the right task run: a server's log file is followed that
way while the server runs (`stages.eval.serving.follow_output`).
"""

from __future__ import annotations

import logging
import threading
from typing import Any
from uuid import UUID

from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.context import FlowRunContext, TaskRunContext
from prefect.events import emit_event
from prefect.logging.handlers import APILogHandler

from stages.core import reporter
from stages.core.log import root_logger
from tasks.artifacts import artifact_key, publish_image, publish_markdown, publish_table

RunIds = tuple[UUID, UUID | None]  # (flow run, task run or None)


def run_ids() -> RunIds | None:
    task = TaskRunContext.get()
    if task is not None:
        return task.task_run.flow_run_id, task.task_run.id
    flow = FlowRunContext.get()
    if flow is not None and flow.flow_run is not None:
        return flow.flow_run.id, None
    return None


class RunLogForwarder(APILogHandler):
    """`arpo` records -> logs of the current Prefect run; records logged outside any run are left to the console."""

    def emit(self, record: logging.LogRecord) -> None:
        if run_ids() is not None:
            super().emit(record)


class PrefectReporter(reporter.Reporter):
    def __init__(self) -> None:
        self._progress: dict[tuple[RunIds, str], UUID] = {}
        self._lock = threading.Lock()

    def handle(self, message: dict[str, Any]) -> None:
        ids = run_ids()
        if ids is None:
            return
        kind = message.get("kind")
        if kind == "progress":
            self.progress(ids, message)
        elif kind == "markdown":
            publish_markdown(message["key"], message["text"], message.get("description", ""))
        elif kind == "table":
            publish_table(message["key"], message["rows"], message.get("description", ""))
        elif kind == "image":
            publish_image(message["key"], message["path"], message.get("description", ""))
        elif kind == "event":
            self.event(ids, message["name"], message.get("payload") or {})

    def progress(self, ids: RunIds, message: dict[str, Any]) -> None:
        state = {"done": "finished: ", "failed": "stopped: "}.get(message.get("state", ""), "")
        description = f"{state}{message.get('text', '')}"
        percent = float(message.get("percent") or 0.0)
        slot = (ids, message["key"])
        with self._lock:  # one artifact per run and key, created once, then updated in place
            artifact = self._progress.get(slot)
            if artifact is None:
                self._progress[slot] = create_progress_artifact(
                    progress=percent, key=artifact_key(f"progress-{message['key']}"), description=description,
                    _sync=True)
            else:
                update_progress_artifact(artifact, progress=percent, description=description, _sync=True)

    @staticmethod
    def event(ids: RunIds, name: str, payload: dict[str, Any]) -> None:
        flow_run, task_run = ids
        related = [{"prefect.resource.id": f"prefect.flow-run.{flow_run}", "prefect.resource.role": "flow-run"}]
        if task_run is not None:
            related.append({"prefect.resource.id": f"prefect.task-run.{task_run}", "prefect.resource.role": "task-run"})
        emit_event(event=name, resource={"prefect.resource.id": f"arpo.run.{task_run or flow_run}",
                                         "prefect.resource.name": name.rsplit(".", 1)[-1]},
                   related=related, payload=payload)


_installed: list[Any] = []


def install() -> None:
    """Forward `arpo` logs and reporter messages to the current Prefect run (idempotent)."""
    if _installed:
        return
    forwarder = RunLogForwarder()
    root_logger().addHandler(forwarder)
    reporter.set_reporter(PrefectReporter())
    _installed.append(forwarder)
