"""Helpers shared by the agent tests: whether bubblewrap runs here (a failure in CI, a skip elsewhere), and
reproducible arbitrary text for property-style tests."""

from __future__ import annotations

import os
import random
from functools import lru_cache

import pytest


@lru_cache(maxsize=1)
def bwrap_problem() -> str | None:
    """None when the bwrap sandbox runs a call here, else the reason (the message users get)."""
    from stages.agent.sandbox.executor import resolve_mode
    from stages.agent.sandbox.host import SandboxUnavailable
    from stages.core.config.agent import PythonToolSection

    try:
        resolve_mode(PythonToolSection(sandbox="bwrap", preload=[]))
    except SandboxUnavailable as err:
        return str(err)
    return None


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_bwrap() -> None:
    """Skip when bubblewrap cannot run, with the reason; in CI (`CI=true`), where scripts/setup.sh installs it,
    fail instead: a security test must never pass by not running."""
    problem = bwrap_problem()
    if problem is None:
        return
    if in_ci():
        pytest.fail(f"CI=true and the bwrap sandbox cannot run: {problem}", pytrace=False)
    pytest.skip(f"bwrap unusable: {problem}")


# Code points that broke text pipelines before: lone surrogates, NUL and controls, BOM, bidi overrides,
# combining marks, noncharacters, private use, astral emoji and ZWJ sequences, line/paragraph separators.
NASTY = ["\ud800", "\udfff", "\udc80", "\x00", "\x1b[31m", "\x7f", "\ufeff", "\u202e", "\u0301", "\ufffe",
         "\uffff", "\U0010ffff", "\ue000", "🙂", "👩\u200d💻", "\u2028", "\u2029", "\r\n", "\t", "\\", '"', "'",
         "</python>", "<result>", "```", "search query: ", "\\x00", "%s%n", "{0}", "日本語", "العربية"]


def arbitrary_texts(seed: int, count: int, max_len: int = 120) -> list[str]:
    """`count` strings drawn from every Unicode code point (surrogates included) mixed with NASTY pieces; a few
    are long. Seeded, so a failure names an example that reproduces."""
    rng = random.Random(seed)
    texts = ["", " ", "\ud800", "print('\ud800')", "a\x00b", "\udfff\ud800", "x" * 5000]
    while len(texts) < count:
        length = rng.choice([1, 2, 5, 20, max_len, 4 * max_len if rng.random() < 0.1 else max_len])
        parts = []
        for _ in range(length):
            roll = rng.random()
            if roll < 0.15:
                parts.append(rng.choice(NASTY))
            elif roll < 0.55:
                parts.append(chr(rng.randrange(0x20, 0x7F)))
            elif roll < 0.75:
                parts.append(chr(rng.randrange(0x80, 0x800)))
            else:
                parts.append(chr(rng.randrange(0x110000)))
        texts.append("".join(parts))
    return texts[:count]
