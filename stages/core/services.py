"""Background services the CLI manages (the local Prefect server and workers): started detached through the one
process manager (stages/core/procs.py) with a log file, waited for until healthy, stopped by process group.

State lives in <project>/.prefect/services/<name>.json so `arpo server status|stop` work from any shell.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from stages.core import procs
from stages.core.atomic import write_json

healthy = procs.healthy


@dataclass(frozen=True)
class Service:
    name: str
    pid: int
    url: str
    log: str


def state_dir() -> Path:
    return Path(os.environ.get("PREFECT_HOME", ".prefect")) / "services"


def load(name: str) -> Service | None:
    path = state_dir() / f"{name}.json"
    if not path.is_file():
        return None
    service = Service(**json.loads(path.read_text()))
    return service if procs.alive(service.pid) else None


def start(name: str, cmd: list[str], health_url: str | None, url: str = "", timeout: float = 120.0,
          env: dict[str, str] | None = None) -> Service:
    """Start `cmd` in its own session, logging to .prefect/services/<name>.log; wait for `health_url`."""
    running = load(name)
    if running is not None:
        return running
    folder = state_dir()
    folder.mkdir(parents=True, exist_ok=True)
    log_path = folder / f"{name}.log"
    proc = procs.launch(cmd, log_path, env={**os.environ, **(env or {})}, supervised=False)
    service = Service(name=name, pid=proc.pid, url=url, log=str(log_path))
    write_json(folder / f"{name}.json", asdict(service))
    if health_url:
        try:
            procs.wait_ready(proc, log_path, timeout, lambda: healthy(health_url), f"healthy at {health_url}",
                             on_fail=lambda: stop(name))
        except procs.NotReady as err:
            raise RuntimeError(f"{name} {err}") from None
    return service


def stop(name: str, grace: float = 10.0) -> bool:
    path = state_dir() / f"{name}.json"
    if not path.is_file():
        return False
    service = Service(**json.loads(path.read_text()))
    procs.kill_group(service.pid, grace)
    path.unlink(missing_ok=True)
    return True
