"""`agent.search.browse` and `agent.search.summarizer`: the deep-search mode of the search tool (docs/agent.md,
"Browsing"). Defaults are the reference's settings (ARPO `evaluation/src/tools/search_tool_sds.py`, docs/reference.md
"Deep-search browsing"); the limits the reference lacks (bytes, redirects, robots, per-host rate) are ours."""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any, Literal

from pydantic import Field, model_validator

from stages.core.config.section import Section, used_when
from stages.core.config.serve import ServeSection
from stages.core.input_files import input_file

DESKTOP_USER_AGENT = ("Mozilla/5.0 (Windows NT 10.0; Win64; x64) AppleWebKit/537.36 (KHTML, like Gecko) "
                      "Chrome/58.0.3029.110 Safari/537.36")


class BrowseSection(Section):
    """Fetch the top results' pages, extract their text and keep the passage around the best-matching sentence."""

    enabled: bool = Field(False, description="browse: each search fetches its top results' pages (needs a backend "
                          "whose results carry URLs: web, or a recorded page set with mode=replay)")
    mode: Literal["live", "replay"] = Field(
        "live", description="live = fetch over HTTP (page cache on disk); replay = answer from a recorded page set "
        "(replay_path), no network")
    replay_path: str | None = Field(
        None, description="{url: text | {\"error\": ..., \"kind\": ...}} JSON of recorded pages (mode=replay); "
        "`export_page_cache` writes one from the page cache",
        json_schema_extra={**used_when(mode="replay"), **input_file("json_object")})
    top_k: int = Field(10, ge=1, description="search results whose pages are read (reference: 10)")
    fetch_concurrency: int = Field(10, ge=1, description="pages fetched at once (reference: 10 workers)")
    timeout_s: float = Field(20.0, gt=0, description="wall-clock limit per page, in all: DNS, robots.txt, every "
                             "redirect hop, headers, body and extraction, however the server drips or stalls "
                             "(reference: 20 s per request)")
    max_bytes: int = Field(5_000_000, ge=1024, description="body bytes per page, counted both on the wire and "
                           "decoded (gzip/deflate inflated as it is read); HTML past it is cut, a PDF past it fails "
                           "(the reference reads any size)")
    extract_timeout_s: float = Field(10.0, gt=0, description="time one page's text extraction (HTML parse, PDF) "
                                     "may take, within the page's timeout_s; past it (+1 s) its worker process is "
                                     "killed and replaced and the page fails as extract_timeout")
    extract_memory_mb: int = Field(1024, ge=256, description="address-space limit (RLIMIT_AS) of an extraction "
                                   "worker process; a page that needs more fails as extract_memory")
    extract_workers: int = Field(4, ge=1, description="extraction worker processes per page fetcher (a page "
                                 "waits for a free one within its own time limit)")
    pdf_page_timeout_s: float = Field(2.0, gt=0, description="time one PDF page's text may take; a slower page "
                                      "is skipped (the document as a whole is bounded by extract_timeout_s)")
    max_redirects: int = Field(5, ge=0, description="redirect hops followed per page, each checked like the first")
    max_text_chars: int = Field(20_000, ge=100, description="extracted HTML text kept per page (reference: 20000)")
    pdf_max_words: int = Field(600, ge=1, description="words kept of a PDF's text (reference: 600)")
    pdf_max_pages: int = Field(50, ge=1, description="PDF pages read at most (bounds time on hostile PDFs)")
    passage_chars: int = Field(3000, ge=1, description="characters kept on each side of the best-matching "
                               "sentence; without a match the first 2x this (reference max_doc_len=3000)")
    match_threshold: float = Field(0.2, ge=0, le=1, description="word F1 vs the snippet a sentence must beat "
                                   "(reference: 0.2)")
    scan_chars: int = Field(50_000, ge=100, description="characters of a page searched for the sentence "
                            "(reference: 50000)")
    language: Literal["en", "zh"] = Field(
        "en", description="en = the English tool; zh = the Chinese variant used for xbench (sentences split at "
        "。！？ and jieba words when the snippet is Chinese; Chinese summariser prompt and marker)")
    user_agent: str = Field(DESKTOP_USER_AGENT, description="User-Agent header (the reference's desktop Chrome)")
    requests_per_second: float = Field(20.0, gt=0, description="page requests per second overall (reference: 10x "
                                       "the search rate, 2/s by default), one limit for every process and worker "
                                       "that shares the cache root (<cache_root>/rate-limits/pages.slot)")
    per_host_requests_per_second: float = Field(2.0, gt=0, description="page requests per second to one host, "
                                                "shared the same way (one file per host under <cache_root>/"
                                                "rate-limits/pages-hosts/)")
    reader: Literal["direct", "jina"] = Field(
        "direct", description="how a page's text is read (mode=live): direct = fetched from its host and extracted "
        "here (HTML, PDF); jina = the Jina Reader fetches it (GET jina_url + the page URL) and its markdown is taken "
        "as is, link targets dropped, as the reference's SDS cn `use_jina` path does (robots.txt is then not read: "
        "we never contact the host)", json_schema_extra=used_when(mode="live"))
    jina_url: str = Field("https://r.jina.ai/", description="reader=jina: the reader's base URL, the page URL is "
                          "appended (reference: https://r.jina.ai/)", json_schema_extra=used_when(reader="jina"))
    jina_api_key_env: str = Field(
        "JINA_API_KEY", description="reader=jina: environment variable with the Jina API key, sent as a Bearer "
        "token (unset: requests go without a key, at Jina's lower keyless rate)",
        json_schema_extra=used_when(reader="jina"))
    jina_secret_block: str | None = Field(
        None, description="reader=jina: Prefect Secret block with the key, read by the pipeline's tasks when "
        "jina_api_key_env is unset (as agent.search.web.secret_block)", json_schema_extra=used_when(reader="jina"))
    respect_robots: bool = Field(True, description="read each host's robots.txt and skip disallowed pages")
    allow_private_addresses: bool = Field(
        False, description="fetch URLs that resolve to loopback, private or link-local addresses (off: a result or "
        "redirect pointing inside the network is refused; on only for tests against a local server)")
    cache: bool = Field(True, description="keep fetched pages (and failures, as failures) in "
                        "<cache_root>/page_cache.sqlite (mode=live)")
    transient_retry_s: float = Field(
        0.0, ge=0, description="a cached transient failure (timeout, connection, 429/5xx) older than this is "
        "fetched again; permanent ones (4xx, robots, too large, not text) are kept")


