"""HTML bytes -> text without trusting the page: which charset the bytes are really in, and a reader that needs no
tree for a page nested past the parser's limit. Used by `extract.html_to_text` (in the extraction worker).

- Charset (`decode_page`): a UTF-8 byte-order mark wins; else the first of the declared charsets (the
  Content-Type header's, then a `<meta charset>` / `http-equiv` in the first 1024 bytes, the HTML standard's
  prescan window) that decodes the body without an error, else UTF-8 if it decodes; else detection by
  charset_normalizer over the first `DETECT_BYTES`. Among equally likely answers detection prefers windows-1252,
  the web's legacy default (the WHATWG Encoding standard maps the `latin1` / `iso-8859-1` labels to it): a
  French page mislabelled UTF-8 then reads as Latin-1, never as Central European cp1250. A body cut at the byte
  cap may end inside a character: that last partial character does not count as an error.
- `stream_text`: the page's text in document order from a scan for tags (no tree, no depth): comments, doctype and
  processing instructions skipped, the content of `DROP_TAGS` dropped up to its closing tag (to the end of the page
  when it has none, as the tree parser reads it), entities unescaped, each run of text's words joined by single
  spaces; it stops once `max_chars` of text are read. Linear in the page: every search starts where the last
  ended, and an unterminated tag or comment ends the scan (it runs to the end of the page).
"""

from __future__ import annotations

import codecs
import html
import re

DROP_TAGS = ("script", "style", "noscript", "template", "iframe", "frame", "frameset", "object", "embed", "svg",
             "canvas")
_VOID = frozenset({"embed", "frame"})  # no closing tag: nothing to skip past
_CLOSE = {name: re.compile(rf"</{name}(?=[\s/>])", re.I) for name in DROP_TAGS}
_MARKUP = re.compile(r"<[A-Za-z/!?]")  # where a tag, comment, doctype or processing instruction opens
_NAME = re.compile(r"<([A-Za-z][^\s/>]*)")
_META_CHARSET = re.compile(rb"<meta[^>]*?charset\s*=\s*[\"']?\s*([A-Za-z0-9._:-]{1,40})", re.I)
PRESCAN_BYTES = 1024  # the HTML standard's window for a <meta> charset
DETECT_BYTES = 1 << 20  # what charset detection reads (it decodes its input once per candidate codec)
LEGACY_DEFAULT = "cp1252"


def known_charset(name: str | bytes | None) -> str | None:
    """Python's codec name for a charset label, or None (no label, or one no codec knows)."""
    if isinstance(name, bytes):
        name = name.decode("ascii", "replace")
    try:
        return codecs.lookup(name).name if name else None
    except LookupError:
        return None


def meta_charset(data: bytes) -> str | None:
    """The charset a `<meta>` in the first PRESCAN_BYTES declares (`charset=` or `http-equiv` content)."""
    found = _META_CHARSET.search(data[:PRESCAN_BYTES])
    return known_charset(found.group(1)) if found else None


def decodes(data: bytes, charset: str) -> bool:
    """True when `data` is valid in `charset`, a partial character cut off at its end allowed."""
    try:
        codecs.getincrementaldecoder(charset)("strict").decode(data, final=False)
    except (UnicodeDecodeError, LookupError):
        return False
    return True


def detect_charset(data: bytes) -> str | None:
    """charset_normalizer's answer for the first DETECT_BYTES, windows-1252 among equally likely ones."""
    from charset_normalizer import from_bytes

    matches = from_bytes(data[:DETECT_BYTES])
    best = matches.best()
    if best is None:
        return None
    tied = {m.encoding for m in matches if (m.chaos, m.coherence) == (best.chaos, best.coherence)}
    return LEGACY_DEFAULT if LEGACY_DEFAULT in tied else best.encoding


def choose_charset(data: bytes, header: str | None) -> str:
    """The codec the body is read with (see the module docstring for the order)."""
    if data.startswith(codecs.BOM_UTF8):
        return "utf-8-sig"
    declared = [c for c in dict.fromkeys((known_charset(header), meta_charset(data), "utf-8")) if c]
    for charset in declared:
        if decodes(data, charset):
            return charset
    return detect_charset(data) or declared[0]


def decode_page(data: bytes, header: str | None) -> tuple[str, str]:
    """(the body's text, the codec it was read with); bytes the codec cannot read become U+FFFD."""
    charset = choose_charset(data, header)
    return data.decode(charset, "replace"), charset


def stream_text(text: str, max_chars: int) -> str:
    """The visible text of an HTML document without building a tree (see the module docstring)."""
    parts: list[str] = []
    size, pos, end = 0, 0, len(text)
    while pos < end and size <= max_chars:
        markup = _MARKUP.search(text, pos)
        stop = markup.start() if markup else end
        words = html.unescape(text[pos:stop]).split() if stop > pos else None
        if words:
            parts.append(" ".join(words))
            size += len(parts[-1]) + 1
        if markup is None:
            break
        pos = _skip_markup(text, stop)
    return " ".join(parts)[:max_chars]


def _skip_markup(text: str, start: int) -> int:
    """Where the text after the markup at `start` begins (len(text) when the markup runs to the end)."""
    end = len(text)
    if text.startswith("<!--", start):
        close = text.find("-->", start + 4)
        return end if close < 0 else close + 3
    close = text.find(">", start + 1)
    if close < 0:
        return end  # an unterminated tag: the rest of the page is inside it
    name = _NAME.match(text, start, close)
    tag = name.group(1).lower() if name else ""
    if tag not in _CLOSE or tag in _VOID or text[close - 1] == "/":
        return close + 1
    closing = _CLOSE[tag].search(text, close + 1)
    if closing is None:
        return end  # never closed: its content runs to the end of the page
    after = text.find(">", closing.end())
    return end if after < 0 else after + 1
