"""LLM judge: the reference's parse rule, and the openai client against a real OpenAI-compatible fake server
on loopback (FastAPI + uvicorn in a thread): verdicts, retries with backoff, failure fallback, verdict cache."""

from __future__ import annotations

import ast
import re
import socket
import threading
import time

import pytest

from stages.core.config.eval import JudgeSection
from stages.core.refs import EndpointRef
from stages.eval.judge import PROMPT_HASH, Judge, JudgeRequest, VerdictCache, format_prompt, reply_says_correct


class FakeJudgeServer:
    """A small OpenAI-compatible chat server: says "Correct" when the predicted answer contains a golden answer.

    `fail_first` requests get HTTP 503 (to exercise retries); `requests` counts every chat call received;
    `latency_s` makes each answer take that long (a stand-in for a real judge, used by bench/); `answer_model` is
    the `model` its responses name (default: the one asked for), as an API names the revision behind an alias.
    """

    def __init__(self, fail_first: int = 0, reply_template: str = "<judgment>{verdict}</judgment>",
                 latency_s: float = 0.0, answer_model: str | None = None) -> None:
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse

        self.fail_first = fail_first
        self.requests: list[dict] = []
        app = FastAPI()

        @app.get("/v1/models")
        def models() -> dict:
            return {"object": "list", "data": [{"id": "fake-judge", "object": "model", "owned_by": "test"}]}

        @app.post("/v1/chat/completions")
        def chat(body: dict):
            self.requests.append(body)
            if len(self.requests) <= self.fail_first:
                return JSONResponse({"error": {"message": "overloaded", "type": "server_error"}}, status_code=503)
            time.sleep(latency_s)  # a sync handler: FastAPI runs it in its thread pool, so calls overlap
            prompt = body["messages"][-1]["content"]
            gold = re.search(r"Golden Answer: (.*)\n", prompt).group(1)
            pred = re.search(r"Predicted Answer: (.*)$", prompt, re.S).group(1)
            golds = ast.literal_eval(gold) if gold.startswith("[") else [gold]  # our own repr of a list
            verdict = "Correct" if any(g.lower() in pred.lower() for g in golds) else "Incorrect"
            return {"id": f"chat-{len(self.requests)}", "object": "chat.completion", "created": int(time.time()),
                    "model": answer_model or body["model"], "choices": [{"index": 0, "finish_reason": "stop", "message": {
                        "role": "assistant", "content": reply_template.format(verdict=verdict)}}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

        import uvicorn

        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def endpoint(self, model: str = "fake-judge", fingerprint: str = "w1") -> EndpointRef:
        return EndpointRef(url=self.url, model=model, model_fingerprint=fingerprint)

    def __enter__(self) -> FakeJudgeServer:
        self._thread.start()
        deadline = time.time() + 30
        while not self._server.started:
            if time.time() > deadline:
                raise RuntimeError("fake judge server did not start in 30 s")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()


@pytest.mark.parametrize("reply, expected", [
    ("Correct", True),
    ("Incorrect", False),
    ("The prediction is correct.", True),
    ("CORRECT", True),
    ("<judgment>Correct</judgment>", True),
    ("<judgment>Incorrect</judgment>", False),
    ("This is not correct.", False),
    ("The predicted answer is wrong.", False),
    ("Correct, nothing wrong with it.", False),  # the reference rule: any negation word vetoes
    ("<judgment>Correct</judgment> (I first thought it incorrect)", True),  # the span decides when present
    ("<think>Is it incorrect? No, it matches.</think>\nCorrect", True),  # a thinking judge's musings are dropped
    ("<think>unfinished reasoning that says correct", False),  # an unclosed think block is all musing
    ("", False),
])
def test_reference_reply_forms(reply, expected):
    assert reply_says_correct(reply) is expected


def test_prompt_and_identity():
    prompt = format_prompt("Who?", ("Frank Lowy",), "Frank Lowy")
    assert prompt.endswith("Question: Who?\nGolden Answer: Frank Lowy\nPredicted Answer: Frank Lowy")
    assert "Golden Answer: ['NYC', 'New York']\n" in format_prompt("Where?", ("NYC", "New York"), "NYC")
    a = EndpointRef(url="http://127.0.0.1:8001/v1", model="judge", model_fingerprint="abc")
    b = EndpointRef(url="http://127.0.0.1:9999/v1", model="judge", model_fingerprint="abc")
    assert a.identity == b.identity == "judge@abc"  # the port is not part of what the judge is


def test_cache_key_covers_every_part(tmp_path):
    request = JudgeRequest("q", ("g",), "p")
    base = VerdictCache.key(request, "judge@w1")
    assert VerdictCache.key(request, "judge@w2") != base
    assert VerdictCache.key(request, "judge@w1", prompt_hash="other") != base
    assert VerdictCache.key(JudgeRequest("q", ("g",), "p2"), "judge@w1") != base
    assert VerdictCache.key(JudgeRequest("q", ("g", "h"), "p"), "judge@w1") != base
    assert len(PROMPT_HASH) == 16


def test_judge_against_a_loopback_server_then_cache(tmp_path):
    cfg = JudgeSection(concurrency=2)
    requests = [JudgeRequest("Who presented the bid?", ("Frank Lowy",), "It was Frank Lowy."),
                JudgeRequest("Where?", ("NYC", "New York"), "Boston"),
                JudgeRequest("Where?", ("NYC", "New York"), "new york")]
    with FakeJudgeServer() as server:
        judge = Judge(server.endpoint(), cfg, tmp_path / "judge.sqlite")
        verdicts = judge.judge_many(requests)
        assert [v.says_correct for v in verdicts] == [True, False, True]
        assert [v.cached for v in verdicts] == [False, False, False]
        assert verdicts[0].reply == "<judgment>Correct</judgment>"
        assert len(server.requests) == 3 and judge.calls == 3
        assert server.requests[0]["temperature"] == 0.0 and server.requests[0]["max_tokens"] == 256
        assert len(judge.cache) == 3
        judge.cache.close()

        again = Judge(server.endpoint(), cfg, tmp_path / "judge.sqlite")
        assert [v.says_correct for v in again.judge_many(requests)] == [True, False, True]
        assert len(server.requests) == 3 and again.calls == 0  # all from the cache
        again.cache.close()

        other_model = Judge(server.endpoint(fingerprint="w2"), cfg, tmp_path / "judge.sqlite")
        other_model.judge_many(requests[:1])
        assert len(server.requests) == 4  # new weights, new verdict
        other_model.cache.close()


def test_each_verdict_keeps_the_model_id_that_answered_cached_too(tmp_path):
    from stages.eval.provenance import judge_record

    requests = [JudgeRequest("q", ("42",), "42"), JudgeRequest("q", ("42",), "41")]
    with FakeJudgeServer(answer_model="judge-2024-08-06") as server:  # asked for "fake-judge", answered as this
        judge = Judge(server.endpoint(), JudgeSection(), tmp_path / "judge.sqlite")
        fresh = judge.judge_many(requests)
        judge.cache.close()
        again = Judge(server.endpoint(), JudgeSection(), tmp_path / "judge.sqlite")
        cached = again.judge_many(requests)
        again.cache.close()
    assert [(v.model, v.cached) for v in fresh] == [("judge-2024-08-06", False)] * 2
    assert [(v.model, v.cached) for v in cached] == [("judge-2024-08-06", True)] * 2
    endpoint = server.endpoint().model_copy(update={"meta": {"backend": "external"}})
    # two answered verdicts and one cached before the id was kept (None)
    assert judge_record(endpoint, [v.model for v in fresh] + [None]) == {
        "name": "fake-judge", "path": None, "fingerprint": "w1", "backend": "external", "shared_with": None,
        "answered_as": {"judge-2024-08-06": 2, "not recorded": 1}}
    assert judge_record(None, []) is None


def test_judge_retries_then_succeeds(tmp_path):
    cfg = JudgeSection(concurrency=1, max_retries=3, retry_backoff_s=0.01)
    with FakeJudgeServer(fail_first=2) as server:
        judge = Judge(server.endpoint(), cfg, tmp_path / "judge.sqlite")
        [verdict] = judge.judge_many([JudgeRequest("q", ("42",), "42")])
        judge.cache.close()
    # two 503s, then the third attempt answers
    assert verdict.says_correct is True and verdict.error is None and judge.calls == 3 and len(server.requests) == 3


def test_judge_that_keeps_failing_falls_back_and_caches_nothing(tmp_path):
    cfg = JudgeSection(concurrency=1, max_retries=2, retry_backoff_s=0.01)
    with FakeJudgeServer(fail_first=100) as server:
        judge = Judge(server.endpoint(), cfg, tmp_path / "judge.sqlite")
        [verdict] = judge.judge_many([JudgeRequest("q", ("42",), "42")])
        assert verdict.says_correct is None and "InternalServerError" in verdict.error
        assert len(server.requests) == 2 and len(judge.cache) == 0
        judge.cache.close()


def test_judge_many_works_inside_a_running_event_loop(tmp_path):
    import asyncio

    with FakeJudgeServer() as server:
        judge = Judge(server.endpoint(), JudgeSection(), tmp_path / "judge.sqlite")

        async def inside() -> list:
            return judge.judge_many([JudgeRequest("q", ("7",), "7")])

        [verdict] = asyncio.run(inside())
        judge.cache.close()
    assert verdict.says_correct is True
