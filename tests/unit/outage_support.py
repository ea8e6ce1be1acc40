"""A search provider that fails, over real HTTP: a FlashRAG-style retrieval server (`/health`, `/search`,
`/batch_search`) in front of a real BM25 index that answers some queries with HTTP 503 or 429, every time they are
asked (so the client's retries do not help), and counts every request it receives.

    provider = FlakyProvider(bm25, cycle=(503, 200, 429, 200))   # new queries in arrival order: fail, ok, ...
    with serve_in_thread(provider.app()) as url: ...             # tests/unit/test_agent_search.py
    provider.healthy = True                                      # the outage is over: everything answers
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse


class FlakyProvider:
    def __init__(self, backend: Any, cycle: tuple[int, ...] = (503, 200, 429, 200)) -> None:
        self.backend, self.cycle = backend, cycle
        self.healthy = False
        self.decided: dict[str, int] = {}   # query -> the status it always gets during the outage
        self.requests: list[tuple[str, int]] = []  # (query, status) of every search request
        self._lock = threading.Lock()

    def status(self, query: str) -> int:
        with self._lock:
            if self.healthy:
                return 200
            if query not in self.decided:
                self.decided[query] = self.cycle[len(self.decided) % len(self.cycle)]
            return self.decided[query]

    @property
    def failed_queries(self) -> set[str]:
        return {q for q, s in self.decided.items() if s != 200}

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> dict:
            return {"status": "healthy", "corpus_id": self.backend.corpus_id}

        @app.post("/search")
        async def search(req: Request):
            body = await req.json()
            query = body["query"]
            code = self.status(query)
            with self._lock:
                self.requests.append((query, code))
            if code != 200:
                return JSONResponse({"error": "provider outage"}, status_code=code)
            hits = self.backend.search(query, int(body.get("top_n", 3)))
            return [[{"id": h.id, "contents": h.contents} for h in hits], [h.score for h in hits]]

        return app


def kill_sandbox(sandbox: Any) -> bool:
    """Kill the warm parent of a PythonSandbox (SIGKILL to its process group), as a crash would. With a start-up
    time too short for an interpreter (`agent.python.startup_timeout_s`), the sandbox then cannot come back: every
    call respawns it and fails to start. Returns whether there was one to kill."""
    zygote = sandbox._parent._zygote
    if zygote is None or zygote.proc.poll() is not None:
        return False
    os.killpg(zygote.proc.pid, signal.SIGKILL)
    zygote.proc.wait()
    return True
