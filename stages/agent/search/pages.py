"""Fetch result pages: `PageFetcher(cfg, cache_root).fetch_many(urls) -> list[Page]` (docs/agent.md, "Browsing").

Live mode, per page, within `timeout_s` of wall-clock time in all (DNS, robots.txt, every hop, headers, body and
extraction; stages/agent/search/wire.py enforces it on the sockets however the server drips or stalls): the URL
must be http(s) (its userinfo is stripped, never sent); the host's robots.txt is read once (when `respect_robots`);
the request waits for the per-host and the overall rate limiter; each hop's host is resolved once and, unless
`allow_private_addresses`, every address must be public, and the request goes to that address (no second lookup:
no DNS rebinding); redirects are followed by hand, at most `max_redirects`, each hop checked like the first; the
body is streamed and read up to `max_bytes` on the wire and decoded (an HTML body past it is cut, a PDF past it
fails; other types fail unread). Nothing in a page is executed: its text is extracted in a bounded worker process
(stages/agent/search/extract_worker.py: a time and a memory limit per page). With `reader: jina` the Jina Reader
fetches the page instead and its text is taken as it is, under the same limits (stages/agent/search/reader.py).

Rate limits are shared like web search's (stages/core/ratelimit.py): one `requests_per_second` for every process
and thread whose fetcher has the same cache root (`<cache_root>/rate-limits/pages.slot`, e.g. all agent-loop
workers of a verl run on a host, or a run's parallel benchmarks), and one `per_host_requests_per_second` per host
(`rate-limits/pages-hosts/<host>.slot`). A page whose turn would come after its time limit fails at once as
`rate_limited` (transient) instead of waiting.

Every outcome is a `Page`: text when `ok`, else `kind` (http_404, timeout, too_large, robots, ...) and `transient`
(timeouts, connection errors, HTTP 429/5xx: the network's fault, worth another try). Pages and failures go into the
page cache (one SQLite store, many processes): a failure is stored as a failure, never as content; a transient one
is fetched again once older than `transient_retry_s`. Replay mode answers from a recorded `{url: text | {"error",
"kind"}}` JSON (`export_page_cache` writes one) without any network: an unrecorded URL is a `not_recorded` failure.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Self
from urllib.robotparser import RobotFileParser

import httpx

from stages.agent.search.extract import ExtractError
from stages.agent.search.extract_worker import Extractor
from stages.agent.search.reader import READER_VERSION, jina_key, jina_request, reader_text
from stages.agent.search.wire import (
    ACCEPT_ENCODING,
    Deadline,
    PageFailure,
    Resolver,
    join_location,
    open_response,
    parse_url,
    read_body,
    refuse_private,
    resolve_host,
)
from stages.core.atomic import write_json
from stages.core.config.browse import BrowseSection
from stages.core.log import get_logger
from stages.core.ratelimit import SharedRateLimiter, sleep_for_slot
from stages.core.store import SQLiteStore, store_key

__all__ = ["Page", "PageCache", "PageFailure", "PageFetcher", "check_address", "export_page_cache"]
EXTRACT_VERSION = "lxml-pypdf-3"  # bump when extraction changes what a cached page holds
ROBOTS_MAX_BYTES = 512_000
_TEXT_TYPES = ("text/html", "application/xhtml", "text/plain", "application/xml", "text/xml")
log = get_logger(__name__)


@dataclass(frozen=True)
class Page:
    url: str
    ok: bool
    text: str = ""
    kind: str = "ok"          # ok | http_<code> | timeout | connection | too_large | robots | blocked_address | ...
    error: str = ""
    transient: bool = False   # the network's fault (timeout, connection, 429/5xx): another try may succeed
    cached: bool = False


class PageCache(SQLiteStore):
    """Fetched pages keyed by URL and extraction settings; failures kept as failures."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(path, "pages")

    def export(self, out: str | Path) -> int:
        """Write the replay JSON of every stored page; returns how many."""
        with self._lock:
            rows = self._conn.execute(f"SELECT value FROM {self.table}").fetchall()
        pages: dict[str, object] = {}
        for (value,) in rows:
            item = json.loads(value.decode("utf-8", "surrogatepass") if isinstance(value, bytes) else value)
            pages[item["url"]] = item["text"] if item["ok"] else {
                "error": item["error"], "kind": item["kind"], "transient": item["transient"]}
        write_json(Path(out), pages)
        return len(pages)


