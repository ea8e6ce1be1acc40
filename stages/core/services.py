"""Background services the CLI manages: start detached with a log file, wait for health, stop by process group.

Used for the local Prefect server (web UI + API on SQLite) and the Prefect worker. State lives in
<project>/.prefect/services/<name>.json so `arpo server status|stop` work from any shell.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from stages.core.atomic import write_json


@dataclass(frozen=True)
class Service:
    name: str
    pid: int
    url: str
    log: str


def state_dir() -> Path:
    return Path(os.environ.get("PREFECT_HOME", ".prefect")) / "services"


def healthy(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status == 200
    except Exception:
        return False


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # a zombie child counts as dead
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def load(name: str) -> Service | None:
    path = state_dir() / f"{name}.json"
    if not path.is_file():
        return None
    service = Service(**json.loads(path.read_text()))
    return service if alive(service.pid) else None


def start(name: str, cmd: list[str], health_url: str | None, url: str = "", timeout: float = 120.0,
          env: dict[str, str] | None = None) -> Service:
    """Start `cmd` in its own session, logging to .prefect/services/<name>.log; wait for `health_url`."""
    running = load(name)
    if running is not None:
        return running
    folder = state_dir()
    folder.mkdir(parents=True, exist_ok=True)
    log_path = folder / f"{name}.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env={**os.environ, **(env or {})})
    service = Service(name=name, pid=proc.pid, url=url, log=str(log_path))
    write_json(folder / f"{name}.json", asdict(service))
    deadline = time.monotonic() + timeout
    while health_url and not healthy(health_url):
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with code {proc.returncode} while starting; last log lines:\n"
                               + tail(log_path))
        if time.monotonic() > deadline:
            stop(name)
            raise TimeoutError(f"{name} not healthy at {health_url} after {timeout:.0f}s; log: {log_path}\n"
                               + tail(log_path))
        time.sleep(0.5)
    return service


def stop(name: str, grace: float = 10.0) -> bool:
    path = state_dir() / f"{name}.json"
    if not path.is_file():
        return False
    service = Service(**json.loads(path.read_text()))
    try:
        os.killpg(service.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while alive(service.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if alive(service.pid):
            os.killpg(service.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    path.unlink(missing_ok=True)
    return True


def tail(path: str | Path, lines: int = 30) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
