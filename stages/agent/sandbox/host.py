"""Process-level helpers of the python sandbox: interpreter discovery, per-call uids shared safely by every process
on the machine, sweeping what a call of the rlimit mode left behind, reading capped output. Stdlib only."""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import random
import shutil
import signal
import stat
import subprocess
import threading
import time
from functools import lru_cache
from pathlib import Path

from stages.agent.sandbox.spec import InterpreterPaths, clip_output

UID_SPAN = 100_000
UID_LOCK_FILE = Path("/tmp/arpo-sandbox-uids.lock")
SHARED_TEMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/dev/mqueue")
_PROBE = """
import json, os, sys
from importlib import metadata
names = {}
for module in sys.argv[1:]:
    try:
        dists = metadata.packages_distributions().get(module, [module])
        names[module] = ",".join(f"{d}=={metadata.version(d)}" for d in sorted(set(dists)))
    except Exception:
        names[module] = "missing"
print(json.dumps([sys.prefix, sys.base_prefix, os.path.realpath(sys.executable), sys.version, names]))
"""


class SandboxUnavailable(RuntimeError):
    """The requested isolation level cannot run on this machine."""


@lru_cache(maxsize=8)
def interpreter_paths(executable: str, preload: tuple[str, ...] = ()) -> InterpreterPaths:
    """Ask the interpreter where it lives (its prefixes, the real path of its binary), its version and the
    versions of the distributions behind the preloaded modules (they change what code prints)."""
    try:
        out = subprocess.run([executable, "-I", "-c", _PROBE, *preload], capture_output=True, text=True,
                             timeout=120, check=True)
    except (OSError, subprocess.SubprocessError) as err:
        raise SandboxUnavailable(f"python interpreter {executable!r} does not run ({err}); "
                                 "set agent.python.python_executable to a working python") from err
    prefix, base, real, version, packages = json.loads(out.stdout)
    prefixes = {os.path.realpath(prefix), os.path.realpath(base), os.path.dirname(os.path.dirname(real)), prefix}
    return InterpreterPaths(executable, tuple(sorted(prefixes)), version, tuple(sorted(packages.items())))


def is_root() -> bool:
    return os.geteuid() == 0


class UidAllocator:
    """Per-call uids in [base, base + UID_SPAN), never handed out twice at once on this machine.

    Several processes (Ray workers, parallel stages) may run sandboxes with the same `uid_base`: a POSIX record
    lock on byte `uid - base` of one root-only file marks a uid as taken across processes, a set within ours
    (record locks belong to the process). One allocator per process and base (`uid_allocator`), because closing
    any descriptor of the file would drop all of this process's locks on it.
    """

    def __init__(self, base: int, lock_file: Path = UID_LOCK_FILE) -> None:
        self.base = base
        self._fd = os.open(lock_file, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        info = os.fstat(self._fd)
        if info.st_uid != os.geteuid() or info.st_mode & 0o077 or not stat.S_ISREG(info.st_mode):
            os.close(self._fd)
            raise SandboxUnavailable(f"{lock_file} must be a regular file owned by this user, mode 0600; remove it")
        self._taken: set[int] = set()
        self._next = random.randrange(UID_SPAN)
        self._lock = threading.Lock()

    def acquire(self) -> int:
        with self._lock:
            for _ in range(UID_SPAN):
                index, self._next = self._next, (self._next + 1) % UID_SPAN
                if index in self._taken:
                    continue
                try:
                    fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, index)
                except OSError:
                    continue
                self._taken.add(index)
                return self.base + index
        raise RuntimeError(f"all {UID_SPAN} sandbox uids from {self.base} are in use")

    def release(self, uid: int) -> None:
        with self._lock:
            index = uid - self.base
            fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, index)
            self._taken.discard(index)


_ALLOCATORS: dict[int, UidAllocator] = {}
_ALLOCATORS_LOCK = threading.Lock()


def uid_allocator(base: int) -> UidAllocator:
    with _ALLOCATORS_LOCK:
        if base not in _ALLOCATORS:
            _ALLOCATORS[base] = UidAllocator(base)
        return _ALLOCATORS[base]


