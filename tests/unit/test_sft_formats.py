"""Public SFT formats (ARPO-SFT sharegpt, Tool-Star alpaca) -> validated canonical rows -> LLaMA-Factory folder."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stages.core.rl_parquet import DatasetRowError
from stages.sft.formats import convert_file, dataset_info, write_lf_dataset

SYSTEM = "You are a helpful assistant that can solve the given question step by step with the help of tools."
TRAJECTORY = ("<think> I need the population. </think>\n<search> population of Lyon </search> <result>\n"
              "Page 1: Lyon has 522,250 inhabitants.\n</result>\n<think> Found it. </think>\n"
              "<answer> The final answer is \\[ \\boxed{522,250} \\] </answer>")

# ARPO-SFT-54K rows as LLaMA-Factory's registration reads them: sharegpt, from/value, human/gpt, a system column.
ARPO_ROWS = [
    {"conversations": [{"from": "human", "value": "How many people live in Lyon?"},
                       {"from": "gpt", "value": TRAJECTORY}], "system": SYSTEM},
    # the same data under a `messages` key with OpenAI-style role/content and a leading system message
    {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 2+2?"},
                  {"role": "assistant", "content": "<think> easy </think>\n<answer> \\boxed{4} </answer>"}]},
]
# Tool-Star-SFT-54K rows: alpaca instruction/input/output, no system.
TOOLSTAR_ROWS = [
    {"instruction": "Answer the question with tools.", "input": "How many people live in Lyon?", "output": TRAJECTORY},
    {"instruction": "What is 2+2?", "input": "", "output": "<answer> \\boxed{4} </answer>"},
]


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_arpo_sharegpt_rows_become_canonical(tmp_path: Path) -> None:
    report = convert_file(_write_jsonl(tmp_path / "arpo.jsonl", ARPO_ROWS), "sharegpt")
    assert report.counts == {"rows": 2, "skipped": 0}
    first, second = report.rows
    assert first == {"conversations": [{"from": "human", "value": "How many people live in Lyon?"},
                                       {"from": "gpt", "value": TRAJECTORY}], "system": SYSTEM}
    # role/content + user/assistant map onto from/value + human/gpt; the leading system message moves to `system`
    assert second["system"] == SYSTEM
    assert [t["from"] for t in second["conversations"]] == ["human", "gpt"]


def test_toolstar_alpaca_rows_join_instruction_and_input_like_llamafactory(tmp_path: Path) -> None:
    path = tmp_path / "toolstar.json"
    path.write_text(json.dumps(TOOLSTAR_ROWS))
    first, second = convert_file(path, "alpaca").rows
    # LLaMA-Factory's alpaca converter: "\n".join(instruction, input) when input is non-empty
    assert first["conversations"][0] == {"from": "human",
                                         "value": "Answer the question with tools.\nHow many people live in Lyon?"}
    assert first["conversations"][1] == {"from": "gpt", "value": TRAJECTORY}
    assert first["system"] is None
    assert second["conversations"][0]["value"] == "What is 2+2?"


def test_alpaca_history_becomes_earlier_turns(tmp_path: Path) -> None:
    row = {"instruction": "and 3+3?", "output": "6", "history": [["2+2?", "4"]], "system": "Be brief."}
    (converted,) = convert_file(_write_jsonl(tmp_path / "h.jsonl", [row]), "alpaca").rows
    assert [t["value"] for t in converted["conversations"]] == ["2+2?", "4", "and 3+3?", "6"]
    assert converted["system"] == "Be brief."


BAD_SHAREGPT = [
    ("not a dict", "row must be an object"),
    ({"text": "hello"}, "no 'conversations' or 'messages'"),
    ({"conversations": []}, "non-empty list"),
    ({"conversations": [{"from": "gpt", "value": "hi"}, {"from": "human", "value": "yo"}]}, "turn 0 is 'gpt'"),
    ({"conversations": [{"from": "human", "value": "hi"}]}, "must end with an assistant turn"),
    ({"conversations": [{"from": "robot", "value": "hi"}, {"from": "gpt", "value": "x"}]}, "role tag 'robot'"),
    ({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": ""}]}, "non-empty string"),
    ({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}], "system": 3}, "'system'"),
]


@pytest.mark.parametrize(("row", "problem"), BAD_SHAREGPT)
def test_bad_sharegpt_row_names_file_index_and_problem(tmp_path: Path, row, problem: str) -> None:
    path = _write_jsonl(tmp_path / "bad.jsonl", [ARPO_ROWS[0], row])
    with pytest.raises(DatasetRowError) as err:
        convert_file(path, "sharegpt")
    assert err.value.path == str(path) and err.value.row == 1  # 0-based: the second row
    assert problem in str(err.value) and str(path) in str(err.value)


@pytest.mark.parametrize(("row", "problem"), [
    ({"instruction": "q"}, "no 'output'"),
    ({"instruction": "", "input": "", "output": "a"}, "no user turn"),
    ({"instruction": "q", "output": 7}, "'output' must be a non-empty string"),
    ({"instruction": "q", "output": "a", "history": [["only one"]]}, "history[0]"),
])
def test_bad_alpaca_row_names_file_index_and_problem(tmp_path: Path, row, problem: str) -> None:
    path = _write_jsonl(tmp_path / "bad.jsonl", [TOOLSTAR_ROWS[0], TOOLSTAR_ROWS[1], row])
    with pytest.raises(DatasetRowError, match=r"row 2: ") as err:
        convert_file(path, "alpaca")
    assert problem in str(err.value)


def test_skip_mode_keeps_good_rows_and_reports_bad_ones(tmp_path: Path) -> None:
    path = tmp_path / "mixed.jsonl"
    path.write_text(json.dumps(ARPO_ROWS[0]) + "\n{not json\n" + json.dumps({"text": 1}) + "\n"
                    + json.dumps(ARPO_ROWS[1]) + "\n")
    report = convert_file(path, "sharegpt", bad_rows="skip")
    assert report.counts == {"rows": 2, "skipped": 2}
    assert [e.row for e in report.skipped] == [1, 2]
    assert "not valid JSON" in str(report.skipped[0])


def test_wrong_format_choice_says_which_one_to_use(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "toolstar.jsonl", TOOLSTAR_ROWS)
    with pytest.raises(DatasetRowError, match="set sft.dataset_format=alpaca"):
        convert_file(path, "sharegpt")


def test_all_rows_bad_is_an_error_even_when_skipping(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no valid sharegpt rows"):
        convert_file(_write_jsonl(tmp_path / "bad.jsonl", [{"text": 1}]), "sharegpt", bad_rows="skip")


def test_parquet_input_and_max_rows(tmp_path: Path) -> None:
    path = tmp_path / "arpo.parquet"
    pq.write_table(pa.Table.from_pylist([ARPO_ROWS[0]] * 5), path)
    report = convert_file(path, "sharegpt", max_rows=3)
    assert report.counts == {"rows": 3, "skipped": 0}


def test_missing_file_and_unknown_extension(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="sft.dataset_path"):
        convert_file(tmp_path / "nope.jsonl", "sharegpt")
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="use .json, .jsonl or .parquet"):
        convert_file(tmp_path / "data.csv", "sharegpt")


def test_llamafactory_dataset_folder(tmp_path: Path) -> None:
    rows = convert_file(_write_jsonl(tmp_path / "arpo.jsonl", ARPO_ROWS), "sharegpt").rows
    folder = write_lf_dataset(iter(rows), tmp_path / "lf", "arpo_sft")
    info = json.loads((folder / "dataset_info.json").read_text())
    assert info == {"arpo_sft": {"file_name": "arpo_sft.jsonl", "formatting": "sharegpt",
                                 "columns": {"messages": "conversations", "system": "system"}}}
    written = [json.loads(line) for line in (folder / "arpo_sft.jsonl").read_text().splitlines()]
    assert written == rows
    ranking = dataset_info("pairs", ranking=True)["pairs"]
    assert ranking["ranking"] is True and ranking["columns"]["chosen"] == "chosen"
    with pytest.raises(ValueError, match="no rows"):
        write_lf_dataset([], tmp_path / "empty", "x")
