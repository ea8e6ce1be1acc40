"""The Jina Reader as the page reader (`agent.search.browse.reader: jina`), as the reference's Chinese deep-search
tool can read pages (SDS cn `extract_text_from_url(use_jina=True)`, docs/reference.md "Deep-search browsing").

A page is asked for as `GET <jina_url><page url>` with `X-Return-Format: markdown` and, when the key variable
(`jina_api_key_env`, filled from `jina_secret_block` by the pipeline's tasks: tasks/secrets.py) is set,
`Authorization: Bearer <key>`. The answer is taken as text as it is: no HTML parsing; link targets `(http…)` and
`[http…]` dropped and `---` / `===` / runs of three spaces shortened as the reference does, then the first
`max_text_chars`. The same limits as a direct fetch hold (stages/agent/search/pages.py): the page's time limit, at
most `max_bytes` read, binary junk refused, the rate limits. The page URL must still be a public http(s) address (it
leaves the machine inside the reader request); robots.txt is not read (we never contact the host).
"""

from __future__ import annotations

import os
import re

from stages.agent.search.extract import ExtractError, looks_binary
from stages.core.config.browse import BrowseSection

READER_VERSION = "jina-md-1"  # bump when what a cached reader page holds changes
# the reference's `\(https?:.*?\)|\[https?:.*?\]` (SDS cn 204), bounded so a hostile page cannot make it quadratic
_LINK = re.compile(r"\(https?:[^)\n]{0,2048}\)|\[https?:[^\]\n]{0,2048}\]")


def jina_key(cfg: BrowseSection) -> str:
    """The Jina API key from the environment ('' = keyless)."""
    return os.environ.get(cfg.jina_api_key_env, "").strip()


def jina_request(cfg: BrowseSection, url: str, key: str) -> tuple[str, dict[str, str]]:
    """The reader URL for a page and the headers to send with it."""
    headers = {"X-Return-Format": "markdown", **({"Authorization": f"Bearer {key}"} if key else {})}
    return f"{cfg.jina_url}{url}", headers


def reader_text(body: bytes, charset: str | None, max_chars: int) -> str:
    """The reader's markdown as the reference keeps it: links dropped, rules and spaces shortened, first
    `max_chars` characters. Binary junk is an ExtractError, as for a direct fetch."""
    if looks_binary(body):
        raise ExtractError("binary", "the reader answered with binary data, not text")
    try:
        text = body.decode(charset or "utf-8", "replace")
    except LookupError:  # an unknown charset name in the header
        text = body.decode("utf-8", "replace")
    text = _LINK.sub("", text).replace("---", "-").replace("===", "=").replace("   ", " ").replace("   ", " ")
    return text[:max_chars]
