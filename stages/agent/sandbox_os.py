"""Process-level helpers of the python sandbox: interpreter discovery, the bubblewrap probe, waiting for and
killing interpreters, reading capped output files. Used by stages/agent/sandbox.py."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import time
from functools import lru_cache
from pathlib import Path

from stages.agent.sandbox_spec import InterpreterPaths, bwrap_args, clip_output


class SandboxUnavailable(RuntimeError):
    """The requested isolation level cannot run on this machine."""


@lru_cache(maxsize=8)
def interpreter_paths(executable: str) -> InterpreterPaths:
    """Ask the interpreter where it lives (its prefixes and the real path of its binary)."""
    probe = "import os,sys,json;print(json.dumps([sys.prefix,sys.base_prefix,os.path.realpath(sys.executable)]))"
    try:
        out = subprocess.run([executable, "-I", "-c", probe], capture_output=True, text=True, timeout=60,
                             check=True)
    except (OSError, subprocess.SubprocessError) as err:
        raise SandboxUnavailable(f"python interpreter {executable!r} does not run ({err}); "
                                 "set agent.python.python_executable to a working python") from err
    prefix, base, real = json.loads(out.stdout)
    prefixes = {os.path.realpath(prefix), os.path.realpath(base), os.path.dirname(os.path.dirname(real)), prefix}
    return InterpreterPaths(executable, tuple(sorted(prefixes)))


def is_root() -> bool:
    return os.geteuid() == 0


@lru_cache(maxsize=8)
def probe_bwrap(executable: str, workdir_mb: int) -> str | None:
    """None when bubblewrap runs the interpreter here, else the reason it does not."""
    if shutil.which("bwrap") is None:
        return "bubblewrap is not installed (apt-get install -y bubblewrap)"
    args = bwrap_args(interpreter_paths(executable), is_root(), workdir_mb) + [executable, "-I", "-c", "pass"]
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError) as err:
        return f"bwrap failed to start: {err}"
    return None if done.returncode == 0 else f"bwrap cannot run here: {done.stderr.strip()[-500:]}"


def read_capped(path: Path, limit: int) -> tuple[str, bool]:
    """Read at most the head and tail of a (possibly huge) output file, as clipped text."""
    size = path.stat().st_size
    window = limit * 4  # bytes: enough for `limit` characters of UTF-8 text
    with open(path, "rb") as handle:
        if size <= 2 * window:
            return clip_output(handle.read().decode("utf-8", "replace"), limit)
        head = handle.read(window).decode("utf-8", "replace")
        handle.seek(size - window)
        tail = handle.read().decode("utf-8", "replace")
    keep_head, keep_tail = (2 * limit) // 3, limit // 3
    return f"{head[:keep_head]}\n... [output of {size} bytes; the middle is cut] ...\n{tail[-keep_tail:]}", True


def wait_exit(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Wait for `proc` to exit; True if it did within `timeout_s`. A pidfd wakes us the moment it exits
    (Popen.wait(timeout) polls with sleeps of up to 50 ms)."""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        try:
            proc.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        exited = bool(poller.poll(max(0, int(timeout_s * 1000))))
    finally:
        os.close(pidfd)
    if exited:
        proc.wait()
    return exited


def signal_of(rc: int | None, mode: str) -> int:
    """The signal that ended the interpreter, from its exit status (bwrap reports 128+signal)."""
    if rc is None:
        return 0
    if rc < 0:
        return -rc
    return rc - 128 if mode == "bwrap" and 128 < rc < 128 + 65 else 0


def kill_uid(uid: int) -> None:
    """SIGKILL every process owned by `uid` (the fallback's per-call uid), until none is left."""
    for _ in range(50):
        found = False
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/status") as handle:
                    owner = next((int(line.split()[1]) for line in handle if line.startswith("Uid:")), None)
                if owner == uid:
                    found = True
                    os.kill(int(entry), signal.SIGKILL)
            except (OSError, ValueError):
                continue
        if not found:
            return
        time.sleep(0.02)
