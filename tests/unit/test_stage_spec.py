"""The stage table (stages/core/stage_spec.py) is the one place a stage is described: the stage order, the names
the flows accept, the interpreters, the pre-flight, the tasks (entry point and key), the output folders and the
stage deployments are all read off it, a misspelled stage name fails with the nearest names, and a new stage is one
line plus its own package, its task built from the line (docs/caching.md, CONTRIBUTING.md "Adding a stage"); a line
that contradicts the others fails when the table is built."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import pkgutil
import sys
import typing
from pathlib import Path

import pytest
import yaml

from stages.core import stage_spec
from stages.core.codeversion import STAGES as CODE
from stages.core.selection import SelectionError, select_stages
from stages.core.stage_spec import (
    DEPLOYMENTS,
    GROUPS,
    ISOLATABLE,
    MEMORY,
    SEAMS,
    SPECS,
    STAGE_SPECS,
    STAGES,
    StageName,
    StageSpec,
    StageTable,
    StageTableError,
    UnknownStageError,
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
    with pytest.raises(SelectionError, match="'dpo' runs and refreshes as part of 'sft': select 'sft'"):
        select_stages(only=["dpo"])
    # by hand: the seam checks for every stage that reads the tokenizer, the memory model for RL, each once
    assert stage_spec.TABLE.checked_by(SEAMS) == ("sft", "rl", "heldout", "infer")
    assert stage_spec.TABLE.checks(frozenset(STAGES))[:2] == (SEAMS, MEMORY)
    assert stage_spec.TABLE.checks(frozenset({"data", "bootstrap"})) == ()


def test_a_misspelled_stage_name_fails_with_the_nearest_names() -> None:
    from tasks.stage_tasks import entry_task, stage_task

    with pytest.raises(SelectionError, match=r"unknown stage 'sftt' \(did you mean 'sft'\?\)"):
        select_stages(only=["sftt"])
    with pytest.raises(SelectionError, match=r"'evl' \(did you mean 'eval'\?\).*or 'eval' for infer\+score\+report"):
        select_stages(refresh=["evl"])
    with pytest.raises(SelectionError, match=r"unknown stage 'infr' \(did you mean 'infer'\?\)"):
        select_stages().runs("infr")     # code asking about a stage is checked too: no silent False
    with pytest.raises(UnknownStageError, match=r"unknown stage 'merg' \(did you mean 'merge'\?\)"):
        stage_task("merg")               # a task is never silently uncached
    with pytest.raises(UnknownStageError, match=r"'heldot' \(did you mean 'heldout'\?\)"):
        entry_task("heldot")
    assert select_stages(only=["sft"]).refreshes("dpo") is False and select_stages(refresh=["sft"]).refreshes("dpo")


@pytest.mark.parametrize(("stage", "change", "message"), [
    ("dpo", {"part_of": "sfft"}, r"dpo: part_of 'sfft' names no stage \(did you mean 'sft'\?\)"),
    ("dpo", {"part_of": "dpo"}, r"dpo: part_of 'dpo' is not a stage selected on its own"),
    ("dpo", {"group": "eval"}, r"dpo: a stage part_of 'sft' has no group \('eval'\)"),
    ("score", {"group": "evl"}, r"score: group 'evl' names no other stage .*\(did you mean 'eval'\?\)"),
    ("infer", {"group": "data"}, r"infer: group 'data' is also a stage's name: `--only data` and the deployment "
                                 r"stage-data would mean two things"),
    ("merge", {"entry": "stages.rl.merge"}, r"merge: entry 'stages.rl.merge' is not 'package.module:function'"),
], ids=["part_of-typo", "part_of-itself", "part-with-group", "group-typo", "group-is-a-stage", "entry"])
def test_a_line_that_contradicts_the_table_fails_when_the_table_is_built(stage: str, change: dict,
                                                                        message: str) -> None:
    # hand-built bad lines: each is the real table with one line changed
    lines = tuple(dataclasses.replace(s, **change) if s.name == stage else s for s in STAGE_SPECS)
    with pytest.raises(StageTableError, match=r"^the stage table \(stages/core/stage_spec.py\): " + message):
        StageTable(lines)


def test_a_stage_with_two_lines_fails_when_the_table_is_built() -> None:
    with pytest.raises(StageTableError, match="stage 'merge' has 2 lines"):
        StageTable((*STAGE_SPECS, SPECS["merge"]))


def test_a_stage_without_a_module_of_its_own_gets_its_task_from_its_line() -> None:
    from tasks.stage_tasks import StageKey, entry_task

    heldout = entry_task("heldout", "sft")   # the flow runs heldout once per policy: the run is named after it
    assert (heldout.name, heldout.task_run_name, entry_task("heldout").task_run_name) == ("heldout", "heldout-sft",
                                                                                           "heldout")
    assert isinstance(heldout.cache_policy, StageKey) and heldout.cache_policy.target == SPECS["heldout"].key_target
    assert list(inspect.signature(heldout.fn).parameters) == ["spec", "agent", "policy", "data", "output_root",
                                                              "cache_root"]  # the entry's, `force` left out
    assert (entry_task("bootstrap").retries, entry_task("data").retries) == (2, 1)  # the lines' `retries`


# a new stage's own package, as its author writes it: an entry point and a key function in one module
DISTILL = '''
from stages.core.fingerprint import hash_value
from stages.core.refs import CheckpointRef
from stages.core.workspace import stage_dir


def distill_key(cfg, policy):
    return hash_value(cfg, policy.fingerprint)


def run_distill(cfg, policy, output_root, force=False):
    out = stage_dir(output_root, "distill", distill_key(cfg, policy), force=force)
    if not out.complete:
        (out.path / "student.txt").write_text(f"distilled from {policy.path}")
        out.finish()
    return CheckpointRef(path=str(out.path), fingerprint=out.fingerprint, format="hf")
'''


@pytest.fixture
def distill(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> StageSpec:
    """One line added to the table (after RL), and the stage's package; nothing else is edited."""
    for cached in [m for m in sys.modules if m.partition(".")[0] == "distill_stage"]:  # another test's package
        monkeypatch.delitem(sys.modules, cached)
    (tmp_path / "distill_stage").mkdir()
    (tmp_path / "distill_stage" / "__init__.py").write_text("")
    (tmp_path / "distill_stage" / "stage.py").write_text(DISTILL)
    monkeypatch.syspath_prepend(str(tmp_path))
    line = StageSpec(name="distill", sections=("rl",), entry="distill_stage.stage:run_distill", key="distill_key",
                     isolatable=True)
    specs = list(STAGE_SPECS)
    specs.insert(specs.index(SPECS["rl"]) + 1, line)
    monkeypatch.setattr(stage_spec, "TABLE", StageTable(tuple(specs)))
    return line


