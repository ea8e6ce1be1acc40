"""Search backends behind one interface: `search(query, top_k) -> list[Passage]` and `format_passages`.

`build_search(cfg, corpus_path, cache_root)` makes the configured backend (`local`, `server`, `web`, `replay`);
backends are registered by name in SEARCH_BACKENDS, so a new one needs no change to the callers.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from stages.agent.search.base import (
    NO_RESULTS,
    Passage,
    SearchBackend,
    SearchError,
    SearchMiss,
    format_passages,
    normalize_query,
    parse_formatted,
)
from stages.core.config.agent import SearchSection
from stages.core.registry import Registry

BackendFactory = Callable[[SearchSection, "str | None", str], SearchBackend]
SEARCH_BACKENDS: Registry[BackendFactory] = Registry("search backend")


@SEARCH_BACKENDS.register("local")
def _local(cfg: SearchSection, corpus_path: str | None, cache_root: str) -> SearchBackend:
    from stages.agent.search.local import BM25Backend

    path = cfg.corpus_path or corpus_path
    if not path:
        raise ValueError("search backend 'local' needs a corpus: set agent.search.corpus_path or pass the data "
                         "stage's corpus file")
    return BM25Backend(path, cache_root)


@SEARCH_BACKENDS.register("server")
def _server(cfg: SearchSection, corpus_path: str | None, cache_root: str) -> SearchBackend:
    from stages.agent.search.server import ServerBackend

    if not cfg.server_url:
        raise ValueError("search backend 'server' needs agent.search.server_url (e.g. http://127.0.0.1:1243)")
    return ServerBackend(cfg.server_url, cfg.server_timeout_s)


@SEARCH_BACKENDS.register("web")
def _web(cfg: SearchSection, corpus_path: str | None, cache_root: str) -> SearchBackend:
    from stages.agent.search.web import WebBackend

    return WebBackend(cfg.web, cache_root)


@SEARCH_BACKENDS.register("replay")
def _replay(cfg: SearchSection, corpus_path: str | None, cache_root: str) -> SearchBackend:
    from stages.agent.search.replay import ReplayBackend

    if not cfg.replay_path:
        raise ValueError("search backend 'replay' needs agent.search.replay_path (a {query: result} JSON such as "
                         "../shared/data/search_cache.json)")
    return ReplayBackend(cfg.replay_path)


def build_search(cfg: SearchSection, corpus_path: str | Path | None = None, cache_root: str | Path = ".cache") \
        -> SearchBackend:
    """The configured backend. `corpus_path` is used by `local` when `cfg.corpus_path` is unset."""
    return SEARCH_BACKENDS.get(cfg.backend)(cfg, str(corpus_path) if corpus_path else None, str(cache_root))


__all__ = ["NO_RESULTS", "SEARCH_BACKENDS", "Passage", "SearchBackend", "SearchError", "SearchMiss",
           "build_search", "format_passages", "normalize_query", "parse_formatted"]
