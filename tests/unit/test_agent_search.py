"""Search backends: formatting, local BM25, replay, the retrieval server + client, the web client (fake SERP)."""

from __future__ import annotations

import json
import socket
import threading
import time
from contextlib import contextmanager

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from stages.agent.retriever_server import build_app, parse_args
from stages.agent.search import (
    SEARCH_BACKENDS,
    Passage,
    SearchError,
    SearchMiss,
    build_search,
    format_passages,
)
from stages.agent.search.base import RateLimiter, normalize_query, parse_formatted
from stages.agent.search.local import BM25Backend, read_corpus
from stages.agent.search.replay import ReplayBackend
from stages.agent.search.server import ServerBackend, _split_scored
from stages.agent.search.web import (
    WebBackend,
    is_chinese,
    parse_serp,
    resolve_api_key,
    serp_url,
)
from stages.core.config.agent import SearchSection, WebSearchSection

DOCS = [
    {"id": "paris", "contents": "Paris\nParis is the capital and largest city of France."},
    {"id": "berlin", "contents": "Berlin\nBerlin is the capital of Germany."},
    {"id": "lowy", "contents": "Frank Lowy\nFrank Lowy founded the Westfield Group shopping centres."},
    {"id": "cat", "contents": "Cat\nThe domestic cat is a small carnivorous mammal."},
]


