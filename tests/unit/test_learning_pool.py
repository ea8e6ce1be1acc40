"""bench/learning_pool.py on real processes: tiny worker scripts stand in for the bench's workers (each gets
`--worker <job>` as the bench's do), started through stages.core.procs, timed with os.wait4, retried once when cut
off by the run timeout."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.learning_jobs import Job
from bench.learning_pool import run_pool, worker_env
from stages.core.env import PROJECT_ROOT

WORKER = """
import sys, time
job = sys.argv[sys.argv.index("--worker") + 1]
if "slow" in job:
    time.sleep(60)          # cut off by the run timeout (SIGTERM)
print("ran", job, flush=True)
sys.exit(3 if "grpo" in job else 0)
"""


def _args(**changes) -> argparse.Namespace:
    return argparse.Namespace(**{"jobs": 2, "run_timeout": 600.0, "retries": 0, "tag": "v2", "split": "rl_valid",
                                 **changes})


def test_every_job_runs_once_in_its_own_process_with_its_log_and_attempt(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    jobs = [Job("arith", "sft", 0), Job("arith", "grpo", 0), Job("arith", "format", 0)]
    pool = run_pool(_args(), jobs, tmp_path, [sys.executable, str(script)], worker_env(PROJECT_ROOT), poll_s=0.05)
    exits = {str(job): [a["exit"] for a in attempts] for job, attempts in pool["attempts"].items()}
    assert exits == {"arith/sft:0": [0], "arith/grpo:0": [3], "arith/format:0": [0]}
    # the log holds the command (procs.launch) and the worker's output; attempts.jsonl one line per attempt
    log = (tmp_path / "logs" / "arith-format-s0@v2.log").read_text()
    assert "--worker arith/format:0" in log and "ran arith/format:0" in log
    lines = [json.loads(line) for line in (tmp_path / "attempts.jsonl").read_text().splitlines()]
    assert sorted(line["job"] for line in lines) == ["arith/format:0", "arith/grpo:0", "arith/sft:0"]
    assert all(line["cpu_s"] >= 0 and line["split"] == "rl_valid" and not line["timed_out"] for line in lines)


def test_a_job_past_the_run_timeout_is_stopped_and_retried(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    pool = run_pool(_args(run_timeout=0.5, retries=1), [Job("arith", "slow", 1)], tmp_path,
                    [sys.executable, str(script)], worker_env(PROJECT_ROOT), poll_s=0.05)
    (attempts,) = pool["attempts"].values()
    # cut off twice (the first attempt and its one retry), each by SIGTERM: exit -15
    assert [(a["timed_out"], a["exit"]) for a in attempts] == [(True, -15), (True, -15)]
