"""Which servers an evaluation needs, decided before anything is started: a cached rerun serves nothing.

Starting vLLM costs a minute on the CPU box, and a rerun whose predictions (and judged scores) are all on disk
needs no server at all. `serving_needs` computes the inference and scoring stage keys exactly as those stages do,
with the *expected* endpoints (`stages.eval.serving.expected_endpoint`: the served name, model fingerprint and
sampling extras the keys hash, no live process), and checks the stage folders' completion markers:
- the policy server is needed when some benchmark's predictions are missing (or `infer` is refreshed), or when
  the judge is the policy and some judged score is missing;
- a separate judge server is needed when the judge is enabled and some judged score is missing;
- the summariser server (agent.search.summarizer.path) is needed when some benchmark that browses with it has
  missing predictions; scoring never needs it.
Rule-only scoring (judge off) never needs a server.

Predictions with samples that hit a tool infrastructure failure (the marker's `infra_failed`) are not finished:
those benchmarks are listed in `retry`, the policy server starts, and the flow reruns their inference task (a
refresh that retries only those samples, never a wipe: tasks/eval_infer.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from stages.core.config.agent import AgentSection
from stages.core.config.eval import EvalSection
from stages.core.log import get_logger
from stages.core.refs import DatasetRef, EndpointRef, ModelRef, PredictionsRef
from stages.core.workspace import MARKER, stage_path
from stages.eval import inference, scoring
from stages.eval.search_mode import serves_summarizer
from stages.eval.serving import expected_endpoint, expected_judge

log = get_logger(__name__)


class ServingNeeds(BaseModel):
    """Whether to start the policy / judge / summariser servers; the expected endpoints stand in for the policy and
    judge when they are not started (a summariser's endpoint is in no key, so none stands in for it)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    policy: bool
    judge: bool
    policy_endpoint: EndpointRef
    judge_endpoint: EndpointRef | None
    missing: list[str]
    retry: list[str] = []  # benchmarks whose predictions have infra-failed samples to run again
    summarizer: bool = False
    gpus: dict[str, list[int]] = {}  # role (policy | judge | summarizer) -> GPUs (stages/eval/placement.py); {} on CPU


def inference_marker(cfg: EvalSection, agent: AgentSection, benchmark: str, model: ModelRef,
                     endpoint: EndpointRef, data: DatasetRef, output_root: str | Path) -> dict | None:
    """The completion marker of the benchmark's predictions for this endpoint identity, or None."""
    import json

    try:
        key = inference.infer_key(cfg, agent, benchmark, model, endpoint, data)
    except (OSError, ValueError) as err:  # the inference task reports it properly
        log.info("%s: cannot tell whether inference is cached (%s); serving", benchmark, err)
        return None
    marker = stage_path(output_root, inference.STAGE, key) / MARKER
    return json.loads(marker.read_text()) if marker.is_file() else None


def finished_inference(cfg: EvalSection, agent: AgentSection, benchmark: str, model: ModelRef,
                       endpoint: EndpointRef, data: DatasetRef, output_root: str | Path) -> str | None:
    """The fingerprint of the benchmark's complete predictions for this endpoint identity, or None (also when
    some of its samples hit an infrastructure failure: they are to run again)."""
    marker = inference_marker(cfg, agent, benchmark, model, endpoint, data, output_root)
    return marker["fingerprint"] if marker and not marker.get("infra_failed") else None


def finished_scoring(cfg: EvalSection, benchmark: str, predictions_fingerprint: str, judge: EndpointRef | None,
                     output_root: str | Path) -> bool:
    preds = PredictionsRef(path="", fingerprint=predictions_fingerprint, benchmark=benchmark)
    return (stage_path(output_root, scoring.STAGE, scoring.scoring_key(cfg, preds, judge)) / MARKER).is_file()


def serving_needs(cfg: Any, model: ModelRef, data: DatasetRef, refresh: list[str], score: bool) -> ServingNeeds:
    """`cfg` is the RunConfig; `refresh` the stages this run recomputes; `score` whether it scores."""
    infer, rescore = inference.STAGE in refresh, scoring.STAGE in refresh
    root = cfg.run.output_root
    policy = expected_endpoint(cfg.serve, model)
    judge = expected_judge(cfg.eval.judge, policy) if score else None
    judged = judge is not None
    missing: list[str] = []
    retry: list[str] = []
    for name in cfg.eval.benchmarks:
        done = None if infer else finished_inference(cfg.eval, cfg.agent, name, model, policy, data, root)
        if done is None:
            missing.append(f"infer:{name}")
            marker = None if infer else inference_marker(cfg.eval, cfg.agent, name, model, policy, data, root)
            if marker and marker.get("infra_failed"):
                retry.append(name)
        elif judged and (rescore or not finished_scoring(cfg.eval, name, done, judge, root)):
            missing.append(f"score:{name}")
    need_judge = judged and bool(missing)
    need_policy = any(m.startswith("infer:") for m in missing) or (need_judge and cfg.eval.judge.model == "policy")
    need_summarizer = any(m.startswith("infer:") and serves_summarizer(cfg.eval, cfg.agent.search, m[len("infer:"):])
                          for m in missing)
    return ServingNeeds(policy=need_policy, judge=need_judge, policy_endpoint=policy, judge_endpoint=judge,
                        missing=missing, retry=retry, summarizer=need_summarizer)
