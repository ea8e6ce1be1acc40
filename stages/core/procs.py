"""The one process manager: start a command in its own process group with its output in a log file, wait until it
answers, end the whole group.

- `launch` starts a command in a new session (so it leads a process group holding everything it forks, vLLM's
  workers too), stdout+stderr appended to a log that starts with the command line. `supervised=True` (servers a
  pipeline run uses) puts it under a small supervisor (`python -m stages.core.procs --parent-pid P -- cmd`) that
  polls its parent: when the pipeline process dies, even by SIGKILL where no `finally` or atexit runs, it kills
  the group. `supervised=False` (the Prefect server and workers `arpo` manages, stages/core/services.py) lets the
  service outlive the shell that started it.
- `wait_ready` polls a readiness check (e.g. `healthy(url)`, httpx) and fails fast, with the log's tail, when the
  process exits or the deadline passes.
- `kill_group` ends a group (SIGTERM, then SIGKILL after a grace period) and waits until no member is left
  (`group_members`, psutil: zombies do not count). `stop_group` first asks the leader alone (SIGTERM) and gives it
  the grace period to shut its children down itself, then kills what is left; the supervisor passes the signal on
  to its command the same way, so a server's own shutdown runs before anything is killed. It returns what happened
  (`Stopped`: the exit status, whether the group had to be killed, what survived), so the caller can tell a clean
  stop from one that went wrong (`Stopped.problem`).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

POLL_S = 0.5


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (for servers that cannot bind port 0 themselves)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def supervised_command(cmd: list[str], parent_pid: int) -> list[str]:
    return [sys.executable, "-m", "stages.core.procs", "--parent-pid", str(parent_pid), "--", *cmd]


def launch(cmd: list[str], log_path: str | Path, env: dict[str, str] | None = None,
           supervised: bool = True) -> subprocess.Popen:
    """Start `cmd` in its own process group (under the supervisor unless `supervised=False`), output appended to
    `log_path`; `env` is the whole environment (None = this process's)."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(f"$ {' '.join(cmd)}\n".encode())
        log.flush()
        return subprocess.Popen(supervised_command(cmd, os.getpid()) if supervised else cmd, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, env=env)


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is `pgid`."""
    members = []
    for pid in psutil.pids():
        try:
            if os.getpgid(pid) == pgid and alive(pid):
                members.append(pid)
        except OSError:  # gone meanwhile
            continue
    return members


def kill_group(pgid: int, grace_s: float = 10.0, proc: subprocess.Popen | None = None) -> list[int]:
    """SIGTERM the group, SIGKILL what is left after `grace_s`, wait until it is empty; reap `proc`. Returns the
    members still alive after all that (none, unless one is stuck in the kernel)."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait_s
        while group_members(pgid) and time.monotonic() < deadline:
            if proc is not None:
                proc.poll()  # reap the leader as soon as it exits, so it does not linger as a zombie
            time.sleep(0.05)
        if not group_members(pgid):
            break
    if proc is not None:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    return group_members(pgid)


# exit statuses of a leader that stopped on our SIGTERM: 0, killed by it (-15 from Popen, 143 from a shell), or the
# supervisor's `sys.exit(-15)` for a command killed by it (241)
SIGTERM_EXITS = (0, -signal.SIGTERM, 128 + signal.SIGTERM, 256 - signal.SIGTERM)


@dataclass(frozen=True)
class Stopped:
    """How `stop_group` ended a group: the leader's exit status (None when this process did not start it), whether
    it was still running after the grace period and had to be killed, the members that outlived even SIGKILL."""
    returncode: int | None
    seconds: float
    killed: bool = False
    survivors: tuple[int, ...] = ()

    def problem(self, grace_s: float) -> str:
        """'' for a clean stop, else what went wrong, in words."""
        if self.survivors:
            return (f"processes {', '.join(map(str, self.survivors))} of its group outlived SIGKILL (stuck in the "
                    "kernel?); `ps -o pid,stat,cmd -p <pid>` shows them")
        if self.killed:
            return f"it did not stop within {grace_s:g} s of SIGTERM, so its process group was killed"
        if self.returncode is not None and self.returncode not in SIGTERM_EXITS:
            return f"it exited with status {self.returncode} (a clean stop exits 0 or by SIGTERM)"
        return ""

    def describe(self) -> str:
        status = "exit status unknown" if self.returncode is None else f"exit {self.returncode}"
        return f"{status}, {self.seconds:.1f} s after SIGTERM"


def stop_group(pgid: int, grace_s: float = 10.0, proc: subprocess.Popen | None = None) -> Stopped:
    """SIGTERM the group's leader alone, wait up to `grace_s` for the whole group to exit by itself, then
    `kill_group` whatever is left (module doc)."""
    started = time.monotonic()
    try:
        os.kill(pgid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = started + grace_s
    while group_members(pgid) and time.monotonic() < deadline:
        if proc is not None:
            proc.poll()
        time.sleep(0.05)
    killed = bool(group_members(pgid))
    survivors = kill_group(pgid, min(grace_s, 5.0), proc)
    return Stopped(None if proc is None else proc.returncode, time.monotonic() - started, killed, tuple(survivors))


def healthy(url: str, api_key: str | None = None, timeout: float = 2.0) -> bool:
    """GET `url` answers 200."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        return httpx.get(url, headers=headers, timeout=timeout).status_code == 200
    except (httpx.HTTPError, ValueError):
        return False


class NotReady(RuntimeError):
    """The process exited, or did not get ready in time (`timed_out`); the message ends with its log's tail."""

    def __init__(self, why: str, log_path: str | Path, tail: str, timed_out: bool) -> None:
        super().__init__(f"{why}; log {log_path}, last lines:\n{tail}")
        self.why, self.log_path, self.tail, self.timed_out = why, log_path, tail, timed_out


def wait_ready(proc: subprocess.Popen, log_path: str | Path, timeout_s: float, ready: Callable[[], Any],
               what: str, on_fail: Callable[[], None] | None = None) -> Any:
    """Poll `ready()` until it returns a value other than None/False; raise NotReady (after `on_fail`, e.g. killing
    the group) when the process exits first or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = ready()
        if value is not None and value is not False:
            return value
        timed_out = proc.poll() is None
        if not timed_out:
            why = f"exited with code {proc.returncode} before {what}"
        elif time.monotonic() > deadline:
            why = f"did not get {what} within {timeout_s:.0f} s"
        else:
            time.sleep(0.2)
            continue
        if on_fail is not None:
            on_fail()
        raise NotReady(why, log_path, log_tail(log_path), timed_out)


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
            # the command first (it stops its own children cleanly), then whatever of the group is left
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            child.send_signal(signal.SIGTERM)
            try:
                return_code = child.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                return_code = None
            deadline = time.monotonic() + min(grace_s, 5.0)
            for sig in (signal.SIGTERM, signal.SIGKILL):  # SIGKILL ends this supervisor too
                if return_code is not None and group_members(os.getpgrp()) == [os.getpid()]:
                    return return_code
                os.killpg(os.getpgrp(), sig)
                while len(group_members(os.getpgrp())) > 1 and time.monotonic() < deadline:
                    time.sleep(POLL_S)
                return_code = child.poll()
        time.sleep(POLL_S)
    return child.returncode


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m stages.core.procs",
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
