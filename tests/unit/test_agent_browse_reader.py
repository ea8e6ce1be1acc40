"""Page fetches under one shared rate limit (every fetcher and process on a cache root) and the Jina Reader option
(`agent.search.browse.reader: jina`), against the local site of tests/unit/test_agent_browse.py, whose
`/reader/<page url>` stands in for https://r.jina.ai/ (`browse.jina_url` pointed at it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from stages.agent.search.base import Passage
from stages.agent.search.browse import PAGES_FAILED, Browser
from stages.agent.search.pages import PageFetcher, rate_limit_path
from stages.core.config.agent import SearchSection
from stages.core.config.browse import BrowseSection
from stages.core.env import PROJECT_ROOT
from stages.core.ratelimit import SharedRateLimiter
from tests.unit.test_agent_browse import MB, SLACK_S, LocalSite, browse_cfg

KEY_ENV = "ARPO_TEST_JINA_KEY"


@pytest.fixture(scope="module")
def site():
    server = LocalSite()
    yield server
    server.close()


def jina_cfg(site: LocalSite, **overrides) -> BrowseSection:
    return browse_cfg(reader="jina", jina_url=site.url("/reader/"), jina_api_key_env=KEY_ENV, **overrides)


# ---- one rate limit for every fetcher on a cache root ---------------------------------------------------------
def test_two_fetchers_on_one_cache_root_share_the_per_host_limit(site, tmp_path: Path) -> None:
    """Two fetchers (two benchmarks' toolboxes, say) send 3 requests each to one host at 10/s: together they take
    the 6 slots 0.1 s apart (>= 0.5 s), where limiters of their own would let both finish in 0.2 s."""
    cfg = browse_cfg(per_host_requests_per_second=10.0, respect_robots=False)
    fetchers = [PageFetcher(cfg, tmp_path), PageFetcher(cfg, tmp_path)]
    threads = [threading.Thread(target=f.fetch_many, args=([site.url(f"/shared-{i}-{j}") for j in range(3)],))
               for i, f in enumerate(fetchers)]
    start = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - start
    for fetcher in fetchers:
        fetcher.close()
    assert sum(f.requests for f in fetchers) == 6 and elapsed >= 0.49
    assert rate_limit_path(tmp_path, "127.0.0.1").is_file() and rate_limit_path(tmp_path).is_file()


RATE = 200.0
WORKER = textwrap.dedent("""
    import json, sys
    from stages.agent.search.pages import PageFetcher
    from stages.core.config.browse import BrowseSection
    fetcher = PageFetcher(BrowseSection(enabled=True, requests_per_second=%r), sys.argv[1])
    print(json.dumps([fetcher._limiter.reserve() for _ in range(6)]))
""") % RATE


def test_two_processes_do_not_exceed_the_limit_together(tmp_path: Path) -> None:
    """Two worker processes reserve 6 slots each on one limit of RATE/s: all 12 are at least one interval apart."""
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path / "cache")], env=env,
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    slots = sorted(s for proc in procs for s in json.loads(proc.communicate(timeout=60)[0]))
    assert all(proc.returncode == 0 for proc in procs) and len(slots) == 12
    gaps = [b - a for a, b in zip(slots, slots[1:])]
    assert min(gaps) >= 1 / RATE - 1e-6, gaps


def test_two_limiters_of_one_process_on_one_file_never_share_a_slot(tmp_path: Path) -> None:
    path = tmp_path / "one.slot"
    limiters = [SharedRateLimiter(path, RATE), SharedRateLimiter(path, RATE)]
    slots: list[float] = []
    threads = [threading.Thread(target=lambda lim=lim: slots.extend(lim.reserve() for _ in range(50)))
               for lim in limiters for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    slots.sort()
    assert len(slots) == 200 and min(b - a for a, b in zip(slots, slots[1:])) >= 1 / RATE - 1e-6


def test_a_turn_past_the_page_limit_fails_at_once_as_transient(site, tmp_path: Path) -> None:
    cfg = browse_cfg(per_host_requests_per_second=0.5, respect_robots=False, timeout_s=1.0)   # one per 2 s
    with PageFetcher(cfg, tmp_path) as fetcher:
        first = fetcher.fetch(site.url("/turn-1"))
        start = time.monotonic()
        second = fetcher.fetch(site.url("/turn-2"))
        waited = time.monotonic() - start
    assert first.kind == "http_404" and (second.kind, second.transient) == ("rate_limited", True)
    assert waited < 0.5 and site.hits["/turn-2"] == 0


# ---- the Jina Reader -----------------------------------------------------------------------------------------
def test_jina_reader_text_is_taken_as_is_with_links_dropped(site, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(KEY_ENV, "jina-test-key")
    before = dict(site.hits)
    site.reader_headers.clear()
    with PageFetcher(jina_cfg(site), tmp_path) as fetcher:
        page = fetcher.fetch(site.url("/article.html"))
        again = fetcher.fetch(site.url("/article.html"))
        assert fetcher.identity.startswith("pages-live:jina-md-1:http://127.0.0.1")
    # links `(http…)` / `[http…]` dropped, `---` `===` and three spaces shortened; no HTML parsing
    assert page.ok and page.text == ("Title: Eiffel Tower\n\n[Paris] is a city - the tower = 1889. See  and .\n"
                                     "<script>not run</script>")
    assert again.cached and again.text == page.text
    sent = site.reader_headers[0]
    assert sent["Authorization"] == "Bearer jina-test-key" and sent["X-Return-Format"] == "markdown"
    # the page's host was never contacted: neither the page nor its robots.txt
    assert site.hits["/article.html"] == before.get("/article.html", 0)
    assert site.hits["/robots.txt"] == before.get("/robots.txt", 0)
    with PageFetcher(browse_cfg(), tmp_path) as direct:                     # the direct page: another cache entry
        assert "completed in 1889" in direct.fetch(site.url("/article.html")).text


def test_jina_reader_keeps_the_hostile_page_limits(site, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(KEY_ENV, "jina-test-key")
    with PageFetcher(jina_cfg(site, timeout_s=2.0), tmp_path) as fetcher:
        start = time.monotonic()
        huge, slow, junk, unreadable = fetcher.fetch_many([site.url(p) for p in ("/huge", "/slow", "/junk",
                                                                                   "/gone.html")])
        elapsed = time.monotonic() - start
    assert huge.ok and huge.text == "a" * 20_000                             # 1 MB read at most, 20000 characters
    assert (slow.kind, slow.transient) == ("timeout", True)
    assert (junk.kind, junk.transient) == ("binary", False)
    assert (unreadable.kind, unreadable.transient) == ("http_422", False)
    assert elapsed < 2.0 + SLACK_S  # the 2 s page limit; /slow drips for ever
    huge_path = "/reader/" + site.url("/huge")  # the server notices the closed connection at its next write
    assert site.streamed(huge_path)[huge_path] < 10 * MB


def test_jina_failures_are_infrastructure_failures(site, tmp_path: Path, monkeypatch) -> None:
    """Without the key the reader refuses every page: a transient failure, so the search call is INFRA (masked in
    RL, retried at evaluation) and nothing is served from the page cache once the key is set."""
    monkeypatch.delenv(KEY_ENV, raising=False)
    search = SearchSection(browse=jina_cfg(site, enabled=True))
    browser = Browser(search, tmp_path)
    try:
        outcome = browser.browse("eiffel", [Passage("1", "the tower", title="Eiffel", url=site.url("/article.html"))],
                                 [])
    finally:
        browser.close()
    assert (outcome.ok, outcome.infra, outcome.text) == (False, True, PAGES_FAILED)
    assert outcome.meta["pages"][0]["kind"] == "reader_refused"
    assert "Authorization" not in site.reader_headers[-1]                  # keyless: no empty Bearer header
    monkeypatch.setenv(KEY_ENV, "jina-test-key")
    with PageFetcher(jina_cfg(site), tmp_path) as fetcher:
        assert fetcher.fetch(site.url("/article.html")).ok                  # fetched again, not the cached failure


def test_jina_settings_belong_to_the_jina_reader() -> None:
    with pytest.raises(ValueError, match="jina_url=http://h/ is ignored under reader=direct"):
        BrowseSection(jina_url="http://h/")
    with pytest.raises(ValueError, match="reader=jina is ignored under mode=replay"):
        BrowseSection(mode="replay", replay_path="/p.json", reader="jina")


def test_the_jina_key_comes_from_its_secret_block_when_the_variable_is_unset(monkeypatch) -> None:
    from prefect.blocks.system import Secret

    from stages.core.config.agent import AgentSection
    from tasks.secrets import export_search_key

    read: list[str] = []

    def load(name: str, *args, **kwargs):
        read.append(name)
        return type("Block", (), {"get": lambda self: " key-from-block "})()

    monkeypatch.setattr(Secret, "load", load)
    monkeypatch.delenv(KEY_ENV, raising=False)
    direct = AgentSection.model_validate({"search": {"browse": {"enabled": True}}})
    export_search_key(direct)                                               # reader=direct: no key, no block read
    jina = AgentSection.model_validate({"search": {"browse": {
        "enabled": True, "reader": "jina", "jina_api_key_env": KEY_ENV, "jina_secret_block": "jina-key"}}})
    export_search_key(jina)
    assert read == ["jina-key"] and os.environ[KEY_ENV] == "key-from-block"
    monkeypatch.setenv(KEY_ENV, "key-from-env")                             # an exported key wins over the block
    export_search_key(jina)
    assert read == ["jina-key"] and os.environ[KEY_ENV] == "key-from-env"