def test_a_new_stage_is_one_line_and_its_package(distill: StageSpec, tmp_path: Path) -> None:
    from flows.deployments import stage_deployments
    from stages.core.config.loader import load_config
    from stages.core.preflight import preflight
    from tasks.stage_tasks import StageKey, StageRunner, cache_key, entry_task

    table = stage_spec.table()
    assert table.stages == ("data", "bootstrap", "sft", "rl", "distill", "merge", "heldout", "infer", "score",
                            "report")
    assert table.isolatable == ("sft", "dpo", "rl", "distill", "merge") and table.reading("rl") == ("rl", "distill")
    assert "distill" in typing.get_args(table.names_type)
    # the selection, the pre-flight and the generated deployment find it
    assert select_stages(only=["distill"]).describe() == "data -> bootstrap -> sft -> rl -> distill"
    assert select_stages(refresh_from="distill").refresh == {"distill", "merge", "heldout", "infer", "score",
                                                            "report"}
    cfg = load_config("tiny-cpu", [])
    assert preflight(cfg, select_stages(only=["distill"])).stages[-1] == "distill"
    assert "  - {<<: *stage, name: stage-distill, parameters: {profile: tiny-cpu, only: [distill]}}" in \
        stage_deployments().splitlines()
    # its task: built from the line (the entry's parameters, an interpreter since it may run under another one)
    task = entry_task("distill")
    assert task.name == "distill" and isinstance(task.cache_policy, StageKey)
    assert list(inspect.signature(task.fn).parameters) == ["cfg", "policy", "output_root", "python"]
    # its key is its own key function on the task's inputs, and where the folder lives
    from distill_stage.stage import distill_key

    from stages.core.refs import CheckpointRef

    policy = CheckpointRef(path="/p", fingerprint="f" * 16, format="hf")
    inputs = {"cfg": cfg.rl, "policy": policy, "output_root": str(tmp_path), "python": None}
    assert task.cache_policy.compute_key(None, inputs, {}) == cache_key("distill", distill_key(cfg.rl, policy),
                                                                        str(tmp_path))
    # the flow's one wiring line gives it the run's output root and interpreter, and its refresh
    runner = StageRunner(select_stages(refresh=["distill"]), cfg.run.model_copy(update={"interpreters": {}}))
    assert runner._inputs(task, {}) == {"output_root": cfg.run.output_root, "python": None}


