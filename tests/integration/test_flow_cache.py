"""Prefect caching on the real bootstrap and data tasks: a rerun is all cache hits, a refresh recomputes exactly the
refreshed stage and what depends on it, a config change recomputes only the stage it belongs to."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from prefect import flow

from stages.core.config.data import DataSection
from stages.core.config.loader import ConfigError, load_config
from stages.core.refs import DatasetRef
from stages.core.selection import select_stages
from stages.data.prepare import data_key
from tasks.stage_tasks import call_stage, entry_task, forced, run_stage, stage_task
from tests.conftest import PROJECT_ROOT, TEST_OUTPUTS


@pytest.fixture(autouse=True)
def _prefect(prefect_harness):
    yield


@flow
def two_stages(overrides: list[str], refresh: list[str]) -> dict[str, str]:
    cfg = load_config("tiny-cpu", overrides)
    selection = select_stages(refresh=refresh)
    states = {}
    states["bootstrap"] = run_stage(entry_task("bootstrap"), selection, cfg.model, str(TEST_OUTPUTS),
                                    str(PROJECT_ROOT / ".cache"), return_state=True)
    # the data stage keys on its own section only; a refreshed bootstrap would not change it
    states["data"] = run_stage(entry_task("data"), selection, cfg.data, str(TEST_OUTPUTS / "flowtest"),
                               return_state=True)
    return {name: state.name for name, state in states.items()}


def test_second_run_is_all_cache_hits(tiny_model) -> None:
    overrides = ["data.synthetic.seed=101"]
    first = two_stages(overrides, [])
    assert first["data"] == "Completed"
    assert two_stages(overrides, []) == {"bootstrap": "Cached", "data": "Cached"}


def test_refresh_recomputes_only_that_stage(tiny_model) -> None:
    overrides = ["data.synthetic.seed=102"]
    two_stages(overrides, [])
    assert two_stages(overrides, ["data"]) == {"bootstrap": "Cached", "data": "Completed"}
    assert two_stages(overrides, []) == {"bootstrap": "Cached", "data": "Cached"}


def test_config_change_recomputes_only_its_stage(tiny_model) -> None:
    two_stages(["data.synthetic.seed=103"], [])
    assert two_stages(["data.synthetic.seed=104"], []) == {"bootstrap": "Cached", "data": "Completed"}


def test_refreshed_output_gets_a_new_fingerprint(tmp_path: Path) -> None:
    cfg = load_config("tiny-cpu", ["data.synthetic.seed=105"])

    @flow
    def data_only(refresh: bool) -> str:
        selection = select_stages(refresh=["data"] if refresh else [])
        return run_stage(entry_task("data"), selection, cfg.data, str(tmp_path)).fingerprint

    first = data_only(False)
    assert data_only(False) == first
    assert data_only(True) != first       # downstream keys on the fingerprint, so it recomputes too


@stage_task("data-isolated", data_key, off_table=True)
def isolated_data_task(cfg: DataSection, output_root: str, python: str | None = None) -> DatasetRef:
    return call_stage("stages.data.prepare:prepare_data", python, cfg=cfg, output_root=output_root, force=forced())


@flow
def isolated_data(seed: int, python: str | None) -> tuple[str, DatasetRef]:
    cfg = load_config("tiny-cpu", [f"data.synthetic.seed={seed}"])
    state = isolated_data_task(cfg.data, str(TEST_OUTPUTS / "flowtest"), python=python, return_state=True)
    return state.name, state.result()


def test_stage_under_another_interpreter_shares_the_cache() -> None:
    # computed by a child interpreter (the run.interpreters route) ...
    state, ref = isolated_data(106, sys.executable)
    assert state == "Completed" and Path(ref.files["rl_train"]).is_file()
    # ... and the in-process route finds it cached: the interpreter is where a stage runs, not what it computes
    assert isolated_data(106, None) == ("Cached", ref)


def test_interpreters_only_for_training_stages() -> None:
    with pytest.raises(ConfigError, match=r"run.interpreters names \['serve'\]"):
        load_config("tiny-cpu", ["run.interpreters={serve: /usr/bin/python3}"])


def test_a_stage_added_as_one_line_runs_cached_in_a_flow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The unit test's new stage (tests/unit/test_stage_spec.py: one table line and its package), run by a flow
    through the task the table builds: computed once, then a cache hit on its own key, recomputed when refreshed; the
    publish hook registered for it gets the stage's result and the input it names each time the task runs."""
    from stages.core import stage_spec
    from stages.core.refs import CheckpointRef
    from stages.core.stage_spec import SPECS, STAGE_SPECS, StageSpec, StageTable
    from tasks import publish
    from tasks.stage_tasks import StageRunner
    from tests.unit.test_stage_spec import DISTILL, HOOK

    (tmp_path / "distill_flow_stage").mkdir()
    (tmp_path / "distill_flow_stage" / "__init__.py").write_text("")
    (tmp_path / "distill_flow_stage" / "stage.py").write_text(DISTILL)
    (tmp_path / "distill_flow_stage" / "hook.py").write_text(HOOK)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(publish, "HOOKS", dict(publish.HOOKS))
    line = StageSpec(name="distill", sections=("rl",), entry="distill_flow_stage.stage:run_distill", key="distill_key")
    specs = list(STAGE_SPECS)
    specs.insert(specs.index(SPECS["rl"]) + 1, line)
    monkeypatch.setattr(stage_spec, "TABLE", StageTable(tuple(specs)))
    cfg = load_config("tiny-cpu", [f"run.output_root={tmp_path / 'out'}"])
    policy = CheckpointRef(path="/policy", fingerprint="p" * 16, format="hf")

    @flow
    def with_distill(refresh: list[str]) -> tuple[str, str]:
        stages = StageRunner(select_stages(refresh=refresh), cfg.run)
        state = stages.run(entry_task("distill"), cfg.rl, policy, return_state=True)  # the one wiring line
        return state.name, state.result().path

    from distill_flow_stage.hook import PUBLISHED

    state, path = with_distill([])
    assert state == "Completed" and (Path(path) / "student.txt").read_text() == "distilled from /policy"
    assert Path(path).parent == tmp_path / "out" / "distill" and PUBLISHED == [("/policy", path)]
    assert with_distill([]) == ("Cached", path) and len(PUBLISHED) == 1  # a cache hit runs no task body
    assert with_distill(["distill"])[0] == "Completed" and len(PUBLISHED) == 2
