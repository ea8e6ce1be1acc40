"""Runs the verl contract tests (tests/verl, on the pinned verl: stages/core/engine_spec.py VERL_VERSION) in their own
environment, .venv-verl-test, which ./scripts/test.sh builds with ./scripts/setup-verl.sh --test. verl's pins
(transformers 5.9, tensordict) cannot share the project venv, so the suite crosses as a subprocess; its output is shown
when it fails. In CI a missing environment is a failure, never a skip."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from stages.core.env import PROJECT_ROOT
from tests.conftest import missing_setup

pytestmark = pytest.mark.integration
VERL_PYTHON = PROJECT_ROOT / ".venv-verl-test" / "bin" / "python"


def test_verl_contract_suite_passes_in_the_verl_environment(tmp_path):
    if not VERL_PYTHON.exists():
        missing_setup(f"{VERL_PYTHON} is missing: build it with ./scripts/setup-verl.sh --test (./scripts/test.sh does)")
    # The inner pytest gets a temp folder of its own and none of the outer run's pytest settings: an inherited
    # `--basetemp` (PYTEST_ADDOPTS) would make it wipe the outer run's temp folders, both xdist workers' included.
    env = {key: value for key, value in os.environ.items()
           if key != "PYTEST_ADDOPTS" and not key.startswith("PYTEST_XDIST")}
    env |= {"ARPO_PARENT_PYTHON": sys.executable, "PYTHONPATH": str(PROJECT_ROOT)}
    proc = subprocess.run([str(VERL_PYTHON), "-m", "pytest", "tests/verl", "-q", "-p", "no:cacheprovider",
                           "-W", "ignore", "-rs", f"--basetemp={tmp_path / 'verl-tests'}"], cwd=PROJECT_ROOT, env=env,
                          capture_output=True, text=True, timeout=1800, check=False)
    tail = proc.stdout[-8000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    summary = proc.stdout.strip().splitlines()[-1]
    assert re.search(r"\d+ passed", summary) and "skipped" not in summary and "failed" not in summary, tail
    print(summary)
