"""The synthetic task generator and the RL parquet reader/validator."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stages.core.atomic import read_jsonl
from stages.core.config.data import DataSection, SyntheticSection
from stages.core.rl_parquet import DatasetRowError, make_row, read_rl_parquet, write_rl_parquet
from stages.data import prepare_data
from stages.data.synthetic import generate

SMALL = SyntheticSection(seed=3, n_math=20, n_qa=20, n_entities=12)


def test_generator_is_deterministic_for_a_seed() -> None:
    assert generate(SMALL) == generate(SMALL)
    assert generate(SMALL) != generate(SMALL.model_copy(update={"seed": 4}))


def test_generator_counts_and_splits() -> None:
    tasks = generate(SMALL).tasks
    assert sum(t.kind == "math" for t in tasks) == 20 and sum(t.kind == "qa" for t in tasks) == 20
    assert len({t.question for t in tasks}) == 40
    splits = [t.split for t in tasks]
    # 40 tasks, test 0.2 -> 8, valid 0.1 -> 4, the rest train
    assert (splits.count("test"), splits.count("valid"), splits.count("train")) == (8, 4, 28)


def test_math_answers_match_running_the_reference_solution() -> None:
    for task in (t for t in generate(SMALL).tasks if t.kind == "math"):
        out = subprocess.run([sys.executable, "-c", task.solution_code], capture_output=True, text=True, timeout=60)
        assert out.stdout.strip() == task.answer, task.question


def test_math_needs_a_tool() -> None:
    # every answer has at least 3 digits: not something a 135M model recalls
    assert all(len(t.answer) >= 3 for t in generate(SMALL).tasks if t.kind == "math")


def test_arith_family_is_one_product_and_leaves_the_other_tasks_alone() -> None:
    with_arith = generate(SMALL.model_copy(update={"n_arith": 10, "arith_digits": 3})).tasks
    arith = [t for t in with_arith if t.id.startswith("arith-")]
    assert len(arith) == 10 and all(t.kind == "math" for t in arith)
    for task in arith:
        a, b = (int(x) for x in task.question.removeprefix("What is ").removesuffix("?").split(" * "))
        assert 100 <= a <= 999 and 100 <= b <= 999 and task.answer == str(a * b)
        assert task.solution_code == f"print({a} * {b})"
    # drawn after the other families: the same math and qa tasks as without arith (only the shuffle differs)
    others = {(t.id, t.question, t.answer) for t in with_arith if not t.id.startswith("arith-")}
    assert others == {(t.id, t.question, t.answer) for t in generate(SMALL).tasks}
    only = generate(SyntheticSection(seed=1, n_math=0, n_qa=0, n_arith=30, arith_digits=2)).tasks
    assert len(only) == len({t.question for t in only}) and all(10 <= int(t.answer) <= 99 * 99 for t in only)


def test_chain_family_is_a_lookup_then_a_computation_on_its_result() -> None:
    world = generate(SMALL.model_copy(update={"n_chain": 12}))
    docs = {d["id"]: d["contents"] for d in world.corpus}
    chain = [t for t in world.tasks if t.kind == "chain"]
    assert len(chain) == 12 and all(t.id.startswith("chain-") for t in chain)
    for task in chain:
        (hop,) = task.hops
        year = int(hop.fact.split(" in ")[1])              # "born in 1957" / "founded in 1923"
        assert hop.fact in docs[hop.doc_id] and docs[hop.doc_id].startswith(hop.query)  # the searched name's doc
        assert hop.query in task.question and str(year) not in task.question       # only the search has the year
        assert task.answer == str(2025 - year) and task.solution_code == f"print(2025 - {year})"
    # drawn after the other families: the same math and qa tasks as without chain
    others = {(t.id, t.question, t.answer) for t in world.tasks if t.kind != "chain"}
    assert others == {(t.id, t.question, t.answer) for t in generate(SMALL).tasks}
    with pytest.raises(ValueError, match="n_entities"):
        generate(SMALL.model_copy(update={"n_chain": 10_000}))


def test_qa_answers_are_in_the_corpus_along_the_hops() -> None:
    world = generate(SMALL)
    docs = {d["id"]: d["contents"] for d in world.corpus}
    for task in (t for t in world.tasks if t.kind == "qa"):
        assert len(task.hops) == 2
        first, second = (docs[h.doc_id] for h in task.hops)
        bridge = task.hops[0].fact.split(" in " if "born" in task.hops[0].fact else "for ", 1)[-1]
        assert bridge in first and bridge in second       # hop 1 names the entity that hop 2 is about
        assert task.answer in second
        assert task.answer not in task.question


def test_corpus_is_flashrag_format() -> None:
    for doc in generate(SMALL).corpus:
        assert set(doc) == {"id", "contents"}
        title, text = doc["contents"].split("\n", 1)
        assert title and text.startswith(title)


def test_prepare_writes_all_roles_and_reuses_its_output(tmp_path: Path) -> None:
    cfg = DataSection(synthetic=SMALL)
    ref = prepare_data(cfg, tmp_path)
    assert set(ref.files) == {"rl_train", "rl_valid", "eval_test", "corpus", "tasks"}
    train = read_rl_parquet(ref.files["rl_train"])
    assert len(train) == 28 and train[0].messages[0]["role"] == "system" and "\\boxed{}" in train[0].system
    assert len(read_jsonl(ref.files["eval_test"])) == 8
    assert prepare_data(cfg, tmp_path) == ref                  # complete marker -> same ref, no rebuild
    assert prepare_data(cfg, tmp_path, force=True).fingerprint != ref.fingerprint


def _write(path: Path, rows: list[dict]) -> Path:
    return write_rl_parquet(rows, path)


def test_bad_rows_name_file_and_row(tmp_path: Path) -> None:
    good = make_row(0, "src", "qa", "sys", "q?", "a", "train")
    bad = make_row(1, "src", "qa", "sys", "q2?", " ", "train")
    path = _write(tmp_path / "rl.parquet", [good, bad])
    with pytest.raises(DatasetRowError, match=r"rl.parquet row 1: reward_model.ground_truth must be a non-empty"):
        read_rl_parquet(path)
    skipped: list[DatasetRowError] = []
    rows = read_rl_parquet(path, skipped=skipped)
    assert len(rows) == 1 and skipped[0].row == 1


def test_bad_prompt_shape_is_reported(tmp_path: Path) -> None:
    table = pa.table({"prompt": [[{"role": "robot", "content": "x"}]],
                      "reward_model": [{"ground_truth": "a", "style": "rule"}]})
    path = tmp_path / "odd.parquet"
    pq.write_table(table, path)
    with pytest.raises(DatasetRowError, match=r"odd.parquet row 0: prompt\[0\] must be"):
        read_rl_parquet(path)


def test_missing_columns_are_reported(tmp_path: Path) -> None:
    path = tmp_path / "cols.parquet"
    pq.write_table(pa.table({"question": ["q"]}), path)
    with pytest.raises(DatasetRowError, match="missing columns"):
        read_rl_parquet(path)


def test_real_rl_parquet_reads_and_fixes_backspace(shared_data: Path) -> None:
    raw = pq.read_table(shared_data / "rl" / "valid.parquet").to_pylist()
    assert "\x08oxed" in raw[0]["prompt"][0]["content"]          # the reference data quirk
    rows = read_rl_parquet(shared_data / "rl" / "valid.parquet")
    assert len(rows) == 180
    assert "\\boxed{}" in rows[0].system and "\x08" not in rows[0].system
    assert {r.ability for r in rows} == {"math", "qa"}


def test_real_train_parquet_has_exactly_one_bad_row(shared_data: Path) -> None:
    skipped: list[DatasetRowError] = []
    rows = read_rl_parquet(shared_data / "rl" / "train_10k.parquet", skipped=skipped)
    assert len(rows) == 9999 and [e.row for e in skipped] == [5274]
