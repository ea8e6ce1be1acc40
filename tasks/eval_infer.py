"""Inference task: cached on the generation settings, agent, model, data and benchmark, but not on the endpoint.

The endpoint's URL and port change every time a server starts, so the cache policy leaves it out; which
model answers is keyed through `model` (its fingerprint), and the stage folder key includes it too. Of the
`eval` section only the fields generation reads count (GENERATION_KEYS, as in the stage folder key): changing
the judge, pass@k or the bootstrap rescores the saved predictions instead of generating them again.
"""

from __future__ import annotations

from stages.core.config.agent import AgentSection
from stages.core.config.eval import EvalSection
from stages.core.refs import DatasetRef, EndpointRef, ModelRef, PredictionsRef
from stages.eval.inference import CODE, GENERATION_KEYS, run_inference
from tasks.artifacts import publish_table
from tasks.common import SectionFields, stage_cache, stage_task
from tasks.secrets import export_search_key

INFER_CACHE = (stage_cache("eval-infer", *CODE) - "endpoint" - "cfg"
               + SectionFields(arg="cfg", fields=frozenset(GENERATION_KEYS)))


@stage_task("eval-infer", *CODE)
def _infer(cfg: EvalSection, agent: AgentSection, benchmark: str, model: ModelRef, endpoint: EndpointRef,
           data: DatasetRef, output_root: str, cache_root: str, force: bool = False) -> PredictionsRef:
    export_search_key(agent)
    ref = run_inference(cfg, agent, benchmark, model, endpoint, data, output_root, cache_root, force=force)
    publish_table(f"infer-{benchmark}", [{"benchmark": benchmark, **ref.meta, "path": ref.path}],
                  f"Predictions for {benchmark}")
    return ref


infer_task = _infer.with_options(cache_policy=INFER_CACHE, task_run_name="eval-infer-{benchmark}")
