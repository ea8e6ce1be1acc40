"""Whose failure is it: every failed tool result says `model` or `infra`, and an infra failure is never cached.

Real HTTP throughout: a retrieval server answering 503 / 429 (tests/unit/outage_support.py), a SERP endpoint
answering 503, a port nobody listens on; a real sandbox that cannot start in its start-up time."""

from __future__ import annotations

import json

import pytest

from stages.agent.protocol import ToolCall
from stages.agent.sandbox.executor import PythonSandbox
from stages.agent.search import SearchError
from stages.agent.search.local import BM25Backend
from stages.agent.search.server import ATTEMPTS, ServerBackend
from stages.agent.search.web import WebBackend
from stages.agent.toolbox import ToolBox
from stages.agent.tools import INFRA, MODEL, TOOLS, Tool, ToolOutput, register_tool
from stages.core.config.agent import AgentSection, PythonToolSection, WebSearchSection
from tests.unit.outage_support import FlakyProvider
from tests.unit.test_agent_search import DOCS, _fake_brightdata, serve_in_thread

SANDBOX = {"sandbox": "rlimit", "preload": [], "timeout_s": 2.0, "cpu_s": 2, "memory_mb": 256}


@pytest.fixture(scope="module")
def bm25(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    (folder / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    return BM25Backend(folder / "corpus.jsonl", folder / "cache")


def _server_box(url: str, cache_root, **python) -> ToolBox:
    cfg = AgentSection.model_validate({"search": {"backend": "server", "server_url": url, "top_k": 1},
                                       "python": {**SANDBOX, **python}, "limits": {"max_calls": 8}})
    return ToolBox.from_config(cfg, None, str(cache_root))


def test_provider_503_and_429_after_retries_are_infra_and_never_cached(bm25, tmp_path):
    provider = FlakyProvider(bm25, cycle=(503, 200, 429))
    with serve_in_thread(provider.app()) as url, _server_box(url, tmp_path) as box:
        first = box.execute(ToolCall("search", "capital of France"), box.new_state())     # 503 every time
        ok = box.execute(ToolCall("search", "Westfield founder"), box.new_state())        # answers
        limited = box.execute(ToolCall("search", "domestic cat"), box.new_state())        # 429 every time
        assert (first.ok, first.fault, first.infra) == (False, INFRA, True)
        assert "failed after 3 attempts" in first.meta["error"] and "HTTP 503" in first.meta["error"]
        assert limited.fault == INFRA and "HTTP 429" in limited.meta["error"]
        assert ok.ok and ok.fault is None and "Westfield" in ok.text
        # each failing call was retried: ATTEMPTS requests for it; the answered one took one
        assert [s for q, s in provider.requests if q == "capital of France"] == [503] * ATTEMPTS
        assert [s for q, s in provider.requests if q == "domestic cat"] == [429] * ATTEMPTS
        # the failure was not cached: once the outage is over the same query reaches the provider and answers
        provider.healthy = True
        again = box.execute(ToolCall("search", "capital of France"), box.new_state())
        assert again.ok and not again.cached and "Paris" in again.text
        assert box.execute(ToolCall("search", "capital of France"), box.new_state()).cached   # success is cached
        metrics = box.metrics()
        assert metrics["infra_failures"] == 2.0 and metrics["search_infra_failures"] == 2.0


def test_a_server_that_goes_away_is_infra(bm25, tmp_path):
    provider = FlakyProvider(bm25)
    provider.healthy = True
    with serve_in_thread(provider.app()) as url:
        box = _server_box(url, tmp_path)        # healthy at start-up
    try:                                        # ... and gone for the call
        down = box.execute(ToolCall("search", "Berlin"), box.new_state())
        assert down.fault == INFRA and "not reachable" in down.meta["error"]
    finally:
        box.close()


def test_web_provider_5xx_after_retries_is_a_search_error(monkeypatch):
    log: list = []
    with serve_in_thread(_fake_brightdata(log, fail_first=10)) as url:   # 429 on every attempt
        cfg = WebSearchSection(endpoint=f"{url}/request", requests_per_second=100, retries=2)
        monkeypatch.setenv(cfg.api_key_env, "good-key")
        with pytest.raises(SearchError, match="failed after 2 attempts"):
            WebBackend(cfg).search("anything", 2)
        assert len(log) == 2


def test_model_errors_are_the_models(bm25, tmp_path):
    provider = FlakyProvider(bm25)
    provider.healthy = True
    with serve_in_thread(provider.app()) as url, _server_box(url, tmp_path) as box:
        state = box.new_state()
        empty = box.execute(ToolCall("search", "  "), state)
        error = box.execute(ToolCall("python", "1/0"), state)
        slow = box.execute(ToolCall("python", "import time\ntime.sleep(30)"), state)
        assert (empty.fault, error.fault, slow.fault) == (MODEL, MODEL, MODEL)
        assert "ZeroDivisionError" in error.text and slow.meta["status"] == "timeout"   # its own time limit
        assert box.metrics()["infra_failures"] == 0.0


def test_a_sandbox_that_cannot_start_is_infra(tmp_path):
    # 1 ms to start an interpreter: the warm parent never reports ready, every call fails before any code runs
    with PythonSandbox(PythonToolSection(**SANDBOX, startup_timeout_s=0.001)) as sandbox:
        result = sandbox.run("print(1)")
    assert (result.status, result.infra, result.ok) == ("start_failed", True, False)
    assert "failed to start" in result.stderr
    with PythonSandbox(PythonToolSection(**SANDBOX)) as sandbox:
        crashed = sandbox.run("raise SystemExit(3)")
    assert (crashed.status, crashed.infra) == ("error", False)   # its own exit: the code's


def test_a_tool_bug_is_not_the_models_fault(tmp_path):
    @register_tool("broken")
    class Broken(Tool):
        def run(self, argument, state):
            raise RuntimeError("bug in our tool")

    try:
        cfg = AgentSection.model_validate({"limits": {"max_calls": 2}, "cache": {"tools": ["broken"]}})
        with ToolBox.from_config(cfg, None, str(tmp_path), tools=("broken",)) as box:
            result = box.execute(ToolCall("broken", "x"), box.new_state())
            assert result.fault == INFRA and result.meta["internal_error"] and box.metrics()["infra_failures"] == 1
    finally:
        TOOLS._entries.pop("broken", None)
    assert ToolOutput("x", False).fault == MODEL          # a failure a tool does not attribute is the model's
    with pytest.raises(ValueError, match="no fault"):
        ToolOutput("x", True, {}, INFRA)


def test_a_failing_start_is_loud_in_the_server_client():
    with pytest.raises(SearchError, match="arpo retriever serve"):
        ServerBackend("http://127.0.0.1:9", timeout_s=1)
