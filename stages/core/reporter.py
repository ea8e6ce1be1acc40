"""The seam between a running stage and whoever watches it: the Prefect UI, a parent process, or nobody.

Stages call the plain functions here; what happens to the messages depends on the installed `Reporter`:
- nothing, by default (a stage run alone, a unit test);
- Prefect progress / markdown / table artifacts and events, when the task layer installed its reporter
  (tasks/live.py);
- JSON lines appended to a file, in a stage running under another interpreter (stages/core/isolate.py); the
  parent tails that file with a `Relay` and replays each message into its own reporter and loggers, so the
  same calls reach the UI from either side of the process boundary.

    with track("rl", "RL (arpo)", total=10, unit="steps", done=resumed_step) as bar:
        for ...: bar.update(step, note="reward 0.31")     # progress artifact + an ETA line in the log
    markdown("rl-alarms", text, "collapse alarms")
    image("rl-curves", "curves.png", "reward / entropy / tool calls")
    event("arpo.rl.alarm.entropy_collapse", {"step": 3})

A message is a JSON-able dict with a `kind` (progress, markdown, table, image, event); reporting never breaks
a stage: a reporter that fails is logged and the stage goes on.
"""

from __future__ import annotations

import contextvars
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Self

from stages.core.log import get_logger, progress

log = get_logger("core.progress")

Message = dict[str, Any]
EVENTS_ENV = "ARPO_EVENTS_FILE"   # set for a child interpreter: where its messages go


class Reporter:
    """Receives a stage's messages. This base class drops them: nobody is watching."""

    def handle(self, message: Message) -> None:
        return None


_reporter: Reporter = Reporter()


def set_reporter(reporter: Reporter | None) -> Reporter:
    """Install `reporter` (None: the silent default); returns the one it replaces."""
    global _reporter
    previous, _reporter = _reporter, reporter or Reporter()
    return previous


def send(kind: str, **fields: Any) -> None:
    try:
        _reporter.handle({"kind": kind, **fields})
    except Exception as err:  # noqa: BLE001 -- the UI must never be the reason a training run dies
        log.warning("reporting a %s message failed: %s: %s", kind, type(err).__name__, err)


def markdown(key: str, text: str, description: str = "") -> None:
    send("markdown", key=key, text=text, description=description)


def table(key: str, rows: list[dict[str, Any]], description: str = "") -> None:
    send("table", key=key, rows=rows, description=description)


def image(key: str, path: str | Path, description: str = "") -> None:
    send("image", key=key, path=str(path), description=description)


def event(name: str, payload: dict[str, Any]) -> None:
    send("event", name=name, payload=payload)


# ---- progress + ETA -------------------------------------------------------------------------------------------

