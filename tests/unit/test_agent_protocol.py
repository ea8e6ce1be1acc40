"""TIR protocol: tool-call parsing, answer extraction, the format contract, prompts."""

from __future__ import annotations

import pytest

from stages.agent.prompt_templates import build_messages, template_tools
from stages.agent.protocol import (
    STOP_TAGS,
    ToolCall,
    check_format,
    count_tool_calls,
    extract_answer,
    parse_tool_call,
    render_result,
)

GOOD = (
    "<think> need the capital </think> <search> capital of France </search>"
    " <result>\nPage 1: Paris is the capital.\n</result>"
    "<think> compute </think> <python>print(2+3)</python> <result>\n5\n</result>"
    "<think> done </think> <answer> The final answer is \\[ \\boxed{Paris} \\] </answer>"
)


# ---- parse_tool_call -------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("<think>x</think> <search> capital of France </search>", ToolCall("search", "capital of France")),
    # the server stripped the matched stop string
    ("<think>x</think> <search> capital of France ", ToolCall("search", "capital of France")),
    ("<think>x</think><python>\nimport math\nprint(math.pi)\n</python>\n",
     ToolCall("python", "import math\nprint(math.pi)")),
    ("<python>print(1)", ToolCall("python", "print(1)")),
    # two opening tags: the last one holds the query
    ("<search> a <search> b </search>", ToolCall("search", "b")),
    # python opened, search closed: mismatched -> no call
    ("<python>x = 1</search>", None),
    # a complete call followed by more text is not at a stop
    ("<search>q</search> and then more", None),
    # the call must be in the newest model segment, not before the last result
    ("<search>q</search> <result>\nr\n</result> thinking", None),
    ("", None),
    ("no tags at all", None),
    ("<search></search>", ToolCall("search", "")),
])
def test_parse_tool_call(text, expected):
    assert parse_tool_call(text) == expected


def test_parse_tool_call_with_stop_reason():
    # vLLM reports which stop fired; the text then lacks it
    assert parse_tool_call("<think>a</think><python>print(7)", stop="</python>") == ToolCall("python", "print(7)")
    # the stop names search but only a python tag is open -> mismatched
    assert parse_tool_call("<python>print(7)", stop="</search>") is None
    # an unknown stop (EOS) is not a tool call
    assert parse_tool_call("<python>print(7)", stop="<|im_end|>") is None


def test_parse_tool_call_after_results_uses_last_segment():
    text = GOOD.split("<answer>")[0] + "<search> second query"
    assert parse_tool_call(text) == ToolCall("search", "second query")


# ---- extract_answer ------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    (GOOD, "Paris"),
    # nested braces are balanced
    ("<answer>\\boxed{\\frac{1}{2}}</answer>", "\\frac{1}{2}"),
    # several boxes in the answer: the last one
    ("<answer>\\boxed{3} or rather \\boxed{4}</answer>", "4"),
    # several answers: the last answer span
    ("<answer>\\boxed{1}</answer> hmm <answer>\\boxed{2}</answer>", "2"),
    # truncated: <answer> never closed, box complete
    ("<think>t</think><answer> so \\boxed{42} and then", "42"),
    # truncated inside the box: no complete box -> the raw span text
    ("<answer> so \\boxed{4", "so \\boxed{4"),
    # answer without a box: the span text
    ("<answer> Paris </answer>", "Paris"),
    # no answer tag: the last box outside results
    ("<think>t</think> the result is \\boxed{7}", "7"),
    # a box inside a tool result does not count
    ("<result>\n\\boxed{9}\n</result> no answer", None),
    ("<answer>   </answer>", None),
    ("", None),
    ("plain text", None),
    # the backspace quirk of the reference data ("\b"oxed)
    ("<answer>\x08oxed{5}</answer>", "5"),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


# ---- check_format ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, ok, reason_part", [
    (GOOD, True, "correct"),
    ("<think>a</think><think>b<answer>\\boxed{1}</answer>", False, "not paired"),
    ("<answer>\\boxed{1}</answer>", False, "not found"),
    ("<think>a</think>", False, "<answer>"),
    ("<think>a</think><answer>\\boxed{1}</answer><answer>\\boxed{2}</answer>", False, "<answer>"),
    ("<think>a</think><search>q</search><answer>\\boxed{1}</answer>", False, "search/result tags are incomplete"),
    ("<think>a</think><search>q <result>r</result></search><answer>\\boxed{1}</answer>", False, "wrong order"),
    ("<think>a</think><python>1</python><answer>\\boxed{1}</answer>", False, "python/result tags are incomplete"),
    ("<think>a</think></answer>x<answer>\\boxed{1}", False, "before"),
    ("<think>a</think><answer>Paris</answer>", False, "boxed"),
    ("<think>a</think><answer>\\boxed{Par</answer>", False, "boxed"),
])
def test_check_format(text, ok, reason_part):
    check = check_format(text)
    assert check.ok is ok
    assert reason_part in check.reason


def test_count_tool_calls_ignores_results_and_unclosed():
    assert count_tool_calls(GOOD) == {"search": 1, "python": 1}
    # a tag printed inside a result is not a call; an unclosed call is not counted
    text = "<python>print(1)</python> <result>\n<search>x</search>\n</result><search>open"
    assert count_tool_calls(text) == {"search": 0, "python": 1}


def test_render_result_and_stop_tags():
    assert render_result("5") == " <result>\n5\n</result>"
    assert STOP_TAGS == ("</search>", "</python>")


# ---- prompts -----------------------------------------------------------------------------------------------
def test_build_messages_and_template_tools():
    messages = build_messages("What is 2+2?")
    assert [m["role"] for m in messages] == ["system", "user"]
    assert messages[0]["content"].startswith("You are a helpful assistant")
    assert "\\boxed{answer here}" in messages[0]["content"]
    assert messages[1]["content"] == "What is 2+2?"
    assert template_tools("tir_search_python") == ("search", "python")
    assert template_tools("tir_search") == ("search",)
    assert template_tools("tir_python") == ("python",)
    assert template_tools("no_tool") == ()


def test_build_messages_errors():
    with pytest.raises(ValueError, match="non-empty"):
        build_messages("  ")
    with pytest.raises(FileNotFoundError, match="known templates"):
        build_messages("q", template="nope")
