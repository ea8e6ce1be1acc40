"""The evaluation report's provenance block (issue 47): what produced the numbers, read from the stages' own records,
never retyped. Hand-made records in, the markdown block and `provenance.csv` out; the commit and dirty state of a
scratch git checkout; a policy's stage and key from its folder's completion marker; the inference record from a
config; the score stage carrying the inference record and the judge's answering model id into its summary."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pandas as pd
import pytest

from stages.core.config.agent import SearchSection
from stages.core.config.eval import EvalSection
from stages.core.provenance import git_state, stage_of
from stages.core.refs import EndpointRef, ModelRef, PredictionsRef, ScoresRef
from stages.eval.provenance import SEED_RULE, inference_record
from stages.eval.report import build_report
from tests.unit.test_eval_judge import FakeJudgeServer


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root, check=True,
                          capture_output=True, text=True).stdout.strip()


def test_git_state_reads_the_commit_and_whether_tracked_files_changed(tmp_path):
    assert git_state(tmp_path) == {"commit": None, "dirty": None}  # not a checkout: git cannot tell
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.txt").write_text("one\n")
    _git(tmp_path, "add", "a.txt")
    _git(tmp_path, "commit", "-q", "-m", "first")
    head = _git(tmp_path, "rev-parse", "--short", "HEAD")
    (tmp_path / "new.txt").write_text("untracked\n")  # an untracked file is not a change to the commit's files
    assert git_state(tmp_path) == {"commit": head, "dirty": False}
    (tmp_path / "a.txt").write_text("two\n")
    assert git_state(tmp_path) == {"commit": head, "dirty": True}


def _stage_folder(root: Path, stage: str, key: str) -> Path:
    folder = root / stage / key
    folder.mkdir(parents=True)
    (folder / "_COMPLETE.json").write_text(json.dumps({"key": key, "fingerprint": "x"}))
    return folder


def test_stage_of_reads_the_folders_marker(tmp_path):
    folder = _stage_folder(tmp_path / "outputs", "merge", "3f2a9c")
    (folder / "model").mkdir()
    assert stage_of(folder) == stage_of(folder / "model") == {"stage": "merge", "key": "3f2a9c"}
    assert stage_of("Qwen/Qwen2.5-7B-Instruct") is None  # a hub id: no stage wrote it
    assert stage_of(tmp_path / "outputs") is None


def test_the_inference_record_reads_the_config_and_the_policy_folder(tmp_path, monkeypatch):
    import stages.eval.provenance as provenance

    monkeypatch.setattr(provenance, "git_state", lambda: {"commit": "abc1234", "dirty": True})
    monkeypatch.setattr(provenance, "utc_now", lambda: "2026-05-04T12:00:00Z")
    model_dir = _stage_folder(tmp_path, "merge", "k1") / "model"
    model = ModelRef(path=str(model_dir), fingerprint="f" * 16, name="tiny")
    endpoint = EndpointRef(url="http://127.0.0.1:9/v1", model="tiny-policy")
    cfg = EvalSection(temperature=0.6, top_p=0.95, samples=2, max_tokens=256, max_total_tokens=1024)
    search = SearchSection(backend="replay", replay_path="data/search_cache.json", top_k=10)
    record = inference_record(cfg, search, "snippets", model, endpoint, {"top_k": 20, "min_p": 0.0})
    assert record == {
        "policy": {"path": str(model_dir), "name": "tiny", "fingerprint": "f" * 16, "stage": "merge", "key": "k1"},
        "served_as": "tiny-policy",
        "search": {"backend": "replay", "top_k": 10, "mode": "snippets", "replay_file": "data/search_cache.json",
                   "corpus": None, "server_url": None, "web": None, "pages_replay_file": None, "summarizer": None},
        "sampling": {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "samples": 2, "max_tokens": 256,
                     "max_total_tokens": 1024},
        "seeds": SEED_RULE, "commit": "abc1234", "dirty": True, "date": "2026-05-04T12:00:00Z"}


def _record(mode: str, replay: str | None) -> dict:
    return {"policy": {"path": "/out/merge/k1/model", "name": "tiny", "fingerprint": "f1", "stage": "merge",
                       "key": "k1"},
            "served_as": "tiny-policy",
            "search": {"backend": "replay", "top_k": 10, "mode": mode, "replay_file": "cache.json", "corpus": None,
                       "server_url": None, "web": None, "pages_replay_file": replay, "summarizer": None},
            "sampling": {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "samples": 1, "max_tokens": 256,
                         "max_total_tokens": 1024},
            "seeds": SEED_RULE, "commit": "aaa1111", "dirty": False, "date": "2026-05-01T10:00:00Z"}


def _summary(benchmark: str, inference: dict | None) -> dict:
    point = {"value": 0.5, "ci_low": 0.25, "ci_high": 0.75}
    return {"benchmark": benchmark, "task_type": "qa", "model": "tiny-policy", "questions": 2,
            "samples_per_question": 1, "accuracy_metric": "f1", "correct_metric": "llm_equal",
            "metrics": {"accuracy": point, "pass@1": point}, "em": 0.5, "f1": 0.5, "llm_equal": 0.5,
            "benchmark_hash": "h", "judge": "Qwen2.5-72B-Instruct@j1", "inference": inference,
            "judge_served": {"name": "Qwen2.5-72B-Instruct", "path": "Qwen/Qwen2.5-72B-Instruct", "fingerprint": "j1",
                             "backend": "vllm", "shared_with": None, "answered_as": {"Qwen2.5-72B-Instruct": 2}},
            "scored": {"commit": "bbb2222", "dirty": True, "date": "2026-05-02T11:00:00Z"}}


@pytest.fixture
def fixed_report_state(monkeypatch):
    import stages.eval.report as report

    monkeypatch.setattr(report, "git_state", lambda: {"commit": "ccc3333", "dirty": False})
    monkeypatch.setattr(report, "utc_now", lambda: "2026-05-03T12:00:00Z")


def test_the_block_opens_the_report_and_the_csv_holds_it_per_benchmark(tmp_path, fixed_report_state):
    summaries = [_summary("hotpotqa", _record("snippets", None)),
                 _summary("webwalker", _record("browse (en, replay)", "pages.json"))]
    scores = [ScoresRef(path=str(tmp_path / s["benchmark"]), fingerprint=s["benchmark"], benchmark=s["benchmark"],
                        meta=s) for s in summaries]
    report = build_report(EvalSection(bootstrap_seed=7), scores, tmp_path / "out")
    lines = Path(report.meta["markdown"]).read_text().splitlines()
    assert lines[:2] == ["# Evaluation report", ""] and lines[2] == "## Provenance"  # the top, before the scores
    block = {}
    for line in lines[lines.index("|---|---|") + 1:]:  # the block's rows: "| field | value |"
        if not line.startswith("| "):
            break
        name, value = line[2:-2].split(" | ", 1)
        block[name] = value
    assert block["policy"] == "`/out/merge/k1/model` (stage `merge`, key `k1`; fingerprint `f1`)"
    assert block["served as"] == "`tiny-policy`"
    assert block["predictions"] == "commit `aaa1111`, tracked files unchanged, 2026-05-01T10:00:00Z"
    assert block["scores"] == "commit `bbb2222` + uncommitted changes, 2026-05-02T11:00:00Z"
    assert block["report"] == "commit `ccc3333`, tracked files unchanged, 2026-05-03T12:00:00Z"
    assert block["judge"] == ("`Qwen2.5-72B-Instruct` served from `Qwen/Qwen2.5-72B-Instruct` (vllm, fingerprint "
                              "`j1`); answered as Qwen2.5-72B-Instruct (2 verdicts)")
    # the one value that differs: listed with its benchmarks
    assert block["search"] == ("backend `replay`, top 10, snippets, replay file `cache.json` (hotpotqa); backend "
                               "`replay`, top 10, browse (en, replay), replay file `cache.json`, recorded pages "
                               "`pages.json` (webwalker)")
    assert block["sampling"] == ("temperature 0.6, top_p 0.95, top_k 20; 1 sample per question; max_tokens 256 per "
                                 "call, 1024 per sample")
    assert block["seeds"] == f"{SEED_RULE}; bootstrap intervals: seed 7"
    table = pd.read_csv(report.meta["provenance"])
    assert list(table["benchmark"]) == ["hotpotqa", "webwalker"]
    first = table.iloc[0]
    assert (first["policy_stage"], first["policy_key"], first["predictions_commit"], bool(first["scored_dirty"]),
            first["judge_answered_as"], first["search_replay_file"], first["temperature"], first["bootstrap_seed"]) == \
        ("merge", "k1", "aaa1111", True, "Qwen2.5-72B-Instruct (2 verdicts)", "cache.json", 0.6, 7)
    assert table.iloc[1]["search_pages_replay_file"] == "pages.json" and pd.isna(first["min_p"])  # min_p not sent


def test_a_benchmark_without_records_says_not_recorded(tmp_path, fixed_report_state):
    old = {**_summary("aime24", None)}
    del old["judge_served"], old["scored"]
    scores = [ScoresRef(path=str(tmp_path), fingerprint="o", benchmark="aime24", meta=old)]
    lines = Path(build_report(EvalSection(), scores, tmp_path / "out").meta["markdown"]).read_text().splitlines()
    assert "| policy | not recorded |" in lines and "| search | not recorded |" in lines
    assert "| judge | `Qwen2.5-72B-Instruct@j1` (as served: not recorded) |" in lines
    assert "| report | commit `ccc3333`, tracked files unchanged, 2026-05-03T12:00:00Z |" in lines


def test_scoring_carries_the_inference_record_and_the_model_that_judged(tmp_path):
    from stages.eval.scoring import score_predictions

    row = {"id": "q1", "benchmark": "hotpotqa", "sample": 0, "question": "Q?", "golds": ["Paris"], "task_type": "qa",
           "prediction": "Paris", "output": "<answer>Paris</answer>", "model": "tiny-policy", "benchmark_hash": "h",
           "timing": {"total_s": 1.0}}
    path = tmp_path / "predictions.jsonl"
    path.write_text(json.dumps(row) + "\n")
    record = _record("snippets", None)
    preds = PredictionsRef(path=str(path), fingerprint="p1", benchmark="hotpotqa",
                           meta={"search_mode": "snippets", "provenance": record})
    with FakeJudgeServer(answer_model="judge-rev-2") as server:
        endpoint = server.endpoint().model_copy(update={"meta": {"backend": "external"}})
        summary = score_predictions(EvalSection(bootstrap_samples=10), preds, endpoint, tmp_path / "out",
                                    tmp_path / "cache").meta
    assert summary["inference"] == record
    assert summary["judge_served"]["answered_as"] == {"judge-rev-2": 1}  # one verdict, answered by that id
    assert set(summary["scored"]) == {"commit", "dirty", "date"}
