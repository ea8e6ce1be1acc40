"""The search each benchmark is evaluated with (eval.browse, the benchmark's browsing language), the paper profiles'
deep-search settings, the summariser check, and the report's `search` column (issue 30, item 4)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from stages.core.config.agent import AgentSection, SearchSection
from stages.core.config.eval import EvalSection
from stages.core.config.loader import ConfigError, load_config
from stages.core.errors import BadInputError
from stages.core.refs import DatasetRef, EndpointRef, ModelRef, PredictionsRef
from stages.eval.inference import benchmark_agent, inference_key
from stages.eval.search_mode import benchmark_search, browses, check_summarizer, search_mode

DEEP = ["gaia", "hle", "webwalker", "xbench"]
SUMMARISED = SearchSection(backend="web", summarizer={"model": "Qwen3-14B", "url": "http://127.0.0.1:9/v1"})


@pytest.mark.parametrize("profile", ["arpo-qwen3-14b-deepsearch", "aepo-qwen3-14b-deepsearch"])
def test_paper_profiles_browse_and_summarise_the_deep_search_benchmarks(profile: str) -> None:
    cfg = load_config(profile)
    search = cfg.agent.search
    assert cfg.eval.benchmarks == DEEP and cfg.eval.browse == DEEP
    assert not search.browse.enabled                     # RL rollouts keep snippets, as the papers trained
    # the reference's settings (docs/reference.md "Deep-search browsing"): top 10, 10 workers, 20 s, 3000 chars
    browse = search.browse
    assert (browse.top_k, browse.fetch_concurrency, browse.timeout_s, browse.passage_chars, browse.max_text_chars,
            browse.pdf_max_words, browse.match_threshold, browse.scan_chars) == (10, 10, 20.0, 3000, 20000, 600,
                                                                                 0.2, 50000)
    summ = search.summarizer
    assert (summ.model, summ.url, summ.temperature, summ.top_p, summ.max_tokens) == \
        ("Qwen3-14B", "http://localhost:8004/v1", 0.6, 0.95, 4096)
    modes = {name: search_mode(benchmark_search(cfg.eval, search, name)) for name in DEEP}
    assert modes == {"gaia": "browse+summary (en)", "hle": "browse+summary (en)",
                     "webwalker": "browse+summary (en)", "xbench": "browse+summary (zh)"}


def test_each_benchmark_gets_its_own_search() -> None:
    cfg = EvalSection(benchmarks=["gaia", "xbench", "hotpotqa"], browse=["gaia", "xbench"])
    search = SearchSection(backend="web")
    assert [browses(cfg, search, name) for name in cfg.benchmarks] == [True, True, False]
    assert search_mode(benchmark_search(cfg, search, "gaia")) == "browse (en)"
    assert search_mode(benchmark_search(cfg, search, "xbench")) == "browse (zh)"   # BenchmarkSpec.browse_language
    assert benchmark_search(cfg, search, "hotpotqa") is search and search_mode(search) == "snippets"
    # browsing on for the whole run: every benchmark browses; the run's language except where the spec has its own
    everywhere = search.model_copy(update={"browse": search.browse.model_copy(update={"enabled": True,
                                                                                      "language": "zh"})})
    assert search_mode(benchmark_search(EvalSection(), everywhere, "hotpotqa")) == "browse (zh)"
    replay = search.model_copy(update={"browse": search.browse.model_copy(update={"mode": "replay",
                                                                                  "replay_path": "p.json"})})
    assert search_mode(benchmark_search(cfg, replay, "gaia")) == "browse (en, replay)"
    jina = search.model_copy(update={"browse": search.browse.model_copy(update={"reader": "jina"})})
    assert search_mode(benchmark_search(cfg, jina, "gaia")) == "browse (en, jina)"


def test_the_benchmark_search_is_in_the_inference_key_and_the_toolbox_agent() -> None:
    model = ModelRef(path="/m", fingerprint="a" * 16, name="smol")
    data = DatasetRef(path="/d", fingerprint="d" * 16, files={})
    endpoint = EndpointRef(url="http://127.0.0.1:4000/v1", model="smol")
    agent = AgentSection(search=SearchSection(backend="web"))
    plain, browsing = EvalSection(), EvalSection(browse=["xbench"])
    assert benchmark_agent(browsing, agent, "xbench").search.browse.language == "zh"
    assert benchmark_agent(browsing, agent, "xbench").limits.max_calls == 15        # the eval limits still apply
    assert inference_key(plain, agent, "xbench", "h", model, endpoint, data) != \
        inference_key(browsing, agent, "xbench", "h", model, endpoint, data)       # xbench now browses: recompute
    assert inference_key(plain, agent, "gaia", "h", model, endpoint, data) == \
        inference_key(browsing, agent, "gaia", "h", model, endpoint, data)         # gaia unchanged: reused


def test_config_rules_for_eval_browsing() -> None:
    # a summariser with nothing that browses is refused; eval.browse is something that browses
    with pytest.raises(ConfigError, match="summarizer.model is set but nothing browses"):
        load_config("tiny-cpu", ["agent.search.summarizer.model=m", "agent.search.summarizer.url=http://h/v1"])
    load_config("tiny-cpu", ["agent.search.summarizer.model=m", "agent.search.summarizer.url=http://h/v1",
                             "eval.browse=[synthetic]"])
    # eval.browse browses with agent.search's settings, so they must hold with browsing on
    with pytest.raises(ConfigError, match="eval.browse=.*browse.replay_path"):
        load_config("tiny-cpu", ["eval.browse=[synthetic]", "agent.search.browse.mode=replay"])
    with pytest.raises(ConfigError, match="eval.browse"):
        load_config("tiny-cpu", ["eval.browse=[no-such-benchmark]"])             # registry-checked names


class _Reply:
    def __init__(self, models: list[str], status: int = 200) -> None:
        self.models, self.status_code = models, status

    def raise_for_status(self) -> None:
        if self.status_code != 200:
            raise httpx.HTTPStatusError("bad", request=httpx.Request("GET", "http://x"), response=None)  # type: ignore

    def json(self) -> dict:
        return {"data": [{"id": m} for m in self.models]}


def test_summariser_check_names_the_key_and_the_fix() -> None:
    browsing = benchmark_search(EvalSection(browse=["gaia"]), SUMMARISED, "gaia")
    asked: list[str] = []

    def down(url: str, **_: object) -> _Reply:
        asked.append(url)
        raise httpx.ConnectError("connection refused")

    with pytest.raises(BadInputError, match=r"agent\.search\.summarizer\.url=http://127\.0\.0\.1:9/v1: no "
                                            r"OpenAI-compatible server answers.*summarizer\.url=http"):
        check_summarizer(browsing, get=down)
    assert asked == ["http://127.0.0.1:9/v1/models"]
    with pytest.raises(BadInputError, match=r"summarizer\.model='Qwen3-14B' is not served .*\['other'\]"):
        check_summarizer(browsing, get=lambda url, **_: _Reply(["other"]))
    check_summarizer(browsing, get=lambda url, **_: _Reply(["Qwen3-14B"]))
    check_summarizer(SUMMARISED, get=down)       # a benchmark that does not browse asks nothing
    assert len(asked) == 1


def test_scores_and_report_say_which_search_produced_the_numbers(tmp_path: Path) -> None:
    import pandas as pd

    from stages.eval.report import load_reference_numbers, render_markdown, report_rows
    from stages.eval.scoring import score_predictions

    row = {"id": "q1", "benchmark": "xbench", "sample": 0, "question": "Q", "golds": ["A"], "task_type": "qa",
           "prediction": "A", "output": "<answer>A</answer>", "finish_reason": "stop", "tool_calls": {},
           "timing": {"total_s": 1.0}, "timed_out": False, "error": None, "model": "m", "benchmark_hash": "h"}
    path = tmp_path / "predictions.jsonl"
    path.write_text(json.dumps(row) + "\n")
    preds = PredictionsRef(path=str(path), fingerprint="p1", benchmark="xbench",
                           meta={"search_mode": "browse+summary (zh)"})
    cfg = EvalSection(judge={"enabled": False}, bootstrap_samples=10)
    scores = score_predictions(cfg, preds, None, tmp_path / "out", tmp_path / "cache")
    assert scores.meta["search_mode"] == "browse+summary (zh)"
    reference = load_reference_numbers()
    gaia = {**scores.meta, "benchmark": "gaia", "search_mode": "snippets"}
    rows = report_rows([scores.meta, gaia], reference, "aepo-qwen3-14b")
    assert [r["search"] for r in rows] == ["browse+summary (zh)", "snippets"]
    # the published AEPO GAIA pass@1 47.6 sits in the same row as the search mode that produced ours
    assert rows[1]["paper accuracy"] is None and "pass@1 llm_equal 47.6" in rows[1]["paper (other metric)"]
    markdown = render_markdown(pd.DataFrame(rows), reference, 0.95)
    header = [c.strip() for c in markdown.splitlines()[4].strip("|").split("|")]
    assert header[:2] == ["benchmark", "search"] and "browse+summary (zh)" in markdown
    # an older scores summary without the field shows "-" rather than failing
    old = {k: v for k, v in scores.meta.items() if k != "search_mode"}
    assert report_rows([old], reference, None)[0]["search"] is None
