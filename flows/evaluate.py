"""Per-benchmark fan-out of inference and scoring (eval.fanout): `threads` runs it in the pipeline flow itself, on
that flow's thread pool; `ray` runs it as a subflow on Ray workers through prefect-ray (a task runner belongs to a
flow). Threads need no flow run of their own: a subflow costs a cached run its creation and the join of its
heartbeat thread, which Prefect 3.7 wakes once a second (prefect/flow_engine.py `_send_heartbeats`), up to a
second of a rerun that otherwise takes a few (docs/benchmarks.md, the tiny chain). Serving and teardown stay in the
pipeline flow."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from prefect import Flow, flow

from stages.core.config.loader import RunConfig
from stages.core.refs import DatasetRef, EndpointRef, ModelRef
from stages.core.selection import StageName, select_stages
from tasks.eval_infer import submit_infer
from tasks.publish import scores_as_they_finish
from tasks.stage_tasks import StageRunner, entry_task


@flow(name="evaluate", log_prints=True)
def evaluate_benchmarks(cfg: RunConfig, model: ModelRef, data: DatasetRef, endpoint: EndpointRef,
                        judge: EndpointRef | None, refresh: list[StageName], score: bool,
                        retry: list[str] | None = None, summarizer: EndpointRef | None = None) -> dict[str, Any]:
    """retry: benchmarks whose infra-failed samples run again (stages/eval/reuse.py); summarizer: the summariser
    server the parent flow started (agent.search.summarizer.path), None when it serves none."""
    stages = StageRunner(select_stages(refresh=refresh), cfg.run)
    root, cache = cfg.run.output_root, cfg.run.cache_root
    predictions = [submit_infer(stages.selection, retry or [], cfg.eval, cfg.agent, name, model, endpoint, data, root,
                                cache, summarizer=summarizer) for name in cfg.eval.benchmarks]
    if not score:
        return {"infer": [p.result() for p in predictions]}
    scores = [stages.submit(entry_task("score"), cfg.eval, p, judge) for p in predictions]
    done = scores_as_they_finish(cfg.eval.benchmarks, scores)  # the eval table fills in as each one finishes
    return {"infer": [p.result() for p in predictions], "score": done}


def _with_ray(cfg: RunConfig) -> Flow:
    from prefect_ray import RayTaskRunner

    init: dict[str, Any] = {"include_dashboard": False, "_temp_dir": os.environ.get("RAY_TMPDIR", "/tmp/arpo-ray")}
    if cfg.eval.ray_num_cpus:
        init["num_cpus"] = cfg.eval.ray_num_cpus
    runner = RayTaskRunner(address=cfg.eval.ray_address, init_kwargs=None if cfg.eval.ray_address else init)
    return evaluate_benchmarks.with_options(task_runner=runner)


FANOUT: dict[str, Callable[[RunConfig], Callable[..., dict[str, Any]]]] = {
    "threads": lambda cfg: evaluate_benchmarks.fn,  # in the calling flow, on its thread pool
    "ray": _with_ray,                                # a subflow with a Ray task runner
}
