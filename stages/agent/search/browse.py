"""Deep-search browsing: search results -> fetched pages -> passages -> (a summary | the passages).

    browser = Browser(cfg.agent.search, cache_root)
    outcome = browser.browse(query, passages, steps)   # BrowseOutcome(text, ok, infra, meta)

Each result with a URL is fetched (stages/agent/search/pages.py); its passage is the text around the sentence that
best matches the result's snippet (stages/agent/search/extract.py); a page that could not be read shows as "Web
Page content cannot fetch", as in the reference, and a result without a URL (a corpus passage) keeps its snippet.
The pages become `**Web Page i:**` + JSON documents. With a summariser (`agent.search.summarizer.model`) its summary
is the tool result (stages/agent/search/summarize.py); without one, each page's passage in the `Page i: …` format,
cut at `max_chars_per_passage`.

Whose failure (stages/agent/tools.py): a page that answers 4xx, is disallowed by robots, too large or not text is
the web as it is, shown to the model like the reference does. When every result page failed and at least one for
a network reason (timeout, connection, 429/5xx), or the summariser failed after its retries, the call is an
infrastructure failure: RL masks it, evaluation retries the sample. A result with any transient page failure is
never cached as a tool result, so a later call fetches that page again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stages.agent.search.base import Passage, format_passages
from stages.agent.search.extract import clean_snippet, defang, select_passage
from stages.agent.search.pages import Page, PageFetcher
from stages.core.config.agent import SearchSection

CANNOT_FETCH = "Web Page content cannot fetch"
PAGES_FAILED = "The search tool could not read any result page (network failure). Try again later or continue " \
               "without it."
SUMMARY_FAILED = "The search tool could not summarise the result pages. Try again later or continue without it."


@dataclass(frozen=True)
class BrowseOutcome:
    text: str
    ok: bool
    infra: bool = False
    meta: dict[str, Any] = field(default_factory=dict)


def page_url(passage: Passage) -> str:
    """The address to fetch: the result's URL, else an id that is one; '' for a corpus passage."""
    if passage.url:
        return passage.url
    return passage.id if passage.id.startswith(("http://", "https://")) else ""


class Browser:
    def __init__(self, search: SearchSection, cache_root: str | Path, fetcher: PageFetcher | None = None,
                 summarizer: Any = None) -> None:
        self.cfg, self.max_chars = search.browse, search.max_chars_per_passage
        self.fetcher = fetcher or PageFetcher(self.cfg, cache_root)
        if summarizer is None and search.summarizer.model:
            from stages.agent.search.summarize import Summarizer

            summarizer = Summarizer(search.summarizer, self.cfg.language, cache_root)
        self.summarizer = summarizer

    @property
    def identity(self) -> str:
        """The page source and the summariser (part of a tool result's cache key)."""
        return f"{self.fetcher.identity}|{self.summarizer.identity if self.summarizer else 'no-summary'}"

    def documents(self, passages: list[Passage], pages: dict[str, Page]) -> list[dict[str, Any]]:
        """The reference's page records (`id, title, url, snippet, context`), untrusted text defanged."""
        docs = []
        for i, passage in enumerate(passages, start=1):
            url, snippet = page_url(passage), clean_snippet(passage.contents)
            if not url:
                context = snippet
            elif not pages[url].ok:
                context = CANNOT_FETCH
            else:
                _, context = select_passage(pages[url].text, snippet, self.cfg.passage_chars,
                                            self.cfg.match_threshold, self.cfg.scan_chars, self.cfg.language)
            docs.append({"id": i, "title": defang(passage.title), "url": url, "snippet": defang(snippet),
                         "context": defang(context)})
        return docs

    def browse(self, query: str, passages: list[Passage], steps: list[str]) -> BrowseOutcome:
        urls = [u for u in (page_url(p) for p in passages) if u]
        pages = {p.url: p for p in self.fetcher.fetch_many(urls)}
        failed = [p for p in pages.values() if not p.ok]
        meta: dict[str, Any] = {
            "ids": [p.id for p in passages],
            "pages": [{"url": p.url[:300], "kind": p.kind, "cached": p.cached} for p in pages.values()],
            "pages_failed": len(failed), "pages_transient": sum(p.transient for p in failed)}
        if pages and len(failed) == len(pages) and meta["pages_transient"]:
            return BrowseOutcome(PAGES_FAILED, False, True, {**meta, "error": "; ".join(
                f"{p.url[:100]}: {p.kind}" for p in failed[:5])})
        docs = self.documents(passages, pages)
        if self.summarizer is None:
            shown = [Passage(str(d["url"] or d["id"]), f"{d['title']}: {d['context']}" if d["title"] else
                             str(d["context"])) for d in docs]
            return BrowseOutcome(format_passages(shown, self.max_chars), True, False, meta)
        from stages.agent.search.summarize import SummaryError

        text = "".join(f"**Web Page {d['id']}:**\n{json.dumps(d, ensure_ascii=False, indent=2)}\n" for d in docs)
        try:
            summary, cached = self.summarizer.summarize(steps, query, text)
        except SummaryError as err:
            return BrowseOutcome(SUMMARY_FAILED, False, True, {**meta, "error": str(err)})
        return BrowseOutcome(defang(summary), True, False, {**meta, "summary_cached": cached})

    def close(self) -> None:
        self.fetcher.close()
        if self.summarizer is not None:
            self.summarizer.close()
