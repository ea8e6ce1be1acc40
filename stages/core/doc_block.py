"""A generated table between two markers in a docs page: read what the page holds there, or write it anew (atomic).
Used by the generators whose tables live inside hand-written pages (stages.core.key_coverage, stages.rl.rules_doc).
"""

from __future__ import annotations

from pathlib import Path

from stages.core.atomic import write_text


def read_block(doc: Path, start: str, end: str) -> str:
    """The page's text between `start` and `end`, stripped."""
    text = doc.read_text(encoding="utf-8")
    return text[text.index(start) + len(start):text.index(end)].strip()


def write_block(doc: Path, start: str, end: str, body: str) -> None:
    """Replace what lies between the markers with `body` (on lines of its own)."""
    text = doc.read_text(encoding="utf-8")
    head, tail = text[:text.index(start) + len(start)], text[text.index(end):]
    write_text(doc, f"{head}\n{body}\n{tail}")
