"""Server processes that cannot outlive the pipeline.

`launch` starts a command under a small supervisor (`python -m stages.eval.procs --parent-pid P -- cmd`)
in a new session, so the supervisor leads a process group holding the server and everything it forks
(vLLM's workers too), with stdout+stderr appended to a log file. The supervisor polls its parent: when the
pipeline process dies, even by SIGKILL where no `finally` or atexit runs, it kills the whole group.
`kill_group` ends a group (SIGTERM, then SIGKILL after a grace period) and waits until no member is left.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

POLL_S = 0.5


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (for servers that cannot bind port 0 themselves)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def supervised(cmd: list[str], parent_pid: int) -> list[str]:
    return [sys.executable, "-m", "stages.eval.procs", "--parent-pid", str(parent_pid), "--", *cmd]


def launch(cmd: list[str], log_path: str | Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start `cmd` supervised, in its own process group, output appended to `log_path`."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(f"$ {' '.join(cmd)}\n".encode())
        log.flush()
        return subprocess.Popen(supervised(cmd, os.getpid()), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, env=env)


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is `pgid`, read from /proc."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def kill_group(pgid: int, grace_s: float = 10.0, proc: subprocess.Popen | None = None) -> None:
    """SIGTERM the group, SIGKILL what is left after `grace_s`, wait until it is empty; reap `proc`."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait_s
        while group_members(pgid) and time.monotonic() < deadline:
            if proc is not None:
                proc.poll()  # reap the supervisor as soon as it exits, so it does not linger as a zombie
            time.sleep(0.05)
        if not group_members(pgid):
            break
    if proc is not None:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def log_tail(path: str | Path, chars: int = 3000) -> str:
    path = Path(path)
    if not path.is_file():
        return "(no log written)"
    with open(path, "rb") as handle:
        handle.seek(max(0, path.stat().st_size - chars))
        return handle.read().decode("utf-8", "replace")


def supervise(parent_pid: int, cmd: list[str], grace_s: float = 10.0) -> int:
    """Run `cmd`; end the whole group when our parent dies or we get SIGTERM/SIGINT. Returns its exit code."""
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    child = subprocess.Popen(cmd)
    while child.poll() is None:
        if stopping or os.getppid() != parent_pid:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            os.killpg(os.getpgrp(), signal.SIGTERM)
            try:
                return child.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(os.getpgrp(), signal.SIGKILL)
        time.sleep(POLL_S)
    return child.returncode


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m stages.eval.procs",
                                     description="run a command; kill its process group when the parent dies")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- command and arguments")
    args = parser.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error("give the command after --")
    sys.exit(supervise(args.parent_pid, cmd))


if __name__ == "__main__":
    main()
