"""Output of subprocesses (LLaMA-Factory, a stage under another interpreter, servers) into our logs, with levels.

Every line is kept in the subprocess's own log file; what reaches the logger (and from there the Prefect UI) is
the readable part: each line at the level it announces (`[WARNING|...`, `ERROR`, a traceback), while the noise
is counted instead of repeated: progress-bar refreshes, HTTP access lines, lines seen before, and plain lines
beyond a cap; a very long line is cut. Nothing disappears silently: `summary()` (logged by `close()`, and every
`summary_every_s` for long-lived servers) says how many lines of each kind were left out and where the full output
is.
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
                 teardown_marker: str | None = None) -> None:
        """`teardown_marker`: a line with which the process announces its own shutdown (one we asked for): errors
        after it are forwarded at INFO, said once, and stay as they were in the full log."""
        self.logger, self.what, self.full_log, self.max_lines = logger, what, full_log, max_lines
        self.teardown_marker, self.tearing_down = teardown_marker, False
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

    def feed(self, line: str) -> None:
        line = line.rstrip()
        if not line.strip():
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
            self.flush_summary()

    def _forward(self, line: str) -> None:
        if line.startswith("Traceback (most recent call last)"):
            self._in_traceback = True
        in_traceback = self._in_traceback
        if in_traceback and not line.startswith((" ", "\t", "Traceback")):
            self._in_traceback = False  # the exception line ends the traceback
        level = logging.ERROR if in_traceback else guess_level(line)
        if self.teardown_marker and not self.tearing_down and self.teardown_marker in line:
            self.tearing_down = True
            self.logger.info("%s | shutting down: errors from its own teardown follow at INFO (full log: %s)",
                             self.what, self.full_log)
        if self.tearing_down:
            level = min(level, logging.INFO)
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

    def summary(self) -> str:
        parts = [f"{count} {kind}" for kind, count in self.left_out.items()]
        if self.http:
            codes = ", ".join(f"{code} x{n}" for code, n in sorted(self.http.items()))
            parts.append(f"{sum(self.http.values())} HTTP requests ({codes})")
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
    to a `LineForwarder`; `stop()` reads what is left and logs the summary."""

    def __init__(self, path: str | Path, forwarder: LineForwarder, poll_s: float = 0.5, from_start: bool = True):
        self.path, self.forwarder, self.poll_s = Path(path), forwarder, poll_s
        self._offset = 0 if from_start or not self.path.is_file() else self.path.stat().st_size
        self._stop = threading.Event()
        self._thread = threading.Thread(target=contextvars.copy_context().run, args=(self._loop,), daemon=True,
                                        name=f"arpo-follow-{self.path.name}")

    def start(self) -> FileFollower:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.forwarder.close()

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.read()
        self.read()

    def read(self) -> None:
        if not self.path.is_file():
            return
        with open(self.path, "rb") as handle:
            handle.seek(self._offset)
            data = handle.read()
        whole = data[: data.rfind(b"\n") + 1]
        self._offset += len(whole)
        for line in whole.decode("utf-8", "replace").splitlines():
            self.forwarder.feed(line)