HOOK = """
from tasks.publish import publishes

PUBLISHED = []


@publishes("distill")
def published(result, *, policy):
    PUBLISHED.append((policy.path, result.path))
"""


def test_a_publish_hook_is_checked_against_its_entry_when_it_loads(distill: StageSpec, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from tasks import publish

    monkeypatch.setattr(publish, "HOOKS", dict(publish.HOOKS))
    package = tmp_path / "distill_stage"
    (package / "hook.py").write_text(HOOK)
    importlib.import_module("distill_stage.hook")  # reads `policy`, a parameter of run_distill: registered
    assert publish.HOOKS["distill"].inputs == ("policy",)
    # the same stage line with its entry's `policy` renamed `student`: the same hook now fails as it loads
    (package / "renamed.py").write_text(DISTILL.replace("policy", "student"))
    renamed = dataclasses.replace(distill, entry="distill_stage.renamed:run_distill")
    monkeypatch.setattr(stage_spec, "TABLE", StageTable(tuple(renamed if s.name == "distill" else s
                                                              for s in stage_spec.TABLE.specs)))
    publish.HOOKS.pop("distill")
    (package / "hook_again.py").write_text(HOOK)
    with pytest.raises(StageTableError, match=r"publish hook distill_stage.hook_again.published of stage 'distill' "
                       r"reads 'policy', which its entry distill_stage.renamed:run_distill does not take \(its "
                       r"parameters: cfg, student, output_root\)"):
        importlib.import_module("distill_stage.hook_again")
    assert "distill" not in publish.HOOKS
    # a stage not in the table, a second hook, a hook that takes the inputs positionally: each fails too
    with pytest.raises(UnknownStageError, match=r"'distil' \(did you mean 'distill'\?\)"):
        publish.publishes("distil")(lambda result: None)
    with pytest.raises(StageTableError, match="stage 'sft' has two publish hooks"):
        publish.publishes("sft")(lambda result: None)
    with pytest.raises(StageTableError, match=r"takes the entry's result, then the entry inputs it reads as "
                                              r"keyword-only parameters"):
        publish.publishes("distill")(lambda result, cfg: None)


def test_the_stage_hooks_read_only_inputs_their_entries_take() -> None:
    from stages.core.isolate import resolve
    from tasks.publish import HOOKS

    assert set(HOOKS) == {"data", "sft", "dpo", "merge", "report"}
    for stage, hook in HOOKS.items():  # the check made as tasks/publish.py loaded, restated from the lines
        assert set(hook.inputs) <= set(inspect.signature(resolve(SPECS[stage].entry)).parameters), stage
    # by hand: DPO compares its checkpoint with what it was given, merge names its source, the report counts scores
    assert (HOOKS["dpo"].inputs, HOOKS["merge"].inputs, HOOKS["report"].inputs) == (("checkpoint",), ("ckpt", "cfg"),
                                                                                     ("scores",))


def test_no_stage_module_names_a_task_module() -> None:
    # the lowest floor never points up at the task layer, not even as a string ("tasks.jsonl", a data file, is fine)
    import tasks as task_package

    task_modules = {f"tasks.{info.name}" for info in pkgutil.iter_modules(task_package.__path__)}
    named = [(path, node.value) for path in (Path(stage_spec.__file__).parents[1]).rglob("*.py")
             for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
             if isinstance(node, ast.Constant) and isinstance(node.value, str)
             and node.value.partition(":")[0] in task_modules]
    assert not named


def test_one_stage_call_looks_its_line_up_once(distill: StageSpec, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from stages.core.config.loader import load_config
    from stages.core.refs import CheckpointRef
    from tasks.stage_tasks import StageRunner, _refreshes, entry_task

    cfg = load_config("tiny-cpu", [])
    lookups = []
    real = StageTable.spec
    monkeypatch.setattr(StageTable, "spec", lambda table, name: lookups.append(name) or real(table, name))
    task = entry_task("distill")  # the wiring line names the stage: the one lookup
    runner = StageRunner(select_stages(refresh=["distill"]), cfg.run.model_copy(update={"interpreters": {}}))
    inputs = runner._inputs(task, {"output_root": str(tmp_path)})
    assert _refreshes(runner.selection, task)  # the refresh is read off the task's line
    policy = CheckpointRef(path="/p", fingerprint="f" * 16, format="hf")
    ref = task.fn(cfg.rl, policy, **inputs)  # the task's body: the entry point its line names
    assert (Path(ref.path) / "student.txt").read_text() == "distilled from /p"
    assert lookups == ["distill"]


def test_prefect_yaml_holds_the_generated_stage_deployments() -> None:
    from flows.deployments import PREFECT_YAML, stage_deployments, written_stage_deployments

    assert written_stage_deployments(PREFECT_YAML.read_text()) == stage_deployments(), \
        "prefect.yaml is out of date: run `python -m flows.cli docs --write`"
    project = yaml.safe_load(PREFECT_YAML.read_text())
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
    from tasks.stage_tasks import StageKey, entry_task

    module = importlib.import_module(spec.module)
    assert callable(getattr(module, spec.entry.partition(":")[2])) and callable(getattr(module, spec.key))
    assert _folder_names(spec.module) == {spec.name}
    import tasks as task_package  # every task module, found, not listed
    from tasks.publish import HOOKS

    written = [t for info in pkgutil.iter_modules(task_package.__path__)
               for t in vars(importlib.import_module(f"tasks.{info.name}")).values()
               if isinstance(getattr(t, "cache_policy", None), StageKey) and t.cache_policy.stage == spec.name]
    assert not (written and spec.name in HOOKS), f"{spec.name}: a task written by hand publishes itself; a hook " \
        "is registered only for the task entry_task builds"
    tasks = written or [entry_task(spec.name)]  # no module of its own: the task its line builds
    assert all(t.name == spec.name and t.cache_policy.function.__name__ == spec.key for t in tasks)


def test_no_stage_reads_the_table() -> None:
    # adding a stage must recompute no other stage: the table, the selection, the pre-flight are in no key
    for spec in STAGE_SPECS:
        covered = CODE.closure(spec.module)
        assert not {"stages.core.stage_spec", "stages.core.selection", "stages.core.input_check",
                    "stages.core.preflight"} & set(covered)


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
    verl = load_config("tiny-cpu", [f"run.interpreters={{rl: {tmp_path / 'nope' / 'python'}}}"])
    with pytest.raises(InputError, match=r"\(./scripts/setup-gpu.sh builds .venv-verl"):  # the table's hint
        check_inputs(verl, ["rl"])


def test_the_tables_rows_name_every_value() -> None:
    # a row of ten positional values reads as a list of numbers: each table's row type takes keywords only
    from stages.core.algorithm_spec import AlgorithmSpec
    from stages.core.engine_spec import EngineSpec
    from stages.core.tracking.backends import BackendLine
    from stages.eval.benchmarks import BenchmarkSpec, HubSource
    from stages.rl.reference_code import ReferenceSetting

    for row in (StageSpec, AlgorithmSpec, EngineSpec, BackendLine, BenchmarkSpec, HubSource, ReferenceSetting):
        assert all(f.kw_only for f in dataclasses.fields(row)), row.__name__
    with pytest.raises(TypeError, match="positional"):
        StageSpec("data", ("data",), "stages.data.prepare:prepare_data", "data_key")  # type: ignore[misc]
