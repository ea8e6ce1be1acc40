"""ToolBox: limits, repeats, the shared cache, concurrency, metrics, the debugger path."""

from __future__ import annotations

import asyncio
import json

import pytest

from stages.agent.protocol import (
    LIMIT_MESSAGES,
    REPEAT_MESSAGE,
    ToolCall,
    parse_tool_call,
    render_result,
)
from stages.agent.toolbox import MISS_MESSAGE, CallState, ToolBox
from stages.core.config.agent import AgentSection
from tests.unit.agent_support import require_bwrap
from tests.unit.test_agent_inference import fake_openai
from tests.unit.test_agent_search import DOCS, serve_in_thread

PYTHON = {"preload": [], "timeout_s": 10.0, "cpu_s": 5, "memory_mb": 256}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    return path


def _config(**overrides) -> AgentSection:
    data = {"python": PYTHON, "limits": {"max_calls": 4, "max_python": 2}, "search": {"top_k": 2}}
    data.update(overrides)
    return AgentSection.model_validate(data)


@pytest.fixture(scope="module")
def box(corpus, tmp_path_factory):
    with ToolBox.from_config(_config(), str(corpus), str(tmp_path_factory.mktemp("cache"))) as toolbox:
        yield toolbox


def test_search_and_python_round_trip(box):
    state = box.new_state()
    call = parse_tool_call("<think>look it up</think> <search> capital of France")
    result = box.execute(call, state)
    # BM25 over DOCS: paris then berlin (top_k 2), each rendered on one 'Page i:' line
    assert result.ok and result.text == ("Page 1: Paris Paris is the capital and largest city of France.\n"
                                         "Page 2: Berlin Berlin is the capital of Germany.")
    assert result.meta["ids"] == ["paris", "berlin"]
    assert render_result(result.text).startswith(" <result>\nPage 1: Paris")
    code = box.execute(ToolCall("python", "sum(range(10))"), state)
    assert code.ok and code.text == "45" and code.meta["sandbox"] in ("bwrap", "rlimit")
    assert state.counts == {"search": 1, "python": 1} and state.total == 2


def test_limits_and_repeats(box):
    state = box.new_state()
    first = box.execute(ToolCall("search", "Westfield founder"), state)
    again = box.execute(ToolCall("search", 'search query: "Westfield  founder"'), state)
    assert first.ok and not again.ok and again.text == REPEAT_MESSAGE and again.meta["rejected"] == "repeated"
    assert box.execute(ToolCall("python", "1"), state).ok
    assert box.execute(ToolCall("python", "2"), state).ok
    over_python = box.execute(ToolCall("python", "3"), state)  # max_python = 2
    assert over_python.text == LIMIT_MESSAGES["python"] and over_python.meta["rejected"] == "limit:python"
    over_total = box.execute(ToolCall("search", "mammal"), state)  # 4 calls counted: max_calls = 4
    assert over_total.text == LIMIT_MESSAGES["total"]
    assert (state.total, state.rejected) == (4, 2)
    empty = box.execute(ToolCall("search", "  "), box.new_state())
    assert not empty.ok and "empty" in empty.text


def test_branch_copy_is_independent():
    state = CallState(counts={"search": 1}, total=1, seen_queries={"q"})
    branch = state.copy()
    branch.counts["search"] += 1
    branch.seen_queries.add("other")
    assert state.counts == {"search": 1} and state.seen_queries == {"q"}


