"""Answers that hit a provider failure at evaluation: left out of the metrics (with their question), listed in the
summary and the report, and the folder reopened so the next run retries only them; the pipeline knows to rerun
them. End to end over HTTP: tests/integration/test_eval_outage.py."""

from __future__ import annotations

import json
from pathlib import Path

from stages.core.config.eval import EvalSection
from stages.core.config.loader import load_config
from stages.core.workspace import MARKER, stage_dir
from stages.eval.inference import FINAL, PARTIAL, STAGE, infer_key, reopen_infra_failed
from stages.eval.report import render_infra, report_rows
from stages.eval.reuse import finished_inference, serving_needs
from stages.eval.rows import PredictionRow
from stages.eval.scoring import score_samples, summarize_benchmark
from stages.eval.serving import expected_endpoint
from tests.unit.test_eval_infer import DATA, MODEL, _infer_inputs


def _row(qid: str, sample: int, prediction: str, gold: str, infra: int = 0) -> PredictionRow:
    return PredictionRow(id=qid, sample=sample, question=f"{qid}?", golds=[gold], task_type="qa",
                         prediction=prediction, output=f"<answer>\\boxed{{{prediction}}}</answer>", benchmark="b",
                         infra_failures=infra, infra_errors=["search: HTTP 503"] if infra else [])


def test_infra_hit_questions_are_left_out_not_scored_wrong(tmp_path: Path) -> None:
    # q0: both samples right; q1: sample 1 hit a provider failure (its answer is empty); q2: one right, one wrong.
    rows = [_row("q0", 0, "paris", "paris"), _row("q0", 1, "paris", "paris"), _row("q1", 0, "rome", "rome"),
            _row("q1", 1, "", "rome", 1), _row("q2", 0, "oslo", "oslo"), _row("q2", 1, "bern", "oslo")]
    cfg = EvalSection(samples=2, pass_k=[1, 2], bootstrap_samples=50)
    summary = summarize_benchmark(cfg, score_samples(cfg, rows, None, tmp_path, "f1"), False, "f1")
    # q1 is out entirely (pass@k needs all n samples): accuracy = mean F1 over q0, q2 = (1 + 1 + 1 + 0) / 4
    assert summary["questions"] == 2 and summary["metrics"]["accuracy"]["value"] == 0.75
    assert summary["metrics"]["pass@2"]["value"] == 1.0          # q0 and q2 each have a correct sample
    assert (summary["infra_failed_answers"], summary["infra_failed_questions"], summary["infra_failed"]) == \
        (1, 1, ["q1#1"])
    row = report_rows([summary], _reference(), None)[0]
    assert row["provider failures"] == 1 and row["accuracy"] == 75.0
    assert render_infra([summary])[4] == "- **b**: 1 answer hit a provider failure (1 question left out): q1#1"
    assert render_infra([{**summary, "infra_failed_answers": 0}]) == []
    # every question hit: nothing to score, the report still has the row (no accuracy) and the list
    everything = summarize_benchmark(cfg, score_samples(cfg, [_row("q1", 0, "", "rome", 2)], None, tmp_path, "f1"),
                                     False, "f1")
    assert everything["metrics"] == {} and everything["infra_failed_answers"] == 1
    assert report_rows([everything], _reference(), None)[0]["accuracy"] is None


def _reference():
    from stages.eval.report import load_reference_numbers

    return load_reference_numbers()


def test_a_finished_folder_with_infra_failures_reopens_for_only_those(tmp_path: Path) -> None:
    cfg = load_config("tiny-cpu", ["eval.benchmarks=[synthetic]", f"run.output_root={tmp_path / 'out'}"])
    data = _infer_inputs(tmp_path)["data"]                     # a two-question synthetic test split
    args = {"cfg": cfg.eval, "agent": cfg.agent, "benchmark": "synthetic", "model": MODEL,
            "endpoint": expected_endpoint(cfg.serve, MODEL), "data": data}
    out = stage_dir(cfg.run.output_root, STAGE, infer_key(**args))
    rows = [_row("q0", 0, "oslo", "oslo").model_dump(), _row("q1", 0, "", "rome", 1).model_dump()]
    (out.path / FINAL).write_text("".join(json.dumps(r) + "\n" for r in rows))
    out.finish(content=out.path / FINAL, rows=2, infra_failed=1)
    # not finished for the pipeline: it serves again and lists the benchmark for a retry
    assert finished_inference(**args, output_root=cfg.run.output_root) is None
    needs = serving_needs(cfg, MODEL, data, [], score=False)
    assert needs.retry == ["synthetic"] and needs.missing == ["infer:synthetic"] and needs.policy
    assert serving_needs(cfg, MODEL, data, ["infer"], score=False).retry == []   # a refresh recomputes it all
    # reopening keeps the answered sample as finished work and drops the marker: only q1#0 runs again
    assert reopen_infra_failed(out.path) == 1
    assert not (out.path / MARKER).exists()
    assert [json.loads(line)["id"] for line in (out.path / PARTIAL).read_text().splitlines()] == ["q0"]
    assert serving_needs(cfg, MODEL, data, [], score=False).retry == []   # unfinished now, not a retry


def test_retry_reruns_the_task_without_a_wipe() -> None:
    from stages.core.selection import select_stages
    from tasks.eval_infer import infer_task, submit_infer

    calls = []

    class Recorder:
        def __init__(self, refresh: bool) -> None:
            self.refresh = refresh

        def submit(self, *args, **kwargs):
            calls.append((self.refresh, kwargs["retry"]))

    import tasks.eval_infer as module

    original = module.refreshed
    module.refreshed = lambda task, refresh: Recorder(refresh) if task is infer_task else None
    try:
        submit_infer(select_stages(), ["gsm8k"], EvalSection(), None, "gsm8k", MODEL, None, DATA, "out", ".cache")
        submit_infer(select_stages(), ["gsm8k"], EvalSection(), None, "aime24", MODEL, None, DATA, "out", ".cache")
        submit_infer(select_stages(refresh=["infer"]), ["gsm8k"], EvalSection(), None, "gsm8k", MODEL, None, DATA, "out",
                     ".cache")
    finally:
        module.refreshed = original
    # retried: runs despite its cache entry, without a wipe; others: cached; an explicit refresh still wipes
    assert calls == [(True, True), (False, False), (True, False)]
