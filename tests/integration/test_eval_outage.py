"""A search provider outage at evaluation, over real HTTP end to end: the inference task (Prefect, cached on its
stage key) asks a completions endpoint, runs each sample's search through a retrieval server that answers 503 / 429
for some queries, and finishes; scoring leaves those answers out and the report lists them; the next run, once the
provider is back, retries only those samples (the task runs again despite its cache entry) and the rest is kept.

The model is a scripted OpenAI-compatible completions server: the untrained 135M policy seldom writes a search call
at evaluation, and what is under test is what happens around the model (tools, rows, scoring, report, rerun). Each
sample writes `<search>{question}</search>`, then, after the result, `<answer>\\boxed{gold}</answer>`.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from prefect import flow

from stages.agent.search.local import BM25Backend
from stages.core.atomic import read_jsonl
from stages.core.config.loader import load_config
from stages.core.refs import DatasetRef, EndpointRef
from stages.core.selection import select_stages
from stages.eval.report import build_report
from stages.eval.scoring import score_predictions
from tasks.eval_infer import submit_infer
from tests.unit.outage_support import FlakyProvider
from tests.unit.test_agent_search import DOCS, serve_in_thread

pytestmark = pytest.mark.integration
QUESTIONS = [("q0", "capital of France", "Paris"), ("q1", "Westfield founder", "Frank Lowy"),
             ("q2", "domestic cat", "cat"), ("q3", "capital of Germany", "Berlin")]


@pytest.fixture(autouse=True)
def _prefect(prefect_harness):
    yield


def scripted_model(log: list) -> FastAPI:
    """Completions: a search for the question first, the gold answer once a result is in the prompt."""
    app = FastAPI()
    lock = threading.Lock()

    @app.post("/v1/completions")
    async def complete(req: Request):
        body = await req.json()
        prompt = body["prompt"]
        qid, question, gold = next(q for q in QUESTIONS if q[1] in prompt)
        with lock:
            log.append(qid)
        if "I will look it up." not in prompt:   # (the system prompt itself shows <result> tags)
            text, stop = f"<think>I will look it up.</think>\n<search>{question}", "</search>"
        else:
            text, stop = f"<think>Found it.</think>\n<answer>\\boxed{{{gold}}}", "</answer>"
        return {"id": "cmpl-1", "object": "text_completion", "created": int(time.time()), "model": body["model"],
                "choices": [{"index": 0, "text": text, "finish_reason": "stop", "logprobs": None, "stop_reason": stop}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 12, "total_tokens": 22}}

    return app


@flow
def infer_once(cfg, agent, model, endpoint, data, root: str, cache: str, retry: list[str]) -> tuple[str, dict]:
    future = submit_infer(select_stages(), retry, cfg, agent, "synthetic", model, endpoint, data, root, cache)
    state = future.wait() or future.state
    return state.name, future.result().model_dump()


def test_provider_failures_are_listed_and_only_they_are_retried(tiny_model, tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    test = tmp_path / "eval_test.jsonl"
    test.write_text("".join(json.dumps({"id": i, "question": q, "answer": a, "kind": "qa"}) + "\n"
                            for i, q, a in QUESTIONS))
    data = DatasetRef(path=str(tmp_path), fingerprint="outage-eval", files={"eval_test": str(test),
                                                                              "corpus": str(corpus)})
    provider = FlakyProvider(BM25Backend(corpus, tmp_path / "index"))          # new queries: 503, ok, 429, ok
    asked: list[str] = []
    root, cache = str(tmp_path / "out"), str(tmp_path / "cache")
    with serve_in_thread(provider.app()) as search_url, serve_in_thread(scripted_model(asked)) as llm_url:
        cfg = load_config("tiny-cpu", ["eval.samples=1", "eval.pass_k=[1]", "eval.max_questions=4", "eval.concurrency=1",
                                       "agent.search.backend=server", f"agent.search.server_url={search_url}",
                                       "agent.search.top_k=1"])
        endpoint = EndpointRef(url=f"{llm_url}/v1", model="scripted", meta={"sampling_extras": False})
        args = (cfg.eval, cfg.agent, tiny_model, endpoint, data, root, cache)
        state, first = infer_once(*args, [])
        rows = read_jsonl(first["path"])
        failed = {r["id"] for r in rows if r["infra_failures"]}
        # two of the four questions' searches failed (503, then 429) after the client's retries
        assert state == "Completed" and len(failed) == 2 and first["meta"]["infra_failed"] == 2
        assert all("HTTP 503" in r["infra_errors"][0] or "HTTP 429" in r["infra_errors"][0]
                   for r in rows if r["infra_failures"])
        # scoring leaves them out and the report lists them, instead of scoring them wrong
        scores = score_predictions(cfg.eval, _ref(first), None, root, cache)
        assert scores.meta["questions"] == 2 and scores.meta["infra_failed_answers"] == 2
        assert scores.meta["metrics"]["accuracy"]["value"] == 1.0   # the two answered ones are right
        report = Path(build_report(cfg.eval, [scores], root).meta["markdown"]).read_text()
        assert "synthetic**: 2 answers hit a provider failure (2 questions left out)" in report
        # a plain rerun is a cache hit: the cache alone would never retry them
        assert infer_once(*args, [])[0] == "Cached"
        # the provider is back; the rerun the pipeline makes (the benchmark listed for a retry) runs only them
        provider.healthy = True
        asked.clear()
        state, second = infer_once(*args, ["synthetic"])
        again = read_jsonl(second["path"])
        assert state == "Completed" and sorted(set(asked)) == sorted(failed) and len(asked) == 2 * len(failed)
        assert [r for r in again if r["id"] not in failed] == [r for r in rows if r["id"] not in failed]
        assert all(r["infra_failures"] == 0 and r["prediction"] for r in again)
        assert second["meta"]["infra_failed"] == 0 and second["fingerprint"] != first["fingerprint"]
        rescored = score_predictions(cfg.eval, _ref(second), None, root, cache)
        assert rescored.meta["questions"] == 4 and rescored.meta["infra_failed_answers"] == 0


def _ref(dump: dict):
    from stages.core.refs import PredictionsRef

    return PredictionsRef.model_validate(dump)
