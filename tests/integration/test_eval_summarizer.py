"""The deep-search summariser served like the judge (agent.search.summarizer.path), on the tiny model behind the
session's vLLM server (`vllm_endpoint`, which stands in for the server `start_summarizer` would start: the same
`start_server` with the summariser's served name; a second vLLM start would cost a minute of CI), through the real
inference stage over recorded search results and recorded pages (no network).

The tiny policy never searches by itself, so the one sample's first reply is played back (`<search>eiffel tower`
with vLLM's stop_reason, as tests/integration/test_eval_inference_tools.py plays back a python call); the browse
tool then reads the recorded pages, the summariser on vLLM writes the search result, and every later generation
comes from the server."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from openai.types import Completion

from stages.agent.protocol import render_result
from stages.agent.search.extract import defang
from stages.core.config.agent import SearchSection
from stages.core.refs import EndpointRef
from stages.eval import serving
from stages.eval.inference import run_inference
from stages.eval.search_mode import serves_summarizer

pytestmark = pytest.mark.integration
QUERY = "eiffel tower"


def _recorded(folder: Path) -> tuple[Path, Path]:
    searches, pages = folder / "searches.json", folder / "pages.json"
    searches.write_text(json.dumps({QUERY: [
        {"url": "https://example.org/eiffel", "title": "Eiffel Tower", "snippet": "The tower was completed in 1889."},
        {"url": "https://example.org/gone", "title": "Gone", "snippet": "nothing"}]}))
    pages.write_text(json.dumps({
        "https://example.org/eiffel": "The Eiffel Tower stands in Paris. The tower was completed in 1889. It is "
                                      "330 metres tall.",
        "https://example.org/gone": {"error": "HTTP 404", "kind": "http_404"}}))
    return searches, pages


class FirstReplyPlayedBack:
    """An AsyncOpenAI stand-in whose first completion is a search call ending on the `</search>` stop (as vLLM
    reports it: the stop string cut, `stop_reason` set); every later request goes to the real server."""

    def __init__(self, client) -> None:
        self.client, self.sent = client, 0
        self.completions = self

    async def create(self, **body):
        self.sent += 1
        if self.sent > 1:
            return await self.client.completions.create(**body)
        return Completion.model_validate({
            "id": "played-back", "object": "text_completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "text": f"<think>\nLook it up.\n</think>\n<search>{QUERY}",
                         "finish_reason": "stop", "logprobs": None, "stop_reason": "</search>"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 12, "total_tokens": 13}})

    async def close(self) -> None:
        await self.client.close()


def _client_playing_back(monkeypatch: pytest.MonkeyPatch) -> None:
    real = serving.async_client
    monkeypatch.setattr(serving, "async_client", lambda endpoint, **kw: FirstReplyPlayedBack(real(endpoint, **kw)))


def test_tiny_policy_summarises_recorded_pages_on_vllm(vllm_endpoint, tiny_model, tiny_config, synthetic_data,
                                                      tmp_path, monkeypatch) -> None:
    searches, pages = _recorded(tmp_path)
    search = SearchSection.model_validate({
        "backend": "replay", "replay_path": str(searches),
        "browse": {"mode": "replay", "replay_path": str(pages), "top_k": 2, "passage_chars": 300},
        # served by the evaluation under vllm_endpoint's name: its endpoint is handed to the stage, never configured
        "summarizer": {"path": str(tiny_model.path), "model": vllm_endpoint.model, "temperature": 0.0,
                       "max_tokens": 24}})
    agent = tiny_config.agent.model_copy(update={"search": search})
    cfg = tiny_config.eval.model_copy(update={"browse": ["synthetic"], "max_questions": 1, "samples": 1,
                                              "max_tokens": 8, "max_total_tokens": 24})
    assert serves_summarizer(cfg, search, "synthetic")
    _client_playing_back(monkeypatch)
    cache = tmp_path / "cache"                        # fresh summary, page and tool caches: the summary is written now
    ref = run_inference(cfg, agent, "synthetic", tiny_model, vllm_endpoint, synthetic_data, tmp_path, cache,
                        summarizer=vllm_endpoint)
    row = json.loads(Path(ref.path).read_text().splitlines()[0])
    assert ref.meta["search_mode"] == "browse+summary (en, replay)"
    assert row["tool_calls"]["search"] >= 1 and row["infra_failures"] == 0 and row["error"] is None

    # the summary vLLM wrote (the tiny model's greedy reply) is the search result the policy read on
    with sqlite3.connect(cache / "summary_cache.sqlite") as db:
        stored = {note: json.loads(value) for note, value in db.execute("SELECT note, value FROM search_summaries")}
    summary = stored[f"{vllm_endpoint.model}: {QUERY}"]["summary"]     # written by the served summariser's name
    assert summary.strip() and f"</search>{render_result(defang(summary))}" in row["output"]
    assert "Page 1:" not in row["output"]             # not the passages: the summariser answered

    # a rerun with the summariser elsewhere (a new port, nothing listening) finds the predictions: the key never
    # sees where it runs, and a cached benchmark does not ask the summariser anything
    moved = EndpointRef(url="http://127.0.0.1:9/v1", model=vllm_endpoint.model)
    again = run_inference(cfg, agent, "synthetic", tiny_model, vllm_endpoint, synthetic_data, tmp_path, cache,
                          summarizer=moved)
    assert again.path == ref.path and again.fingerprint == ref.fingerprint
