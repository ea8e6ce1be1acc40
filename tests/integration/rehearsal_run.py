"""`arpo rehearse` as a user runs it, for the rehearsal tests: a subprocess with its own Prefect home (never the
developer's server), offline, its run records read back oldest first. `start_rehearsal` starts one in the background
in its own session (the verl rehearsal SIGKILLs it mid-run, tests/integration/test_rehearse_verl_e2e.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from stages.core.env import PROJECT_ROOT


def _command(profile: str, outputs: Path, prefect_home: Path, args: list[str]) -> tuple[list[str], dict[str, str]]:
    """The argv and environment of `arpo rehearse -p profile --ephemeral ARGS` into `outputs`."""
    # (a verl rehearsal's CPU mode puts CPU_ENV, Ray's OOM killer off, into verl's environment itself)
    env = {**os.environ, "PREFECT_HOME": str(prefect_home), "HF_HUB_OFFLINE": "1"}
    env.pop("PREFECT_API_URL", None)
    argv = [sys.executable, "-m", "flows.cli", "rehearse", "-p", profile, "--ephemeral",
            "-o", f"run.output_root={outputs}", *args]
    return argv, env


def run_records(outputs: Path) -> list[Path]:
    """Every run record under `outputs` (a killed run's too), oldest first: their names start with the time;
    `latest` is a link to the newest."""
    runs = outputs / "rehearse" / "runs"
    return sorted(p for p in runs.iterdir() if not p.is_symlink()) if runs.is_dir() else []


def start_rehearsal(profile: str, outputs: Path, prefect_home: Path, args: list[str], log: Path) -> subprocess.Popen:
    """`arpo rehearse ...` in the background, in a session of its own (os.killpg takes the whole run), its output
    in `log`."""
    argv, env = _command(profile, outputs, prefect_home, args)
    with open(log, "w") as out:
        return subprocess.Popen(argv, cwd=PROJECT_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def rehearse(profile: str, outputs: Path, prefect_home: Path, args: list[str], times: int = 1) -> list[dict[str, Any]]:
    """Run `arpo rehearse -p profile --ephemeral ARGS` `times` times into `outputs`; each must exit 0 and write
    exactly one run record with its rehearsal report. Per run: its stdout, record folder and rehearsal.json."""
    argv, env = _command(profile, outputs, prefect_home, args)
    before = run_records(outputs)   # an earlier (killed) run's record is not one of these runs'
    stdouts = []
    for _ in range(times):
        done = subprocess.run(argv, cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=2400)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
        stdouts.append(done.stdout)
    records = [p for p in run_records(outputs) if p not in before]
    assert len(records) == times and all((p / "rehearsal.json").is_file() for p in records), records
    return [{"stdout": out, "run_dir": record, "report": json.loads((record / "rehearsal.json").read_text())}
            for out, record in zip(stdouts, records)]
