"""Page bytes -> text, and the passage of a page that a search snippet points at (the reference's deep-search tool,
docs/reference.md "Deep-search browsing").

- HTML: BeautifulSoup with Python's own parser (no lxml, nothing executed: scripts, styles, templates and frames are
  dropped before the text is read), words joined by single spaces, first `max_text_chars`.
- PDF: pypdf, at most `pdf_max_pages` pages, first `pdf_max_words` words.
- Binary junk served as text (NUL or control bytes in its first 8 KB) is refused, never passed on as text.
- Passage: the sentence with the best word F1 against the snippet (above the threshold) and `passage_chars` on each
  side of it; without one, the first 2 x `passage_chars`. The Chinese variant splits sentences at 。！？ when the
  snippet holds a CJK ideograph and cuts Chinese text into words with jieba.
- `defang`: protocol tags (`<result>`, `<answer>`, a tool's tags, `<think>`) in page text cannot close or open a
  block of the trajectory: their `<` becomes `‹`.
"""

from __future__ import annotations

import io
import logging
import re
import string

_DROP_TAGS = ("script", "style", "noscript", "template", "iframe", "object", "embed", "svg", "canvas")
_CONTROL = set(range(0, 9)) | {11, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31}
_PUNCT = str.maketrans("", "", string.punctuation)
_EN_SENTENCE = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[\"'(\[]?[A-Z0-9])")
_ZH_SENTENCE = re.compile(r"[。！？]")
_CJK = re.compile(r"[\u4e00-\u9fa5]")
_PROTOCOL_TAG = re.compile(r"<(\s*/?\s*(?:result|answer|search|python|think|tool_call|tool_response)\b)", re.I)


class ExtractError(ValueError):
    """The body is not text this tool reads (binary junk, a broken PDF). `kind` names why."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def looks_binary(data: bytes) -> bool:
    """True when the first 8 KB hold a NUL byte or more than 5% control bytes (not text, whatever its type says)."""
    head = data[:8192]
    if not head:
        return False
    if b"\x00" in head:
        return True
    return sum(b in _CONTROL for b in head) > 0.05 * len(head)


def html_to_text(data: bytes, charset: str | None, max_chars: int) -> str:
    """Visible text of an HTML (or plain text) body, whitespace squeezed, first `max_chars` characters."""
    from bs4 import BeautifulSoup

    if looks_binary(data):
        raise ExtractError("binary", "the body is binary data, not text")
    try:
        soup = BeautifulSoup(data, "html.parser", from_encoding=charset or None)
    except Exception as err:  # noqa: BLE001 - a parser failure on hostile input is a page failure, not a crash
        raise ExtractError("unparsable", f"HTML could not be parsed: {type(err).__name__}") from err
    for tag in soup(list(_DROP_TAGS)):
        tag.decompose()
    text = soup.get_text(separator=" ", strip=True)
    return " ".join(text.split())[:max_chars]


def pdf_to_text(data: bytes, max_pages: int, max_words: int) -> str:
    """Text of a PDF's first `max_pages` pages, first `max_words` words."""
    from pypdf import PdfReader

    try:
        reader = PdfReader(io.BytesIO(data))
        words: list[str] = []
        for page in reader.pages[:max_pages]:
            words += (page.extract_text() or "").split()
            if len(words) >= max_words:
                break
    except Exception as err:  # noqa: BLE001 - pypdf raises many types on broken files
        raise ExtractError("bad_pdf", f"the PDF could not be read: {type(err).__name__}: {str(err)[:120]}") from err
    return " ".join(words[:max_words])


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
