"""Output of subprocesses (LLaMA-Factory, a stage under another interpreter, servers) into our logs, with levels.

Every line is kept in the subprocess's own log file; what reaches the logger (and from there the Prefect UI) is
the readable part: each line at the level it announces (`[WARNING|...`, `ERROR`, a traceback), while the noise
is counted instead of repeated: progress-bar refreshes, HTTP access lines, lines seen before, and plain lines
beyond a cap; a very long line is cut. Nothing disappears silently: `summary()` (logged by `close()`, and every
`summary_every_s` for long-lived servers) says how many lines of each kind were left out and where the full output
is.

A server is quieter still (stages/eval/serving.py): its start-up stays in its log (the console gets one line: what
it serves, where, in how long), and while it runs only its warnings and errors are forwarded (`min_level`); the
rest is counted for the line that says it stopped.

A server we stop tears itself down loudly (vLLM 0.32 on CPU: nanobind's leak report, multiprocessing's resource
tracker warnings, `EngineDeadError` tracebacks; docs/eval.md, Serving). After `begin_teardown()` (called just before
the stop signal) no line is forwarded: each stays in the full log only and is counted by kind, and the lines that
are not known noise are kept (`teardown_tail`) for the one case they matter, a stop that went wrong.
"""

from __future__ import annotations

import contextvars
import logging
import re
import threading
import time
from collections import Counter, deque
from pathlib import Path

_PROGRESS = re.compile(r"\d+%\|.*\|\s*\d+/\d+|\d+/\d+ \[\d")          # tqdm refreshes
_HTTP = re.compile(r'"(?:GET|POST|PUT|PATCH|DELETE|HEAD|OPTIONS) \S+ HTTP/[\d.]+" (\d{3})')  # access-log lines
_LEVEL = re.compile(r"(?<![A-Za-z])(DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL|FATAL)(?![A-Za-z])")
_EXCEPTION = re.compile(r"^(?:[\w.]+\.)?\w*(?:Error|Exception|Interrupt|Exit)(?::|$)")
_CLOCK = re.compile(r"\d{1,2}:\d{2}:\d{2}(?:[.,]\d+)?")   # a time of day: ignored when telling repeats
# known teardown noise, by the kind the stop line names (`teardown_summary`)
TEARDOWN_NOISE = (
    ("nanobind leak report", re.compile(r"^nanobind: |^ - (?:leaked |\.\.\. skipped)|nanobind\.readthedocs")),
    ("resource-tracker warnings", re.compile(r"resource_tracker|warnings\.warn\('resource_tracker")),
)
LEVELS = {"DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARNING": logging.WARNING, "WARN": logging.WARNING,
          "ERROR": logging.ERROR, "CRITICAL": logging.CRITICAL, "FATAL": logging.CRITICAL}


def guess_level(line: str) -> int:
    """The level a line announces: a level word near its start, a Python warning, an exception line; else INFO."""
    if _EXCEPTION.match(line.strip()) or line.startswith("Traceback (most recent call last)"):
        return logging.ERROR
    match = _LEVEL.search(line[:48])
    if match:
        return LEVELS[match.group(1)]
    if re.search(r"\b\w*Warning: ", line):
        return logging.WARNING
    return logging.INFO


