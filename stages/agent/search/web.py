"""`web` search: a Bing SERP through Bright Data's request API, as the reference training setup does.

Request: `POST {endpoint}` with `Authorization: Bearer <key>` and `{"zone", "url": <bing search URL with
brd_json=1>, "format": "raw"}`; the answer is the SERP as JSON, whose `organic[].description` snippets become
passages (stripped, de-duplicated, in order). The key comes from the environment variable `api_key_env`, which
the pipeline's tasks fill from the Prefect Secret block `secret_block` when it is unset (tasks/secrets.py);
never from a file in the repository. Requests are rate limited and retried with exponential backoff on network
errors, HTTP 429 and 5xx. The rate limit (`requests_per_second`) is one limit for every process that shares
`cache_root` (e.g. all agent-loop workers of a verl run on a host): `rate_limit_path` names its file
(stages/core/ratelimit.py); without a `cache_root` it is per process.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import urlencode

import httpx
from tenacity import retry, retry_if_exception, stop_after_attempt, wait_exponential

from stages.agent.search.base import Passage, RateLimiter, SearchBackend, SearchError
from stages.core.config.agent import WebSearchSection
from stages.core.ratelimit import SharedRateLimiter


class _Retryable(Exception):
    """An HTTP answer worth retrying (429, 5xx)."""


def resolve_api_key(cfg: WebSearchSection) -> str:
    """The API key from the environment (a task exports it there from `secret_block`); a clear error otherwise."""
    key = os.environ.get(cfg.api_key_env, "").strip()
    if key:
        return key
    raise SearchError(f"web search needs an API key: export {cfg.api_key_env}=<your Bright Data key> or set "
                      "agent.search.web.secret_block to a Prefect Secret block holding it (read by the pipeline's "
                      "tasks, tasks/secrets.py)")


def is_chinese(text: str) -> bool:
    """True when at least 30% of the letters are CJK ideographs (the reference switches Bing to zh-CN)."""
    letters = [c for c in text if c.isalpha()]
    cjk = sum("\u4e00" <= c <= "\u9fff" for c in letters)
    return bool(letters) and cjk / len(letters) >= 0.3


def serp_url(cfg: WebSearchSection, query: str) -> str:
    market = "zh-CN" if is_chinese(query) else cfg.market
    params = {"q": query, "mkt": market, "setLang": market.split("-")[0], "brd_json": 1, "cc": cfg.country}
    return f"{cfg.search_url}?{urlencode(params)}"


def parse_serp(body: dict, top_k: int) -> list[Passage]:
    """Organic results' descriptions, stripped and de-duplicated, first `top_k`."""
    passages, seen = [], set()
    for item in body.get("organic") or []:
        text = str(item.get("description") or "").strip()
        if text and text not in seen:
            seen.add(text)
            link = str(item.get("link") or item.get("url") or "")
            passages.append(Passage(link or str(len(passages)), text, title=str(item.get("title") or ""), url=link))
        if len(passages) >= top_k:
            break
    return passages


def rate_limit_path(cfg: WebSearchSection, cache_root: str | Path) -> Path:
    """The file of the provider's shared rate limit (one per provider and zone under the cache root)."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", f"web-{cfg.provider}-{cfg.zone}")
    return Path(cache_root) / "rate-limits" / f"{name}.slot"


class WebBackend(SearchBackend):
    name = "web"

    def __init__(self, cfg: WebSearchSection, cache_root: str | Path | None = None) -> None:
        self.cfg = cfg
        self._key = resolve_api_key(cfg)
        self._limiter = RateLimiter(cfg.requests_per_second) if cache_root is None else \
            SharedRateLimiter(rate_limit_path(cfg, cache_root), cfg.requests_per_second)
        self._client = httpx.Client(timeout=cfg.timeout_s)
        self.corpus_id = f"web:{cfg.provider}:{cfg.market}:{cfg.country}"
        self.requests = 0

    def _post(self, query: str) -> dict:
        @retry(retry=retry_if_exception(lambda e: isinstance(e, (httpx.TransportError, _Retryable))),
               stop=stop_after_attempt(self.cfg.retries), wait=wait_exponential(multiplier=0.5, max=10.0),
               reraise=True)
        def attempt() -> dict:
            self._limiter.acquire()
            self.requests += 1
            response = self._client.post(
                self.cfg.endpoint, headers={"Authorization": f"Bearer {self._key}"},
                json={"zone": self.cfg.zone, "url": serp_url(self.cfg, query), "format": "raw"})
            if response.status_code == 429 or response.status_code >= 500:
                raise _Retryable(f"HTTP {response.status_code}: {response.text[:200]}")
            if response.status_code in (401, 403):
                raise SearchError(f"web search: the API key in {self.cfg.api_key_env} was refused "
                                  f"(HTTP {response.status_code}); check the key and zone {self.cfg.zone!r}")
            if response.status_code >= 400:
                raise SearchError(f"web search: HTTP {response.status_code}: {response.text[:300]}")
            try:
                return response.json()
            except ValueError as err:
                raise SearchError(f"web search: the answer is not JSON: {response.text[:200]!r}") from err

        try:
            return attempt()
        except (httpx.TransportError, _Retryable) as err:
            raise SearchError(f"web search failed after {self.cfg.retries} attempts: {err}") from err

    def search(self, query: str, top_k: int) -> list[Passage]:
        return parse_serp(self._post(query), top_k)

    def close(self) -> None:
        self._client.close()
