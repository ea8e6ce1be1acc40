"""The processes of one verl run, found by the settings path our launcher puts into every one's environment: the
verl test checks that a run (killed, finished or cached) leaves none behind. `kill_after_step_1` is its kill: the
whole pipeline SIGKILLed once verl has saved and logged step 1."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")  # outlive their raylet; the next attempt reaps them


def verl_processes(stage: Path, agents: bool = True) -> list[int]:
    """Processes of the verl run of `stage` (the RL stage folder); Ray's agents only with `agents`."""
    marker = f"ARPO_VERL_SETTINGS={stage / 'verl_inputs' / 'plugin_settings.json'}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker in (entry / "environ").read_bytes():
                if agents or not (entry / "cmdline").read_bytes().decode(errors="replace").startswith(AGENTS):
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


def wait_for(predicate: Callable[[], Any], timeout_s: float, proc: subprocess.Popen | None = None,
             poll_s: float = 5.0) -> Any:
    """Poll `predicate` (its docstring says what it waits for) until it is true; fails after `timeout_s`, or as soon
    as `proc` has ended."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run ended (exit {proc.returncode}) before {predicate.__doc__}")
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {predicate.__doc__}")


def kill_after_step_1(proc: subprocess.Popen, rl_root: Path, log: Path, timeout_s: float = 2400) -> Path:
    """Wait until the verl run of the RL stage under `rl_root` (`<output root>/rl`) has saved its step-1 checkpoint
    and logged step 1; check that its processes carry the stage's settings path; SIGKILL the process group of
    `proc` (the whole pipeline dies without a word) and wait until verl's trainer, Ray (GCS, raylet, workers) and
    vLLM have died with it (120 s; only Ray's two agents may outlive it, and are killed then). Returns the stage."""
    def logged_step_1():
        """verl's checkpoint and metrics of step 1"""
        ckpts = list(rl_root.glob("*/checkpoints/latest_checkpointed_iteration.txt"))
        logs = list(rl_root.glob("*/verl_metrics/attempt_*.jsonl"))
        return ckpts and ckpts[0].read_text().strip() == "1" and any(a.read_text().strip() for a in logs)

    stage = None
    try:
        try:   # polled every 2 s: the kill must land before step 2's checkpoint, so that the rerun resumes
            wait_for(logged_step_1, timeout_s, proc, poll_s=2.0)
        except AssertionError as error:
            raise AssertionError(f"{error}\n{log.read_text()[-5000:]}") from None
        stage = next(rl_root.glob("*/checkpoints")).parent
        assert verl_processes(stage), "verl's processes carry the stage's settings path"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

        def gone():
            """verl's trainer, Ray's GCS, raylet and workers, and vLLM to die with the pipeline (parent-death signal)"""
            return not verl_processes(stage, agents=False)

        wait_for(gone, 120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in verl_processes(stage) if stage else []:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return stage
