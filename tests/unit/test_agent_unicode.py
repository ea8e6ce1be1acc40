"""Any text a model can emit comes back as a tool result or a tool error, never an exception (property-style:
seeded arbitrary Unicode, lone surrogates included, through every tool and every search backend)."""

from __future__ import annotations

import json

import pytest

from stages.agent.cache import ToolCache
from stages.agent.protocol import ToolCall
from stages.agent.sandbox.executor import PythonSandbox
from stages.agent.search import build_search
from stages.agent.search.replay import ReplayBackend
from stages.agent.search.server import ServerBackend
from stages.agent.search.web import WebBackend
from stages.agent.toolbox import ToolBox, valid_text
from stages.agent.tools import SearchTool, ToolEnv
from stages.core.config.agent import AgentSection, PythonToolSection, WebSearchSection
from tests.unit.agent_support import arbitrary_texts, require_bwrap
from tests.unit.test_agent_search import DOCS, _fake_brightdata, serve_in_thread
from tests.unit.test_agent_toolbox import PYTHON

STATUSES = {"ok", "error", "timeout", "cpu_limit", "killed", "refused"}


def _check(result, text: str) -> None:
    """The property: a ToolResult whose text is valid UTF-8 (it goes into the model's context and JSON)."""
    assert isinstance(result.ok, bool), text
    result.text.encode("utf-8")  # raises on a lone surrogate
    json.dumps(result.meta, ensure_ascii=False).encode("utf-8")
    if not result.ok:
        assert result.text, f"a failed call must say why: {text!r}"


def test_valid_text_replaces_only_lone_surrogates():
    assert valid_text("a\ud800b\udfff") == "a\ufffdb\ufffd"
    assert valid_text("🙂 日本 \x00") == "🙂 日本 \x00"  # astral characters are not surrogates in Python str


def test_cache_round_trips_any_text(tmp_path):
    with ToolCache(tmp_path / "c.sqlite") as cache:
        for i, text in enumerate(arbitrary_texts(seed=1, count=300)):
            cache.put("search", "v", text, f"b{i}", {"text": text, "meta": {"q": text}})
            assert cache.get("search", "v", text, f"b{i}") == {"text": text, "meta": {"q": text}}, repr(text)
        assert len(cache) == 300


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    return path


def _search_backend(kind, corpus, tmp_path, monkeypatch, stack):
    if kind == "local":
        return build_search(AgentSection().search, str(corpus), str(tmp_path))
    if kind == "replay":
        replay = tmp_path / "replay.json"
        replay.write_text(json.dumps({"capital of France": "Page 1: Paris"}))
        return ReplayBackend(replay)
    if kind == "server":
        from stages.agent.retriever_server import build_app

        local = build_search(AgentSection().search, str(corpus), str(tmp_path))
        return ServerBackend(stack.enter_context(serve_in_thread(build_app(local))))
    url = stack.enter_context(serve_in_thread(_fake_brightdata([])))
    monkeypatch.setenv("BRIGHTDATA_API_KEY", "good-key")
    return WebBackend(WebSearchSection(endpoint=f"{url}/request", requests_per_second=1000, retries=1))


@pytest.mark.parametrize("kind", ["local", "replay", "server", "web"])
def test_search_backends_never_raise(kind, corpus, tmp_path, monkeypatch):
    from contextlib import ExitStack

    with ExitStack() as stack:
        search = _search_backend(kind, corpus, tmp_path, monkeypatch, stack)
        cfg = AgentSection.model_validate({"limits": {"max_calls": 10_000, "reject_repeated_queries": False}})
        box = ToolBox(cfg, {"search": SearchTool(cfg, ToolEnv(), backend=search)}, ToolCache(tmp_path / "tools.sqlite"))
        stack.callback(box.close)
        state = box.new_state()
        count = 200 if kind in ("local", "replay") else 60
        for text in arbitrary_texts(seed=2, count=count):
            _check(box.execute(ToolCall("search", text), state), text)
        _check(box.execute(ToolCall("search", "\ud800 capital of France"), state), "surrogate + query")
        assert box.metrics()["internal_errors"] == 0.0


def test_python_tool_never_raises(corpus, tmp_path):
    require_bwrap()
    cfg = AgentSection.model_validate({"python": {**PYTHON, "seed": 0}, "cache": {"tools": ["search", "python"]},
                                       "limits": {"max_calls": 10_000}})
    with ToolBox.from_config(cfg, str(corpus), str(tmp_path), tools=("python",)) as box:
        texts = arbitrary_texts(seed=3, count=40) + ['print("\ud800")', "x = '\udfff'\nx", "# \ud800\nprint(7)"]
        for text in texts:
            first = box.execute(ToolCall("python", text), box.new_state())
            again = box.execute(ToolCall("python", text), box.new_state())  # through the cache when it succeeded
            _check(first, text)
            _check(again, text)
            assert again.text == first.text, repr(text)
        surrogate = box.execute(ToolCall("python", 'print("\ud800")'), box.new_state())
        assert surrogate.ok and surrogate.text == "\ufffd"  # the lone surrogate became U+FFFD before running
        assert box.execute(ToolCall("python", "# \ud800\nprint(7)"), box.new_state()).text == "7"
        assert box.metrics()["internal_errors"] == 0.0


@pytest.mark.parametrize("mode", ["bwrap", "rlimit"])
def test_sandbox_runs_any_text(mode):
    """Below the ToolBox (no U+FFFD replacement): the sandbox itself reports, never raises."""
    if mode == "bwrap":
        require_bwrap()
    with PythonSandbox(PythonToolSection(sandbox=mode, **{**PYTHON, "timeout_s": 5.0})) as box:
        for text in arbitrary_texts(seed=4, count=25) + ['print("\ud800")', "\ud800"]:
            result = box.run(text)
            assert result.status in STATUSES, (text, result)
            result.text.encode("utf-8")
        assert box.run('print("\ud800")').status == "error"  # not encodable: a traceback, not a crash
