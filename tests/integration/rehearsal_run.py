"""`arpo rehearse` as a user runs it, for the rehearsal tests: a subprocess with its own Prefect home (never the
developer's server), offline, its run records read back oldest first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from stages.core.env import PROJECT_ROOT


def rehearse(profile: str, outputs: Path, prefect_home: Path, args: list[str], times: int = 1) -> list[dict[str, Any]]:
    """Run `arpo rehearse -p profile --ephemeral ARGS` `times` times into `outputs`; per run its stdout, record folder
    and rehearsal.json."""
    # (a verl rehearsal's CPU mode puts CPU_ENV, Ray's OOM killer off, into verl's environment itself)
    env = {**os.environ, "PREFECT_HOME": str(prefect_home), "HF_HUB_OFFLINE": "1"}
    env.pop("PREFECT_API_URL", None)
    argv = [sys.executable, "-m", "flows.cli", "rehearse", "-p", profile, "--ephemeral",
            "-o", f"run.output_root={outputs}", *args]
    stdouts = []
    for _ in range(times):
        done = subprocess.run(argv, cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=2400)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
        stdouts.append(done.stdout)
    # the run records, oldest first (their names start with the time; `latest` is a link to the newest)
    records = sorted(p for p in (outputs / "rehearse" / "runs").iterdir() if not p.is_symlink())
    assert len(records) == times, records
    return [{"stdout": out, "run_dir": record, "report": json.loads((record / "rehearsal.json").read_text())}
            for out, record in zip(stdouts, records)]
