"""Faults around a running stage, with `arpo run` in child processes as a user runs it: two runs started at once on
the same outputs, `kill -9` in the middle of a stage, the Prefect server stopped mid-run. Each asserts what the user
sees and that nothing is lost. The stage is the model bootstrap (GGUF -> HF conversion, ~20-60 s here): long enough
to be caught in the middle, and no training."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stages.core.workspace import MARKER, verify
from tests.conftest import PROJECT_ROOT

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.extended]  # not in the default suite (CI time)
ARPO = [sys.executable, "-m", "flows.cli"]
UNTIL_BOOTSTRAP = ["run", "--until", "bootstrap"]


@pytest.fixture
def harness_env(prefect_harness, tiny_model) -> dict[str, str]:
    """Child processes reporting to the session's Prefect harness; `tiny_model` has put the model wheel in .cache."""
    from prefect.settings import PREFECT_API_URL

    return {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": str(PROJECT_ROOT),
            "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str(prefect_harness)}


def start(env: dict[str, str], *argv: str) -> subprocess.Popen:
    return subprocess.Popen([*ARPO, *argv], env=env, cwd=PROJECT_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def wait_for_line(proc: subprocess.Popen, text: str, timeout: float = 300.0) -> str:
    """Read the child's output until a line holds `text`; return what was read."""
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"exited ({proc.wait()}) before {text!r}:\n{''.join(seen)}")
        seen.append(line)
        if text in line:
            return "".join(seen)
    raise AssertionError(f"no {text!r} within {timeout} s:\n{''.join(seen)}")


def finished(proc: subprocess.Popen, timeout: float = 600.0) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def built(root: Path) -> list[Path]:
    return sorted(p.parent for p in (root / "bootstrap").glob(f"*/{MARKER}"))


def test_two_runs_at_once_build_once_and_both_finish(tmp_path: Path, harness_env: dict[str, str]) -> None:
    runs = [start(harness_env, *UNTIL_BOOTSTRAP, "-o", f"run.output_root={tmp_path}") for _ in range(2)]
    results = [finished(proc) for proc in runs]
    assert [code for code, _ in results] == [0, 0], results
    both = "".join(out for _, out in results)
    assert both.count("converting SmolLM2-135M-Instruct.Q4_1.gguf") == 1     # one conversion ...
    assert "waiting for another run (pid " in both                          # ... the other run waited for it
    (folder,) = built(tmp_path)
    assert verify(folder, full=True) == []                                  # whole, as its manifest says
    records = sorted((tmp_path / "runs").glob("tiny-*"))
    assert len(records) == 2 and (tmp_path / "runs" / "latest").resolve() in [r.resolve() for r in records]


def test_kill_9_mid_stage_then_the_rerun_completes_intact(tmp_path: Path, harness_env: dict[str, str]) -> None:
    proc = start(harness_env, *UNTIL_BOOTSTRAP, "-o", f"run.output_root={tmp_path}")
    wait_for_line(proc, "converting SmolLM2")
    time.sleep(3)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert built(tmp_path) == []                          # no completion marker: nothing half-built is reused
    code, out = finished(start(harness_env, *UNTIL_BOOTSTRAP, "-o", f"run.output_root={tmp_path}"))
    assert code == 0, out                                 # not stuck on the dead run's lock (the kernel dropped it)
    (folder,) = built(tmp_path)
    assert verify(folder, full=True) == []
    from safetensors import safe_open

    with safe_open(str(folder / "model" / "model.safetensors"), "pt") as weights:   # a readable, whole file
        assert len(list(weights.keys())) > 100


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_prefect_server_stopped_mid_run(tmp_path: Path, tiny_model) -> None:
    home, out, port = tmp_path / "prefect-home", tmp_path / "outputs", _free_port()
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str(home / "storage"),
           "PREFECT_LOCAL_STORAGE_PATH": str(home / "storage"), "PYTHONPATH": str(PROJECT_ROOT),
           # fewer client retries than Prefect's default 5 (about a minute per call): the same path, sooner
           "PREFECT_CLIENT_MAX_RETRIES": "1"}
    env.pop("PREFECT_API_URL", None)
    server = [*ARPO, "server", "start", "--port", str(port), "--crash-after", "0"]
    subprocess.run(server, env=env, check=True, cwd=PROJECT_ROOT)
    run_env = {**env, "PREFECT_API_URL": f"http://127.0.0.1:{port}/api"}
    try:
        proc = start(run_env, *UNTIL_BOOTSTRAP, "-o", f"run.output_root={out}")
        wait_for_line(proc, "converting SmolLM2")
        subprocess.run([*ARPO, "server", "stop"], env=env, check=True, cwd=PROJECT_ROOT)
        code, printed = finished(proc)
        assert code == 3, printed
        last = printed.rstrip().splitlines()[-1]
        assert last.startswith(f"error: the Prefect server at http://127.0.0.1:{port} stopped answering during the "
                               "run (") and last.endswith(f"Finished stages are kept in {out}/ and are reused: start "
                                                          "the server again (`arpo server start`), or add "
                                                          "--ephemeral, and rerun the same command"), printed
        (folder,) = built(out)                  # the stage that was running finished and is complete
        build = json.loads((folder / MARKER).read_text())["build_id"]
        subprocess.run(server, env=env, check=True, cwd=PROJECT_ROOT)
        code, printed = finished(start(run_env, *UNTIL_BOOTSTRAP, "-o", f"run.output_root={out}"))
        assert code == 0, printed
        assert "converting" not in printed and json.loads((folder / MARKER).read_text())["build_id"] == build
    finally:
        subprocess.run([*ARPO, "server", "stop"], env=env, cwd=PROJECT_ROOT)