class SummarizerSection(Section):
    """The model that condenses the browsed pages into the search result (reference: a separately served Qwen3-8B/14B
    or QwQ-32B). Unset `model` and `path` = no summariser: the tool returns each page's passage instead.

    Where it runs, one of two: `url`, a server you run (nothing is started); or `path`, a model the evaluation serves
    the way it serves the judge (`serve`, default vLLM: own port, health check, teardown; not started when every
    browsing benchmark's predictions are cached; stages/eval/serving.py `start_summarizer`)."""

    model: str | None = Field(None, description="the summariser's served name: the name the server at `url` knows, "
                              "or the name `path` is served under (default: the last part of `path`)")
    url: str | None = Field(None, description="OpenAI-compatible base URL (…/v1) of a summariser server you run; "
                            "or give `path` and the evaluation serves it")
    path: str | None = Field(None, description="a model folder or hub id the evaluation serves as the summariser "
                             "with `serve` (like eval.judge.path), for the benchmarks that browse (eval.browse); "
                             "instead of `url`")
    serve: ServeSection = Field(default_factory=ServeSection, description="how `path` is served (like "
                                "eval.judge.serve); its served name is `model`")
    api_key_env: str | None = Field(None, description="environment variable with the summariser's API key, if any")
    temperature: float = Field(0.6, ge=0, description="sampling temperature (reference: 0.6)")
    top_p: float = Field(0.95, gt=0, le=1, description="nucleus sampling (reference: 0.95)")
    max_tokens: int = Field(4096, ge=1, description="summary token budget (reference: 4096)")
    timeout_s: float = Field(300.0, gt=0, description="HTTP timeout per summariser call")
    max_retries: int = Field(3, ge=1, description="attempts per summary (exponential backoff)")
    cache: bool = Field(True, description="reuse a summary for the same pages, query and model (the previous "
                        "reasoning steps are not in the key); <cache_root>/summary_cache.sqlite")

    @model_validator(mode="before")
    @classmethod
    def _name_from_path(cls, data: Any) -> Any:
        """`path` alone turns the summariser on, served under its last part (Qwen/Qwen3-14B -> Qwen3-14B)."""
        if isinstance(data, dict) and data.get("path") and not data.get("model"):
            return {**data, "model": PurePosixPath(str(data["path"]).rstrip("/")).name}
        return data

    @model_validator(mode="after")
    def _one_place(self) -> SummarizerSection:
        if self.url and self.path:
            raise ValueError(f"agent.search.summarizer has both url={self.url!r} (a server you run) and path="
                             f"{self.path!r} (a model the evaluation serves): keep one, e.g. "
                             "-o agent.search.summarizer.url=null to have the evaluation serve path")
        if self.model and not (self.url or self.path):
            raise ValueError(f"agent.search.summarizer.model={self.model!r} needs a place to run: "
                             "agent.search.summarizer.url (an OpenAI-compatible …/v1 server you run) or "
                             "agent.search.summarizer.path (a model folder or hub id the evaluation serves)")
        if not self.path and self.serve != ServeSection():
            raise ValueError("agent.search.summarizer.serve is set but agent.search.summarizer.path is not: serve "
                             "says how the evaluation serves path; set path, or drop serve")
        if self.path and self.serve.served_name not in (None, self.model):
            raise ValueError(f"agent.search.summarizer.serve.served_name={self.serve.served_name!r} differs from "
                             f"agent.search.summarizer.model={self.model!r}: the summariser is served under model; "
                             "set that one and drop serve.served_name")
        return self

    @property
    def served_here(self) -> bool:
        """Whether the evaluation serves it (`path`), rather than a server the user runs (`url`)."""
        return bool(self.model and self.path)
