"""A stage entry point called under a separate interpreter gets its pydantic arguments back intact, and its errors
keep their kind."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from stages.core.config.data import DataSection, SyntheticSection
from stages.core.errors import DeterministicError
from stages.core.isolate import (
    IsolatedDeterministicError,
    IsolatedStageError,
    call_in_interpreter,
)
from stages.core.refs import DatasetRef


def test_data_stage_runs_in_a_subprocess_and_returns_a_ref(tmp_path: Path) -> None:
    cfg = DataSection(synthetic=SyntheticSection(n_math=4, n_qa=4, n_entities=6))
    ref = call_in_interpreter(sys.executable, "stages.data.prepare:prepare_data",
                              {"cfg": cfg, "output_root": str(tmp_path)})
    assert isinstance(ref, DatasetRef)
    assert Path(ref.files["rl_train"]).is_file()
    # the same call in-process finds the completed stage folder: same ref, so both routes agree
    from stages.data import prepare_data

    assert prepare_data(cfg, tmp_path) == ref


def test_failure_in_the_child_is_reported(tmp_path: Path) -> None:
    with pytest.raises(IsolatedStageError, match="exited with code 1"):
        call_in_interpreter(sys.executable, "stages.data.prepare:prepare_data",
                            {"cfg": {"source": "parquet"}, "output_root": str(tmp_path)})


def test_a_deterministic_error_in_the_child_stays_one(tmp_path: Path, caplog) -> None:
    # a config error is raised again by every retry: the parent's error says so (tasks/common.py does not retry it),
    # and the child's traceback reached our log as ERROR lines
    with caplog.at_level("INFO", logger="arpo"), pytest.raises(IsolatedDeterministicError) as err:
        call_in_interpreter(sys.executable, "stages.core.config.loader:load_config", {"profile": "tiny-cpuu"})
    assert isinstance(err.value, DeterministicError) and "ConfigError: no profile 'tiny-cpuu'" in str(err.value)
    assert any(r.levelname == "ERROR" and "load_config output | Traceback" in r.getMessage() for r in caplog.records)