def export_page_cache(cache_path: str | Path, out: str | Path) -> int:
    """A recorded page set for `agent.search.browse.mode=replay` from a live run's page cache."""
    with PageCache(cache_path) as cache:
        return cache.export(out)


def check_address(host: str, allow_private: bool, resolve: bool = True) -> None:
    """Refuse hosts that resolve to loopback, private, link-local, multicast or reserved addresses (`resolve`
    False: only address literals and localhost are checked, no DNS lookup). A fetch pins the address it checked
    instead (stages/agent/search/wire.py `Resolver`); this check is for a page the Jina Reader fetches."""
    if allow_private:
        return
    host = host.strip("[]")
    try:
        addresses = [str(ipaddress.ip_address(host))]
    except ValueError:
        if not resolve:
            if host.lower().rstrip(".") == "localhost" or host.lower().rstrip(".").endswith(".localhost"):
                raise PageFailure("blocked_address", f"{host} is this machine") from None
            return
        try:
            addresses = resolve_host(host)
        except (OSError, UnicodeError) as err:
            raise PageFailure("dns", f"cannot resolve {host}: {err}", transient=True) from err
    refuse_private(host, addresses)


def rate_limit_path(cache_root: str | Path, host: str | None = None) -> Path:
    """The shared rate-limit file of all page requests (`host` None) or of one host's."""
    root = Path(cache_root) / "rate-limits"
    if host is None:
        return root / "pages.slot"
    name = host.lower()
    safe = re.sub(r"[^a-z0-9.-]", "_", name)[:80]
    return root / "pages-hosts" / f"{safe}-{hashlib.sha256(name.encode()).hexdigest()[:8]}.slot"


def _status_failure(status: int) -> PageFailure:
    transient = status == 429 or status >= 500
    return PageFailure(f"http_{status}", f"HTTP {status}", transient)


