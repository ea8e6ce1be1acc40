"""Scoring and report tasks. The score cache ignores where the judge runs (URL, port) but keys on what it is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefect.cache_policies import CachePolicy
from prefect.context import TaskRunContext
from prefect.futures import PrefectFuture, as_completed

from stages.core.config.eval import EvalSection
from stages.core.fingerprint import hash_value
from stages.core.refs import EndpointRef, PredictionsRef, Ref, ScoresRef
from stages.eval.judge import PROMPT_HASH, judge_identity
from stages.eval.report import build_report, progress_rows
from stages.eval.scoring import score_predictions
from tasks.artifacts import publish_markdown, publish_table
from tasks.common import stage_cache, stage_task


@dataclass
class JudgeIdentity(CachePolicy):
    """Keys on the judge's model name + weights fingerprint and the judge prompt, not on its endpoint URL."""

    def compute_key(self, task_ctx: TaskRunContext, inputs: dict[str, Any], flow_parameters: dict[str, Any],
                    **kwargs: Any) -> str:
        judge = inputs.get("judge")
        return hash_value(judge_identity(judge) if isinstance(judge, EndpointRef) else None, PROMPT_HASH)


SCORE_CACHE = stage_cache("eval-score", "stages.eval", "stages.agent") - "judge" + JudgeIdentity()


@stage_task("eval-score", "stages.eval", "stages.agent")
def _score(cfg: EvalSection, preds: PredictionsRef, judge: EndpointRef | None, output_root: str, cache_root: str,
           force: bool = False) -> ScoresRef:
    return score_predictions(cfg, preds, judge, output_root, cache_root, force=force)


score_task = _score.with_options(cache_policy=SCORE_CACHE, task_run_name="eval-score")


@stage_task("eval-report", "stages.eval")
def report_task(cfg: EvalSection, scores: list[ScoresRef], output_root: str, force: bool = False) -> Ref:
    ref = build_report(cfg, scores, output_root, force=force)
    publish_table("eval-report", ref.meta["rows"], f"Evaluation over {len(scores)} benchmarks ({ref.meta['csv']})")
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
