"""One request rate shared by every process that names the same file: an even-spacing limiter (no bursts) whose
state is the next free slot, kept as text in that file under a POSIX record lock.

    limiter = SharedRateLimiter(path, rate)   # the same path in every process (e.g. all of a run's Ray workers)
    limiter.acquire()                          # blocks until this call's slot; returns the seconds waited

A provider's limit is per account, not per process: verl's agent-loop workers are separate processes, so a
per-process limiter lets N workers send N times the configured rate. Here each acquisition reserves the slot
`max(now, next)` and moves `next` one interval on, under `fcntl.lockf` (POSIX locks also work on NFS with a lock
daemon); threads of one process serialise on a thread lock first, because POSIX locks belong to the process: one
thread lock per file, shared by every limiter of the process on that file (two limiters on one file in one process
would otherwise both hold the POSIX lock at once). The clock is wall time (`time.time()`), which every process of a
host shares. A stored slot more than `STALE_AFTER_S` ahead (a clock set back, a damaged file) is ignored rather than
waited for.

Every wait for a slot (`sleep_for_slot`, which `acquire` and the page fetcher use) is added to a per-thread total,
`thread_wait_s()`: the ToolBox reads it before and after a call to report the call's rate-limit queueing.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from pathlib import Path

STALE_AFTER_S = 3600.0
_FILE_LOCKS: dict[str, threading.Lock] = {}
_FILE_LOCKS_GUARD = threading.Lock()
_WAITED = threading.local()


def thread_wait_s() -> float:
    """Seconds this thread has slept for rate-limit slots so far (any limiter)."""
    return getattr(_WAITED, "total", 0.0)


def sleep_for_slot(wait: float) -> float:
    """Sleep `wait` seconds (if positive) for a rate-limit slot, counted in this thread's total; returns it."""
    if wait > 0:
        _WAITED.total = thread_wait_s() + wait
        time.sleep(wait)
    return max(0.0, wait)


def _file_lock(path: Path) -> threading.Lock:
    """The thread lock of this process for one limiter file."""
    with _FILE_LOCKS_GUARD:
        return _FILE_LOCKS.setdefault(os.path.abspath(path), threading.Lock())


class SharedRateLimiter:
    """At most `rate` acquisitions per second over all threads and processes using `path`."""

    def __init__(self, path: str | Path, rate: float) -> None:
        if rate <= 0:
            raise ValueError(f"rate must be > 0, got {rate}")
        self.path, self.interval = Path(path), 1.0 / rate
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = _file_lock(self.path)

    def reserve(self) -> float:
        """Take the next free slot (a `time.time()` value, never earlier than now) without waiting for it."""
        with self._lock:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX)
                raw = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
                now = time.time()
                try:
                    booked = float(raw)
                except ValueError:
                    booked = 0.0
                slot = now if booked - now > STALE_AFTER_S else max(now, booked)
                os.ftruncate(fd, 0)
                os.pwrite(fd, repr(slot + self.interval).encode("ascii"), 0)
            finally:
                os.close(fd)  # releases the record lock
        return slot

    def acquire(self) -> float:
        """Block until the next slot; return the seconds waited."""
        return sleep_for_slot(self.reserve() - time.time())
