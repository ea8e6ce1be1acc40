"""Inference task, cached on the stage's own key (`infer_key`): the generation settings, agent, model, data,
benchmark content and what the endpoint serves (served name, weights, sampling extras), never its URL or port,
which change every time a server starts. Changing the judge, pass@k or the bootstrap rescores the saved
predictions instead of generating them again."""

from __future__ import annotations

from stages.core.config.agent import AgentSection
from stages.core.config.eval import EvalSection
from stages.core.refs import DatasetRef, EndpointRef, ModelRef, PredictionsRef
from stages.eval.inference import infer_key, run_inference
from tasks.artifacts import publish_table
from tasks.common import forced, stage_task
from tasks.secrets import export_search_key


@stage_task("eval-infer", infer_key)
def _infer(cfg: EvalSection, agent: AgentSection, benchmark: str, model: ModelRef, endpoint: EndpointRef,
           data: DatasetRef, output_root: str, cache_root: str) -> PredictionsRef:
    export_search_key(agent)
    ref = run_inference(cfg, agent, benchmark, model, endpoint, data, output_root, cache_root, force=forced())
    publish_table(f"infer-{benchmark}", [{"benchmark": benchmark, **ref.meta, "path": ref.path}],
                  f"Predictions for {benchmark}")
    return ref


infer_task = _infer.with_options(task_run_name="eval-infer-{benchmark}")
