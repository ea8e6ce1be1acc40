"""The one pre-flight (stages/core/preflight.py): the input checks, then each check the stage table names for the
selected stages, each once; a pass the CLI remembers is not checked again by the flow it starts; `arpo run` fails
on a bad input before Prefect or torch is imported."""

from __future__ import annotations

import subprocess
import sys

import pytest

from stages.core import preflight as pre
from stages.core import stage_spec
from stages.core.config.loader import load_config
from stages.core.env import PROJECT_ROOT
from stages.core.errors import InputError
from stages.core.selection import select_stages
from stages.core.stage_spec import SPECS, STAGE_SPECS, StageTable

CALLS: list[tuple[str, frozenset[str]]] = []


def tokenizer_check(cfg, stages) -> str:
    CALLS.append(("tokenizer", frozenset(stages)))
    return "tokenizer ok"


def memory_check(cfg, stages) -> None:
    CALLS.append(("memory", frozenset(stages)))


TOKENIZER, MEMORY = f"{__name__}:tokenizer_check", f"{__name__}:memory_check"


@pytest.fixture
def checks(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, frozenset[str]]]:
    """The table with this module's checks in place of the real ones: SFT and RL read the tokenizer, RL's memory."""
    own = {"sft": (TOKENIZER,), "rl": (MEMORY, TOKENIZER)}
    specs = tuple(s.__class__(**{**s.__dict__, "checks": own.get(s.name, ())}) for s in STAGE_SPECS)
    monkeypatch.setattr(stage_spec, "TABLE", StageTable(specs))
    CALLS.clear()
    return CALLS


def test_each_check_runs_once_in_table_order_for_the_selected_stages(checks) -> None:
    cfg = load_config("tiny-cpu", [])
    done = pre.preflight(cfg, select_stages(until="rl"))
    # by hand: sft names the tokenizer check first, rl adds the memory check; each runs once, with every stage
    assert checks == [("tokenizer", frozenset({"data", "bootstrap", "sft", "rl"})),
                      ("memory", frozenset({"data", "bootstrap", "sft", "rl"}))]
    assert done.result(TOKENIZER) == "tokenizer ok" and done.stages == ("data", "bootstrap", "sft", "rl")
    checks.clear()
    pre.preflight(cfg, select_stages(until="bootstrap"))
    assert checks == []                                   # no selected stage needs either


def test_a_remembered_pass_is_not_checked_again(checks) -> None:
    cfg = load_config("tiny-cpu", ["run.seed=11"])
    selection = select_stages(until="sft")
    pre.preflight(cfg, selection)
    pre.preflight(cfg, selection)
    assert len(checks) == 2                               # the flow's own passes are not remembered
    pre.preflight(cfg, selection, remember=True)          # the CLI's is, for the flow it starts next
    pre.preflight(cfg, selection)
    pre.preflight(load_config("tiny-cpu", ["run.seed=11"]), selection)   # the flow loads the same config again
    assert len(checks) == 3
    pre.preflight(cfg, select_stages(until="rl"))         # other stages: checked
    assert len(checks) == 5


def test_a_check_that_waited_for_the_model_runs_right_after_the_bootstrap(checks, monkeypatch) -> None:
    # a first run's pre-flight skips the seam checks (no tokenizer yet: the check returns None); the flow runs them
    # once the bootstrap stage has put the model on the machine, before SFT, so its cached rerun's pre-flight finds
    # their pass remembered instead of importing transformers for them (docs/benchmarks.md, the tiny chain)
    assert pre.READ_THE_MODEL == (stage_spec.SEAMS,)  # the seam checks read the bootstrapped tokenizer
    monkeypatch.setattr(pre, "READ_THE_MODEL", (TOKENIZER,))
    cfg = load_config("tiny-cpu", ["run.seed=12"])
    selection = select_stages(until="rl")
    skipped = pre.Preflight(("data", "bootstrap", "sft", "rl"), {TOKENIZER: None, MEMORY: None})
    done = pre.after_bootstrap(cfg, selection, skipped)
    assert checks == [("tokenizer", frozenset({"data", "bootstrap", "sft", "rl"}))]   # not the memory check
    assert done.result(TOKENIZER) == "tokenizer ok" and done.stages == skipped.stages
    checks.clear()
    assert pre.after_bootstrap(cfg, selection, done) is done and checks == []   # passed before: nothing again


def test_a_bad_input_fails_before_any_check(checks, tmp_path) -> None:
    cfg = load_config("tiny-cpu", ["data.source=parquet", f"data.train_path={tmp_path / 'missing.parquet'}"])
    with pytest.raises(InputError, match="data.train_path"):
        pre.preflight(cfg, select_stages(until="rl"))
    assert checks == []


def test_a_check_finds_an_earlier_stages_folder_by_the_tables_key(tmp_path) -> None:
    from stages.bootstrap.model import bootstrap_key
    from stages.core.workspace import MARKER, stage_path

    cfg = load_config("tiny-cpu", [f"run.output_root={tmp_path}"])
    assert pre.finished_folder(str(tmp_path), "bootstrap", cfg=cfg.model) is None   # not run yet
    folder = stage_path(tmp_path, "bootstrap", bootstrap_key(cfg.model))
    folder.mkdir(parents=True)
    (folder / MARKER).write_text("{}")
    assert pre.finished_folder(str(tmp_path), "bootstrap", cfg=cfg.model) == folder
    assert SPECS["bootstrap"].key_target == "stages.bootstrap.model:bootstrap_key"


def test_arpo_run_fails_on_a_bad_input_before_prefect_or_torch_is_imported(tmp_path) -> None:
    code = ("import sys; from flows.cli import main\n"
            f"rc = main(['run', '-o', 'data.source=parquet', '-o', 'data.train_path={tmp_path / 'nope.parquet'}'])\n"
            "print(rc, sorted(m for m in ('prefect', 'torch', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120)
    assert done.stdout.split("\n")[-2] == "2 []", done.stdout + done.stderr
    assert "error: data.train_path" in done.stderr


def test_what_a_cached_run_imports_before_the_cache_answers_holds_no_model_library() -> None:
    """A fully cached `arpo run` imports the flow (flows.launch.import_flow), its tasks and every stage's key module
    (each cache key calls its key function): none of them may import torch, transformers, vLLM or pandas at import
    time (they come when a stage runs). `python -X importtime` shows the rest (docs/benchmarks.md, the tiny chain)."""
    code = ("import sys\nfrom flows.launch import import_flow\nimport_flow()\nimport tasks.eval_serve\n"
            "from stages.core.isolate import resolve\nfrom stages.core.stage_spec import STAGE_SPECS\n"
            "for spec in STAGE_SPECS: resolve(spec.key_target)\n"
            "heavy = [m for m in ('torch', 'transformers', 'vllm', 'datasets', 'llamafactory', 'pandas')\n"
            "         if m in sys.modules]\n"
            "import pandas\nprint(heavy)")  # pandas: not imported by Prefect's import, importable afterwards
    done = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)
    assert done.stdout.strip().split("\n")[-1] == "[]", done.stdout + done.stderr
