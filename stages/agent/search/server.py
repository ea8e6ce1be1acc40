"""`server` search: a client of a FlashRAG/Tool-Star retrieval server (`POST /search`, `POST /batch_search`,
`GET /health`), such as `arpo retriever serve` (stages/agent/retriever_server.py) or Tool-Star's host_wiki.py.

Network errors, timeouts, HTTP 429 and 5xx are retried with exponential backoff (3 attempts); what remains after
them, and any other HTTP error, is a SearchError (an infrastructure failure of the search tool)."""

from __future__ import annotations

from typing import Any

import httpx
from tenacity import (
    retry,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
)

from stages.agent.search.base import Passage, SearchBackend, SearchError

ATTEMPTS = 3


class _Retryable(Exception):
    """An HTTP answer worth retrying (429, 5xx)."""


_RETRY = {"retry": retry_if_exception_type((httpx.TransportError, _Retryable)), "stop": stop_after_attempt(ATTEMPTS),
          "wait": wait_exponential(multiplier=0.2, max=2.0), "reraise": True}


def _passages(docs: list[dict[str, Any]], scores: list[float] | None) -> list[Passage]:
    scores = scores if scores is not None else [None] * len(docs)
    return [Passage(str(d.get("id", i)), str(d["contents"]), s) for i, (d, s) in enumerate(zip(docs, scores))]


def _split_scored(body: Any, n_queries: int | None = None) -> tuple[Any, Any]:
    """FlashRAG answers `docs` or, with return_score, `[docs, scores]`; tell them apart.

    `n_queries` is set for /batch_search, where `docs` is one list per query.
    """
    scored = (isinstance(body, list) and len(body) == 2 and all(isinstance(part, list) for part in body)
              and not any(isinstance(x, dict) for x in body[1])
              and (n_queries is None or len(body[0]) == n_queries == len(body[1])))
    return (body[0], body[1]) if scored else (body, None)


class ServerBackend(SearchBackend):
    name = "server"

    def __init__(self, url: str, timeout_s: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self._client = httpx.Client(base_url=self.url, timeout=timeout_s)
        health = self.health()
        self.corpus_id = str(health.get("corpus_id") or f"server:{self.url}")

    @retry(**_RETRY)
    def _request(self, method: str, path: str, payload: dict | None = None) -> Any:
        response = self._client.request(method, path, json=payload)
        if response.status_code == 429 or response.status_code >= 500:
            raise _Retryable(f"HTTP {response.status_code}: {response.text[:200]}")
        if response.status_code >= 400:
            raise SearchError(f"retrieval server {self.url}{path} answered HTTP {response.status_code}: "
                              f"{response.text[:300]}")
        return response.json()

    def _call(self, method: str, path: str, payload: dict | None = None) -> Any:
        try:
            return self._request(method, path, payload)
        except httpx.TransportError as err:
            raise SearchError(f"retrieval server {self.url} is not reachable ({err!r}); start one with "
                              "`arpo retriever serve --corpus <corpus.jsonl>` or fix agent.search.server_url") from err
        except _Retryable as err:
            raise SearchError(f"retrieval server {self.url}{path} failed after {ATTEMPTS} attempts: {err}") from err

    def health(self) -> dict[str, Any]:
        body = self._call("GET", "/health")
        if not isinstance(body, dict) or body.get("status") != "healthy":
            raise SearchError(f"retrieval server {self.url} is not healthy: {body!r}")
        return body

    def search(self, query: str, top_k: int) -> list[Passage]:
        body = self._call("POST", "/search", {"query": query, "top_n": top_k, "return_score": True})
        docs, scores = _split_scored(body)
        return _passages(docs, scores)

    def batch_search(self, queries: list[str], top_k: int) -> list[list[Passage]]:
        if not queries:
            return []
        body = self._call("POST", "/batch_search", {"query": list(queries), "top_n": top_k, "return_score": True})
        docs, scores = _split_scored(body, len(queries))
        scores = scores if scores is not None else [None] * len(docs)
        return [_passages(d, s) for d, s in zip(docs, scores)]

    def close(self) -> None:
        self._client.close()
