"""Answer scoring primitives shared by RL rewards and evaluation metrics.

- `normalize_answer`: SQuAD normalisation (lower-case, drop punctuation, drop a/an/the, squeeze whitespace).
- `parse_gold`: a gold answer may be a plain string, a list, or a string holding a Python list such as
  `"['Frank Lowy']"` (the hotpotqa/2wiki/musique/bamboogle/SimpleQA files); always returns a list of strings.
  Dataset-specific gold extraction (gsm8k `#### 18`) belongs to the eval loaders.
- `exact_match`, `f1_score`: max over the golds; F1 follows the HotpotQA/reference rule that a yes/no/noanswer
  on either side scores 0 unless both normalise to the same string (docs/reference.md "Reward").
- `math_equivalent`: math-verify, bounded from any thread or process. The answer is pre-screened
  (`stages.agent.math_screen`: length, nesting, power towers, huge factorials, TeX that does I/O) and then scored
  in a persistent worker subprocess that is killed and replaced when it overruns (`stages.agent.math_worker`):
  a hostile answer costs at most the bound and scores as not equal. Verdicts are cached per process (an RL
  group often repeats one answer). `math_equivalent_local` scores in this process with the scorer the workers
  run (`stages.agent.math_local`, below both modules).
  An escaped dollar `\\$` is a currency sign, not a math delimiter: it is dropped first (as the reference's
  `strip_string` does), so MATH500 golds such as `\\$18.90` can be matched.
- `unwrap_text`: `\\text{Frank Lowy}` -> `Frank Lowy` (also \\textbf, \\textit, \\textrm, \\mathrm, \\mbox),
  for EM / F1 of answers the model boxed as LaTeX text (the reference's evaluation unwraps `\\text{}`).
"""

from __future__ import annotations

import ast
import re
import string
from collections import Counter
from collections.abc import Iterable
from typing import Any

from stages.agent.math_local import equivalent_here, refused, screened_golds
from stages.agent.math_screen import MAX_MATH_CHARS as MAX_MATH_CHARS  # re-exported: callers size inputs by it
from stages.agent.math_worker import worker_equivalent

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)
_SPECIAL = ("yes", "no", "noanswer")


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


def _brace_pairs(text: str) -> dict[int, int]:
    """{index of `{`: index of its matching `}`} for every balanced pair, in one pass (unmatched ones left out)."""
    stack: list[int] = []
    pairs: dict[int, int] = {}
    for i, ch in enumerate(text):
        if ch == "{":
            stack.append(i)
        elif ch == "}" and stack:
            pairs[stack.pop()] = i
    return pairs


def unwrap_text(text: str) -> str:
    """Replace every `\\text{...}` (and the other text macros) by its content, braces balanced, nested ones too:
    `\\text{Frank Lowy}` -> `Frank Lowy`; `5.4 \\text{ cents}` -> `5.4  cents`. From the first unclosed group on
    the text is left as is. One pass with a brace table, no recursion: linear in the text however deep the
    nesting (model-written text may nest thousands of levels)."""
    pairs = _brace_pairs(text)
    drop: list[tuple[int, int]] = []  # spans to delete: the macro openers and their closing braces
    pos = 0
    while (match := _TEXT_MACRO.search(text, pos)) is not None:
        close = pairs.get(match.end() - 1)
        if close is None:
            break
        # the content is balanced, so every macro inside it closes inside it too
        for macro in (match, *_TEXT_MACRO.finditer(text, match.end(), close)):
            drop += [(macro.start(), macro.end()), (pairs[macro.end() - 1], pairs[macro.end() - 1] + 1)]
        pos = close + 1
    out, last = [], 0
    for begin, stop in sorted(drop):
        out.append(text[last:begin])
        last = stop
    return "".join(out) + text[last:]


def _screened(pred: Any, gold: Any) -> tuple[str, list[str]] | None:
    """(prediction, golds) when the prediction passes the pre-screen, else None (scores as not equal). Golds
    the screen refuses are left out: no parse of them could end in time either."""
    if refused(pred):
        return None
    golds = screened_golds(parse_gold(gold))
    return (str(pred), golds) if golds else None


def math_equivalent(pred: str | None, gold: Any, timeout_s: float = 5.0) -> bool:
    """True when math-verify finds `pred` equal to any gold (`0.5` vs `\\frac{1}{2}` -> True).

    Bounded from any thread or process: a screened answer is scored in a worker subprocess that is killed after
    `timeout_s` + `KILL_GRACE_S` (stages.agent.math_worker); refused, timed-out or crashing answers are False.
    Bare strings are wrapped in `$...$` before parsing (math-verify reads a bare `1+x^2` as `1`).
    """
    texts = _screened(pred, gold)
    if texts is None:
        return False
    return worker_equivalent(texts[0], tuple(texts[1]), float(timeout_s))


def math_equivalent_local(pred: str | None, gold: Any, timeout_s: float = 5.0) -> bool:
    """math-verify in this process (stages.agent.math_local): screened, with a soft time limit on the main thread
    and none elsewhere. A C-level computation (a huge integer power) does not see the signal: only callers that
    can kill the process (the eval pool) should call this. Timeouts and errors are False."""
    return not refused(pred) and equivalent_here(pred, parse_gold(gold), timeout_s)
