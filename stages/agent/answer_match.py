"""Answer scoring primitives shared by RL rewards and evaluation metrics.

- `normalize_answer`: SQuAD normalisation (lower-case, drop punctuation, drop a/an/the, squeeze whitespace).
- `parse_gold`: a gold answer may be a plain string, a list, or a string holding a Python list such as
  `"['Frank Lowy']"` (the hotpotqa/2wiki/musique/bamboogle/SimpleQA files); always returns a list of strings.
  Dataset-specific gold extraction (gsm8k `#### 18`) belongs to the eval loaders.
- `exact_match`, `f1_score`: max over the golds; F1 follows the HotpotQA/reference rule that a yes/no/noanswer
  on either side scores 0 unless both normalise to the same string (docs/reference.md "Reward").
- `math_equivalent`: math-verify. math-verify enforces its timeouts with `signal.alarm`, which only works in the
  main thread; called from any other thread this function disables math-verify's timeouts and instead refuses
  inputs longer than `MAX_MATH_CHARS` (the pathological cases are huge expressions). Safe from any thread.
  An escaped dollar `\\$` is a currency sign, not a math delimiter: it is dropped first (as the reference's
  `strip_string` does), so MATH500 golds such as `\\$18.90` can be matched.
- `unwrap_text`: `\\text{Frank Lowy}` -> `Frank Lowy` (also \\textbf, \\textit, \\textrm, \\mathrm, \\mbox),
  for EM / F1 of answers the model boxed as LaTeX text (the reference's evaluation unwraps `\\text{}`).
"""

from __future__ import annotations

import ast
import math
import re
import string
import threading
from collections import Counter
from collections.abc import Iterable
from typing import Any

MAX_MATH_CHARS = 1000
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)
_SPECIAL = ("yes", "no", "noanswer")
_LATEX_DELIMS = ("$", "\\(", "\\[", "\\boxed")


def normalize_answer(text: Any) -> str:
    """SQuAD normalisation: 'The  Eiffel-Tower!' -> 'eiffeltower'."""
    text = str(text).lower()
    text = "".join(ch for ch in text if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def parse_gold(gold: Any) -> list[str]:
    """Return the gold answers as a list of strings.

    `"['Frank Lowy', 'Lowy']"` -> `['Frank Lowy', 'Lowy']`; `["a", 3]` -> `['a', '3']`; `"Paris"` -> `['Paris']`;
    a string that merely starts with `[` but is not a Python list literal stays one answer.
    `None` or an empty list is an error (a gold answer is required).
    """
    if gold is None:
        raise ValueError("gold answer is None; every scored row needs an answer (check the dataset's answer field)")
    if isinstance(gold, str):
        stripped = gold.strip()
        if stripped.startswith("[") and stripped.endswith("]"):
            try:
                value = ast.literal_eval(stripped)
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                return [gold]
            if isinstance(value, (list, tuple)):
                return parse_gold(list(value))
        return [gold]
    if isinstance(gold, Iterable) and not isinstance(gold, (bytes, dict)):
        golds = [str(g) for g in gold if g is not None]
        if not golds:
            raise ValueError(f"gold answer list {gold!r} is empty; every scored row needs at least one answer")
        return golds
    return [str(gold)]


def exact_match(pred: str | None, golds: Any) -> float:
    """1.0 when the normalised prediction equals any normalised gold, else 0.0 (None scores 0)."""
    if pred is None:
        return 0.0
    norm = normalize_answer(pred)
    return float(any(norm == normalize_answer(g) for g in parse_gold(golds)))


def _f1_one(pred: str, gold: str) -> float:
    p, g = normalize_answer(pred), normalize_answer(gold)
    if (p in _SPECIAL or g in _SPECIAL) and p != g:
        return 0.0
    p_tokens, g_tokens = p.split(), g.split()
    same = sum((Counter(p_tokens) & Counter(g_tokens)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p_tokens), same / len(g_tokens)
    return 2 * precision * recall / (precision + recall)


def f1_score(pred: str | None, golds: Any) -> float:
    """Token F1 after normalisation, max over the golds (None scores 0)."""
    if pred is None:
        return 0.0
    return max(_f1_one(pred, g) for g in parse_gold(golds))


_TEXT_MACRO = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mbox)\s*\{")


def unwrap_text(text: str) -> str:
    """Replace every `\\text{...}` (and the other text macros) by its content, braces balanced, nested ones too:
    `\\text{Frank Lowy}` -> `Frank Lowy`; `5.4 \\text{ cents}` -> `5.4  cents`. An unclosed group is left as is."""
    out, pos = [], 0
    while (match := _TEXT_MACRO.search(text, pos)) is not None:
        depth, end = 1, match.end()
        while end < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            end += 1
        if depth:
            break
        out.append(text[pos:match.start()] + unwrap_text(text[match.end():end - 1]))
        pos = end
    return "".join(out) + text[pos:]


def _latex(text: str) -> str:
    # `\$` is an escaped dollar (currency), not a math delimiter; math-verify would read it as one and parse nothing
    text = text.replace("\\$", "").strip()
    return text if any(d in text for d in _LATEX_DELIMS) else f"${text}$"


def math_equivalent(pred: str | None, gold: Any, timeout_s: float = 5.0) -> bool:
    """True when math-verify finds `pred` equal to any gold (`0.5` vs `\\frac{1}{2}` -> True).

    Bare strings are wrapped in `$...$` before parsing (math-verify reads a bare `1+x^2` as `1`). In the main
    thread math-verify's own signal timeouts apply (`timeout_s`, rounded up to whole seconds); elsewhere they
    are disabled and inputs over MAX_MATH_CHARS are rejected (False). Parse failures and timeouts are False.
    """
    if pred is None or not str(pred).strip():
        return False
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    main = threading.current_thread() is threading.main_thread()
    seconds = max(1, math.ceil(timeout_s)) if main else None
    texts = [str(pred)] + parse_gold(gold)
    if not main and any(len(t) > MAX_MATH_CHARS for t in texts):
        return False
    try:
        target = parse(_latex(texts[0]), parsing_timeout=seconds)
        if not target:
            return False
        for g in texts[1:]:
            parsed = parse(_latex(g), parsing_timeout=seconds)
            if parsed and verify(parsed, target, timeout_seconds=seconds):
                return True
    except (TimeoutException, RecursionError, ValueError, TypeError):
        return False
    return False
