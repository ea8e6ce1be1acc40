"""Benchmark registry and loaders: every real file read whole, fixture rows for the absent sets, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stages.core.errors import MissingInputError
from stages.eval.benchmarks import (
    BENCHMARKS,
    GOLD_PARSERS,
    check_benchmarks,
    get_spec,
    load_benchmark,
    prompt_template_for,
)

# name -> (folder under shared/data/eval, rows in the file, task type); counts from shared/data/README.md
SHARED = {
    "aime24": ("aime24", 30, "math"), "aime25": ("aime25", 30, "math"), "math500": ("math500", 500, "math"),
    "gsm8k": ("gsm8k", 1319, "math"), "hotpotqa": ("hotpotqa", 200, "qa"), "2wiki": ("2wiki", 200, "qa"),
    "musique": ("musique", 200, "qa"), "bamboogle": ("bamboogle", 125, "qa"), "webwalker": ("webwalker", 200, "qa"),
    "simpleqa": ("SimpleQA", 500, "qa"),
}


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def test_registry_has_every_benchmark_of_the_paper_plus_synthetic():
    expected = {"aime24", "aime25", "math500", "gsm8k", "math", "hotpotqa", "2wiki", "musique", "bamboogle",
                "webwalker", "gaia", "hle", "simpleqa", "xbench", "synthetic"}
    assert set(BENCHMARKS) == expected
    # default caps from the Tool-Star README: math 500, QA 200, HLE 500; SimpleQA 500 (ARPO's COUNTS=500)
    assert {BENCHMARKS[n].default_cap for n in ("aime24", "aime25", "math500", "gsm8k", "math")} == {500}
    assert {BENCHMARKS[n].default_cap for n in ("hotpotqa", "2wiki", "gaia", "xbench")} == {200}
    assert BENCHMARKS["hle"].default_cap == 500 and BENCHMARKS["simpleqa"].default_cap == 500
    # headline metrics as the papers report them (ARPO Table 1: F1 for knowledge QA, llm_equal for math and
    # WebWalker; Table 2: llm_equal)
    assert {n for n, spec in BENCHMARKS.items() if spec.headline == "f1"} == {"hotpotqa", "2wiki", "musique",
                                                                               "bamboogle"}
    assert {spec.headline for spec in BENCHMARKS.values()} == {"f1", "llm_equal"}
    # field mapping facts of docs/reference.md "Evaluation" (Benchmarks and fields)
    assert BENCHMARKS["aime25"].question_field == "problem" and BENCHMARKS["gaia"].question_field == "Question"
    assert BENCHMARKS["hle"].files[-1] == "hle/top.json"


@pytest.mark.parametrize("name", sorted(SHARED))
def test_every_row_of_every_shared_file_loads(shared_data, name):
    folder, rows, task_type = SHARED[name]
    path = shared_data / "eval" / folder / "test.jsonl"
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert len(lines) == rows
    loaded = load_benchmark(name, shared_data / "eval", cap=10_000)
    assert len(loaded.items) == rows and loaded.source == str(path)
    raw = [json.loads(line) for line in lines]
    for item, row in zip(loaded.items, raw):
        assert item.task_type == task_type
        assert item.question == str(row[BENCHMARKS[name].question_field]).strip()
        assert item.golds and all(isinstance(g, str) and g for g in item.golds)
    assert len({i.id for i in loaded.items}) == rows  # ids are unique within a benchmark


def test_shared_rows_map_to_the_right_golds(shared_data):
    root = shared_data / "eval"
    hotpot = load_benchmark("hotpotqa", root, cap=1).items[0]
    assert hotpot.golds == ("Frank Lowy",) and hotpot.question.startswith("Which man who presented")
    wiki = load_benchmark("2wiki", root, cap=1).items[0]  # 8 aliases, first "the five boroughs"
    assert len(wiki.golds) == 8 and wiki.golds[0] == "the five boroughs"
    gsm = load_benchmark("gsm8k", root, cap=1).items[0]  # "... #### 18"
    assert gsm.golds == ("18",) and gsm.id == "0"
    aime25 = load_benchmark("aime25", root, cap=1).items[0]  # answer stored as the int 70
    assert aime25.golds == ("70",) and aime25.question.startswith("Find the sum of all integer bases")
    aime24 = load_benchmark("aime24", root, cap=1).items[0]
    assert aime24.id == "60" and aime24.golds == ("204",) and "url" in aime24.meta
    math500 = load_benchmark("math500", root, cap=1).items[0]
    assert math500.golds == ("\\left( 3, \\frac{\\pi}{2} \\right)",) and math500.id == "math500-0"


def test_default_caps_keep_the_first_rows(shared_data):
    root = shared_data / "eval"
    assert len(load_benchmark("gsm8k", root).items) == 500  # 1319 rows, math cap 500
    assert len(load_benchmark("simpleqa", root).items) == 500  # all 500 rows, as ARPO evaluates it
    assert len(load_benchmark("bamboogle", root).items) == 125  # smaller than the cap: read whole
    capped = load_benchmark("gsm8k", root, cap=3)
    assert [i.id for i in capped.items] == ["0", "1", "2"]


def test_content_hash_is_stable_and_tracks_the_items(tmp_path):
    rows = [{"question": "Q1", "answer": ["A1"]}, {"question": "Q2", "answer": ["A2"]}]
    _write_jsonl(tmp_path / "bamboogle" / "test.jsonl", rows)
    first = load_benchmark("bamboogle", tmp_path)
    assert load_benchmark("bamboogle", tmp_path).content_hash == first.content_hash
    assert load_benchmark("bamboogle", tmp_path, cap=1).content_hash != first.content_hash
    _write_jsonl(tmp_path / "bamboogle" / "test.jsonl", [rows[0], {"question": "Q2", "answer": ["B2"]}])
    assert load_benchmark("bamboogle", tmp_path).content_hash != first.content_hash


def test_fixture_rows_for_the_absent_sets(tmp_path):
    _write_jsonl(tmp_path / "math" / "test.jsonl", [
        {"problem": "What is $1+1$?", "answer": "2", "level": "Level 1", "type": "Algebra"},
        {"problem": "Solve $x^2<4$.", "answer": "[-2,2]"}])  # an interval, not a list of two golds
    math = load_benchmark("math", tmp_path)
    assert [i.golds for i in math.items] == [("2",), ("[-2,2]",)]
    assert math.items[0].meta == {"level": "Level 1", "type": "Algebra"} and math.items[0].task_type == "math"

    _write_jsonl(tmp_path / "gaia" / "test.jsonl", [
        {"id": 0, "task_id": "c61d22de", "Question": "How many studio albums?", "answer": "3", "Level": "1",
         "Annotator_Metadata": {"Steps": "..."}}])
    gaia = load_benchmark("gaia", tmp_path).items[0]
    assert (gaia.id, gaia.question, gaia.golds, gaia.meta) == ("c61d22de", "How many studio albums?", ("3",),
                                                               {"Level": "1"})

    # HLE: JSON lines in a .json file; image rows are left out (text-only evaluation)
    _write_jsonl(tmp_path / "hle" / "top.json", [
        {"id": "h1", "question": "Which is prime? A) 4 B) 7", "answer": "B", "answer_type": "multipleChoice",
         "category": "Math", "has_image": False, "canary": "BENCHMARK DATA SHOULD NEVER APPEAR"},
        {"id": "h2", "question": "What is shown?", "answer": "cat", "has_image": True},
        {"id": "h3", "question": "Name the element with Z=26.", "answer": "Iron", "answer_type": "exactMatch",
         "category": "Chemistry", "has_image": False}])
    hle = load_benchmark("hle", tmp_path)
    assert [i.id for i in hle.items] == ["h1", "h3"] and hle.skipped == 1
    assert hle.items[0].meta == {"answer_type": "multipleChoice", "category": "Math"}

    _write_jsonl(tmp_path / "xbench" / "test.jsonl", [{"question": "中国的首都是哪里？", "answer": "['北京', '北京市']"}])
    xbench = load_benchmark("xbench", tmp_path).items[0]
    assert xbench.golds == ("北京", "北京市") and xbench.id == "xbench-0" and xbench.task_type == "qa"


def test_synthetic_reads_the_data_stage_file_with_per_row_kind(tmp_path):
    path = _write_jsonl(tmp_path / "eval_test.jsonl", [
        {"id": "math-0001", "question": "Compute 17*23.", "answer": "391", "kind": "math"},
        {"id": "qa-0002", "question": "Where was Ada born?", "answer": "Norhaven", "kind": "qa"}])
    loaded = load_benchmark("synthetic", "/nonexistent", synthetic_path=path)
    assert [(i.id, i.task_type, i.golds) for i in loaded.items] == [("math-0001", "math", ("391",)),
                                                                    ("qa-0002", "qa", ("Norhaven",))]
    with pytest.raises(FileNotFoundError, match="synthetic_path=dataset.file"):
        load_benchmark("synthetic", tmp_path)
    _write_jsonl(path, [{"id": "x", "question": "q", "answer": "a", "kind": "code"}])
    with pytest.raises(ValueError, match=r"eval_test.jsonl row 1: field 'kind' must be one of"):
        load_benchmark("synthetic", tmp_path, synthetic_path=path)


def test_missing_file_names_where_to_put_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(MissingInputError) as err:
        load_benchmark("gaia", tmp_path)
    message = str(err.value)
    assert str(tmp_path / "gaia" / "test.jsonl") in message and "gaia-benchmark/GAIA" in message
    with pytest.raises(FileNotFoundError, match=r"xbench/test.jsonl.*fields 'question' and 'answer'"):
        load_benchmark("xbench", tmp_path)
    # every candidate name is listed: SimpleQA/test.jsonl and simpleqa/test.jsonl, HLE's test.jsonl and top.json
    with pytest.raises(MissingInputError) as err:
        load_benchmark("simpleqa", tmp_path)
    assert f"[{tmp_path / 'SimpleQA/test.jsonl'}, {tmp_path / 'simpleqa/test.jsonl'}]" in str(err.value)
    with pytest.raises(MissingInputError, match=r"hle/test.jsonl, .*hle/top.json\]"):
        load_benchmark("hle", tmp_path)


def test_check_benchmarks_fails_before_work_listing_every_missing_file(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    _write_jsonl(tmp_path / "bamboogle" / "test.jsonl", [{"question": "q", "answer": ["a"]}])
    check_benchmarks(["bamboogle", "synthetic"], tmp_path)  # present / from the data stage: nothing to say
    with pytest.raises(MissingInputError) as err:
        check_benchmarks(["bamboogle", "gaia", "hle"], tmp_path)
    lines = str(err.value).splitlines()
    assert len(lines) == 2 and "'gaia'" in lines[0] and "hle/top.json" in lines[1]
    with pytest.raises(KeyError, match="Did you mean 'hotpotqa'"):
        check_benchmarks(["hotpot"], tmp_path)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
    check_benchmarks(["gaia"], tmp_path)  # online, the hub copy stands in (its own errors come at load time)


def test_per_benchmark_prompt_templates():
    from stages.agent.prompt_templates import system_prompt, template_tools
    from stages.core.config.agent import AgentSection
    from stages.core.config.eval import EvalSection
    from stages.eval.inference import benchmark_template

    # the reference runs xbench through infer_cn.py with its Chinese `code_search_cn` system prompt, everything
    # else with `code_search` (docs/reference.md "System prompt")
    assert [n for n, spec in BENCHMARKS.items() if spec.prompt_template] == ["xbench"]
    assert template_tools("tir_search_python_zh") == ("search", "python")
    assert "Wikipedia 搜索工具" in system_prompt("tir_search_python_zh")
    agent, cfg = AgentSection(), EvalSection()
    assert benchmark_template(cfg, agent, "xbench") == "tir_search_python_zh"
    assert benchmark_template(cfg, agent, "gaia") == "tir_search_python"
    assert benchmark_template(cfg.model_copy(update={"benchmark_prompts": False}), agent, "xbench") == \
        "tir_search_python"
    # a run whose template offers other tools keeps its own prompt (the Chinese one would offer python too)
    search_only = agent.model_copy(update={"prompt_template": "tir_search"})
    assert benchmark_template(cfg, search_only, "xbench") == "tir_search"
    assert prompt_template_for(BENCHMARKS["xbench"], "tir_search_python_zh") == "tir_search_python_zh"


def test_hub_fallback_maps_hub_fields_and_fails_clearly(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
    calls = []

    def fake_load(name, config=None, split=None):
        calls.append((name, config, split))
        return datasets.Dataset.from_list([{"problem": "Find x.", "answer": "5", "unique_id": "test/a/1.json"}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    item = load_benchmark("math500", tmp_path).items[0]
    assert calls == [("HuggingFaceH4/MATH-500", None, "test")]
    assert (item.question, item.golds) == ("Find x.", ("5",))

    def offline(*args, **kwargs):
        raise ConnectionError("no route to host")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(FileNotFoundError, match=r"hub copy 'HuggingFaceH4/MATH-500' could not be loaded "
                                                r"\(ConnectionError: no route to host\)"):
        load_benchmark("math500", tmp_path)


def test_bad_rows_name_file_and_row(tmp_path):
    path = _write_jsonl(tmp_path / "hotpotqa" / "test.jsonl", [{"question": "ok", "answer": ["a"]},
                                                                {"query": "wrong field", "answer": ["b"]}])
    with pytest.raises(ValueError, match=rf"{path} row 2: field 'question'.*missing or empty"):
        load_benchmark("hotpotqa", tmp_path)
    path.write_text('{"question": "q", "answer": ["a"]}\n{"question": \n', encoding="utf-8")
    with pytest.raises(ValueError, match=rf"{path}:2: not valid JSON"):
        load_benchmark("hotpotqa", tmp_path)
    _write_jsonl(tmp_path / "gsm8k" / "test.jsonl", [{"question": "q", "answer": "no final line", "idx": 0}])
    with pytest.raises(ValueError, match=r"row 1: gsm8k answer has no '#### <number>' line"):
        load_benchmark("gsm8k", tmp_path)


def test_gold_parsers():
    assert GOLD_PARSERS.get("list")("['Frank Lowy']") == ("Frank Lowy",)
    assert GOLD_PARSERS.get("list")(["NYC", "New York City", "NYC"]) == ("NYC", "New York City")  # deduplicated
    assert GOLD_PARSERS.get("list")("Paris") == ("Paris",)
    assert GOLD_PARSERS.get("gsm8k")("She pays 2 * 500 = <<2*500=1000>>1000.\n#### 1,000") == ("1000",)
    assert GOLD_PARSERS.get("gsm8k")("#### -3.5") == ("-3.5",)
    assert GOLD_PARSERS.get("plain")(70) == ("70",)


def test_unknown_benchmark_and_bad_cap(tmp_path):
    with pytest.raises(KeyError, match="Did you mean 'hotpotqa'"):
        get_spec("hotpot")
    with pytest.raises(ValueError, match="cap must be >= 1"):
        load_benchmark("hotpotqa", tmp_path, cap=0)


def test_every_profile_names_registered_benchmarks_and_a_published_setting():
    from stages.core.config.loader import load_config, profile_names
    from stages.eval.report import load_reference_numbers, load_reference_settings

    settings = set(load_reference_settings())  # declared: with numbers, or a released checkpoint without any known
    assert set(load_reference_numbers()["setting"]) <= settings
    for profile in profile_names():
        cfg = load_config(profile).eval
        assert set(cfg.benchmarks) <= set(BENCHMARKS), profile
        assert cfg.reference_setting is None or cfg.reference_setting in settings, profile


def test_reference_numbers_reject_undeclared_settings(tmp_path):
    from stages.eval.report import load_reference_numbers

    table = load_reference_numbers()
    # docs/reference.md "Published numbers": Qwen3-14B + ARPO reaches GAIA pass@5 61.2
    row = table[(table.setting == "arpo-qwen3-14b") & (table.benchmark == "gaia") & (table.metric == "pass@5")]
    assert row["value"].tolist() == [61.2] and row["model"].tolist() == ["Qwen3-14B"]
    assert row["measure"].tolist() == ["llm_equal"]
    # every entry says what it measures; the knowledge-QA entries are F1 as in ARPO's Table 1
    assert set(table["measure"]) == {"llm_equal", "f1", "mixed"}
    assert set(table[table.measure == "f1"]["benchmark"]) <= {"hotpotqa", "2wiki", "musique", "bamboogle"}
    bad = tmp_path / "ref.yaml"
    bad.write_text("settings: {a: {model: m, method: x}}\nnumbers:\n"
                   "  - {setting: b, benchmark: gaia, metric: pass@1, measure: f1, value: 1, source: s}\n")
    with pytest.raises(ValueError, match=r"setting 'b' is not declared under `settings:` \(known: \['a'\]\)"):
        load_reference_numbers(bad)


def _summary(benchmark: str, accuracy_metric: str, correct_metric: str, accuracy: float, pass5: float | None,
             llm_equal: float | None) -> dict:
    metrics = {"accuracy": {"value": accuracy, "ci_low": accuracy, "ci_high": accuracy},
               "pass@1": {"value": accuracy, "ci_low": accuracy, "ci_high": accuracy}}
    if pass5 is not None:
        metrics["pass@5"] = {"value": pass5, "ci_low": pass5, "ci_high": pass5}
    return {"benchmark": benchmark, "task_type": "qa", "model": "m", "questions": 10, "samples_per_question": 5,
            "accuracy_metric": accuracy_metric, "correct_metric": correct_metric, "metrics": metrics,
            "em": 0.1, "f1": accuracy if accuracy_metric == "f1" else 0.2, "llm_equal": llm_equal,
            "benchmark_hash": "h"}


def test_report_compares_the_same_metric_and_shows_the_judge_beside_it():
    import pandas as pd

    from stages.eval.report import load_reference_numbers, render_markdown, report_rows

    reference = load_reference_numbers()
    # arpo-qwen2.5-7b publishes 2Wiki pass@1 76.1 as F1 and WebWalker pass@1 26.0 as llm_equal (ARPO issue #60).
    # Judge on: 2Wiki's headline stays F1 (60.0 ours) next to the paper's F1; the judge's 70.0 sits beside it.
    wiki = _summary("2wiki", "f1", "llm_equal", 0.60, None, 0.70)
    walker = _summary("webwalker", "llm_equal", "llm_equal", 0.20, None, 0.20)
    # judge off: WebWalker falls back to F1, which the paper's llm_equal 26.0 must not be compared with
    walker_rules = _summary("webwalker", "f1", "em", 0.25, None, None)
    rows = report_rows([wiki, walker, walker_rules], reference, "arpo-qwen2.5-7b")
    assert (rows[0]["metric"], rows[0]["accuracy"], rows[0]["paper accuracy"], rows[0]["llm_equal"]) == \
        ("f1", 60.0, 76.1, 70.0)
    assert (rows[1]["metric"], rows[1]["accuracy"], rows[1]["paper accuracy"]) == ("llm_equal", 20.0, 26.0)
    assert rows[2]["paper accuracy"] is None
    assert rows[2]["paper (other metric)"] == "pass@1 llm_equal 26 (ours: f1)"
    # pass@5 (binary verdicts): arpo-qwen3-14b GAIA 61.2 (llm_equal) beside ours only when the judge decided
    gaia = _summary("gaia", "llm_equal", "llm_equal", 0.40, 0.55, 0.40)
    gaia_rules = _summary("gaia", "f1", "em", 0.30, 0.45, None)
    judged, rules = report_rows([gaia, gaia_rules], reference, "arpo-qwen3-14b")
    assert (judged["paper accuracy"], judged["paper pass@5"]) == (43.7, 61.2) and judged["pass@5"] == pytest.approx(55)
    assert rules["paper pass@5"] is None and rules["paper accuracy"] is None
    assert "pass@5 llm_equal 61.2 (ours: em)" in rules["paper (other metric)"]
    markdown = render_markdown(pd.DataFrame([judged, rules]), reference, 0.95)
    header = markdown.splitlines()[4]
    order = [c.strip() for c in header.strip("|").split("|")]
    assert order.index("accuracy") < order.index("paper accuracy") < order.index("llm_equal")
    # without a setting every published entry is listed with what it measures
    (listed,) = report_rows([wiki], reference, None)
    assert listed["published"] == "ARPO Qwen2.5-7B-Instruct pass@1 f1 76.1"
