"""Page bytes -> text, and the passage of a page that a search snippet points at (the reference's deep-search tool,
docs/reference.md "Deep-search browsing").

- HTML: the body decoded in its real charset (the declared one when it decodes, else detected:
  stages/agent/search/html_text.py), then lxml's HTML parser (libxml2: linear time) over it, comments and
  processing instructions dropped, then scripts, styles, templates and frames with their content (nothing is
  executed or fetched), words joined by single spaces, first `max_text_chars`. libxml2 stops at its nesting limit
  (256 levels: it bounds the tree of a page of unclosed tags) and drops everything after that point; a page that
  reaches it is read again by `html_text.stream_text`, which needs no tree, so the text below the limit is kept. A
  page that reaches the limit and holds no text at all fails as `too_deep`, never an empty success.
- PDF: pypdf, at most `pdf_max_pages` pages, first `pdf_max_words` words; with a `deadline` each page gets at most
  `page_timeout_s` (a slower page is skipped) and the whole document until the deadline (`Overrun`).
- Binary junk served as text (NUL or control bytes in its first 8 KB) is refused, never passed on as text.
- Lone surrogates (a PDF's ToUnicode map can produce them) become U+FFFD.
- Passage: the sentence with the best word F1 against the snippet (above the threshold) and `passage_chars` on each
  side of it; without one, the first 2 x `passage_chars`. The Chinese variant splits sentences at 。！？ when the
  snippet holds a CJK ideograph and cuts Chinese text into words with jieba.
- `defang`: protocol tags (`<result>`, `<answer>`, a tool's tags, `<think>`) in page text cannot close or open a
  block of the trajectory: their `<` becomes `‹`.

HTML and PDF extraction run in a bounded worker process (stages/agent/search/extract_worker.py): the time limits
here are soft (a signal, seen between bytecodes), the worker's kill is the hard one.
"""

from __future__ import annotations

import io
import logging
import re
import signal
import string
import time
from collections.abc import Iterator
from contextlib import contextmanager

from stages.agent.search.html_text import DROP_TAGS, decode_page, stream_text

_CONTROL = set(range(0, 9)) | {11, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31}
_PUNCT = str.maketrans("", "", string.punctuation)
_EN_SENTENCE = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[\"'(\[]?[A-Z0-9])")
_ZH_SENTENCE = re.compile(r"[。！？]")
_CJK = re.compile(r"[\u4e00-\u9fa5]")
_PROTOCOL_TAG = re.compile(r"<(\s*/?\s*(?:result|answer|search|python|think|tool_call|tool_response)\b)", re.I)
_SURROGATE = re.compile("[\ud800-\udfff]")


class ExtractError(ValueError):
    """The body is not text this tool reads (binary junk, a broken PDF). `kind` names why."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class Overrun(BaseException):  # noqa: N818 - a signal, not an error; BaseException so `except Exception` misses it
    """A soft time limit ran out (raised from SIGALRM in the main thread)."""


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise `Overrun` in this (main) thread after `seconds` of wall-clock time."""
    def _raise(_signum: int, _frame: object) -> None:
        raise Overrun

    previous = signal.signal(signal.SIGALRM, _raise)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1e-3))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def looks_binary(data: bytes) -> bool:
    """True when the first 8 KB hold a NUL byte or more than 5% control bytes (not text, whatever its type says)."""
    head = data[:8192]
    if not head:
        return False
    if b"\x00" in head:
        return True
    return sum(b in _CONTROL for b in head) > 0.05 * len(head)


def valid_text(text: str) -> str:
    """Lone surrogates (not encodable as UTF-8) replaced by U+FFFD."""
    return _SURROGATE.sub("\ufffd", text)


def _parse_html(text: str) -> tuple[object | None, bool]:
    """(lxml's tree of `text`, or None for a document of nothing but markup; whether libxml2 stopped at one of its
    limits, the nesting depth: what follows that point is missing from the tree)."""
    from lxml import etree, html

    parser = html.HTMLParser(encoding="utf-8", remove_comments=True, remove_pis=True, no_network=True)
    try:
        root = html.document_fromstring(text.encode("utf-8"), parser=parser)
    except etree.ParserError:  # "Document is empty": nothing but markup or whitespace
        root = None
    except (LookupError, ValueError, etree.LxmlError) as err:
        if any(entry.type_name == "ERR_NO_MEMORY" for entry in getattr(err, "error_log", ())):
            raise MemoryError("libxml2 ran out of memory") from None  # the worker's limit, not bad HTML
        raise ExtractError("unparsable", f"HTML could not be parsed: {type(err).__name__}") from None
    return root, any(entry.type_name == "ERR_RESOURCE_LIMIT" for entry in parser.error_log)


