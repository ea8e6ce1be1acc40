"""Scoring and report tasks, each cached on its stage's own key: the score cache ignores where the judge runs
(URL, port) but keys on what it is (`scoring_key`)."""

from __future__ import annotations

from typing import Any

from prefect.futures import PrefectFuture, as_completed

from stages.core.config.eval import EvalSection
from stages.core.refs import EndpointRef, PredictionsRef, Ref, ScoresRef
from tasks.artifacts import publish_markdown, publish_table
from tasks.common import call_entry, stage_task


@stage_task("score")
def _score(cfg: EvalSection, preds: PredictionsRef, judge: EndpointRef | None, output_root: str,
           cache_root: str) -> ScoresRef:
    return call_entry(cfg=cfg, preds=preds, judge=judge, output_root=output_root, cache_root=cache_root)


score_task = _score.with_options(task_run_name="score")


@stage_task("report")
def report_task(cfg: EvalSection, scores: list[ScoresRef], output_root: str,
                gains: dict[str, ScoresRef] | None = None) -> Ref:
    ref = call_entry(cfg=cfg, scores=scores, output_root=output_root, gains=gains)
    publish_table("eval-report", ref.meta["rows"], f"Evaluation over {len(scores)} benchmarks ({ref.meta['csv']})")
    if ref.meta["stage_gains"]:
        publish_table("stage-gains", ref.meta["stage_gains"], "What each stage bought: held-out accuracy per policy")
    with open(ref.meta["markdown"], encoding="utf-8") as handle:
        publish_markdown("eval-report-md", handle.read(), "Evaluation report with published numbers")
    return ref


def scores_as_they_finish(benchmarks: list[str], futures: list[PrefectFuture]) -> list[ScoresRef]:
    """Wait for the score tasks, republishing the `eval-scores` table each time a benchmark is scored."""
    from stages.eval.report import progress_rows

    names = dict(zip(futures, benchmarks))
    done: dict[str, dict[str, Any]] = {}
    for future in as_completed(futures):
        done[names[future]] = future.result().meta
        publish_table("eval-scores", progress_rows(benchmarks, done),
                      f"{len(done)}/{len(benchmarks)} benchmarks scored")
    return [future.result() for future in futures]
