"""Registering prefect.yaml's deployments on the local server and running a process worker for them, and writing
the file's stage deployments: one `stage-<name>` per deployment of the stage table (stages/core/stage_spec.py),
generated between two marker lines, never typed.

    python -m flows.deployments            # print the generated section
    python -m flows.deployments --write    # rewrite it in prefect.yaml (`arpo deploy` does this before registering)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from stages.core import services
from stages.core.env import PROJECT_ROOT
from stages.core.stage_spec import StageTable
from stages.core.stage_spec import table as stage_table

WORK_POOLS = {"arpo-cpu": None, "arpo-gpu": 1}  # pool -> concurrency limit (one GPU job at a time)
PREFECT_YAML = PROJECT_ROOT / "prefect.yaml"
START = "  # <stage-deployments:start> generated from stages/core/stage_spec.py: python -m flows.deployments --write"
END = "  # <stage-deployments:end>"


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

    write_stage_deployments()  # a stage added to the table since the file was written is deployed too
    _prefect("deploy", "--all", "--prefect-file", str(PREFECT_YAML))
    spec = yaml.safe_load(PREFECT_YAML.read_text())
    return [d["name"] for d in spec["deployments"]]


def stage_deployments(table: StageTable | None = None) -> str:
    """The prefect.yaml lines of the stage deployments: each runs the pipeline flow with `only` set to the stage
    (or its group), the tiny profile by default, on the CPU pool (`&stage` in the file's definitions)."""
    table = table or stage_table()
    lines = [f"  - {{<<: *stage, name: {name}, parameters: {{profile: tiny-cpu, only: [{name.removeprefix('stage-')}]}}}}"
             for name in table.deployments]
    return "\n".join([START, *lines, END])


def written_stage_deployments(text: str) -> str:
    """The generated section as it stands in prefect.yaml's `text`."""
    if START not in text or END not in text:
        raise ValueError(f"prefect.yaml has no generated stage-deployment section: restore the lines {START!r} and "
                         f"{END!r} under `deployments:`, then run python -m flows.deployments --write")
    return text[text.index(START):text.index(END) + len(END)]


def write_stage_deployments(path: Path = PREFECT_YAML) -> bool:
    """Rewrite the generated section of `path`; True when it changed."""
    from stages.core.atomic import write_text

    text = path.read_text()
    new = text.replace(written_stage_deployments(text), stage_deployments())
    if new != text:
        write_text(path, new)
    return new != text


def start_worker(pool: str) -> services.Service:
    cmd = [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, "--type", "process"]
    env = {"ARPO_PROJECT_ROOT": str(PROJECT_ROOT)}
    return services.start(f"worker-{pool}", cmd, health_url=None, env=env)


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        print("prefect.yaml: " + ("stage deployments rewritten" if write_stage_deployments() else "up to date"))
    else:
        print(stage_deployments())
