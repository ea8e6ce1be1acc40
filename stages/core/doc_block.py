"""A generated block between two markers in a docs page: read what the page holds there, or put a new body there.
Every generated block is listed once, in flows/generated_docs.py, and rewritten or checked by one command
(`DOCS_COMMAND`); the generators only render.
"""

from __future__ import annotations

from pathlib import Path

DOCS_COMMAND = "python -m flows.cli docs --write"  # `arpo docs --write`: every generated block (flows/generated_docs.py)


def read_block(doc: Path, start: str, end: str) -> str:
    """The page's text between `start` and `end`, stripped."""
    text = doc.read_text(encoding="utf-8")
    return text[text.index(start) + len(start):text.index(end)].strip()


def replace_block(text: str, start: str, end: str, body: str, where: str = "the page") -> str:
    """`text` with what lies between the markers replaced by `body` (on lines of its own)."""
    if start not in text or end not in text:
        raise ValueError(f"{where} lacks the markers {start} and {end} around its generated block: restore them, "
                         f"then run `{DOCS_COMMAND}`")
    return f"{text[:text.index(start) + len(start)]}\n{body}\n{text[text.index(end):]}"
