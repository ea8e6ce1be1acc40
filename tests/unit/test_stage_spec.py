"""The stage table (stages/core/stage_spec.py) is the one place a stage is described: the stage order, the names
the flows accept, the interpreters, the input checks, the tasks, the output folders and the stage deployments are
all read off it, and a new stage is one line (docs/caching.md, README "Layout")."""

from __future__ import annotations

import ast
import importlib
import typing

import pytest
import yaml

from stages.core.codeversion import STAGES as CODE
from stages.core.env import PROJECT_ROOT
from stages.core.selection import SelectionError, select_stages
from stages.core.stage_spec import (
    DEPLOYMENTS,
    GROUPS,
    ISOLATABLE,
    SPECS,
    STAGE_SPECS,
    STAGES,
    StageName,
    StageSpec,
    StageTable,
)


def test_the_order_and_names_come_from_the_table() -> None:
    # by hand from the table: data before bootstrap (a bad data file fails before a model is fetched), DPO goes
    # with SFT, infer/score/report are the eval group
    assert STAGES == ("data", "bootstrap", "sft", "rl", "merge", "heldout", "infer", "score", "report")
    assert GROUPS == {"eval": ("infer", "score", "report")}
    assert ISOLATABLE == ("sft", "dpo", "rl", "merge")
    assert set(typing.get_args(StageName)) == set(STAGES) | {"eval"}
    assert select_stages(until="data").run == {"data"}           # checking the data fetches no model
    assert select_stages(only=["rl"]).describe() == "data -> bootstrap -> sft -> rl"
    with pytest.raises(SelectionError, match="'eval' for infer\\+score\\+report"):
        select_stages(only=["dpo"])


def test_a_new_stage_is_one_line() -> None:
    distill = StageSpec("distill", ("rl",), "stages.rl.distill:distill_key", isolatable=True)
    specs = list(STAGE_SPECS)
    specs.insert(specs.index(SPECS["rl"]) + 1, distill)
    table = StageTable(tuple(specs))
    assert table.stages == ("data", "bootstrap", "sft", "rl", "distill", "merge", "heldout", "infer", "score",
                            "report")
    assert table.isolatable == ("sft", "dpo", "rl", "distill", "merge")
    assert table.deployments == ("stage-data", "stage-bootstrap", "stage-sft", "stage-rl", "stage-distill",
                                 "stage-merge", "stage-heldout", "stage-eval")
    assert table.reading("rl") == ("rl", "distill")


def test_prefect_yaml_has_one_deployment_per_stage_deployment_of_the_table() -> None:
    project = yaml.safe_load((PROJECT_ROOT / "prefect.yaml").read_text())
    stage = {d["name"]: d for d in project["deployments"] if d["name"].startswith("stage-")}
    assert tuple(stage) == DEPLOYMENTS
    for name, deployment in stage.items():
        assert deployment["parameters"]["only"] == [name.removeprefix("stage-")], name
        assert deployment["entrypoint"] == "flows/pipeline.py:pipeline"


def _folder_names(module: str) -> set[str]:
    """The folder names a module passes to stage_dir (a literal or a module constant)."""
    mod = importlib.import_module(module)
    tree = ast.parse(CODE.module_file(module).read_text(encoding="utf-8"))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "stage_dir":
            arg = node.args[1]
            names.add(arg.value if isinstance(arg, ast.Constant) else getattr(mod, arg.id))
    return names


@pytest.mark.parametrize("spec", STAGE_SPECS, ids=lambda s: s.name)
def test_each_stage_writes_the_folder_named_after_it_with_the_key_the_table_names(spec: StageSpec) -> None:
    from tasks.common import StageKey

    module, _, function = spec.key.partition(":")
    assert callable(getattr(importlib.import_module(module), function))
    assert _folder_names(module) == {spec.name}
    tasks = [t for m in ("bootstrap", "data", "sft", "rl", "heldout", "eval_infer", "eval_score")
             for t in vars(importlib.import_module(f"tasks.{m}")).values()
             if isinstance(getattr(t, "cache_policy", None), StageKey) and t.cache_policy.stage == spec.name]
    assert tasks and all(t.name == spec.name and t.cache_policy.key_fn.__name__ == function for t in tasks)


def test_no_stage_reads_the_table() -> None:
    # adding a stage must recompute no other stage: the table, the selection and the input checks are in no key
    for spec in STAGE_SPECS:
        covered = CODE.closure(spec.key.partition(":")[0])
        assert not {"stages.core.stage_spec", "stages.core.selection", "stages.core.input_check"} & set(covered)


def test_inputs_are_checked_for_the_sections_the_selected_stages_read(tmp_path) -> None:
    from stages.core.config.loader import load_config
    from stages.core.errors import InputError
    from stages.core.input_check import check_inputs

    cfg = load_config("tiny-cpu", [f"data.train_path={tmp_path / 'missing.parquet'}", "data.source=parquet"])
    check_inputs(cfg, ["bootstrap"])     # bootstrap reads the model section only
    with pytest.raises(InputError, match="data.train_path"):
        check_inputs(cfg, ["data"])
    interp = load_config("tiny-cpu", [f"run.interpreters={{dpo: {tmp_path / 'nope' / 'python'}}}"])
    check_inputs(interp, ["rl"])         # DPO's interpreter matters only when SFT runs
    with pytest.raises(InputError, match="run.interpreters.dpo"):
        check_inputs(interp, ["sft"])