def test_cache_shared_between_toolboxes(corpus, tmp_path):
    cfg = _config(python={**PYTHON, "seed": 0}, cache={"tools": ["search", "python"]})  # python: only when seeded
    with ToolBox.from_config(cfg, str(corpus), str(tmp_path)) as first:
        assert not first.execute(ToolCall("search", "domestic cat"), first.new_state()).cached
        assert not first.execute(ToolCall("python", "print(6 * 7)"), first.new_state()).cached
    with ToolBox.from_config(cfg, str(corpus), str(tmp_path)) as second:
        search = second.execute(ToolCall("search", "domestic cat"), second.new_state())
        code = second.execute(ToolCall("python", "print(6 * 7)"), second.new_state())
        failing = second.execute(ToolCall("python", "1/0"), second.new_state())
        assert search.cached and code.cached and code.text == "42" and not failing.cached
        metrics = second.metrics()
        # two hits, one miss (1/0 was never stored: failures are not cached)
        assert (metrics["cache_hits"], metrics["cache_misses"]) == (2.0, 1.0)
        assert (metrics["calls"], metrics["errors"], metrics["python_calls"]) == (3.0, 1.0, 2.0)


def test_python_not_cached_by_default(corpus, tmp_path):
    # RL and sampled evaluation: random draws must differ between trajectories, so python results are not replayed
    code = ToolCall("python", "import random\nprint(random.random())")
    with ToolBox.from_config(_config(), str(corpus), str(tmp_path)) as box:
        first, second = box.execute(code, box.new_state()), box.execute(code, box.new_state())
        search = [box.execute(ToolCall("search", "Westfield"), box.new_state()).cached for _ in range(2)]
    assert not first.cached and not second.cached and first.text != second.text
    assert search == [False, True]  # search stays cached


def test_python_cache_key_includes_the_isolation(corpus, tmp_path):
    """A result computed under rlimit (which can read what bwrap hides) is never served to a bwrap toolbox."""
    require_bwrap()
    shared = {"tools": ["search", "python"], "path": str(tmp_path / "tools.sqlite")}
    code = ToolCall("python", "print(40 + 2)")
    loose_cfg = _config(python={**PYTHON, "seed": 0, "sandbox": "rlimit"}, cache=shared)
    strict_cfg = _config(python={**PYTHON, "seed": 0, "sandbox": "bwrap"}, cache=shared)
    with ToolBox.from_config(loose_cfg, str(corpus), str(tmp_path), tools=("python",)) as loose:
        assert not loose.execute(code, loose.new_state()).cached
        assert loose.execute(code, loose.new_state()).cached
    with ToolBox.from_config(strict_cfg, str(corpus), str(tmp_path), tools=("python",)) as strict:
        result = strict.execute(code, strict.new_state())
        assert not result.cached and result.meta["sandbox"] == "bwrap" and result.text == "42"
    limits_cfg = _config(python={**PYTHON, "seed": 0, "sandbox": "rlimit", "memory_mb": 300}, cache=shared)
    with ToolBox.from_config(limits_cfg, str(corpus), str(tmp_path), tools=("python",)) as other_limits:
        assert not other_limits.execute(code, other_limits.new_state()).cached


def test_execute_many_keeps_order_and_counts(box):
    shared = box.new_state()
    items = [(ToolCall("python", f"print({i} * {i})"), box.new_state()) for i in range(4)]
    items += [(ToolCall("search", "capital"), shared), (ToolCall("search", "capital"), shared)]
    results = box.execute_many(items)
    assert [r.text for r in results[:4]] == ["0", "1", "4", "9"]
    # the same query twice on one shared trajectory state: exactly one runs, the other is a repeat
    assert sorted(r.meta.get("rejected", "ran") for r in results[4:]) == ["ran", "repeated"]
    assert shared.total == 2


def test_aexecute(box):
    result = asyncio.run(box.aexecute(ToolCall("python", "print('async')"), box.new_state()))
    assert result.ok and result.text == "async"


def test_unavailable_tool_and_template(corpus, tmp_path):
    with ToolBox.from_config(_config(prompt_template="tir_search"), str(corpus), str(tmp_path)) as search_only:
        assert search_only.tools == ("search",)
        result = search_only.execute(ToolCall("python", "1"), search_only.new_state())
        assert not result.ok and result.meta["rejected"] == "unavailable" and "not available" in result.text


