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


def test_input_error_in_the_child_comes_back_as_an_input_error(tmp_path: Path, monkeypatch) -> None:
    # deterministic: the parent re-raises it as a MissingInputError with the child's message (so the task layer
    # does not retry it), instead of a generic IsolatedStageError
    from stages.core.errors import MissingInputError

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(MissingInputError, match=r"benchmark 'gaia': no file at any of \["):
        call_in_interpreter(sys.executable, "stages.eval.benchmarks:load_benchmark",
                            {"name": "gaia", "data_root": str(tmp_path)})


def test_a_deterministic_error_in_the_child_stays_one(tmp_path: Path, caplog) -> None:
    # a config error is raised again by every retry: the parent raises it again as an input error with the child's
    # message (tasks/stage_tasks.py does not retry a DeterministicError), and the child's one-line error reached our log
    from stages.core.errors import BadInputError

    with caplog.at_level("INFO", logger="arpo"), pytest.raises(BadInputError) as err:
        call_in_interpreter(sys.executable, "stages.core.config.loader:load_config", {"profile": "tiny-cpuu"})
    assert isinstance(err.value, DeterministicError) and str(err.value).startswith("no profile 'tiny-cpuu'")
    assert any("load_config output | error: no profile 'tiny-cpuu'" in r.getMessage() for r in caplog.records)


def test_other_errors_in_the_child_keep_their_traceback_and_kind(tmp_path: Path, caplog) -> None:
    # not an input error: the parent's IsolatedStageError names the child's error, and its traceback is in our log
    # as ERROR lines (a DeterministicError that is not an input error would come back as IsolatedDeterministicError)
    with caplog.at_level("INFO", logger="arpo"), pytest.raises(IsolatedStageError) as err:
        call_in_interpreter(sys.executable, "stages.core.isolate:resolve", {"target": "no_colon"})
    assert not isinstance(err.value, IsolatedDeterministicError) and "ValueError: target 'no_colon'" in str(err.value)
    assert any(r.levelname == "ERROR" and "resolve output | Traceback" in r.getMessage() for r in caplog.records)
