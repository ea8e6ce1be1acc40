"""Registering prefect.yaml's deployments on the local server and running a process worker for them."""

from __future__ import annotations

import os
import subprocess
import sys

from stages.core import services
from stages.core.env import PROJECT_ROOT

WORK_POOLS = {"arpo-cpu": None, "arpo-gpu": 1}  # pool -> concurrency limit (one GPU job at a time)


def _prefect(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "ARPO_PROJECT_ROOT": str(PROJECT_ROOT)}
    proc = subprocess.run([sys.executable, "-m", "prefect", "--no-prompt", *args], cwd=PROJECT_ROOT, env=env,
                          capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"prefect {' '.join(args)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return proc


def create_work_pools() -> None:
    for pool, limit in WORK_POOLS.items():
        _prefect("work-pool", "create", pool, "--type", "process", "--overwrite")
        if limit:
            _prefect("work-pool", "set-concurrency-limit", pool, str(limit))


def register_deployments() -> list[str]:
    import yaml

    _prefect("deploy", "--all", "--prefect-file", str(PROJECT_ROOT / "prefect.yaml"))
    spec = yaml.safe_load((PROJECT_ROOT / "prefect.yaml").read_text())
    return [d["name"] for d in spec["deployments"]]


def start_worker(pool: str) -> services.Service:
    cmd = [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, "--type", "process"]
    env = {"ARPO_PROJECT_ROOT": str(PROJECT_ROOT)}
    return services.start(f"worker-{pool}", cmd, health_url=None, env=env)
