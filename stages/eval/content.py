"""Content accuracy: the task's answer graded wherever the response gives one, whatever its format.

The format-strict accuracy (the reward's `correct`, the eval stage's headline) counts an answer only in the form the
format contract asks for. A policy can raise that by closing its answers alone (format repair), so it cannot tell
whether RL taught anything else. Content accuracy reads the answer through the format's common failures, so format
repair cannot move it (docs/learning.md, the primary endpoint of protocol v2):

- a missing EOS: the answer is followed by more text (another turn, a second <answer>): the *first* <answer> span
  is the response's answer to this question;
- an unclosed <answer>: the span runs to the end of the response;
- no \\boxed{} in the span: the span itself; an unclosed `\\boxed{`: the text after it;
- no <answer> at all: the last complete `\\boxed{}`; else the last line written after the last tag (`</think>`, a
  tool call), for math its last number.

The environment's `<result>` blocks are removed first: a tool's output is not the policy's answer. Bounded on hostile
text: only the last `MAX_RESPONSE_CHARS` characters of a response are read, every step is linear in them, and an
answer longer than `MAX_ANSWER_CHARS` is cut to its last ones (math-verify refuses longer texts anyway). The grade
is the eval stage's rule for the row's task type (math-verify equality for math, exact match for qa).

Used by the scoring stage (`content_equal` per sample, `content_accuracy` in the summary: stages/eval/scoring.py)
and by the learning bench (bench/bench_learning.py, per held-out response).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from stages.agent.answer_match import exact_match, math_equivalent, unwrap_text
from stages.agent.math_screen import MAX_MATH_CHARS
from stages.agent.protocol import last_boxed, strip_results

MAX_RESPONSE_CHARS = 16_384
MAX_ANSWER_CHARS = MAX_MATH_CHARS
BOX_OPENER = "\\boxed{"
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def content_answer(response: str | None, task_type: str = "math") -> str | None:
    """The answer `response` gives (module doc), or None when it gives none."""
    text = strip_results((response or "")[-MAX_RESPONSE_CHARS:])
    start = text.find("<answer>")
    if start >= 0:
        span = text[start + len("<answer>"):]
        end = span.find("</answer>")
        answer = _boxed_or_text(span if end < 0 else span[:end])
    else:
        answer = last_boxed(text) or _unclosed_box(text) or _last_line(text, task_type)
    answer = None if answer is None else answer.strip()
    return answer[-MAX_ANSWER_CHARS:] if answer else None


def _boxed_or_text(span: str) -> str:
    return last_boxed(span) or _unclosed_box(span) or span


def _unclosed_box(text: str) -> str | None:
    """The text after the last `\\boxed{` that no `}` closes (a response cut inside its box), or None."""
    opener = text.rfind(BOX_OPENER)
    if opener < 0:
        return None
    rest, depth = text[opener + len(BOX_OPENER):], 1
    for brace in re.finditer(r"[{}]", rest):
        depth += 1 if brace.group() == "{" else -1
        if depth == 0:
            return None  # closed: last_boxed would have found it, unless its braces are off; nothing to add
    return rest


def _last_line(text: str, task_type: str) -> str | None:
    """The last non-empty line of the text written after the last tag (`</think>`, a tool call: what the policy
    wrote in the open at the end), for math its last number; None when it wrote nothing there."""
    after = text[text.rfind(">") + 1:]
    lines = [line for line in after[-4 * MAX_ANSWER_CHARS:].splitlines() if line.strip()]
    if not lines:
        return None
    if task_type != "math":
        return lines[-1]
    numbers = _NUMBER.findall(lines[-1])
    return numbers[-1].replace(",", "") if numbers else None


def content_text(response: str | None, task_type: str = "math") -> str:
    """The text a grader compares with the gold: the answer with its `\\text{}` unwrapped, "" when there is none."""
    answer = content_answer(response, task_type)
    return unwrap_text(answer).strip() if answer else ""


def content_correct(response: str | None, golds: str | Sequence[str], task_type: str = "math") -> bool:
    """Is the answer `response` gives, in whatever format, the gold? Math: math-verify (bounded, in its worker
    process); qa: exact match after SQuAD normalisation."""
    text = content_text(response, task_type)
    if not text:
        return False
    if task_type == "math":
        return math_equivalent(text, golds)
    return exact_match(text, golds) == 1.0
