"""The search interface every backend implements, and the `Page {i}: …` result format."""

from __future__ import annotations

import re
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Self

from stages.core.ratelimit import sleep_for_slot

NO_RESULTS = "No search results found."
_PREFIX = re.compile(r"^\s*search\s+query\s*:\s*", re.IGNORECASE)
_PAGE = re.compile(r"(?m)^Page (\d+): ")


class SearchError(RuntimeError):
    """A backend could not answer (server down, bad key, HTTP error after retries)."""


class SearchMiss(LookupError):
    """The replay backend has no recorded result for this query (nothing is invented)."""


@dataclass(frozen=True)
class Passage:
    id: str
    contents: str
    score: float | None = None
    title: str = ""   # a web result's title and page address (what browsing fetches); empty for corpus passages
    url: str = ""


def normalize_query(query: str) -> str:
    """`'search query: "Who  wrote X?" '` -> `'Who wrote X?'`: drop the prefix models copy from the data,
    double quotes (as the reference does before lookup and request) and repeated whitespace."""
    query = _PREFIX.sub("", query or "")
    return " ".join(query.replace('"', " ").split())


def passage_text(passage: Passage, max_chars: int) -> str:
    """One line of text for a passage: whitespace squeezed, cut at `max_chars` characters."""
    text = " ".join(passage.contents.split())
    return text[:max_chars]


def format_passages(passages: list[Passage], max_chars: int) -> str:
    """`Page 1: …\\nPage 2: …` (one line per passage, each cut at `max_chars`); no passages -> NO_RESULTS."""
    lines = [f"Page {i}: {passage_text(p, max_chars)}" for i, p in enumerate(passages, start=1)]
    return "\n".join(lines) if lines else NO_RESULTS


def parse_formatted(text: str) -> list[Passage]:
    """Inverse of `format_passages` for stored results (`search_cache.json` values); ids are `page-{i}`."""
    if not text.strip() or text.strip() == NO_RESULTS:
        return []
    marks = list(_PAGE.finditer(text))
    if not marks:
        return [Passage("page-1", text.strip())]
    passages = []
    for mark, nxt in zip(marks, marks[1:] + [None]):
        body = text[mark.end(): nxt.start() if nxt else len(text)].strip()
        passages.append(Passage(f"page-{mark.group(1)}", body))
    return passages


class RateLimiter:
    """At most `rate` acquisitions per second across threads (even spacing, no bursts)."""

    def __init__(self, rate: float) -> None:
        self.interval = 1.0 / rate
        self._next = 0.0
        self._lock = threading.Lock()

    def acquire(self) -> float:
        """Block until the next slot; return the seconds waited."""
        with self._lock:
            now = time.monotonic()
            slot = max(now, self._next)
            self._next = slot + self.interval
        return sleep_for_slot(slot - now)


class SearchBackend(ABC):
    """`search(query, top_k) -> list[Passage]`. `name` and `corpus_id` identify what answers (cache key)."""

    name: str = "base"
    corpus_id: str = ""

    @abstractmethod
    def search(self, query: str, top_k: int) -> list[Passage]:
        """Passages for a normalised query, best first, at most `top_k`."""

    def batch_search(self, queries: list[str], top_k: int) -> list[list[Passage]]:
        return [self.search(q, top_k) for q in queries]

    def close(self) -> None:  # noqa: B027 - a no-op by default, not abstract: most backends hold nothing
        """Release connections or files (default: nothing)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
