"""One builder per stage folder: two runs started at once on the same outputs never build the same folder together.

`acquire(folder)` takes an exclusive `flock` on `<root>/.locks/<stage>/<key>.lock` (outside the folder, so wiping
the folder keeps it). The kernel drops a flock when its holder dies, `kill -9` included, so a crashed run never
leaves a stale lock.
Across threads of one process a plain lock does the same; the thread that holds it may take it again (a retry in
the same thread does not wait for itself). `stages.core.workspace.stage_dir` takes it before it looks at a folder
and lets go at once when the folder is complete; otherwise the lock is held while the stage builds, until
`StageDir.finish()`, or the end of the stage task (`release_thread_locks`), or the process.
"""

from __future__ import annotations

import fcntl
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from stages.core.log import get_logger

log = get_logger(__name__)


@dataclass
class _Held:
    fd: int
    thread: int


_GUARD = threading.Lock()
_THREAD_LOCKS: dict[str, threading.Lock] = {}
_HELD: dict[str, _Held] = {}


def lock_path(folder: Path) -> Path:
    """<root>/.locks/<stage>/<key>.lock: outside the stage folders, so a listing of <root>/<stage>/ shows only them."""
    return folder.parent.parent / ".locks" / folder.parent.name / f"{folder.name}.lock"


def acquire(folder: str | Path) -> None:
    """Hold the folder's lock (waiting, with a log line, while another process or thread holds it)."""
    path = lock_path(Path(folder))
    name, me = str(path), threading.get_ident()
    with _GUARD:
        held = _HELD.get(name)
        if held is not None and held.thread == me:
            return
        thread_lock = _THREAD_LOCKS.setdefault(name, threading.Lock())
    if not thread_lock.acquire(blocking=False):
        log.info("waiting for another thread that is building %s", folder)
        thread_lock.acquire()
    try:
        fd = _flock(path, Path(folder))
    except BaseException:
        thread_lock.release()
        raise
    with _GUARD:
        _HELD[name] = _Held(fd=fd, thread=me)


def _flock(path: Path, folder: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            log.info("waiting for another run (pid %s) that is building %s", holder, folder)
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def release(folder: str | Path) -> None:
    """Let go of the folder's lock if this thread holds it."""
    _release(str(lock_path(Path(folder))))


def _release(name: str) -> None:
    with _GUARD:
        held = _HELD.get(name)
        if held is None or held.thread != threading.get_ident():
            return
        del _HELD[name]
        os.close(held.fd)  # drops the flock
        _THREAD_LOCKS[name].release()


def release_thread_locks() -> None:
    """Every folder lock this thread holds (a stage task that ended without finishing its folder)."""
    me = threading.get_ident()
    with _GUARD:
        mine = [name for name, held in _HELD.items() if held.thread == me]
    for name in mine:
        _release(name)


def held() -> list[str]:
    """Lock files held by this process (for tests and diagnostics)."""
    with _GUARD:
        return sorted(_HELD)