class LineForwarder:
    """Feed it a subprocess's output line by line; it logs `<what> | <line>` to `logger` as described above."""

    def __init__(self, logger: logging.Logger, what: str, full_log: str | Path | None = None, max_lines: int = 300,
                 max_chars: int = 2000, summary_every_s: float | None = None, clock=time.monotonic,
                 min_level: int = logging.NOTSET) -> None:
        """`min_level`: lines below it stay in the full log only, counted (a server's: only its warnings and errors
        reach the console while it runs)."""
        self.logger, self.what, self.full_log, self.max_lines = logger, what, full_log, max_lines
        self.min_level = min_level
        self.tearing_down = False
        self.teardown: Counter[str] = Counter()       # teardown lines by kind (TEARDOWN_NOISE, errors, other)
        self.teardown_tail: deque[str] = deque(maxlen=20)  # its last lines that are not known noise
        self.max_chars = max_chars
        self.summary_every_s, self.clock = summary_every_s, clock
        self.left_out: Counter[str] = Counter()
        self.http: Counter[str] = Counter()
        self.forwarded = 0
        self.last_progress = ""
        self._seen: set[str] = set()
        self._tail: deque[str] = deque(maxlen=40)
        self._in_traceback = False
        self._last_summary = clock()

    def begin_teardown(self) -> None:
        """From now on the process is stopping because we asked: its lines stay in the full log only."""
        self.tearing_down = True

    def feed(self, line: str) -> None:
        line = line.rstrip()
        if not line.strip():
            return
        if self.tearing_down:
            self._count_teardown(line)
            return
        if _PROGRESS.search(line):
            self.left_out["progress-bar refreshes"] += 1
            self.last_progress = line.strip()[-120:]
        elif (match := _HTTP.search(line)) is not None:
            self.http[match.group(1)] += 1
        else:
            self._tail.append(line)
            self._forward(line)
        if self.summary_every_s is not None and self.clock() - self._last_summary >= self.summary_every_s:
            self.flush_summary()  # (never during a teardown: the stop line says what was left out)

    def _forward(self, line: str) -> None:
        if line.startswith("Traceback (most recent call last)"):
            self._in_traceback = True
        in_traceback = self._in_traceback
        if in_traceback and not line.startswith((" ", "\t", "Traceback")):
            self._in_traceback = False  # the exception line ends the traceback
        level = logging.ERROR if in_traceback else guess_level(line)
        if level < self.min_level:
            self.left_out[f"lines of its own below {logging.getLevelName(self.min_level)}"] += 1
            return
        if not in_traceback:
            key = _CLOCK.sub("", line)
            if key in self._seen:
                self.left_out["repeated lines"] += 1
                return
            self._seen.add(key)
        if level < logging.WARNING and self.forwarded >= self.max_lines:
            self.left_out[f"lines over the {self.max_lines}-line cap"] += 1
            return
        self.forwarded += level < logging.WARNING
        if len(line) > self.max_chars:  # e.g. a tokenized sample dumped as one line of ids
            line = f"{line[:self.max_chars]} ... (+{len(line) - self.max_chars} chars)"
        self.logger.log(level, "%s | %s", self.what, line)

    def _count_teardown(self, line: str) -> None:
        kind = next((name for name, pattern in TEARDOWN_NOISE if pattern.search(line)), None)
        if kind is None:
            starts = line.startswith("Traceback (most recent call last)")
            in_traceback = self._in_traceback or starts   # the exception line that ends it included
            self._in_traceback = starts or (self._in_traceback and line.startswith((" ", "\t")))
            level = logging.ERROR if in_traceback else guess_level(line)
            kind = "errors" if level >= logging.ERROR else "warnings" if level >= logging.WARNING else "other"
            self.teardown_tail.append(line)
        self.teardown[kind] += 1

    def teardown_summary(self) -> str:
        """E.g. `41 lines of its own teardown (27 nanobind leak report, 4 resource-tracker warnings, 10 other)`."""
        total = sum(self.teardown.values())
        if not total:
            return ""
        kinds = ", ".join(f"{count} {kind}" for kind, count in self.teardown.items())
        return f"{total} lines of its own teardown ({kinds})"

    def left_out_parts(self) -> list[str]:
        """What was not forwarded since the last summary, by kind: `6 repeated lines`, `2 HTTP requests (200 x2)`."""
        parts = [f"{count} {kind}" for kind, count in self.left_out.items() if count]
        if self.http:
            codes = ", ".join(f"{code} x{n}" for code, n in sorted(self.http.items()))
            parts.append(f"{sum(self.http.values())} HTTP requests ({codes})")
        return parts

    def summary(self) -> str:
        parts = self.left_out_parts()
        if not parts:
            return ""
        where = f"; full output in {self.full_log}" if self.full_log else ""
        last = f"; last progress: {self.last_progress}" if self.left_out["progress-bar refreshes"] else ""
        return f"{self.what}: not shown: {', '.join(parts)}{last}{where}"

    def flush_summary(self) -> None:
        """Log the summary of what was left out since the last one, and start counting again."""
        self._last_summary = self.clock()
        text = self.summary()
        if text:
            self.logger.info("%s", text)
        self.left_out.clear()
        self.http.clear()

    def close(self) -> None:
        self.flush_summary()

    def last_lines(self, n: int = 40) -> str:
        return "\n".join(list(self._tail)[-n:])


class FileFollower:
    """Follows a growing log file (a server's) on a thread that carries the caller's context, feeding new lines
    to a `LineForwarder`; `stop()` reads what is left and logs the summary. For a server we stop:
    `begin_teardown()` before the stop signal, `finish()` once the process is gone (module doc)."""

    def __init__(self, path: str | Path, forwarder: LineForwarder, poll_s: float = 0.5, from_start: bool = True,
                 offset: int | None = None):
        """`offset`: the byte to start reading at (a server's log: where its start-up ended), else the file's start
        (`from_start`) or its current end."""
        self.path, self.forwarder, self.poll_s = Path(path), forwarder, poll_s
        if offset is None:
            offset = 0 if from_start or not self.path.is_file() else self.path.stat().st_size
        self._offset = offset
        self._lock = threading.Lock()  # one reader at a time: the thread, or begin_teardown's catch-up
        self._stop = threading.Event()
        self._thread = threading.Thread(target=contextvars.copy_context().run, args=(self._loop,), daemon=True,
                                        name=f"arpo-follow-{self.path.name}")

    def start(self) -> FileFollower:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._halt(last=False)
        self.forwarder.close()

    def begin_teardown(self) -> None:
        """Forward what the process wrote so far as usual; everything after is its teardown (not forwarded)."""
        with self._lock:
            self._read()
            self.forwarder.begin_teardown()

    def finish(self) -> str:
        """Stop following (reading what is left) and return what was not shown, for the caller's stop line:
        `41 lines of its own teardown (...), 2 HTTP requests (200 x2)`; nothing is logged."""
        self._halt(last=True)  # the process is gone: a last line without its newline counts too
        parts = [self.forwarder.teardown_summary(), *self.forwarder.left_out_parts()]
        return ", ".join(part for part in parts if part)

    def _halt(self, last: bool) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        with self._lock:
            self._read(last)

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.read()

    def read(self) -> None:
        with self._lock:
            self._read()

    def _read(self, last: bool = False) -> None:
        if not self.path.is_file():
            return
        with open(self.path, "rb") as handle:
            handle.seek(self._offset)
            data = handle.read()
        whole = data if last else data[: data.rfind(b"\n") + 1]
        self._offset += len(whole)
        for line in whole.decode("utf-8", "replace").splitlines():
            self.forwarder.feed(line)
