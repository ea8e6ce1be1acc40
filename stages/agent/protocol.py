"""The tool-integrated reasoning (TIR) text protocol: pure functions, no I/O.

Tags (docs/reference.md "Tags and the format contract"): `<think>…</think>`, a call `<tool>argument</tool>` of
every registered tool (stages/agent/tools.py: `<search>query</search>`, `<python>code</python>`), the environment's
`<result>…</result>`, and `<answer>… \\boxed{X} …</answer>`. Generation stops at a closing tool
tag (`STOP_TAGS`); the caller runs the tool and appends `render_result(text)`.

Every function here accepts arbitrary model output (truncated, nested, mismatched tags) without raising.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from stages.agent.tools import TOOLS as TOOL_CLASSES
from stages.agent.tools import tool_names

# The tools registered when stages.agent.tools is imported (the built-ins), in protocol order. The functions
# below read the registry at call time, so a tool registered later is parsed and checked like these.
TOOLS: tuple[str, ...] = tool_names()
STOP_TAGS: tuple[str, ...] = tuple(f"</{tool}>" for tool in TOOLS)
ANSWER_STOP = "</answer>"

# Feedback the environment gives inside <result> instead of silently stopping (ARPO eval `completion` modes).
LIMIT_MESSAGES = {
    **{tool: TOOL_CLASSES.get(tool).limit_message() for tool in TOOLS},
    "total": "The maximum tool call limit is exceeded. You are not allowed to call tools anymore; "
             "give your final answer.",
}
REPEAT_MESSAGE = "You have searched this query. Please refer to previous results."

_RESULT_BLOCK = re.compile(r"<result>.*?(?:</result>|\Z)", re.DOTALL)
_BOX_OPENERS = ("\\boxed{", "\\fbox{", "\x08oxed{")  # 0x08: the reference data's "\b"oxed quirk
_BRACE = re.compile(r"[{}]")


@dataclass(frozen=True)
class ToolCall:
    tool: str  # a registered tool
    argument: str  # the query or the code, stripped of surrounding whitespace


@dataclass(frozen=True)
class FormatCheck:
    ok: bool
    reason: str


def _last_segment(text: str) -> str:
    """The text the model wrote after the last environment result (a tool call must be there)."""
    end = text.rfind("</result>")
    return text[end + len("</result>"):] if end >= 0 else text


def parse_tool_call(text: str, stop: str | None = None) -> ToolCall | None:
    """The tool call that ends `text`, or None.

    `text` is model output up to a stop; it may or may not end with the closing tag (servers strip the
    matched stop string). `stop`, when given (e.g. vLLM's `stop_reason`), names the tag that fired.
    Without `stop` the closing tag at the end of `text`, else the last opening tag that is still open in the
    last model segment, decides. The argument is the text after the last matching opening tag.
    `<python>x</search>` (mismatched) and text without an open call give None.
    """
    segment = _last_segment(text).rstrip()
    tools = tool_names()
    if stop is not None and stop not in tuple(f"</{tool}>" for tool in tools):
        return None
    for tool in tools:
        close = f"</{tool}>"
        if (stop == close) or (stop is None and segment.endswith(close)):
            body = segment.removesuffix(close)
            start = body.rfind(f"<{tool}>")
            if start < 0:
                return None
            return ToolCall(tool, body[start + len(tool) + 2:].strip())
    if stop is not None:
        return None
    # closing tag stripped by the server: the latest opening tag that has no closing tag after it
    best: tuple[int, str] | None = None
    for tool in tools:
        start = segment.rfind(f"<{tool}>")
        if start >= 0 and f"</{tool}>" not in segment[start:] and (best is None or start > best[0]):
            best = (start, tool)
    if best is None:
        return None
    start, tool = best
    return ToolCall(tool, segment[start + len(tool) + 2:].strip())


def render_result(text: str) -> str:
    """The environment's insertion after a tool call, in the RL/training form (leading space, newlines)."""
    return f" <result>\n{text}\n</result>"


def _last_boxed(text: str, openers: tuple[str, ...] = _BOX_OPENERS) -> str | None:
    """Content of the last complete `\\boxed{…}` (balanced braces; the one that opens last), or None.

    One pass over the braces with a stack (each `{` is matched to its `}` once) that slices only the answer, so
    thousands of unclosed or nested `\\boxed{` in model output cost linear time and memory."""
    last: tuple[int, int, int] | None = None  # (opener start, content start, content end)
    stack: list[tuple[int, int]] = []  # (index of the `{`, start of its opener or -1 for a plain brace)
    for brace in _BRACE.finditer(text):
        i = brace.start()
        if text[i] == "{":
            opener = next((op for op in openers if i + 1 >= len(op) and text.startswith(op, i + 1 - len(op))), None)
            stack.append((i, -1 if opener is None else i + 1 - len(opener)))
        elif stack:
            start, box = stack.pop()
            if box >= 0 and (last is None or box > last[0]):
                last = (box, start + 1, i)
    return None if last is None else text[last[1]:last[2]]


def last_boxed(text: str) -> str | None:
    """Content of the last complete `\\boxed{…}` of `text` (balanced braces), or None; linear time."""
    return _last_boxed(text)


def strip_results(text: str) -> str:
    """`text` without the environment's `<result>` blocks (an unclosed one runs to the end)."""
    return _RESULT_BLOCK.sub("", text)


def _answer_span(text: str) -> str | None:
    """Content of the last <answer>…</answer>; an unclosed last <answer> runs to the end of the text."""
    start = text.rfind("<answer>")
    if start < 0:
        return None
    body = text[start + len("<answer>"):]
    end = body.find("</answer>")
    return body if end < 0 else body[:end]


def extract_answer(text: str) -> str | None:
    """The final answer of a response, or None.

    1. the last complete `\\boxed{…}` inside the last `<answer>` span (unclosed `<answer>` = to the end);
    2. else the stripped `<answer>` span itself when it is non-empty (an answer written without \\boxed);
    3. else (no `<answer>` tag) the last `\\boxed{…}` outside `<result>` blocks;
    4. else None.
    The reward uses `check_format` first, so fallbacks 2-3 only matter for evaluation of sloppy outputs.
    """
    span = _answer_span(text)
    if span is not None:
        box = _last_boxed(span)
        if box is not None:
            return box.strip()
        span = span.strip()
        if span:
            return span
    if span is None:
        box = _last_boxed(_RESULT_BLOCK.sub("", text))
        if box is not None:
            return box.strip()
    return None


def _pairs_ok(text: str, tool: str) -> str | None:
    """Every `<tool>` must be followed, in order, by `</tool>`, `<result>`, `</result>` (reference rule)."""
    pos = 0
    while (start := text.find(f"<{tool}>", pos)) >= 0:
        close = text.find(f"</{tool}>", start)
        res = text.find("<result>", start)
        res_end = text.find("</result>", res) if res >= 0 else -1
        if -1 in (close, res, res_end):
            return f"{tool}/result tags are incomplete"
        if not start < close < res < res_end:
            return f"{tool}/result tags are nested in the wrong order"
        pos = res_end
    return None


def check_format(response: str) -> FormatCheck:
    """The reference format contract (`deep_research.py::validate_format`; docs/reference.md "Tags and the format contract").

    `response` is the decoded response only (no prompt). Only a literal `\\boxed{…}` with balanced braces
    counts (the reference accepts `\\boxed{` plus any `}` but then fails to extract an unbalanced box and
    scores -1 anyway, so the reward is the same).
    """
    if response.count("<think>") != response.count("</think>"):
        return FormatCheck(False, "<think> </think> not paired")
    if response.count("<think>") == 0:
        return FormatCheck(False, "<think> or </think> not found")
    if response.count("<answer>") != 1 or response.count("</answer>") != 1:
        return FormatCheck(False, "<answer> or </answer> not found exactly once")
    for tool in tool_names():
        problem = _pairs_ok(response, tool)
        if problem:
            return FormatCheck(False, problem)
    start, end = response.find("<answer>"), response.find("</answer>")
    if start > end:
        return FormatCheck(False, "<answer> must be before </answer>")
    if _last_boxed(response[start:end], ("\\boxed{",)) is None:
        return FormatCheck(False, "answer is missing \\boxed{} format")
    return FormatCheck(True, "format is correct")


def count_tool_calls(response: str) -> dict[str, int]:
    """Complete `<tool>…</tool>` pairs per tool, ignoring anything inside `<result>` blocks."""
    text = _RESULT_BLOCK.sub("", response)
    return {tool: _count_pairs(text, f"<{tool}>", f"</{tool}>") for tool in tool_names()}


def _count_pairs(text: str, opening: str, closing: str) -> int:
    """Non-overlapping `opening…closing` pairs, leftmost first (what a lazy regex finds), in one pass: a regex
    would rescan to the end from every unclosed opening tag."""
    count, pos = 0, 0
    while (start := text.find(opening, pos)) >= 0:
        end = text.find(closing, start + len(opening))
        if end < 0:
            break  # no later opening tag can close either
        count, pos = count + 1, end + len(closing)
    return count


def minimal_answer(ground_truth: str) -> str:
    """The shortest response the format contract accepts, with `ground_truth` as its answer: a thinking block and
    the boxed answer, no tool call. It scores as a correct answer without the multi-tool bonus (the reference
    reward gives it F1 = 1). What stands in for a known-correct trajectory where no real one exists (a rehearsal's
    SFT file, self-critic DPO's `gold` chosen side)."""
    return f"<think>\nThe answer is {ground_truth}.\n</think>\n\n<answer>\\boxed{{{ground_truth}}}</answer>"
