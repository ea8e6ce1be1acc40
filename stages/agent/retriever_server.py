"""`arpo retriever serve`: any local search backend on the FlashRAG/Tool-Star retrieval API, so a team shares
one index.

Endpoints (same shapes as Tool-Star's host_wiki.py):
- `GET /health` -> `{"status": "healthy", "backend", "corpus_id", "documents"}`
- `POST /search {"query", "top_n": 10, "return_score": false}` -> `[{"id", "contents"}…]` or `[docs, scores]`
- `POST /batch_search {"query": [...], "top_n", "return_score"}` -> one list per query (or `[docs, scores]`)
An empty query is HTTP 400; a replay miss is HTTP 404.
"""

from __future__ import annotations

import argparse
from typing import Any

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, Field

from stages.agent.search.base import Passage, SearchBackend, SearchMiss


class QueryRequest(BaseModel):
    query: str
    top_n: int = Field(10, ge=1, le=1000)
    return_score: bool = False


class BatchQueryRequest(BaseModel):
    query: list[str]
    top_n: int = Field(10, ge=1, le=1000)
    return_score: bool = False


def _docs(passages: list[Passage]) -> list[dict[str, str]]:
    return [{"id": p.id, "contents": p.contents} for p in passages]


def _scores(passages: list[Passage]) -> list[float]:
    return [float(p.score) if p.score is not None else 0.0 for p in passages]


def build_app(backend: SearchBackend) -> FastAPI:
    """A FastAPI app answering the retrieval API from `backend` (sync endpoints run in the threadpool)."""
    app = FastAPI(title="arpo retriever", description=f"{backend.name} search over {backend.corpus_id}")

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "healthy", "backend": backend.name, "corpus_id": backend.corpus_id,
                "documents": getattr(backend, "size", None) or (len(backend) if hasattr(backend, "__len__") else None)}

    @app.post("/search")
    def search(request: QueryRequest) -> Any:
        if not request.query.strip():
            raise HTTPException(status_code=400, detail="Query content cannot be empty")
        try:
            passages = backend.search(request.query, request.top_n)
        except SearchMiss as miss:
            raise HTTPException(status_code=404, detail=str(miss)) from miss
        return [_docs(passages), _scores(passages)] if request.return_score else _docs(passages)

    @app.post("/batch_search")
    def batch_search(request: BatchQueryRequest) -> Any:
        if any(not q.strip() for q in request.query):
            raise HTTPException(status_code=400, detail="Query content cannot be empty")
        try:
            results = backend.batch_search(request.query, request.top_n)
        except SearchMiss as miss:
            raise HTTPException(status_code=404, detail=str(miss)) from miss
        if request.return_score:
            return [[_docs(r) for r in results], [_scores(r) for r in results]]
        return [_docs(r) for r in results]

    return app


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="arpo retriever serve",
                                     description="Serve a local search backend on the FlashRAG retrieval API.")
    parser.add_argument("--backend", choices=["local", "replay"], default="local")
    parser.add_argument("--corpus", help="FlashRAG JSONL corpus (backend local)")
    parser.add_argument("--replay-path", help="{query: result} JSON (backend replay)")
    parser.add_argument("--cache-root", default=".cache", help="where the BM25 index is cached")
    parser.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to serve the team's network")
    parser.add_argument("--port", type=int, default=1243)
    args = parser.parse_args(argv)
    if args.backend == "local" and not args.corpus:
        parser.error("--corpus is required with --backend local")
    if args.backend == "replay" and not args.replay_path:
        parser.error("--replay-path is required with --backend replay")
    return args


def make_backend(args: argparse.Namespace) -> SearchBackend:
    if args.backend == "local":
        from stages.agent.search.local import BM25Backend

        return BM25Backend(args.corpus, args.cache_root)
    from stages.agent.search.replay import ReplayBackend

    return ReplayBackend(args.replay_path)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `arpo retriever serve [--backend local --corpus X | --backend replay --replay-path Y]`."""
    import uvicorn

    args = parse_args(argv)
    backend = make_backend(args)
    uvicorn.run(build_app(backend), host=args.host, port=args.port, log_level="info")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
