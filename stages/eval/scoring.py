"""The scoring stage: predictions JSONL -> per-sample verdicts + a benchmark summary (accuracy, pass@k, CIs).

`score_predictions(cfg, preds, judge, output_root, cache_root, force)` writes
`<output_root>/score/<key>/{samples.jsonl, summary.json}` and returns a ScoresRef whose `meta` is the
summary. Answers that hit a tool infrastructure failure (a provider, server or sandbox failed; PredictionRow
`infra_failures`) are not scored wrong: every sample of their question is left out of the metrics (pass@k needs
all n samples of a question), and the summary lists them (`infra_failed_answers`, `infra_failed_questions`,
`infra_failed`); the next run retries those samples. The key hashes the scoring-relevant config, the predictions
fingerprint, the judge's identity (model name + weights fingerprint, never its URL), the judge prompt hash and the
code version. Judge verdicts are cached in `<cache_root>/judge_cache.sqlite`, so a crashed or forced re-score
repeats no judge call. The summary carries what produced the numbers, for the report's provenance block: the
inference stage's record (`inference`), the judge as served and the model ids that answered (`judge_served`,
stages/eval/provenance.py) and when and at which commit the scoring ran (`scored`).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import ValidationError

from stages.core import tracking
from stages.core.atomic import read_jsonl, write_json, write_jsonl
from stages.core.codeversion import code_version
from stages.core.config.eval import EvalSection
from stages.core.env import free_cpu_threads
from stages.core.fingerprint import hash_value
from stages.core.log import get_logger
from stages.core.passk import summarize
from stages.core.provenance import git_state, utc_now
from stages.core.refs import EndpointRef, PredictionsRef, ScoresRef
from stages.core.workspace import StageDir, stage_dir
from stages.eval.benchmarks import headline_metric
from stages.eval.content import content_text
from stages.eval.judge import PROMPT_HASH, Judge, JudgeRequest, Verdict
from stages.eval.provenance import judge_record
from stages.eval.rows import PredictionRow, ScoredSample
from stages.eval.sample_metrics import (
    MathVerifier,
    effective_prediction,
    qa_metrics,
    sample_score,
    tool_productivity,
)

log = get_logger(__name__)
INFERENCE_AIDS = ("debug", "rollback", "refine")  # Tool-Star's inference-time tools, counted per sample

STAGE = "score"
PREDICTIONS_FILE = "predictions.jsonl"


def predictions_file(preds: PredictionsRef) -> Path:
    path = Path(preds.path)
    return path / PREDICTIONS_FILE if path.is_dir() else path


def scoring_key(cfg: EvalSection, preds: PredictionsRef, judge: EndpointRef | None) -> str:
    judged = cfg.judge.enabled and judge is not None
    settings = {"judge": cfg.judge.model_dump(include={"enabled", "temperature", "max_tokens"}) if judged else None,
                "pass_k": sorted(set(cfg.pass_k)), "bootstrap": [cfg.bootstrap_samples, cfg.bootstrap_seed,
                                                                 cfg.confidence]}
    return hash_value(settings, preds.fingerprint, judge.identity if judged else None, PROMPT_HASH,
                      code_version(__name__))


def score_predictions(cfg: EvalSection, preds: PredictionsRef, judge: EndpointRef | None, output_root: str | Path,
                      cache_root: str | Path, force: bool = False) -> ScoresRef:
    if cfg.judge.enabled and judge is None:
        raise ValueError("eval.judge.enabled is true but no judge endpoint was given: serve one (eval.judge.model="
                         "policy reuses the policy server) or set eval.judge.enabled=false for rule-only scoring")
    judged = cfg.judge.enabled and judge is not None
    out = stage_dir(output_root, STAGE, scoring_key(cfg, preds, judge), force=force)
    if not out.complete:
        with tracking.stage_run("score", out.path, label=preds.benchmark) as run:
            summary = _score(cfg, preds, judge, judged, out, cache_root)
            run.log_summary(score_metrics(summary))
    summary = _read_summary(out.path)
    return ScoresRef(path=str(out.path), fingerprint=out.fingerprint, benchmark=summary["benchmark"], meta=summary)


def score_metrics(summary: dict[str, Any]) -> dict[str, float]:
    """A benchmark's scores as the tracker's summary metrics: accuracy, pass@k (`pass_at_k`), tool use."""
    out = {name: stats["value"] for name, stats in (summary.get("metrics") or {}).items()
           if isinstance(stats, dict) and isinstance(stats.get("value"), int | float)}
    return out | {name: summary[name] for name in ("em", "f1", "tool_calls", "tool_use_rate")
                  if isinstance(summary.get(name), int | float)}


def _score(cfg: EvalSection, preds: PredictionsRef, judge: EndpointRef | None, judged: bool, out: StageDir,
           cache_root: str | Path) -> dict[str, Any]:
    """Score the predictions, write samples.jsonl and summary.json, finish `out`; returns the summary."""
    rows = load_predictions(predictions_file(preds))
    samples = score_samples(cfg, rows, judge if judged else None, Path(cache_root),
                            headline_metric(preds.benchmark))
    summary = summarize_benchmark(cfg, samples, judged, headline_metric(preds.benchmark))
    summary |= {"judge": judge.identity if judged else None, "predictions": str(predictions_file(preds)),
                "search_mode": preds.meta.get("search_mode"),  # how the answers searched, for the report
                "inference": preds.meta.get("provenance"),  # what produced the predictions (the report's block)
                "judge_served": judge_record(judge if judged else None,
                                             [s.judge_model for s in samples if s.judge_says_correct is not None]),
                "scored": {**git_state(), "date": utc_now()}}
    write_jsonl(out.path / "samples.jsonl", [sample.model_dump() for sample in samples])
    write_json(out.path / "summary.json", summary)
    out.finish()
    accuracy = summary["metrics"].get("accuracy", {}).get("value", float("nan"))
    log.info("%s: accuracy %.3f over %d questions x %d samples (%d answers left out: infrastructure failures)",
             summary["benchmark"], accuracy, summary["questions"], summary["samples_per_question"],
             summary["infra_failed_answers"])
    return summary


def _read_summary(folder: Path) -> dict[str, Any]:
    import json

    return json.loads((folder / "summary.json").read_text(encoding="utf-8"))


def load_predictions(path: Path) -> list[PredictionRow]:
    if not path.is_file():
        raise FileNotFoundError(f"predictions file {path} does not exist; run the inference stage first")
    rows = []
    for number, raw in enumerate(read_jsonl(path), start=1):
        try:
            rows.append(PredictionRow.model_validate(raw))
        except ValidationError as err:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'row'}: {e['msg']}" for e in err.errors())
            raise ValueError(f"{path} row {number}: {problems}; the predictions file must be written by "
                             f"stages.eval inference (fields of stages.eval.rows.PredictionRow)") from None
    if not rows:
        raise ValueError(f"predictions file {path} is empty; rerun inference (it resumes missing samples)")
    keys = [(row.id, row.sample) for row in rows]
    if len(set(keys)) != len(keys):
        raise ValueError(f"{path}: duplicate (id, sample) rows; delete the duplicates or rerun inference with force")
    return rows


def score_samples(cfg: EvalSection, rows: list[PredictionRow], judge: EndpointRef | None,
                  cache_root: Path, headline: str = "llm_equal") -> list[ScoredSample]:
    """One scored row per prediction row: rule metrics, math_equal, judge verdict, score (the benchmark's
    `headline` metric) / correct, tool calls."""
    scored = []
    for row in rows:
        text, fallback = effective_prediction(row.prediction, row.output)
        scored.append(ScoredSample(
            id=row.id, sample=row.sample, task_type=row.task_type, golds=list(row.golds), scored_text=text,
            fallback_prediction=fallback, has_prediction=not fallback, **qa_metrics(text, row.golds),
            python_calls=row.tool_calls.get("python", 0), search_calls=row.tool_calls.get("search", 0),
            inference_tools=dict(row.inference_tools), timed_out=row.timed_out, error=row.error,
            infra_failures=row.infra_failures,
            total_s=row.timing.get("total_s", 0.0),
            benchmark=row.benchmark, model=row.model, benchmark_hash=row.benchmark_hash))
    for row, sample in zip(rows, scored):
        sample.content_text = content_text(row.output, row.task_type)
    _verify_math(cfg, scored)
    for sample in scored:
        sample.rule_equiv = sample.math_equal if sample.task_type == "math" else sample.em
        if sample.task_type == "qa":
            sample.content_equal = qa_metrics(sample.content_text, sample.golds)["em"]
    if judge is not None:
        _apply_judge(cfg, rows, scored, judge, cache_root)
    for sample in scored:
        sample.score, sample.correct = sample_score(sample.task_type, sample.model_dump(), judge is not None,
                                                    headline)
    return scored


def _verify_math(cfg: EvalSection, scored: list[ScoredSample]) -> None:
    """math_equal of every math sample's scored text, and content_equal of its content text, in one verifier pool
    (a content text equal to the scored text is not verified twice)."""
    todo = [(s, "math_equal", s.scored_text) for s in scored if s.task_type == "math" and s.scored_text]
    todo += [(s, "content_equal", s.content_text) for s in scored if s.task_type == "math" and s.content_text
             and s.content_text != s.scored_text]
    if not todo:
        return
    workers = min(cfg.math_workers, free_cpu_threads(), len(todo))  # spare cores only
    with MathVerifier(workers=workers) as verifier:
        results = verifier.check([(text, s.golds) for s, _, text in todo])
    for (sample, field, _), result in zip(todo, results):
        setattr(sample, field, float(result.equal))
        if field == "math_equal":
            sample.math_error = result.error
    for sample in scored:
        if sample.task_type == "math" and sample.content_text and sample.content_text == sample.scored_text:
            sample.content_equal = sample.math_equal


def _apply_judge(cfg: EvalSection, rows: list[PredictionRow], scored: list[ScoredSample], judge: EndpointRef,
                 cache_root: Path) -> None:
    client = Judge(judge, cfg.judge, cache_root / "judge_cache.sqlite")
    asked = [i for i, s in enumerate(scored) if s.scored_text]  # nothing to judge in an empty output
    try:
        answers = client.judge_many([JudgeRequest(rows[i].question, tuple(scored[i].golds), scored[i].scored_text)
                                     for i in asked])
    finally:
        client.cache.close()
    verdicts = [Verdict(says_correct=False, reply="", cached=False)] * len(scored)
    for i, verdict in zip(asked, answers):
        verdicts[i] = verdict
    log.info("judge %s: %d verdicts, %d from cache, %d calls sent", client.identity, len(answers),
             sum(v.cached for v in answers), client.calls)
    for sample, verdict in zip(scored, verdicts):
        sample.judge_says_correct, sample.judge_reply = verdict.says_correct, verdict.reply
        sample.judge_cached, sample.judge_error, sample.judge_model = verdict.cached, verdict.error, verdict.model
        # the reference: correct iff rule-equivalent OR the judge says so (rule alone when it failed)
        sample.llm_equal = float(bool(sample.rule_equiv) or bool(verdict.says_correct))


def infra_summary(samples: list[ScoredSample]) -> tuple[list[ScoredSample], dict[str, Any]]:
    """(the samples of questions no infrastructure failure touched, what was left out)."""
    hit = {s.id for s in samples if s.infra_failures}
    failed = [f"{s.id}#{s.sample}" for s in samples if s.infra_failures]
    return [s for s in samples if s.id not in hit], {
        "infra_failed_answers": len(failed), "infra_failed_questions": len(hit), "infra_failed": failed[:50]}


def summarize_benchmark(cfg: EvalSection, samples: list[ScoredSample], judged: bool,
                        headline: str = "llm_equal") -> dict[str, Any]:
    first, (samples, infra) = samples[0], infra_summary(samples)
    if not samples:  # every question hit a provider failure: nothing to score
        return {"benchmark": first.benchmark, "model": first.model, "benchmark_hash": first.benchmark_hash,
                "task_type": first.task_type, "questions": 0, "samples_per_question": 0, "judged": judged,
                "headline": headline, "accuracy_metric": headline, "correct_metric": None, "metrics": {},
                "confidence": cfg.confidence, **infra}
    by_id: dict[str, list[ScoredSample]] = defaultdict(list)
    for sample in samples:
        by_id[sample.id].append(sample)
    counts = {len(group) for group in by_id.values()}
    if len(counts) != 1:
        short = sorted((len(g), i) for i, g in by_id.items())[:3]
        raise ValueError(f"questions have different sample counts {sorted(counts)} (fewest: {short}); "
                         f"rerun inference to complete the missing samples")
    n = counts.pop()
    groups = [sorted(group, key=lambda s: s.sample) for group in by_id.values()]
    score_QN = np.array([[s.score for s in group] for group in groups])
    correct_QN = np.array([[s.correct for s in group] for group in groups])
    skipped_k = [k for k in cfg.pass_k if k > n]
    if skipped_k:
        log.warning("pass@%s left out: only %d samples per question (raise eval.samples)", skipped_k, n)
    metrics = summarize(score_QN, correct_QN, list(cfg.pass_k), samples=cfg.bootstrap_samples,
                        confidence=cfg.confidence, seed=cfg.bootstrap_seed)
    return {"benchmark": samples[0].benchmark, "model": samples[0].model,
            "benchmark_hash": samples[0].benchmark_hash, "task_type": _task_type(samples),
            "questions": len(groups), "samples_per_question": n, "judged": judged, "headline": headline,
            "accuracy_metric": _accuracy_metric(samples, judged, headline),
            "correct_metric": _correct_metric(samples, judged), "metrics": metrics,
            "confidence": cfg.confidence, **_means(samples, judged, metrics["accuracy"]["value"]), **infra}


def _means(samples: list[ScoredSample], judged: bool, accuracy: float) -> dict[str, Any]:
    def mean(key: str) -> float:
        return float(np.mean([float(getattr(s, key)) for s in samples]))

    calls = [s.python_calls + s.search_calls for s in samples]
    tool_calls = float(np.mean(calls))
    out = {"em": mean("em"), "f1": mean("f1"), "acc": mean("acc"), "math_equal": mean("math_equal"),
           "content_accuracy": mean("content_equal"),  # the answer wherever given (stages/eval/content.py)
           "num_valid_answer": int(sum(s.has_prediction for s in samples)),
           "tool_calls": tool_calls, "python_calls": mean("python_calls"), "search_calls": mean("search_calls"),
           "tool_use_rate": float(np.mean([c > 0 for c in calls])),
           "tool_productivity": tool_productivity(accuracy, tool_calls),
           "timed_out": int(sum(s.timed_out for s in samples)),
           "errors": int(sum(bool(s.error) for s in samples)), "mean_total_s": mean("total_s"),
           **{f"{aid}_uses": int(sum(s.inference_tools.get(aid, 0) for s in samples)) for aid in INFERENCE_AIDS}}
    if judged:
        raw = [s for s in samples if s.judge_says_correct is not None]
        out |= {"llm_equal": mean("llm_equal"), "judge_failures": len(samples) - len(raw),
                "judge_rule_agreement": float(np.mean([bool(s.judge_says_correct) == bool(s.rule_equiv)
                                                       for s in raw])) if raw else None,
                "judge_only_correct": int(sum(bool(s.judge_says_correct) and not s.rule_equiv for s in raw)),
                "rule_only_correct": int(sum(bool(s.rule_equiv) and not s.judge_says_correct for s in raw))}
    return out


def _task_type(samples: list[ScoredSample]) -> str:
    kinds = sorted({s.task_type for s in samples})
    return kinds[0] if len(kinds) == 1 else "mixed"


def _accuracy_metric(samples: list[ScoredSample], judged: bool, headline: str) -> str:
    """What `accuracy` measured: the headline, or (llm_equal without a judge) the rule it fell back to."""
    if headline == "f1" or judged:
        return headline
    kinds = {s.task_type for s in samples}
    return {frozenset({"math"}): "math_equal", frozenset({"qa"}): "f1"}.get(frozenset(kinds), "math_equal|f1")


def _correct_metric(samples: list[ScoredSample], judged: bool) -> str:
    """The binary verdict pass@k counts."""
    if judged:
        return "llm_equal"
    kinds = {s.task_type for s in samples}
    return {frozenset({"math"}): "math_equal", frozenset({"qa"}): "em"}.get(frozenset(kinds), "math_equal|em")