def duration(seconds: float | None) -> str:
    """38s, 4m12s, 2h05m; '?' when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Tracker:
    """Progress of one loop: reported at most every `report_every_s` (and at the end), an ETA line logged at
    most every `log_every_s`. The ETA extrapolates the rate of the units done by this process, so a resumed run
    (started at `done` > 0) is not credited with the work of the run before it."""

    def __init__(self, key: str, what: str, total: float | None, done: float = 0, unit: str = "steps",
                 report_every_s: float = 2.0, log_every_s: float = 30.0, clock: Callable[[], float] = time.monotonic,
                 on_update: Callable[[float, float | None], None] | None = None) -> None:
        self.key, self.what, self.total, self.done, self.unit = key, what, total, done, unit
        self.report_every_s, self.log_every_s = report_every_s, log_every_s
        self.clock, self.on_update = clock, on_update
        self.note = ""
        self._start, self._start_done = clock(), done
        self._last_report = self._last_log = -math.inf

    @property
    def finished(self) -> bool:
        return self.total is not None and self.done >= self.total

    def elapsed_s(self) -> float:
        return self.clock() - self._start

    def eta_s(self) -> float | None:
        made = self.done - self._start_done
        if self.total is None or made <= 0:
            return None
        return max(0.0, self.total - self.done) * self.elapsed_s() / made

    def describe(self) -> str:
        total = f"/{self.total:g}" if self.total is not None else ""
        pct = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        text = (f"{self.what}: {self.done:g}{total} {self.unit}{pct}, {duration(self.elapsed_s())} elapsed, "
                f"ETA {duration(0.0 if self.finished else self.eta_s())}")
        return f"{text}, {self.note}" if self.note else text

    def update(self, done: float, total: float | None = None, note: str | None = None) -> None:
        self.done = done
        self.total = total if total is not None else self.total
        self.note = note if note is not None else self.note
        if self.on_update is not None:
            self.on_update(self.done, self.total)
        now = self.clock()
        if self.finished or now - self._last_report >= self.report_every_s:
            self.report()
        if self.finished or now - self._last_log >= self.log_every_s:
            self._last_log = now
            log.info("%s", self.describe())

    def advance(self, n: float = 1, note: str | None = None) -> None:
        self.update(self.done + n, note=note)

    def report(self, state: str = "running") -> None:
        self._last_report = self.clock()
        percent = min(100.0, 100.0 * self.done / self.total) if self.total else 0.0
        send("progress", key=self.key, what=self.what, done=self.done, total=self.total, unit=self.unit,
             percent=percent, elapsed_s=round(self.elapsed_s(), 1), eta_s=self.eta_s(), note=self.note,
             state=state, text=self.describe())


@contextmanager
def track(key: str, what: str, total: float | None, done: float = 0, unit: str = "steps",
          **options: Any) -> Iterator[Tracker]:
    """A `Tracker` that also drives a terminal progress bar; reports the start, and how the loop ended."""
    with progress() as bar:
        task = bar.add_task(what, total=total, completed=done)
        tracker = Tracker(key, what, total, done, unit, on_update=lambda d, t: bar.update(task, completed=d, total=t),
                          **options)
        tracker.report()
        try:
            yield tracker
        except BaseException:
            tracker.report(state="failed")
            raise
        tracker.report(state="done")


# ---- across a process boundary: JSON lines ---------------------------------------------------------------------

class JsonlReporter(Reporter):
    """Appends every message as one JSON line (flushed), for a parent process to replay."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()

    def handle(self, message: Message) -> None:
        line = json.dumps(message, default=str) + "\n"
        with self._lock, open(self.path, "a", encoding="utf-8") as handle:
            handle.write(line)


class JsonlLogHandler(logging.Handler):
    """Log records as `log` messages in the same file, so the parent re-logs them with their levels."""

    def __init__(self, sink: JsonlReporter) -> None:
        super().__init__()
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.sink.handle({"kind": "log", "name": record.name, "level": record.levelno,
                              "msg": self.format(record), "created": record.created})
        except Exception:  # noqa: BLE001
            self.handleError(record)


def install_child_sink(path: str | Path) -> JsonlReporter:
    """In a child interpreter: send reporter messages and `arpo` log records to `path`."""
    from stages.core.log import set_console

    sink = JsonlReporter(path)
    set_reporter(sink)
    set_console(JsonlLogHandler(sink))
    return sink


def replay(message: Message) -> None:
    """One message from a child: a log record goes to our logger of the same name, the rest to our reporter."""
    if message.get("kind") != "log":
        send(**message)
        return
    level = int(message.get("level", logging.INFO))
    record = logging.makeLogRecord({"name": message.get("name", "arpo"), "levelno": level,
                                    "levelname": logging.getLevelName(level), "msg": message.get("msg", ""),
                                    "created": message.get("created", time.time())})
    logging.getLogger(record.name).handle(record)


class Relay:
    """Tails a child's JSONL file on a thread that carries the caller's context (so the task layer still knows
    which run the messages belong to) and replays each complete line. `stop()` drains what is left."""

    def __init__(self, path: str | Path, poll_s: float = 0.25) -> None:
        self.path, self.poll_s = Path(path), poll_s
        self._offset = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=contextvars.copy_context().run, args=(self._loop,), daemon=True,
                                        name="arpo-relay")

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.drain()
        self.drain()

    def drain(self) -> None:
        if not self.path.is_file():
            return
        with open(self.path, "rb") as handle:
            handle.seek(self._offset)
            data = handle.read()
        whole = data[: data.rfind(b"\n") + 1]  # a line being written is read next time
        self._offset += len(whole)
        for line in whole.decode("utf-8", "replace").splitlines():
            if line.strip():
                try:
                    replay(json.loads(line))
                except (ValueError, TypeError) as err:
                    log.warning("unreadable message from a child process in %s: %s", self.path, err)