def test_replay_miss_is_reported(shared_data, tmp_path):
    cfg = _config(prompt_template="tir_search",
                  search={"backend": "replay", "replay_path": str(shared_data / "search_cache.json")})
    with ToolBox.from_config(cfg, None, str(tmp_path)) as replay:
        miss = replay.execute(ToolCall("search", "never recorded query 98765"), replay.new_state())
        assert not miss.ok and miss.text == MISS_MESSAGE and miss.meta["miss"]
        assert replay.metrics()["search_misses"] == 1.0


def test_debugger_fixes_failing_code(corpus, tmp_path):
    log: list = []
    with serve_in_thread(fake_openai(lambda p: "```python\nprint(7 // 2)\n```", log)) as url:
        cfg = _config(inference={"debugger": True, "llm_url": f"{url}/v1", "llm_model": "helper"})
        # a training toolbox (RL rollouts, DPO self-samples) has no debugger, as Tool-Star's RL rollouts have none
        with ToolBox.from_config(cfg, str(corpus), str(tmp_path)) as training_box:
            plain = training_box.execute(ToolCall("python", "print(7 / undefined)"), training_box.new_state())
            assert not plain.ok and "debug_attempted" not in plain.meta and log == []
        with ToolBox.from_config(cfg, str(corpus), str(tmp_path), inference_tools=True) as debug_box:
            state = debug_box.new_state()
            fixed = debug_box.execute(ToolCall("python", "print(7 / undefined)"), state)
            assert fixed.ok and fixed.text == "3" and fixed.meta["debugged"] and state.scratch["python_debug"] == 1
            assert fixed.meta["debug_attempted"]  # the text loop counts it (and does not roll it back)
            # max_debug = 1: the second failure of this trajectory is returned as is
            second = debug_box.execute(ToolCall("python", "1/0"), state)
            assert not second.ok and "ZeroDivisionError" in second.text and len(log) == 1
            assert "debug_attempted" not in second.meta


def test_a_new_tool_is_one_registered_class(tmp_path):
    from stages.agent.prompt_templates import template_tools
    from stages.agent.protocol import check_format, count_tool_calls
    from stages.agent.tools import TOOLS, Tool, ToolOutput, register_tool

    @register_tool("echo")
    class Echo(Tool):
        argument = "text"

        def run(self, argument, state):
            return ToolOutput(argument.upper(), True, {})

    try:
        cfg = AgentSection.model_validate({"limits": {"max_calls": 1}, "cache": {"tools": ["echo"]}})
        with ToolBox.from_config(cfg, None, str(tmp_path), tools=("echo",)) as echo_box:
            state = echo_box.new_state()
            call = parse_tool_call("<think>t</think><echo> hi </echo>")
            assert call == ToolCall("echo", "hi")  # the protocol reads the new tag from the registry
            assert echo_box.execute(call, state).text == "HI"
            again = echo_box.execute(call, echo_box.new_state())
            assert again.cached and again.text == "HI"  # cached: it is in agent.cache.tools
            # messages follow from the class: one call allowed in total, an empty one is named by its argument
            assert echo_box.execute(call, state).text == LIMIT_MESSAGES["total"]
            assert echo_box.execute(ToolCall("echo", " "), echo_box.new_state()).text == \
                "The echo text is empty. Write the text between <echo> and </echo>."
            assert echo_box.metrics()["echo_calls"] == 2.0  # the run and the cache hit; rejections count apart
        text = "<think>a</think><echo>x</echo> <result>\nX\n</result><think>b</think><answer>\\boxed{X}</answer>"
        assert count_tool_calls(text)["echo"] == 1 and check_format(text).ok
        assert "echo" not in template_tools("tir_search_python")  # offered only by a template that shows <echo>
    finally:
        TOOLS._entries.pop("echo")


def test_each_capped_tool_is_named_once_in_the_limits() -> None:
    from stages.core.config.agent import ToolLimitsSection

    limits = ToolLimitsSection(max_python=2, max_search=1)
    # by hand: the two capped tools read their own keys; any other tool has only the total
    assert (limits.per_tool("python"), limits.per_tool("search"), limits.per_tool("browse")) == (2, 1, None)