@contextmanager
def serve_in_thread(app: FastAPI):
    """Run a FastAPI app with uvicorn on a free loopback port; yield its base URL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    return path


@pytest.fixture(scope="module")
def bm25(corpus, tmp_path_factory):
    return BM25Backend(corpus, tmp_path_factory.mktemp("cache"))


# ---- formatting --------------------------------------------------------------------------------------------
def test_normalize_and_format():
    assert normalize_query('search query:  "Who  founded Westfield?" ') == "Who founded Westfield?"
    assert normalize_query("Search Query: x") == "x"
    passages = [Passage("a", "Title\nsome   text"), Passage("b", "x" * 50)]
    assert format_passages(passages, 10) == "Page 1: Title some\nPage 2: xxxxxxxxxx"
    assert format_passages([], 10) == "No search results found."
    assert parse_formatted("Page 1: a b\nPage 2: c\nmore") == [Passage("page-1", "a b"), Passage("page-2", "c\nmore")]
    assert parse_formatted("No search results found.") == []


# ---- local BM25 ----------------------------------------------------------------------------------------------
def test_bm25_ranking(bm25):
    hits = bm25.search("capital of France", 3)
    # 'capit' is in paris and berlin, 'franc' only in paris -> paris first, berlin second, nothing else matches
    assert [h.id for h in hits] == ["paris", "berlin"]
    assert hits[0].score > hits[1].score > 0
    assert bm25.search("Who founded Westfield", 1)[0].id == "lowy"
    assert bm25.search("the of a", 5) == []  # only stopwords: no match, no invented results
    assert [r[0].id for r in bm25.batch_search(["cat mammal", "Germany"], 10)] == ["cat", "berlin"]
    assert len(bm25.search("capital", 100)) == 2  # top_k above the corpus size is fine


def test_bm25_top_k_matches_bm25s_retrieve(bm25):
    # our numpy top-k over bm25s scores must give bm25s.retrieve's own scores, in the same order
    from stages.agent.search.local import _tokenize

    queries = ["capital city", "Westfield shopping", "small mammal France", "Germany capital"]
    tokens = _tokenize(queries, bm25._stemmer, False)
    _, ref_scores = bm25._retriever.retrieve(tokens, k=3, show_progress=False)
    for hits, ref in zip(bm25.batch_search(queries, 3), ref_scores.tolist()):
        assert [h.score for h in hits] == pytest.approx([s for s in ref if s > 0], rel=1e-6)


def test_bm25_index_cached_by_fingerprint(corpus, tmp_path, monkeypatch):
    first = BM25Backend(corpus, tmp_path)
    from stages.agent.search import local

    monkeypatch.setattr(local, "build_index", lambda *a: pytest.fail("index rebuilt although cached"))
    second = BM25Backend(corpus, tmp_path)
    assert second.index_dir == first.index_dir and second.corpus_id == first.corpus_id
    changed = tmp_path / "changed.jsonl"
    changed.write_text(json.dumps(DOCS[0]) + "\n")
    monkeypatch.undo()
    assert BM25Backend(changed, tmp_path).corpus_id != first.corpus_id


def test_corpus_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "contents": "ok"}\n{"id": 2, "body": "x"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: .*'contents'"):
        read_corpus(bad)
    bad.write_text('{"id": 1, "contents": "ok"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        read_corpus(bad)
    with pytest.raises(FileNotFoundError, match="corpus_path"):
        read_corpus(tmp_path / "missing.jsonl")
    (tmp_path / "tt.jsonl").write_text('{"id": "x", "title": "T", "text": "body"}\n')
    assert read_corpus(tmp_path / "tt.jsonl") == [{"id": "x", "contents": "T\nbody"}]


# ---- replay ------------------------------------------------------------------------------------------------
def test_replay_on_shared_cache(shared_data):
    path = shared_data / "search_cache.json"
    raw = json.loads(path.read_text())
    replay = ReplayBackend(path)
    prefixed = next(k for k in raw if k.startswith("search query: "))
    bare = prefixed.removeprefix("search query: ")
    expected = parse_formatted(raw[prefixed])
    # found with and without the prefix, and case-insensitively
    assert replay.search(bare, 10) == expected[:10]
    assert replay.search(prefixed.upper(), 3) == expected[:3]
    assert format_passages(replay.search(bare, 10), 10_000) == raw[prefixed].strip()
    empty = next(k for k, v in raw.items() if v == "No search results found.")
    assert replay.search(empty, 5) == []
    with pytest.raises(SearchMiss, match="no recorded search result"):
        replay.search("a query nobody ever recorded 12345", 5)


def test_replay_bad_file(tmp_path):
    bad = tmp_path / "r.json"
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        ReplayBackend(bad)
    with pytest.raises(FileNotFoundError, match="replay_path"):
        ReplayBackend(tmp_path / "missing.json")


# ---- retrieval server + client -------------------------------------------------------------------------------
def test_server_backend_against_retriever_app(bm25):
    with serve_in_thread(build_app(bm25)) as url:
        client = ServerBackend(url)
        assert client.corpus_id == bm25.corpus_id  # learnt from /health: cache keys match the local backend
        hits = client.search("capital of France", 2)
        assert [(h.id, h.contents) for h in hits] == [(p.id, p.contents) for p in bm25.search("capital of France", 2)]
        assert hits[0].score == pytest.approx(bm25.search("capital of France", 2)[0].score, rel=1e-6)
        batch = client.batch_search(["Westfield", "mammal"], 1)
        assert [[h.id for h in r] for r in batch] == [["lowy"], ["cat"]]
        with pytest.raises(SearchError, match="HTTP 400"):
            client.search("  ", 2)
        client.close()


def test_server_unreachable_is_clear():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(SearchError, match="arpo retriever serve"):
        ServerBackend(f"http://127.0.0.1:{port}", timeout_s=2)


def test_split_scored_shapes():
    docs = [{"id": "1", "contents": "a"}, {"id": "2", "contents": "b"}]
    assert _split_scored(docs) == (docs, None)  # plain search answer with two documents
    assert _split_scored([docs, [0.5, 0.25]]) == (docs, [0.5, 0.25])
    assert _split_scored([[docs[:1]], [[0.5]]], 1) == ([docs[:1]], [[0.5]])
    assert _split_scored([docs[:1], []], 2) == ([docs[:1], []], None)  # unscored batch, second query empty


def test_retriever_cli_args():
    args = parse_args(["--corpus", "c.jsonl", "--port", "9999"])
    assert (args.backend, args.corpus, args.port, args.host) == ("local", "c.jsonl", 9999, "127.0.0.1")
    with pytest.raises(SystemExit):
        parse_args(["--backend", "replay"])  # replay needs --replay-path


# ---- web (fake Bright Data SERP on loopback) -------------------------------------------------------------------
def _fake_brightdata(log: list, fail_first: int = 0):
    app = FastAPI()
    state = {"left": fail_first}

    @app.post("/request")
    async def request(req: Request):
        body = await req.json()
        log.append({"auth": req.headers.get("authorization"), **body})
        if req.headers.get("authorization") != "Bearer good-key":
            return JSONResponse({"error": "bad key"}, status_code=401)
        if state["left"] > 0:
            state["left"] -= 1
            return JSONResponse({"error": "slow down"}, status_code=429)
        return {"organic": [{"description": " First snippet. ", "link": "https://a"},
                            {"description": "First snippet.", "link": "https://dup"},
                            {"description": "", "link": "https://empty"},
                            {"description": "Second snippet.", "link": "https://b"},
                            {"description": "Third snippet.", "link": "https://c"}]}

    return app


def test_web_backend_against_fake_serp(monkeypatch):
    log: list = []
    with serve_in_thread(_fake_brightdata(log, fail_first=1)) as url:
        cfg = WebSearchSection(endpoint=f"{url}/request", requests_per_second=50, retries=3, zone="z1")
        monkeypatch.setenv(cfg.api_key_env, "good-key")
        backend = WebBackend(cfg)
        hits = backend.search("Who founded Westfield?", 2)
        # the first answer was a 429 and was retried; duplicates and empty snippets are dropped
        assert [(h.id, h.contents) for h in hits] == [("https://a", "First snippet."), ("https://b", "Second snippet.")]
        assert backend.requests == 2 and len(log) == 2
        assert log[-1]["zone"] == "z1" and log[-1]["format"] == "raw" and log[-1]["auth"] == "Bearer good-key"
        assert "q=Who+founded+Westfield%3F" in log[-1]["url"] and "brd_json=1" in log[-1]["url"]
        monkeypatch.setenv(cfg.api_key_env, "bad-key")
        with pytest.raises(SearchError, match="refused"):
            WebBackend(cfg).search("x", 2)


def test_web_key_missing_and_helpers(monkeypatch):
    cfg = WebSearchSection(api_key_env="ARPO_TEST_NO_SUCH_KEY")
    monkeypatch.delenv("ARPO_TEST_NO_SUCH_KEY", raising=False)
    with pytest.raises(SearchError, match="export ARPO_TEST_NO_SUCH_KEY"):
        resolve_api_key(cfg)
    assert is_chinese("北京是中国的首都") and not is_chinese("Beijing capital")
    assert "mkt=zh-CN" in serp_url(cfg, "北京") and "mkt=en-US&setLang=en" in serp_url(cfg, "Paris")
    assert parse_serp({}, 3) == []


def test_rate_limiter_spacing():
    limiter = RateLimiter(rate=20.0)  # one slot every 0.05 s
    waits = [limiter.acquire() for _ in range(3)]
    # the first slot is free; the next two wait for their slots: at least 0.05 + 0.05 s minus scheduling slack
    assert waits[0] == 0.0 and sum(waits) >= 0.09


def test_build_search_registry(corpus, tmp_path):
    assert SEARCH_BACKENDS.names() == ["local", "replay", "server", "web"]
    assert build_search(SearchSection(backend="local"), corpus, tmp_path).name == "local"
    with pytest.raises(ValueError, match="corpus"):
        build_search(SearchSection(backend="local"), None, tmp_path)
    with pytest.raises(ValueError, match="server_url"):
        build_search(SearchSection(backend="server"), None, tmp_path)
    with pytest.raises(ValueError, match="replay_path"):
        build_search(SearchSection(backend="replay"), None, tmp_path)
