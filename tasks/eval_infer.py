"""Inference task, cached on the stage's own key (`infer_key`): the generation settings, agent, model, data,
benchmark content and what the endpoint serves (served name, weights, sampling extras), never its URL or port,
which change every time a server starts. Changing the judge, pass@k or the bootstrap rescores the saved
predictions instead of generating them again.

A benchmark whose predictions have samples that hit a tool infrastructure failure is submitted again by the next
run (`submit_infer` with it in `retry`, from stages/eval/reuse.py): the task runs despite its cache entry, which it
then overwrites, and the stage reruns only those samples (`retry=True`: the folder is reopened, never wiped)."""

from __future__ import annotations

from typing import Any

from stages.core.config.agent import AgentSection
from stages.core.config.eval import EvalSection
from stages.core.refs import DatasetRef, EndpointRef, ModelRef, PredictionsRef
from stages.core.selection import StageSelection
from tasks.artifacts import publish_table
from tasks.secrets import export_search_key
from tasks.stage_tasks import call_entry, forced, refreshed, stage_task


@stage_task("infer")
def _infer(cfg: EvalSection, agent: AgentSection, benchmark: str, model: ModelRef, endpoint: EndpointRef,
           data: DatasetRef, output_root: str, cache_root: str, retry: bool = False,
           summarizer: EndpointRef | None = None) -> PredictionsRef:
    export_search_key(agent)
    ref = call_entry(cfg=cfg, agent=agent, benchmark=benchmark, model=model, endpoint=endpoint, data=data,
                     output_root=output_root, cache_root=cache_root, force=forced() and not retry,
                     summarizer=summarizer)
    publish_table(f"infer-{benchmark}", [{"benchmark": benchmark, **ref.meta, "path": ref.path}],
                  f"Predictions for {benchmark}")
    return ref


infer_task = _infer.with_options(task_run_name="infer-{benchmark}")


def submit_infer(selection: StageSelection, retry: list[str], cfg: EvalSection, agent: AgentSection, benchmark: str,
                 *args: Any, summarizer: EndpointRef | None = None) -> Any:
    """Submit one benchmark's inference: recomputed when the stage selection refreshes `infer`; run again without a
    wipe (only its infra-failed samples) when it is in `retry`. `summarizer`: the served summariser's endpoint."""
    refresh = selection.refreshes(infer_task.name)
    again = benchmark in retry and not refresh
    return refreshed(infer_task, refresh or again).submit(cfg, agent, benchmark, *args, retry=again,
                                                          summarizer=summarizer)
