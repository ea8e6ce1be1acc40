"""Scoring and report tasks, each cached on its stage's own key: the score cache ignores where the judge runs
(URL, port) but keys on what it is (`scoring_key`)."""

from __future__ import annotations

from typing import Any

from prefect.futures import PrefectFuture, as_completed

from stages.core.config.eval import EvalSection
from stages.core.refs import EndpointRef, PredictionsRef, Ref, ScoresRef
from stages.eval.report import build_report, progress_rows
from stages.eval.scoring import score_predictions
from tasks.artifacts import publish_markdown, publish_table
from tasks.common import forced, stage_task


@stage_task("score")
def _score(cfg: EvalSection, preds: PredictionsRef, judge: EndpointRef | None, output_root: str,
           cache_root: str) -> ScoresRef:
    return score_predictions(cfg, preds, judge, output_root, cache_root, force=forced())


score_task = _score.with_options(task_run_name="score")


@stage_task("report")
def report_task(cfg: EvalSection, scores: list[ScoresRef], output_root: str,
                gains: dict[str, ScoresRef] | None = None) -> Ref:
    ref = build_report(cfg, scores, output_root, gains=gains, force=forced())
    publish_table("eval-report", ref.meta["rows"], f"Evaluation over {len(scores)} benchmarks ({ref.meta['csv']})")
    if ref.meta["stage_gains"]:
        publish_table("stage-gains", ref.meta["stage_gains"], "What each stage bought: held-out accuracy per policy")
    with open(ref.meta["markdown"], encoding="utf-8") as handle:
        publish_markdown("eval-report-md", handle.read(), "Evaluation report with published numbers")
    return ref


def scores_as_they_finish(benchmarks: list[str], futures: list[PrefectFuture]) -> list[ScoresRef]:
    """Wait for the score tasks, republishing the `eval-scores` table each time a benchmark is scored."""
    names = dict(zip(futures, benchmarks))
    done: dict[str, dict[str, Any]] = {}
    for future in as_completed(futures):
        done[names[future]] = future.result().meta
        publish_table("eval-scores", progress_rows(benchmarks, done),
                      f"{len(done)}/{len(benchmarks)} benchmarks scored")
    return [future.result() for future in futures]
