"""Which search each benchmark is evaluated with, the label the report shows for it, and the summariser check.

`eval.browse` names the benchmarks whose searches browse the result pages, as the reference's deep-search mode
(`completion_sds`) did; `agent.search.browse.enabled` browses for every benchmark (and in RL rollouts). A benchmark
that browses uses the reference's variant of the browsing tool for it where it had its own
(`BenchmarkSpec.browse_language`: xbench is read with the Chinese one), else `agent.search.browse.language`. So one
eval run reads GAIA, HLE and WebWalker with the English tool and xbench with the Chinese one.

The summariser (`agent.search.summarizer.model`) runs in one of two places: an OpenAI-compatible server the user
runs at `agent.search.summarizer.url`, or a model (`agent.search.summarizer.path`) the evaluation serves like the
judge (stages/eval/serving.py `start_summarizer`). A served one's address is not in the config: the flow hands its
endpoint to the inference stage, which gives it to the toolbox (`summarizer_search`), and the stage key never sees
where a summariser runs (`keyed_agent`), only what it is. `check_summarizer` asks the server for its models before
a benchmark's first sample, so a missing server stops the stage once, naming the key and the fix, rather than
turning every search into an infrastructure failure.
"""

from __future__ import annotations

import os
from typing import Any

from stages.core.config.agent import AgentSection, SearchSection
from stages.core.config.browse import SummarizerSection
from stages.core.config.eval import EvalSection
from stages.core.errors import BadInputError
from stages.core.refs import EndpointRef
from stages.eval.benchmarks import BENCHMARKS


def browses(cfg: EvalSection, search: SearchSection, benchmark: str) -> bool:
    """Whether the benchmark's searches read the result pages."""
    return search.browse.enabled or benchmark in cfg.browse


def benchmark_search(cfg: EvalSection, search: SearchSection, benchmark: str) -> SearchSection:
    """agent.search as this benchmark runs it: browsing on where it browses, in its own language variant."""
    if not browses(cfg, search, benchmark):
        return search
    spec = BENCHMARKS[benchmark] if benchmark in BENCHMARKS else None
    language = (spec.browse_language if spec is not None else None) or search.browse.language
    browse = search.browse.model_copy(update={"enabled": True, "language": language})
    return search.model_copy(update={"browse": browse})


def serves_summarizer(cfg: EvalSection, search: SearchSection, benchmark: str) -> bool:
    """Whether this benchmark's inference needs the summariser the evaluation serves (agent.search.summarizer.path)."""
    return browses(cfg, search, benchmark) and search.summarizer.served_here


# Where a summariser runs and how it is reached; none of it changes a summary (tools.py's SearchTool.version agrees)
WHERE_IT_RUNS = ("url", "api_key_env", "timeout_s", "serve")


def keyed_agent(agent: AgentSection) -> AgentSection:
    """The agent as a stage key hashes it: the summariser's address, key variable, timeout and serving settings
    reset (a served summariser's port changes every start; a rerun must find its predictions)."""
    summ = agent.search.summarizer
    reset = summ.model_copy(update={k: SummarizerSection.model_fields[k].get_default(call_default_factory=True)
                                    for k in WHERE_IT_RUNS})
    return agent.model_copy(update={"search": agent.search.model_copy(update={"summarizer": reset})})


def summarizer_search(search: SearchSection, endpoint: EndpointRef | None) -> SearchSection:
    """agent.search as the toolbox needs it: a summariser the evaluation serves reached at its endpoint."""
    summ = search.summarizer
    if not (search.browse.enabled and summ.served_here):
        return search
    if endpoint is None:
        raise BadInputError(f"agent.search.summarizer.path={summ.path!r} is served by the evaluation, but this "
                            "inference was given no summariser endpoint: start it with stages.eval.serving."
                            "start_summarizer and pass it (the pipeline's evaluate does), or give "
                            "agent.search.summarizer.url of a server you run")
    served = summ.model_copy(update={"url": endpoint.url, "model": endpoint.model, "api_key_env": endpoint.api_key_env})
    return search.model_copy(update={"summarizer": served})


def search_mode(search: SearchSection) -> str:
    """The report's label: `snippets`, `browse (en)` or `browse+summary (zh)`; `, replay` for recorded pages,
    `, jina` for pages read by the Jina Reader."""
    if not search.browse.enabled:
        return "snippets"
    kind = "browse+summary" if search.summarizer.model else "browse"
    source = ", replay" if search.browse.mode == "replay" else ", jina" if search.browse.reader == "jina" else ""
    return f"{kind} ({search.browse.language}{source})"


def check_summarizer(search: SearchSection, get: Any = None) -> None:
    """Fail with the key and the fix when the summariser server is not there or does not serve the model.
    `get` (httpx.get's signature) is for tests."""
    summarizer = search.summarizer
    if not (search.browse.enabled and summarizer.model):
        return
    if not summarizer.url:
        raise BadInputError(f"agent.search.summarizer.url is not set but agent.search.summarizer.model="
                            f"{summarizer.model!r} is: {_HOW}")
    if get is None:
        import httpx

        get = httpx.get
    key = os.environ.get(summarizer.api_key_env, "") if summarizer.api_key_env else ""
    url = summarizer.url.rstrip("/") + "/models"
    try:
        response = get(url, headers={"Authorization": f"Bearer {key}"} if key else {},
                       timeout=min(summarizer.timeout_s, 30.0))
        response.raise_for_status()
        served = [m.get("id") for m in response.json().get("data", [])]
    except Exception as err:  # noqa: BLE001 -- any way of not answering is the same fix
        why = f"{type(err).__name__}: {str(err)[:200]}"
        if summarizer.path:  # this evaluation started it: not a config problem, and its log says what happened
            from stages.eval.vllm_cmd import ServeError

            raise ServeError(f"the summariser served from agent.search.summarizer.path={summarizer.path!r} does not "
                             f"answer {url} ({why}); its server log is in the run folder") from None
        raise BadInputError(f"agent.search.summarizer.url={summarizer.url}: no OpenAI-compatible server answers "
                            f"{url} ({why}). {_HOW}") from None
    if summarizer.model not in served:
        raise BadInputError(f"agent.search.summarizer.model={summarizer.model!r} is not served at "
                            f"{summarizer.url} (it serves {served}); set -o agent.search.summarizer.model=<one of "
                            f"them>, or serve the model under that name there")


_HOW = ("Start that server (e.g. `vllm serve Qwen/Qwen3-14B --served-model-name Qwen3-14B --port 8004 "
        "--max-model-len 32768`) and set -o agent.search.summarizer.url=http://<host>:<port>/v1; or let the "
        "evaluation serve it: -o agent.search.summarizer.url=null -o agent.search.summarizer.path=<model folder or "
        "hub id> (docs/eval.md, \"Search mode per benchmark\"); or leave the benchmark out of eval.browse to search "
        "with snippets only")
