"""Registering prefect.yaml's deployments on the local server and running a process worker for them, and writing
the file's two generated sections, each between two marker lines, never typed: the stage deployments, one
`stage-<name>` per deployment of the stage table (stages/core/stage_spec.py), and the work pools' job variables,
which carry prefect.toml's heartbeat to every flow run a worker starts (a worker's flow run does not read the file).

Rewritten and checked with every other generated block by `python -m flows.cli docs --write` (flows/generated_docs.py);
`arpo deploy` rewrites them before registering.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from stages.core import services
from stages.core.doc_block import DOCS_COMMAND
from stages.core.env import PROJECT_ROOT, prefect_settings
from stages.core.stage_spec import StageTable
from stages.core.stage_spec import table as stage_table

WORK_POOLS = {"arpo-cpu": None, "arpo-gpu": 1}  # pool -> concurrency limit (one GPU job at a time)
PREFECT_YAML = PROJECT_ROOT / "prefect.yaml"
START = f"  # <stage-deployments:start> generated from stages/core/stage_spec.py: {DOCS_COMMAND}"
END = "  # <stage-deployments:end>"
JOB_START = f"  # <job-variables:start> generated from prefect.toml: {DOCS_COMMAND}"
JOB_END = "  # <job-variables:end>"


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

    write_generated()  # a stage added to the table since the file was written is deployed too
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


def job_variables() -> str:
    """The prefect.yaml lines of the work pools' job variables: the heartbeat of prefect.toml, so every flow run a
    worker starts beats at the rate the server's crash automation expects (flows/automations.py)."""
    beat = prefect_settings()["flows"]["heartbeat_frequency"]
    return "\n".join([JOB_START, "  job_variables: &job_variables",
                      f'    env: {{PREFECT_FLOWS_HEARTBEAT_FREQUENCY: "{beat}"}}', JOB_END])


def _written(text: str, start: str, end: str, where: str) -> str:
    if start not in text or end not in text:
        raise ValueError(f"prefect.yaml has no generated {where} section: restore the lines {start!r} and {end!r}, "
                         f"then run {DOCS_COMMAND}")
    return text[text.index(start):text.index(end) + len(end)]


def written_stage_deployments(text: str) -> str:
    """The generated stage deployments as they stand in prefect.yaml's `text` (under `deployments:`)."""
    return _written(text, START, END, "stage-deployment")


def written_job_variables(text: str) -> str:
    """The generated job variables as they stand in prefect.yaml's `text` (under `definitions:`)."""
    return _written(text, JOB_START, JOB_END, "job-variables")


def render(text: str) -> str:
    """prefect.yaml's `text` with both generated sections rewritten."""
    new = text.replace(written_stage_deployments(text), stage_deployments())
    return new.replace(written_job_variables(new), job_variables())


def write_generated(path: Path = PREFECT_YAML) -> bool:
    """Rewrite both generated sections of `path`; True when it changed."""
    from stages.core.atomic import write_text

    text = path.read_text()
    new = render(text)
    if new != text:
        write_text(path, new)
    return new != text


def start_worker(pool: str) -> services.Service:
    cmd = [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, "--type", "process"]
    env = {"ARPO_PROJECT_ROOT": str(PROJECT_ROOT)}
    return services.start(f"worker-{pool}", cmd, health_url=None, env=env)