class PageFetcher:
    def __init__(self, cfg: BrowseSection, cache_root: str | Path,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.cfg = cfg
        self._replay: dict[str, object] | None = None
        self.cache: PageCache | None = None
        self.version = EXTRACT_VERSION if cfg.reader == "direct" else f"{READER_VERSION}:{cfg.jina_url}"
        self.identity = f"pages-live:{self.version}"  # what answers: part of a tool result's cache key
        if cfg.mode == "replay":
            self._replay = _load_replay(cfg.replay_path)
            self.identity = f"pages-replay:{store_key(self._replay)[:16]}"
        elif cfg.cache:
            self.cache = PageCache(Path(cache_root) / "page_cache.sqlite")
        self.headers = {
            "User-Agent": cfg.user_agent, "Referer": "https://www.google.com/", "Accept-Encoding": ACCEPT_ENCODING,
            "Accept": "text/html,application/xhtml+xml,application/xml;q=0.9,image/webp,*/*;q=0.8",
            "Accept-Language": "zh-CN,zh;q=0.9,en;q=0.5" if cfg.language == "zh" else "en-US,en;q=0.5"}
        # no keep-alive: a pooled connection to a pinned address must not carry another host's request
        self.transport = transport or httpx.HTTPTransport(limits=httpx.Limits(
            max_connections=2 * cfg.fetch_concurrency, max_keepalive_connections=0))
        self.resolver = Resolver(cfg.allow_private_addresses)
        live_direct = self._replay is None and cfg.reader == "direct"
        self.extractor = Extractor(cfg) if live_direct else None
        self.cache_root = Path(cache_root)
        self._limiter = None if self._replay is not None else \
            SharedRateLimiter(rate_limit_path(cache_root), cfg.requests_per_second)
        self._hosts: dict[str, SharedRateLimiter] = {}
        self._jina_key = jina_key(cfg) if cfg.reader == "jina" and self._replay is None else ""
        if cfg.reader == "jina" and self._replay is None and not self._jina_key:
            log.warning("agent.search.browse.reader=jina without a key (%s is unset): the Jina Reader answers at its "
                        "keyless rate", cfg.jina_api_key_env)
        self._robots: dict[str, RobotFileParser | None] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=cfg.fetch_concurrency, thread_name_prefix="pages")
        self.requests = 0

    def fetch_many(self, urls: list[str]) -> list[Page]:
        """Pages in the order of `urls` (each distinct URL fetched once, `fetch_concurrency` at a time)."""
        distinct = list(dict.fromkeys(urls))
        done = dict(zip(distinct, self._pool.map(self.fetch, distinct)))
        return [done[u] for u in urls]

    def fetch(self, url: str) -> Page:
        if self._replay is not None:
            return _replayed(url, self._replay)
        key = store_key("page", url, self.version, self.cfg.max_text_chars, self.cfg.pdf_max_words,
                        self.cfg.pdf_max_pages, self.cfg.max_bytes)
        if self.cache is not None:
            hit = self.cache.get(key)
            if hit is not None and (hit["ok"] or not hit["transient"]
                                    or time.time() - hit["time"] < self.cfg.transient_retry_s):
                fields = {k: hit[k] for k in ("url", "ok", "text", "kind", "error", "transient")}
                return Page(**fields, cached=True)
        try:
            page = Page(url, True, self._fetch_live(url))
        except PageFailure as failure:
            page = Page(url, False, kind=failure.kind, error=str(failure)[:300], transient=failure.transient)
        if self.cache is not None:
            self.cache.put(key, {**asdict(page), "cached": False, "time": time.time()}, note=url[:300])
        return page

    # ---- live fetching ---------------------------------------------------------------------------------------
    def _wait_turn(self, host: str, deadline: Deadline) -> None:
        """Wait for this request's slot of the host's limit, then of the overall one (so the overall spacing holds
        for what is sent); a slot past the page's deadline fails now, as `rate_limited`."""
        with self._lock:
            if host not in self._hosts:
                self._hosts[host] = SharedRateLimiter(rate_limit_path(self.cache_root, host),
                                                      self.cfg.per_host_requests_per_second)
            limiter = self._hosts[host]
        for which in (limiter, *([self._limiter] if self._limiter else [])):  # none overall: replay, never here
            wait = which.reserve() - time.time()
            if wait > deadline.left():
                raise PageFailure("rate_limited", f"the rate limit's next turn is {wait:.1f} s away, past the "
                                  f"page's {self.cfg.timeout_s:g} s limit", transient=True)
            sleep_for_slot(wait)
        with self._lock:
            self.requests += 1

    def _robots_allow(self, url: httpx.URL, deadline: Deadline) -> bool:
        origin = f"{url.scheme}://{url.netloc.decode('ascii')}"
        with self._lock:
            known = origin in self._robots
            parser = self._robots.get(origin)
        if not known:
            parser = self._read_robots(url, deadline)
            with self._lock:
                self._robots[origin] = parser
        return parser is None or parser.can_fetch(self.cfg.user_agent, str(url))

    def _read_robots(self, url: httpx.URL, deadline: Deadline) -> RobotFileParser | None:
        """The host's rules; None (everything allowed) when it has none (4xx, a redirect, not text)."""
        self._wait_turn(url.host, deadline)
        robots = url.copy_with(raw_path=b"/robots.txt")
        try:
            with open_response(self.transport, robots, self.headers, deadline, self.resolver) as response:
                if response.status_code == 429 or response.status_code >= 500:
                    raise PageFailure("robots_unreachable", f"robots.txt: HTTP {response.status_code}", True)
                if response.status_code != 200:
                    return None
                body = read_body(response, ROBOTS_MAX_BYTES, deadline, cut=True)
        except httpx.HTTPError as err:
            if deadline.expired:
                raise
            raise PageFailure("robots_unreachable", f"robots.txt: {type(err).__name__}", True) from err
        parser = RobotFileParser()
        parser.parse(body.decode("utf-8", "replace").splitlines())
        return parser

    def _fetch_live(self, url: str) -> str:
        deadline = Deadline(self.cfg.timeout_s)
        try:
            target = parse_url(url)
            if self.cfg.reader == "jina":
                return self._fetch_jina(target, deadline)
            return self._fetch_direct(target, deadline)
        except httpx.TimeoutException as err:
            raise PageFailure("timeout", f"no answer within {self.cfg.timeout_s:g} s", True) from err
        except httpx.HTTPError as err:
            if deadline.expired:  # the deadline shut the socket down under a read
                raise PageFailure("timeout", f"the page's {self.cfg.timeout_s:g} s limit ran out", True) from err
            raise PageFailure("connection", f"{type(err).__name__}: {str(err)[:200]}", True) from err
        finally:
            deadline.close()

    def _fetch_direct(self, url: httpx.URL, deadline: Deadline) -> str:
        for _hop in range(self.cfg.max_redirects + 1):
            if self.cfg.respect_robots and not self._robots_allow(url, deadline):
                raise PageFailure("robots", f"robots.txt of {url.host} disallows {str(url)[:200]}")
            self._wait_turn(url.host, deadline)
            with open_response(self.transport, url, self.headers, deadline, self.resolver) as response:
                location = response.headers.get("location")
                if response.is_redirect and location:
                    url = join_location(url, location)
                    continue
                if response.status_code >= 400:
                    raise _status_failure(response.status_code)
                return self._read_text(response, url, deadline)
        raise PageFailure("too_many_redirects", f"more than {self.cfg.max_redirects} redirects")

    def _fetch_jina(self, url: httpx.URL, deadline: Deadline) -> str:
        """The page through the Jina Reader: one request, no redirect followed; a refused key is the network's
        fault for the page (transient: never served from the cache once the key is fixed). The page's host is
        checked without a lookup (the reader resolves it); the reader itself is configuration, not pinned."""
        check_address(url.host, self.cfg.allow_private_addresses, resolve=False)
        self._wait_turn(url.host, deadline)
        target, headers = jina_request(self.cfg, str(url), self._jina_key)
        with open_response(self.transport, parse_url(target), {**self.headers, **headers}, deadline,
                           None) as response:
            if response.status_code in (401, 403):
                raise PageFailure("reader_refused", f"the Jina Reader refused the request (HTTP "
                                  f"{response.status_code}); check the key in {self.cfg.jina_api_key_env}", True)
            if response.status_code >= 300:
                raise _status_failure(response.status_code)
            body = read_body(response, self.cfg.max_bytes, deadline, cut=True)
            charset = response.charset_encoding
        try:
            return reader_text(body, charset, self.cfg.max_text_chars)
        except ExtractError as err:
            raise PageFailure(err.kind, str(err)) from err

    def _read_text(self, response: httpx.Response, url: httpx.URL, deadline: Deadline) -> str:
        ctype = response.headers.get("content-type", "").split(";")[0].strip().lower()
        is_pdf = ctype == "application/pdf" or (ctype in ("", "application/octet-stream")
                                                and url.path.lower().endswith(".pdf"))
        if not is_pdf and ctype and not ctype.startswith(_TEXT_TYPES):
            raise PageFailure("unsupported_type", f"content type {ctype!r} is not a page")
        body = read_body(response, self.cfg.max_bytes, deadline, cut=not is_pdf)
        assert self.extractor is not None  # live and direct
        return self.extractor.extract("pdf" if is_pdf else "html", body, response.charset_encoding, deadline)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.transport.close()
        if self.extractor is not None:
            self.extractor.close()
        if self.cache is not None:
            self.cache.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _load_replay(path: str | None) -> dict[str, object]:
    from stages.core.input_files import resolve

    path = str(resolve(path, project_relative=True)) if path else path   # not the worker's folder: the project's
    if not path or not Path(path).is_file():
        raise FileNotFoundError(f"page replay file {path} does not exist; set agent.search.browse.replay_path to a "
                                "{url: text} JSON (export_page_cache writes one from a live run's page cache)")
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err.msg} at line {err.lineno})") from err
    if not isinstance(raw, dict) or not all(isinstance(v, (str, dict)) for v in raw.values()):
        raise ValueError(f"{path}: expected one JSON object mapping URLs to page text or {{\"error\", \"kind\"}}")
    return raw


def _replayed(url: str, pages: dict[str, object]) -> Page:
    item = pages.get(url, pages.get(url.split("#")[0]))
    if item is None:
        return Page(url, False, kind="not_recorded", error="no recorded page for this URL", cached=True)
    if isinstance(item, str):
        return Page(url, True, item, cached=True)
    return Page(url, False, kind=str(item.get("kind", "error")), error=str(item.get("error", "")),
                transient=bool(item.get("transient", False)), cached=True)