def read_capped(fd: int, limit: int) -> tuple[str, bool, int]:
    """(text, cut, size): at most the head and tail of a (possibly huge) output memfd, as clipped text."""
    size = os.fstat(fd).st_size
    window = limit * 4  # bytes: enough for `limit` characters of UTF-8 text
    if size <= 2 * window:
        text, cut = clip_output(os.pread(fd, size, 0).decode("utf-8", "replace"), limit)
        return text, cut, size
    head = os.pread(fd, window, 0).decode("utf-8", "replace")
    tail = os.pread(fd, window, size - window).decode("utf-8", "replace")
    keep_head, keep_tail = (2 * limit) // 3, limit // 3
    return f"{head[:keep_head]}\n... [output of {size} bytes; the middle is cut] ...\n{tail[-keep_tail:]}", True, size


def processes_of(uid: int) -> list[int]:
    """Live (not zombie) processes whose real uid is `uid`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = dict(line.split(":", 1) for line in Path(f"/proc/{entry}/status").read_text().splitlines()
                          if ":" in line)
            if int(fields["Uid"].split()[0]) == uid and not fields["State"].strip().startswith(("Z", "X")):
                found.append(int(entry))
        except (OSError, ValueError, KeyError):
            continue
    return found


def tasks_of(uid: int) -> int:
    """Processes plus threads whose real uid is `uid`: what the kernel compares with RLIMIT_NPROC."""
    total = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = dict(line.split(":", 1) for line in Path(f"/proc/{entry}/status").read_text().splitlines()
                              if ":" in line)
                if int(fields["Uid"].split()[0]) == uid:
                    total += int(fields["Threads"])
            except (OSError, ValueError, KeyError):
                continue
    return total


def kill_uid(uid: int, settle_s: float = 0.02) -> None:
    """End every process owned by `uid` (a call's own uid in the rlimit mode). Stop them all first, until two
    scans in a row find no running one (a stopped process cannot fork, so none is born behind the scan), then
    SIGKILL the lot and wait until none is left."""
    if not processes_of(uid):
        return  # nothing alive can fork: nothing can appear later either
    stable = 0
    for _ in range(100):
        running = [pid for pid in processes_of(uid) if not _stopped(pid)]
        for pid in running:
            _signal(pid, signal.SIGSTOP)
        stable = 0 if running else stable + 1
        if stable >= 2:
            break
        time.sleep(settle_s)
    for _ in range(100):
        pids = processes_of(uid)
        if not pids:
            return
        for pid in pids:
            _signal(pid, signal.SIGKILL)
        time.sleep(settle_s)


def _stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return True


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except OSError:
        pass


def remove_files_of(uid: int, roots: tuple[str, ...] = SHARED_TEMP_DIRS) -> int:
    """Delete what `uid` created in the shared temp folders, so the next call cannot read it. Only folders the
    uid could write to are searched (world-writable ones and its own), which keeps this to a few ms."""
    removed = 0
    stack = [r for r in roots if os.path.isdir(r)]
    while stack:
        folder = stack.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if info.st_uid == uid:
                if stat.S_ISDIR(info.st_mode):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    Path(entry.path).unlink(missing_ok=True)
                removed += 1
            elif stat.S_ISDIR(info.st_mode) and info.st_mode & stat.S_IWOTH:
                stack.append(entry.path)
    return removed + _remove_sysv_ipc_of(uid)


def _remove_sysv_ipc_of(uid: int) -> int:
    """SysV shared memory, semaphores and message queues outlive their process: remove those owned by `uid`."""
    libc = ctypes.CDLL(None, use_errno=True)
    removers = {"shm": lambda i: libc.shmctl(i, 0, None), "sem": lambda i: libc.semctl(i, 0, 0),
                "msg": lambda i: libc.msgctl(i, 0, None)}  # IPC_RMID = 0
    removed = 0
    for kind, remove in removers.items():
        try:
            lines = Path(f"/proc/sysvipc/{kind}").read_text().splitlines()
        except OSError:
            continue
        header = lines[0].split() if lines else []
        for line in lines[1:]:
            row = dict(zip(header, line.split()))
            if row.get("uid") == str(uid):
                removed += remove(int(row[{"shm": "shmid", "sem": "semid", "msg": "msqid"}[kind]])) == 0
    return removed
