"""Serving tasks. Never cached: an endpoint is a live process, not a result.

In a flow, stop what you serve even when a later task fails:
    endpoint = serve_task(cfg.serve, model, log_dir)
    try: ... infer_task(..., endpoint=endpoint, ...) ...
    finally: stop_task(endpoint)
(flows/pipeline.py `evaluate` does exactly that). If the flow process dies outright, the server's supervisor
kills it.
"""

from __future__ import annotations

import os
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from stages.core.config.browse import SummarizerSection
from stages.core.config.eval import JudgeSection
from stages.core.config.serve import ServeSection
from stages.core.refs import DatasetRef, EndpointRef, ModelRef
from stages.eval.placement import describe, gpu_count, placement_rows, plan_gpus, served_sections, visible_gpus
from stages.eval.reuse import ServingNeeds, serving_needs
from stages.eval.serving import endpoint_info, follow_output, start_judge, start_server, start_summarizer, stop_server
from stages.eval.vllm_cmd import with_devices
from tasks.artifacts import publish_table


@task(name="serving-needs", cache_policy=NO_CACHE, persist_result=False)
def serving_needs_task(cfg: Any, model: ModelRef, data: DatasetRef, refresh: list[str], score: bool) -> ServingNeeds:
    """Which servers this run must start (none when every prediction and judged score is already on disk), and on
    which GPUs: checked here, before any server starts (stages/eval/placement.py)."""
    needs = serving_needs(cfg, model, data, refresh, score)
    logger = get_run_logger()
    start = lambda needed: "start" if needed else "not needed"  # noqa: E731
    logger.info("serving: policy %s, judge %s, summariser %s (missing: %s)", start(needs.policy),
                start(needs.judge), start(needs.summarizer), ", ".join(needs.missing) or "nothing")
    if not served_sections(cfg, needs):
        return needs
    visible = visible_gpus(os.environ, gpu_count())
    needs = needs.model_copy(update={"gpus": plan_gpus(cfg, needs, visible)})
    rows = placement_rows(cfg, needs, visible)
    logger.info("GPU placement: %s", describe(rows, visible))
    publish_table("gpu-placement", rows, "the GPUs of each vLLM server (CUDA_VISIBLE_DEVICES)")
    return needs


@task(name="serve", cache_policy=NO_CACHE, persist_result=False, task_run_name="serve-{cfg.backend}")
def serve_task(cfg: ServeSection, model: ModelRef, log_dir: str, devices: list[int] | None = None) -> EndpointRef:
    """`devices`: the GPUs the placement gave the policy server (ServingNeeds.gpus); None = as configured."""
    endpoint = start_server(with_devices(cfg, devices), model, log_dir)
    follow_output(endpoint, f"{cfg.backend} server")
    publish_table("serve-endpoint", [endpoint_info(endpoint)], f"{cfg.backend} server for {model.name or model.path}")
    return endpoint


@task(name="serve-judge", cache_policy=NO_CACHE, persist_result=False)
def judge_serve_task(cfg: JudgeSection, policy: EndpointRef | None, log_dir: str,
                     devices: list[int] | None = None) -> EndpointRef | None:
    cfg = cfg.model_copy(update={"serve": with_devices(cfg.serve, devices)})
    judge = start_judge(cfg, policy, log_dir)
    follow_output(judge, "judge server")  # a shared or external one has no log of its own: not followed
    if judge is not None and "pgid" in judge.meta:
        publish_table("judge-endpoint", [endpoint_info(judge)], f"judge server for {judge.model}")
    return judge


@task(name="serve-summarizer", cache_policy=NO_CACHE, persist_result=False)
def summarizer_serve_task(cfg: SummarizerSection, log_dir: str, devices: list[int] | None = None) -> EndpointRef | None:
    cfg = cfg.model_copy(update={"serve": with_devices(cfg.serve, devices)})
    summarizer = start_summarizer(cfg, log_dir)
    follow_output(summarizer, "summariser server")
    if summarizer is not None:
        publish_table("summarizer-endpoint", [endpoint_info(summarizer)], f"summariser server for {summarizer.model}")
    return summarizer


@task(name="stop-server", cache_policy=NO_CACHE, persist_result=False)
def stop_task(endpoint: EndpointRef | None) -> None:
    """One line per server stopped; its teardown output stays in its log (stop_server)."""
    stop_server(endpoint)
