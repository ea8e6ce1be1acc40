"""Content accuracy (stages/eval/content.py): the answer graded wherever the response gives one. The responses are
written the way the learning bench's SFT policy answers `arith` ("What is 347 * 812?", gold 281764, one <python>
call, prompt template tir_python_short), one per failure kind the format check rejects (docs/learning.md); the
expected answer of each follows from the rules in the module doc."""

from __future__ import annotations

import pytest

from stages.agent.protocol import check_format
from stages.core.config.eval import EvalSection
from stages.eval.content import MAX_ANSWER_CHARS, content_answer, content_correct, content_text
from stages.eval.rows import PredictionRow
from stages.eval.scoring import score_samples, summarize_benchmark

GOLD = "281764"
CALL = ("<think>I need the product of 347 and 812; I will compute it with python.</think>"
        "<python>print(347 * 812)</python> <result>\n281764\n</result>")
THINK = "<think>The result is 281764, so the product of 347 and 812 is 281764.</think>"
WELL_FORMED = CALL + THINK + "<answer>The answer is \\boxed{281764}</answer>"
# the failure kinds, with the answer each gives
NO_EOS = WELL_FORMED + ("\n<|im_start|>user\nWhat is 100 * 200?<|im_end|>\n<|im_start|>assistant\n"
                        "<think>100 times 200 is 20000.</think><answer>The answer is \\boxed{20000}</answer>")
TRAILING = WELL_FORMED + " I hope this helps! Let me know if you need anything else."
UNCLOSED_ANSWER = CALL + THINK + "<answer>The answer is \\boxed{281764}"
CUT_IN_BOX = CALL + THINK + "<answer>The answer is \\boxed{2817"          # cut at the response cap
NO_BOX = CALL + THINK + "<answer>281764</answer>"
NO_ANSWER_TAG = CALL + THINK + "\nThe answer is 281,764."
BOX_WITHOUT_TAG = CALL + THINK + "So the final answer is \\boxed{281764}."
ONLY_THE_TOOL = CALL                                                   # the result is the tool's, not an answer
WRONG = CALL + "<think>The product is 281765.</think><answer>The answer is \\boxed{281765}</answer>"
NO_THINK = "<python>print(347 * 812)</python> <result>\n281764\n</result><answer>\\boxed{281764}</answer>"


@pytest.mark.parametrize(("response", "answer"), [
    (WELL_FORMED, "281764"),
    (NO_EOS, "281764"),           # the first <answer> span: the later one answers a turn the policy made up
    (TRAILING, "281764"),
    (UNCLOSED_ANSWER, "281764"),  # the span runs to the end
    (CUT_IN_BOX, "2817"),         # the text after the unclosed \boxed{
    (NO_BOX, "281764"),           # the span itself
    (NO_ANSWER_TAG, "281764"),    # the last number of the last line after the last tag, thousands comma dropped
    (BOX_WITHOUT_TAG, "281764"),  # the last complete \boxed{}
    (ONLY_THE_TOOL, None),        # <result> blocks removed: nothing written after the call
    (WRONG, "281765"),
    (NO_THINK, "281764"),
    ("", None),
])
def test_the_answer_is_found_through_each_format_failure(response: str, answer: str | None) -> None:
    assert content_answer(response) == answer


def test_the_format_check_rejects_every_failure_kind_the_content_grade_reads() -> None:
    # the format-strict accuracy counts only the first (and the wrong one); content accuracy reads them all
    assert check_format(WELL_FORMED).ok and check_format(WRONG).ok
    for response in (NO_EOS, UNCLOSED_ANSWER, CUT_IN_BOX, NO_BOX, NO_ANSWER_TAG, BOX_WITHOUT_TAG, NO_THINK):
        assert not check_format(response).ok
    # text after </answer> without a second <answer> passes the reference's check; content reads it the same way
    assert check_format(TRAILING).ok


@pytest.mark.parametrize(("response", "correct"), [
    (WELL_FORMED, True), (NO_EOS, True), (TRAILING, True), (UNCLOSED_ANSWER, True), (CUT_IN_BOX, False),
    (NO_BOX, True), (NO_ANSWER_TAG, True), (BOX_WITHOUT_TAG, True), (ONLY_THE_TOOL, False), (WRONG, False),
    (NO_THINK, True),
])
def test_content_correct_grades_math_by_math_verify(response: str, correct: bool) -> None:
    assert content_correct(response, GOLD, "math") is correct


def test_qa_answers_are_graded_by_exact_match_and_text_is_unwrapped() -> None:
    response = "<think>Paris.</think><answer>\\boxed{\\text{Paris}}</answer> and then some more text"
    assert content_text(response, "qa") == "Paris"
    assert content_correct(response, "['Paris', 'City of Paris']", "qa")
    # the last line after the last tag, whole for qa (no number picking)
    assert content_answer("<think>Where?</think>\nParis", "qa") == "Paris"
    assert not content_correct("<think>Where?</think>\nLondon", "Paris", "qa")


def test_hostile_text_is_bounded() -> None:
    # a megabyte of unclosed boxes: only the last 16,384 characters are read; they hold no <answer>, no complete
    # box, an unclosed one with nothing after it, and no number: no answer
    hostile = WELL_FORMED + "<answer>" + "\\boxed{" * 150_000
    assert content_answer(hostile) is None and not content_correct(hostile, GOLD, "math")
    # 50,000 digits after the last tag: the last 16,384 are read (the tag falls outside), the number is cut to its
    # last MAX_ANSWER_CHARS (1000) characters, so math-verify never sees more
    assert content_answer("<think>x</think>" + "9" * 50_000) == "9" * MAX_ANSWER_CHARS


def test_the_scoring_stage_reports_content_accuracy_beside_its_headline(tmp_path) -> None:
    # q0: an unclosed answer (prediction extracted by the inference stage: extract_answer gives the span's box);
    # q1: no <answer> and no box: the headline falls back to the last 5 lines, content finds "281764"; q2: wrong
    from stages.agent.protocol import extract_answer

    outputs = {"q0": UNCLOSED_ANSWER, "q1": NO_ANSWER_TAG, "q2": WRONG}
    rows = [PredictionRow(id=qid, sample=0, question="What is 347 * 812?", golds=[GOLD], task_type="math",
                          prediction=extract_answer(out), output=out, benchmark="arith")
            for qid, out in outputs.items()]
    cfg = EvalSection(math_workers=1)
    samples = score_samples(cfg, rows, None, tmp_path, "llm_equal")
    assert [s.content_text for s in samples] == ["281764", "281764", "281765"]
    assert [s.content_equal for s in samples] == [1.0, 1.0, 0.0]
    summary = summarize_benchmark(cfg, samples, False, "llm_equal")
    assert summary["content_accuracy"] == pytest.approx(2 / 3)
