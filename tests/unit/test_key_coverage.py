"""Each stage's key covers its own stage only (stages/core/key_coverage.py): no other stage's package, no command
(`arpo plan`, `arpo rehearse`), no other section's config model; an edit to evaluation or cost code leaves the RL
and SFT keys as they were; and docs/caching.md's table is the one the code gives."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from stages.core import key_coverage
from stages.core.codeversion import STAGES as CODE
from stages.core.codeversion import CodeIndex
from stages.core.stage_spec import SPECS, STAGE_SPECS, StageSpec


@pytest.mark.parametrize("spec", STAGE_SPECS, ids=lambda s: s.name)
def test_a_key_covers_its_own_stage_the_runtime_and_its_sections_only(spec: StageSpec) -> None:
    assert key_coverage.problems(spec) == []


def test_the_rl_key_holds_no_cost_or_eval_module() -> None:
    covered = CODE.closure("stages.rl.stage")
    assert not [m for m in covered if m.startswith(("stages.cost", "stages.eval", "stages.rehearse", "stages.data",
                                                     "stages.sft", "stages.heldout", "stages.bootstrap"))]
    # nor another section's config model (hand-listed: what RL reads is rl, agent, and what they nest)
    assert not {"stages.core.config.eval", "stages.core.config.cost", "stages.core.config.model",
                "stages.core.config.sft", "stages.core.config.data", "stages.core.config.run",
                "stages.core.config.loader", "stages.core.config.root"} & set(covered)


def test_the_rule_catches_a_stage_that_imports_another(monkeypatch: pytest.MonkeyPatch) -> None:
    real = CODE.closure
    monkeypatch.setattr(CODE, "closure", lambda *e: [*real(*e), "stages.eval.benchmarks", "stages.core.config.cost"])
    assert key_coverage.problems(SPECS["rl"]) == [
        "rl: covers stages.eval (another stage's package or a command's; move what it uses to stages.core)",
        "rl: covers the config model stages.core.config.cost, which is no section it reads (rl, agent)"]


@pytest.fixture
def tree(tmp_path: Path) -> CodeIndex:
    shutil.copytree(CODE.package_dir, tmp_path / "stages", ignore=shutil.ignore_patterns("__pycache__"))
    return CodeIndex(tmp_path / "stages", tmp_path / "index.json")


def _append(index: CodeIndex, module: str, line: str) -> None:
    path = index.module_file(module)
    path.write_text(path.read_text(encoding="utf-8") + f"\n{line}\n", encoding="utf-8")


def test_an_eval_or_cost_edit_leaves_rl_and_sft_cached(tree: CodeIndex) -> None:
    def keys() -> dict[str, str]:
        fresh = CodeIndex(tree.package_dir, tree.cache_file)
        return {m: fresh.code_version(m) for m in ("stages.rl.stage", "stages.sft.stage", "stages.eval.inference")}

    before = keys()
    _append(tree, "stages.eval.benchmarks", "NEW_BENCHMARK = 'x'")
    _append(tree, "stages.cost.estimate", "NEW_COST = 1")
    _append(tree, "stages.rehearse.rule", "NEW_RULE = 1")
    _append(tree, "stages.core.config.eval", "NEW_FIELD = 1")
    after = keys()
    assert after["stages.rl.stage"] == before["stages.rl.stage"]
    assert after["stages.sft.stage"] == before["stages.sft.stage"]
    assert after["stages.eval.inference"] != before["stages.eval.inference"]  # the edit is seen where it belongs
    _append(tree, "stages.rl.losses", "NEW_LOSS = 1")
    assert keys()["stages.rl.stage"] != before["stages.rl.stage"]


def test_another_sections_field_leaves_the_rl_and_sft_keys() -> None:
    from stages.core.config.loader import load_config
    from stages.core.refs import DatasetRef, ModelRef
    from stages.rl.stage import rl_key
    from stages.sft.stage import sft_key

    def keys(overrides: list[str]) -> tuple[str, str]:
        cfg = load_config("tiny-cpu", overrides)
        model = ModelRef(path="m", fingerprint="f", name="m")
        data = DatasetRef(path="d", fingerprint="g", files={})
        return (rl_key(cfg.rl, cfg.agent, model, data, cfg.run.seed, cfg.model.dtype),
                sft_key(cfg.sft, cfg.agent, model, data))

    base = keys([])
    assert keys(["eval.max_questions=3", "cost.gpu_memory_gib=40", "serve.port=9999", "run.name=other",
                 "model.name=other"]) == base
    rl, sft = keys(["rl.rollout.temperature=0.5"])
    assert rl != base[0] and sft == base[1]


def test_the_table_in_docs_caching_md_is_the_one_the_code_gives() -> None:
    assert key_coverage.documented() == key_coverage.table(), \
        "docs/caching.md is out of date: run `python -m flows.cli docs --write`"