def html_to_text(data: bytes, charset: str | None, max_chars: int) -> str:
    """Visible text of an HTML (or plain text) body, whitespace squeezed, first `max_chars` characters."""
    from lxml import etree

    if looks_binary(data):
        raise ExtractError("binary", "the body is binary data, not text")
    if not data.strip():
        return ""
    text, _ = decode_page(data, charset)
    root, stopped = _parse_html(text)
    if stopped:  # libxml2 hit its nesting limit and dropped the rest: read the page without a tree
        read = stream_text(text, max_chars)
        if not read:
            raise ExtractError("too_deep", "the page nests its elements past the HTML parser's limit (256 levels) "
                               "and no text was found in it")
        return valid_text(read)
    if root is None:
        return ""
    etree.strip_elements(root, *DROP_TAGS, with_tail=False)
    parts, size = [], 0
    for piece in root.itertext():
        words = piece.split()
        if words:
            parts.append(" ".join(words))
            size += len(parts[-1]) + 1
            if size > max_chars:
                break
    return valid_text(" ".join(parts)[:max_chars])


def pdf_to_text(data: bytes, max_pages: int, max_words: int, deadline: float | None = None,
                page_timeout_s: float = 0.0) -> str:
    """Text of a PDF's first `max_pages` pages, first `max_words` words. With a `deadline` (time.monotonic()) the
    document must be read by then (else `Overrun`) and a page that takes over `page_timeout_s` is skipped (main
    thread only: signals)."""
    from pypdf import PdfReader

    def bounded(seconds: float):  # noqa: ANN202 - a context manager
        if deadline is None:
            return _no_limit()
        left = deadline - time.monotonic()
        if left <= 0:
            raise Overrun
        return time_limit(min(seconds, left))

    words: list[str] = []
    try:
        with bounded(float("inf")):
            reader = PdfReader(io.BytesIO(data))
            pages = reader.pages[:max_pages]
        for page in pages:
            try:
                with bounded(page_timeout_s or float("inf")):
                    words += (page.extract_text() or "").split()
            except Overrun:
                if deadline is not None and time.monotonic() >= deadline:
                    raise
                continue  # this page alone was too slow: the others may still be read
            if len(words) >= max_words:
                break
    except MemoryError:
        raise
    except Exception as err:  # noqa: BLE001 - pypdf raises many types on broken files
        raise ExtractError("bad_pdf", f"the PDF could not be read: {type(err).__name__}: {str(err)[:120]}") from err
    return valid_text(" ".join(words[:max_words]))


@contextmanager
def _no_limit() -> Iterator[None]:
    yield


def defang(text: str) -> str:
    """Protocol tags in untrusted text lose their `<` (see the module docstring)."""
    return _PROTOCOL_TAG.sub(lambda m: "\u2039" + m.group(1), text)


def clean_snippet(snippet: str) -> str:
    """Bing's bold marks dropped, as the reference does before matching."""
    return snippet.replace("<b>", "").replace("</b>", "")


def _words(text: str, language: str) -> set[str]:
    text = text.lower().translate(_PUNCT)
    if language == "zh" and len(_CJK.findall(text)) >= 0.3 * max(1, sum(c.isalpha() for c in text)):
        import jieba

        jieba.setLogLevel(logging.WARNING)  # its dictionary load would print at INFO/DEBUG
        return {w for w in jieba.lcut(text) if w.strip()}
    return set(text.split())


def sentences(text: str, snippet: str, language: str) -> list[str]:
    if language == "zh" and _CJK.search(snippet):
        return [s for s in _ZH_SENTENCE.split(text) if s]
    return [s for s in _EN_SENTENCE.split(text) if s]


def word_f1(truth: set[str], pred: set[str]) -> float:
    common = len(truth & pred)
    if not common:
        return 0.0
    precision, recall = common / len(pred), common / len(truth)
    return 2 * precision * recall / (precision + recall)


def select_passage(text: str, snippet: str, context_chars: int, threshold: float = 0.2,
                   scan_chars: int = 50_000, language: str = "en") -> tuple[bool, str]:
    """(found, passage): `context_chars` on each side of the sentence of `text[:scan_chars]` whose word F1 against
    the snippet is best and above `threshold`; else (False, the first 2 x `context_chars`)."""
    text = text[:scan_chars]
    target = _words(snippet, language)
    best, best_f1 = None, threshold
    for sentence in sentences(text, snippet, language):
        f1 = word_f1(target, _words(sentence, language))
        if f1 > best_f1:
            best, best_f1 = sentence, f1
    if best is None:
        return False, text[: context_chars * 2]
    start = text.find(best)
    return True, text[max(0, start - context_chars): start + len(best) + context_chars]
