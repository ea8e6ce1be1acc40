"""Numbers live once: every bench writes `bench/results/<name>.json` (bench/results.py), and the tables of
docs/benchmarks.md are the ones those files give (`python -m bench.results --write-docs`)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from bench import results

ROOT = results.PROJECT_ROOT
SCRIPTS = sorted((ROOT / "bench").glob("bench_*.py"))
FIELDS = {"name", "what", "command", "summary", "figures", "conditions", "details", "date", "commit",
          "load_average", "source"}


def test_the_tables_in_docs_benchmarks_md_are_the_ones_the_result_files_give() -> None:
    text = results.DOC.read_text(encoding="utf-8")
    assert text.count("<!-- bench-table:start -->") == 1, "docs/benchmarks.md lost its summary table's markers"
    for doc in results.DOCS:  # docs/learning.md holds the learning bench's tables
        page = doc.read_text(encoding="utf-8")
        assert results.render(page, results.load_results()) == page, \
            f"{doc.name} is out of date: run `python -m bench.results --write-docs`"


def test_every_record_reads_and_says_where_it_came_from() -> None:
    records = results.load_results()
    assert {"tiny_chain", "ci"} <= set(records)
    for name, record in records.items():
        assert FIELDS <= set(record), (name, FIELDS - set(record))
        assert record["name"] == name.removeprefix("history/")   # a record kept for the page's history
        record["summary"].format(**record["figures"])      # the summary names only figures the record holds
        assert record["date"] or record.get("documented_by"), f"{name}: no date of measurement or record"
        assert record["source"].startswith(("measured: ", "docs/", "README.md")), (name, record["source"])


def test_the_tiny_chain_was_measured_with_the_command_a_user_runs() -> None:
    record = results.load_results()["tiny_chain"]
    # bench/bench_tiny_chain.py times the user's own command in a fresh clone (and `arpo run` alone)
    assert record["command"] == "bench/bench_tiny_chain.py" and record["source"].startswith("measured: ")
    assert "`./scripts/run-tiny.sh` cold and fully cached" in record["what"]
    assert record["figures"]["cold_s"] > 10 * max(record["figures"]["cached_rerun_s"])


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_bench_writes_its_result_and_has_one(script: Path) -> None:
    calls = [node for node in ast.walk(ast.parse(script.read_text(encoding="utf-8")))
             if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "write_result"]
    assert calls, f"{script.name} writes no result file (bench.results.write_result)"
    names = {call.args[0].value for call in calls if isinstance(call.args[0], ast.Constant)}
    commands = {kw.value.value for call in calls for kw in call.keywords
                if kw.arg == "command" and isinstance(kw.value, ast.Constant)}
    assert commands == {f"bench/{script.name}"}, commands
    assert all((results.RESULTS_DIR / f"{name}.json").is_file() for name in names), \
        f"{script.name}: no bench/results/{names} yet: seed it or run the bench"


def test_write_result_replaces_the_file_and_the_docs_follow(tmp_path: Path) -> None:
    path = results.write_result("demo", {"cold_s": 12.345, "ratio": [0.5, 0.25]}, summary="cold {cold_s:.1f} s, "
                                "{ratio[0]:.2f}x / {ratio[1]:.2f}x", what="a demo", command="bench/bench_demo.py",
                                details="rl.md#benchmarks", tables={"t": {"columns": ["a", "b|c"], "rows": [[1, 2]]}},
                                root=tmp_path)
    record = json.loads(path.read_text())
    assert record["figures"]["cold_s"] == 12.345 and len(record["load_average"]) == 3
    assert [p.name for p in tmp_path.iterdir()] == ["demo.json"]          # no temporary file left behind
    doc = ("x\n<!-- bench-table:start -->\nold\n<!-- bench-table:end -->\n"
           "<!-- bench-table:demo/t:start -->\n<!-- bench-table:demo/t:end -->\ny\n")
    out = results.render(doc, results.load_results(tmp_path))
    assert "| `bench/bench_demo.py` | a demo | cold 12.3 s, 0.50x / 0.25x ([details](rl.md#benchmarks)) |" in out
    assert "| a | b\\|c |\n|---|---|\n| 1 | 2 |\n" in out and "\nold\n" not in out
    assert results.render(out, results.load_results(tmp_path)) == out   # idempotent


def test_a_summary_naming_a_figure_it_lacks_fails_when_written(tmp_path: Path) -> None:
    with pytest.raises(KeyError, match="cached_s"):
        results.write_result("demo", {"cold_s": 1.0}, summary="{cached_s:.1f}", what="", command="x", root=tmp_path)
    assert not list(tmp_path.iterdir())


def test_docs_naming_a_table_no_result_holds_fail() -> None:
    with pytest.raises(KeyError, match="nothing/t"):
        results.render("<!-- bench-table:nothing/t:start -->\n<!-- bench-table:nothing/t:end -->\n", {})


def test_history_records_keep_their_tables_and_leave_the_summary(tmp_path: Path) -> None:
    for name in ("now", "old"):
        results.write_result(name, {"x": 1}, summary=f"{name} {{x}}", what=name, command=f"bench/bench_{name}.py",
                             tables={"t": {"columns": ["a"], "rows": [[name]]}}, root=tmp_path)
    (tmp_path / "history").mkdir()
    (tmp_path / "old.json").rename(tmp_path / "history" / "old.json")
    (tmp_path / "per-question").mkdir()                 # another folder's JSON is no record
    (tmp_path / "per-question" / "now.json").write_text("{}")
    loaded = results.load_results(tmp_path)
    assert list(loaded) == ["now", "history/old"]
    doc = ("<!-- bench-table:start -->\n<!-- bench-table:end -->\n"
           "<!-- bench-table:history/old/t:start -->\n<!-- bench-table:history/old/t:end -->\n")
    out = results.render(doc, loaded)
    assert "bench_now.py" in out and "bench_old.py" not in out                      # the summary: current only
    assert "| a |\n|---|\n| old |\n" in out and "`history/old` in bench/results/." in out
