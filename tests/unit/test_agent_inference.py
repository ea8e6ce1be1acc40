"""Inference-time tools: rollback cutting (Tool-Star's rule), rollback and refiner in the text loop, code
extraction, the helper LLM against a fake OpenAI server."""

from __future__ import annotations

import asyncio
import time

import pytest
from fastapi import FastAPI, Request

from stages.agent.inference_tools import (
    CodeDebugger,
    HelperLLM,
    LoopAids,
    Refiner,
    extract_code,
    rollback_cut,
)
from stages.agent.loop import LoopRules, TextBudget, TextLoopState, TextSegment, run_text_loop
from stages.agent.protocol import ANSWER_STOP
from stages.agent.toolbox import ToolResult
from stages.core.config.agent import InferenceToolsSection
from stages.eval.agent_loop import EVAL_STOPS
from tests.unit.test_agent_search import serve_in_thread


def fake_openai(reply_for, log: list) -> FastAPI:
    """An OpenAI-compatible chat endpoint whose reply is `reply_for(prompt)`; requests are appended to `log`."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(req: Request):
        body = await req.json()
        log.append(body)
        content = reply_for(body["messages"][-1]["content"])
        return {"id": "chatcmpl-1", "object": "chat.completion", "created": int(time.time()), "model": body["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                             "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

    return app


@pytest.mark.parametrize("text, expected", [
    # Tool-Star's rule: back over "\n", "</think>" and " " to "b"; keep up to the newline before that line
    ("<think>a\nb </think>\n<python>x</python>", "<think>a\n"),
    ("<think>t</think> <search>q</search> <result>\nr\n</result>\nthen <python>1/0</python>",
     "<think>t</think> <search>q</search> <result>\nr\n</result>\n"),
    ("<python>x", ""),  # nothing before it
    ("one line, then <python>x", ""),  # no newline before it: the whole output is regenerated
    ("no code here", None),
    # two python calls: roll back the last one only, with the line that announced it
    ("<python>1</python> <result>\n1\n</result>\nok\n<python>1/0", "<python>1</python> <result>\n1\n</result>\n"),
    # Tool-Star's own example shape (rollback_code.py __main__): "...values.\n </think><python>" cuts the
    # "We will use Python..." line too
    ("<think> x = 1.\n\nWe will use Python.\n </think><python>\nprint(x)\n</python>", "<think> x = 1.\n\n"),
])
def test_rollback_cut(text, expected):
    assert rollback_cut(text) == expected


class PythonBox:
    """python: code containing '1/0' fails (with `meta` on the failure), anything else prints 2."""

    def __init__(self, meta: dict | None = None) -> None:
        self.meta, self.calls = meta or {}, []

    def new_state(self):
        return None

    async def aexecute(self, call, state):
        self.calls.append(call.argument)
        failed = "1/0" in call.argument
        return ToolResult(call.tool, "ZeroDivisionError" if failed else "2", not failed, 0.0, False,
                          dict(self.meta) if failed else {})


EVAL = LoopRules(stops=EVAL_STOPS, call_limit=None, empty_call="ask")  # the evaluation's rules


def scripted(replies):
    async def generate(output, max_tokens, call):
        text = replies(output)
        stop = next((s for s in ("</python>", ANSWER_STOP) if text.endswith(s)), None)
        return TextSegment(text, "stop" if stop else "eos", stop, len(text.split()))
    return generate


def policy(output: str) -> str:
    """Writes failing code first; after a rollback (the plan line gone) writes working code, then answers."""
    if "<result>" in output:
        return "<answer>2</answer>"
    if output.endswith("plan\n"):
        return "<python>print(2)</python>"
    return "<think>plan\nuse code </think>\n<python>1/0</python>"


def aids(**kw) -> LoopAids:
    return LoopAids(InferenceToolsSection(**kw), None, lambda text: len(text.split()), "prompt", "q")


def test_rollback_cuts_the_failed_step_and_regenerates():
    state, box = TextLoopState(), PythonBox()
    asyncio.run(run_text_loop(scripted(policy), box, EVAL, TextBudget(50, 500, 10), state,
                              aids(rollback=True, max_rollback=1)))
    # the failing call ran, was cut back to "<think>plan\n" (its line and </think> dropped), never rendered
    assert box.calls == ["1/0", "print(2)"] and state.inference_tools == {"debug": 0, "rollback": 1, "refine": 0}
    assert state.output == "<think>plan\n<python>print(2)</python> <result>\n2\n</result><answer>2</answer>"
    assert state.tools_run["python"] == 2  # the failed call counts against the limits, as in Tool-Star


def test_rollback_budget_debugger_and_refused_calls():
    always_fail = lambda output: "<answer>x</answer>" if "<result>" in output else "a\n<python>1/0</python>"
    # max_rollback 2: two cuts, the third failure's error is appended
    state = TextLoopState()
    asyncio.run(run_text_loop(scripted(always_fail), PythonBox(), EVAL, TextBudget(50, 500, 10), state,
                              aids(rollback=True, max_rollback=2)))
    assert state.inference_tools["rollback"] == 2 and "ZeroDivisionError" in state.output
    # a call the debugger already tried is not rolled back (Tool-Star run.py 200-218); it counts as a debug use
    for meta, debug in (({"debug_attempted": True}, 1), ({"rejected": "limit"}, 0), ({"internal_error": 1}, 0)):
        state = TextLoopState()
        asyncio.run(run_text_loop(scripted(always_fail), PythonBox(meta), EVAL, TextBudget(50, 500, 10), state,
                                  aids(rollback=True, max_rollback=2)))
        assert state.inference_tools == {"debug": debug, "rollback": 0, "refine": 0}


def test_refiner_compresses_once_past_the_threshold():
    log: list = []
    with serve_in_thread(fake_openai(lambda prompt: "<think>short</think>\n", log)) as url:
        cfg = InferenceToolsSection(refiner=True, max_refine=1, refine_threshold_tokens=6, llm_url=f"{url}/v1",
                                    llm_model="helper")
        refiner = Refiner(HelperLLM.from_config(cfg), cfg.refine_threshold_tokens)
        loop_aids = LoopAids(cfg, refiner, lambda text: len(text.split()), "the prompt", "what is 1+1?")
        outputs = []

        async def writer(output: str, max_tokens: int, call: int) -> TextSegment:
            outputs.append(output)
            if call == 2:
                return TextSegment("<answer>2</answer>", "stop", ANSWER_STOP, 1)
            return TextSegment("<think>one two three four</think>\n", "length", None, 4)  # cut: the loop goes on

        state = TextLoopState()
        asyncio.run(run_text_loop(writer, PythonBox(), EVAL, TextBudget(50, 500, 10), state, loop_aids))
    # prompt 2 tokens + output 4 = 6 >= 6 before the second generation: compressed once; 2 + 6 = 8 before the
    # third, but max_refine = 1
    assert outputs[1] == "<think>short</think>" and state.inference_tools["refine"] == 1   # the reply, stripped
    assert len(log) == 1 and "what is 1+1?" in log[0]["messages"][0]["content"]
    assert state.output == "<think>short</think><think>one two three four</think>\n<answer>2</answer>"


def test_extract_code():
    assert extract_code("Here:\n```python\nprint(1)\n```\nand\n```py\nprint(2)\n```") == "print(2)"
    assert extract_code("  print(3)  ") == "print(3)"
    assert extract_code("") == ""


def test_debugger_and_refiner_against_fake_server():
    log: list = []

    def reply(prompt: str) -> str:
        if "failed" in prompt:
            return "Fixed:\n```python\nprint(10 // 2)\n```"
        return "<think>short</think>"

    with serve_in_thread(fake_openai(reply, log)) as url:
        cfg = InferenceToolsSection(llm_url=f"{url}/v1", llm_model="helper", max_tokens=64)
        llm = HelperLLM.from_config(cfg)
        debugger = CodeDebugger(llm)
        assert debugger.fix("print(10 / 0)", "ZeroDivisionError: division by zero") == "print(10 // 2)"
        assert "ZeroDivisionError" in log[-1]["messages"][0]["content"]
        assert log[-1]["model"] == "helper" and log[-1]["max_tokens"] == 64 and log[-1]["temperature"] == 0.0
        refiner = Refiner(llm, threshold_tokens=100)
        assert not refiner.needed(50, 49) and refiner.needed(50, 50)  # 99 < 100 <= 100
        assert refiner.refine("q", "<think>long long long</think>") == "<think>short</think>"


def test_helper_failures_fall_back():
    llm = HelperLLM("http://127.0.0.1:9/v1", "helper", timeout_s=1.0, max_retries=0)  # port 9: nothing listens
    assert CodeDebugger(llm).fix("x", "err") is None
    assert Refiner(llm, 10).refine("q", "original") == "original"
    with pytest.raises(ValueError, match="llm_url"):
        HelperLLM.from_config(InferenceToolsSection())
