"""What produced a benchmark's numbers, recorded by the stage that did the work; the report reads these records
back into its provenance block (stages/eval/report_provenance.py), nothing retyped.

- `inference_record` (the inference stage's summary.json, `provenance`, when the predictions are made): the policy
  (its path, fingerprint, and the stage and key of the folder that holds it), the name it was served as, the search
  (backend, replay file, corpus or server, the browsing mode and its recorded pages, the summariser), the sampling
  sent (temperature, top_p, vLLM's extras when the server took them, samples per question, token budgets), the
  seed rule, the commit (and whether tracked files differed from it) and the time.
- `judge_record` (the score stage's summary.json, `judge_served`): the judge as served (its name, model path,
  weights fingerprint, backend or the policy server it shares) and the model ids its responses named (the OpenAI
  response's `model` field: the revision behind an API alias), counted over the verdicts.

This module is imported by the inference and score stages, so its code is part of their cache keys; the report's
rendering lives apart (and imports none of this: the report's key covers no agent config) so that changing it
reruns only the report.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from stages.core.config.agent import SearchSection
from stages.core.config.eval import EvalSection
from stages.core.provenance import NOT_RECORDED, git_state, stage_of, utc_now
from stages.core.refs import EndpointRef, ModelRef

SEED_RULE = "per request: sample_seed(benchmark, question id, sample) + the request's number in the sample"


def policy_record(model: ModelRef) -> dict[str, Any]:
    """The policy's path, name and fingerprint, with the stage and key of the folder it lies in (None for a model
    that no stage of this pipeline wrote, e.g. a hub id)."""
    return {"path": model.path, "name": model.name, "fingerprint": model.fingerprint, **(stage_of(model.path) or
                                                                                          {"stage": None, "key": None})}


def search_record(search: SearchSection, mode: str) -> dict[str, Any]:
    """The search a benchmark's answers were found with: only the settings its backend and mode read."""
    browsing = search.browse.enabled
    return {"backend": search.backend, "top_k": search.top_k, "mode": mode,
            "replay_file": search.replay_path if search.backend == "replay" else None,
            "corpus": search.corpus_path if search.backend == "local" else None,
            "server_url": search.server_url if search.backend == "server" else None,
            "web": f"{search.web.provider} {search.web.search_url} ({search.web.market})"
            if search.backend == "web" else None,
            "pages_replay_file": search.browse.replay_path if browsing and search.browse.mode == "replay" else None,
            "summarizer": search.summarizer.model if browsing and search.summarizer.model else None}


def inference_record(cfg: EvalSection, search: SearchSection, mode: str, model: ModelRef, endpoint: EndpointRef,
                     extras: dict[str, Any]) -> dict[str, Any]:
    """The inference stage's provenance (see the module docstring); `extras`: the vLLM sampling fields sent."""
    return {"policy": policy_record(model), "served_as": endpoint.model, "search": search_record(search, mode),
            "sampling": {"temperature": cfg.temperature, "top_p": cfg.top_p, **extras, "samples": cfg.samples,
                         "max_tokens": cfg.max_tokens, "max_total_tokens": cfg.max_total_tokens},
            "seeds": SEED_RULE, **git_state(), "date": utc_now()}


def judge_record(judge: EndpointRef | None, answered_as: list[str | None]) -> dict[str, Any] | None:
    """The judge as served and the model ids its verdicts were answered by ({id: verdicts}; verdicts cached
    before the id was kept count as NOT_RECORDED); None without a judge."""
    if judge is None:
        return None
    counts = Counter(model or NOT_RECORDED for model in answered_as)
    return {"name": judge.model, "path": judge.meta.get("model_path"), "fingerprint": judge.model_fingerprint or None,
            "backend": judge.meta.get("backend"), "shared_with": judge.meta.get("shared_with"),
            "answered_as": dict(sorted(counts.items()))}
