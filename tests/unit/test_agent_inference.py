"""Inference-time tools: rollback cutting, code extraction, the helper LLM against a fake OpenAI server."""

from __future__ import annotations

import time

import pytest
from fastapi import FastAPI, Request

from stages.agent.inference_tools import (
    CodeDebugger,
    HelperLLM,
    Refiner,
    extract_code,
    rollback_cut,
    rollback_keep_tokens,
)
from stages.core.config.agent import InferenceToolsSection
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
    # the newline before <python> follows </think>: keep up to it, then drop that </think>
    ("<think>a\nb </think>\n<python>x</python>", "<think>a\nb "),
    ("<think>t</think> <search>q</search> <result>\nr\n</result>\nthen <python>1/0</python>",
     "<think>t</think> <search>q</search> <result>\nr\n</result>\n"),
    ("<python>x", ""),  # nothing before it
    ("no code here", None),
    # two python calls: roll back the last one only
    ("<python>1</python> <result>\n1\n</result>\nok\n<python>1/0", "<python>1</python> <result>\n1\n</result>\nok\n"),
])
def test_rollback_cut(text, expected):
    assert rollback_cut(text) == expected


def test_rollback_keep_tokens():
    pieces = ["<think>", "a", "\n", "b", " </think>", "\n", "<python>"]
    text = "".join(pieces)
    cut = rollback_cut(text)  # "<think>a\nb "
    # cumulative lengths 7, 8, 9, 10, 19: len(cut) = 11 -> the first 4 tokens fit ("<think>a\nb" = 10 chars)
    assert rollback_keep_tokens(pieces, len(cut)) == 4
    assert rollback_keep_tokens(pieces, 0) == 0 and rollback_keep_tokens(pieces, 10_000) == len(pieces)


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
