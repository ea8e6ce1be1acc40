"""The subprocess runner (streaming, failure tail, resume point, metrics) and the pure masking helpers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from stages.sft.masking import IGNORE_INDEX, label_runs, overlapping_tokens, result_spans
from stages.sft.runner import (
    LlamaFactoryError,
    parse_log_dict,
    resume_point,
    run_streaming,
    subprocess_env,
    training_metrics,
)


def test_result_spans_include_the_protocol_space_and_truncated_results() -> None:
    text = "<python>x</python> <result>\n1\n</result>\n<think> a </think><search>q</search> <result>\ncut"
    # " <result>\n1\n</result>" starts at the space at index 18 ("<python>x</python>" is 8+1+9 characters) and is
    # 1 + 8 ("<result>") + 1 + 1 + 1 + 9 ("</result>") = 21 characters long
    # the second result has no closing tag (cut by cutoff_len): it runs to the end of the text
    second = text.rindex(" <result>")
    assert result_spans(text) == [(18, 39), (second, len(text))]
    assert text[18:39] == " <result>\n1\n</result>"
    assert result_spans("no tools here") == []


def test_overlapping_tokens() -> None:
    # tokens [0,3) [3,5) [5,9) [9,10); span [4,9) touches tokens 1 and 2 only
    assert overlapping_tokens([(0, 3), (3, 5), (5, 9), (9, 10)], [(4, 9)]) == [False, True, True, False]
    assert overlapping_tokens([(0, 2)], []) == [False]


def test_label_runs_are_the_assistant_turns() -> None:
    x = IGNORE_INDEX
    assert label_runs([x, x, 5, 6, x, 7, 8, 9]) == [(2, 4), (5, 8)]
    assert label_runs([x, x]) == []
    assert label_runs([1]) == [(0, 1)]


def test_parse_trainer_log_lines() -> None:
    assert parse_log_dict("{'loss': 1.25, 'grad_norm': 3.0, 'epoch': 0.5}") == {"loss": 1.25, "grad_norm": 3.0,
                                                                              "epoch": 0.5}
    assert parse_log_dict("[INFO] {not a dict}") is None
    assert parse_log_dict("{'a': __import__('os')}") is None  # literal_eval only: never executes anything


def test_failure_raises_with_the_last_log_lines(tmp_path: Path) -> None:
    script = "import sys\nfor i in range(60): print(f'line {i}')\nprint('ValueError: bad key', flush=True)\nsys.exit(3)"
    log = tmp_path / "run.log"
    with pytest.raises(LlamaFactoryError) as err:
        run_streaming([sys.executable, "-c", script], log, cwd=tmp_path, env=subprocess_env(), what="fake")
    message = str(err.value)
    assert "exit code 3" in message and "ValueError: bad key" in message
    assert "line 59" in message and "line 5\n" not in message  # only the tail (40 lines) is quoted
    assert log.read_text().count("\n") == 61  # the full output is in the log file


def test_success_streams_and_logs(tmp_path: Path) -> None:
    script = "print(\"{'loss': 2.5, 'epoch': 0.1}\")\nprint(' 50%|#####     | 1/2 [00:01<00:01,  1.00s/it]')"
    run_streaming([sys.executable, "-c", script], tmp_path / "ok.log", cwd=tmp_path, env=subprocess_env(), what="ok")
    assert "'loss': 2.5" in (tmp_path / "ok.log").read_text()


def test_resume_point_picks_the_newest_complete_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "trainer"
    for step, complete in ((4, True), (8, True), (12, False)):  # checkpoint-12 crashed while saving
        (out / f"checkpoint-{step}").mkdir(parents=True)
        if complete:
            (out / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    (out / "checkpoint-x").mkdir()
    assert resume_point(out) == out / "checkpoint-8"
    assert out.is_dir()


def test_resume_point_clears_a_folder_without_checkpoints(tmp_path: Path) -> None:
    out = tmp_path / "trainer"
    out.mkdir()
    (out / "trainer_log.jsonl").write_text("{}\n")  # left by a run that died before its first checkpoint
    assert resume_point(out) is None
    assert not out.exists()  # LLaMA-Factory would refuse a non-empty output_dir without checkpoints
    assert resume_point(tmp_path / "never-made") is None


def test_training_metrics_from_llamafactory_logs(tmp_path: Path) -> None:
    rows = [{"current_steps": 1, "total_steps": 3, "loss": 3.0}, {"current_steps": 2, "total_steps": 3, "loss": 2.0},
            {"current_steps": 3, "total_steps": 3, "loss": 2.5}]
    (tmp_path / "trainer_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "all_results.json").write_text(json.dumps({"train_loss": 2.5, "train_runtime": 9.0, "note": "x"}))
    assert training_metrics(tmp_path) == {"train_loss": 2.5, "train_runtime": 9.0, "loss_first": 3.0,
                                          "loss_last": 2.5, "loss_min": 2.0, "steps": 3, "total_steps": 3}
    assert training_metrics(tmp_path / "missing") == {}
