"""Every scorer of model-written text returns within its bound from any thread, and a hostile answer scores wrong.

Calling paths: verl's reward (`stages.rl.verl.reward.compute_score`) from worker threads, as verl's reward loop
calls it; the local engine's `compute_rewards` on the main thread, as `stages.rl.trainer` calls it; the eval
scorer (`score_samples`); the judge's reply parser. "Within the bound" is a thread join with a timeout (or
pytest-timeout on the main thread), never a measured speed. The bound of a math answer is `timeout_s` (5 s) +
`KILL_GRACE_S` once the worker is up (docs/agent.md "Bounded math scoring"); SLACK_S covers a loaded 2-core box.
"""

from __future__ import annotations

import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from stages.agent.answer_match import math_equivalent, unwrap_text
from stages.agent.math_screen import screen_math
from stages.agent.math_worker import KILL_GRACE_S, MathWorkerError, MathWorkerPool, pool
from stages.agent.protocol import check_format, count_tool_calls, extract_answer
from stages.agent.rewards import compute_rewards
from stages.eval.judge import reply_says_correct
from stages.rl.verl.reward import compute_score

pytestmark = pytest.mark.timeout(120)  # a hang fails the file instead of stalling CI

SLACK_S = 10.0
BOUND_S = 5.0 + KILL_GRACE_S + SLACK_S
MARKER = Path("/tmp/arpo-scoring-bounded-pwned")
GOLD = "42"  # no hostile answer equals it by any rule (`{{1}}` normalises to the token '1' for EM/F1)

HOSTILE = {
    "power tower (the issue's answer)": r"10^{10^{10^{10}}}",
    "plain power tower": "9^9^9^9",
    "python power tower": "9**9**9",
    "negative tower": r"10^{-10^{10}}",
    "huge integer exponent": r"2^{10^{7}}",
    "factorial 100000!": "100000!",
    "factorial of a power": r"(10^{10})!",
    "nested factorials": "((5!)!)!",
    "factorial exponent": r"2^{5000!}",
    "deep braces": "{" * 400 + "1" + "}" * 400,
    "deep parentheses": "(" * 400 + "1" + ")" * 400,
    "deep fractions": r"\frac{1}{1+" * 60 + "1" + "}" * 60,
    "50k characters": "1+" * 25_000 + "1",
    "TeX input": r"\input{/etc/passwd}",
    "TeX shell escape": rf"\immediate\write18{{touch {MARKER}}}",
    "TeX recursion": r"\def\a{\a}\a",
    "python code": f"__import__('os').system('touch {MARKER}')",
    "unicode junk": "\x00\ud800\U0010fffd\u202e\u200b\ufeff" * 30,
}


def within(seconds: float, fn, *args, **kwargs):
    """fn(*args) on a worker thread (as verl calls the reward); fails when it is still running after `seconds`."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as err:  # noqa: BLE001 - re-raised on the caller's thread
            box["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{getattr(fn, '__name__', fn)} still running after {seconds} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


def response(answer: str) -> str:
    """A well-formed response (format ok, no tool calls) whose final answer is `answer`."""
    return f"<think>so</think>\n<answer>\\boxed{{{answer}}}</answer>"


@pytest.fixture(scope="module", autouse=True)
def warm_worker():
    """Start the scoring worker once (its start-up is not part of the per-answer bound)."""
    assert within(60, math_equivalent, "1", "1") is True
    yield
    assert not MARKER.exists(), "a scorer ran code written in an answer"


# ---- the screen -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", HOSTILE)
def test_the_screen_refuses_each_hostile_answer(name):
    assert screen_math(HOSTILE[name]) is not None


@pytest.mark.parametrize("answer", [
    r"\frac{1}{2}", "x^2+2x+1", r"2^{10}", r"10^{5}", "5!", r"\frac{2024!}{2022!}", r"e^{x^2}", r"2^{2^{4}}",
    r"\left( 3, \frac{\pi}{2} \right)", r"\$32,\!348", "1,000", r"\sqrt[3]{2}", "99^{99}", r"\text{(C)}",
    r"\{1,2\}", "3.14", "-7", "π/2", "60°", r"\dfrac{\sqrt{3}}{2}",
])
def test_the_screen_passes_ordinary_answers(answer):
    assert screen_math(answer) is None


# ---- the RL reward on verl's calling path: worker threads ---------------------------------------------------------

@pytest.mark.parametrize("name", HOSTILE)
def test_verl_reward_from_a_thread_scores_hostile_answers_wrong(name):
    result = within(BOUND_S, compute_score, data_source="math", solution_str=response(HOSTILE[name]),
                    ground_truth=GOLD, extra_info={"ability": "math"}, reward="math_equiv")
    assert result["acc"] == 0.0 and result["score"] <= 0.0  # 0 (wrong) or -1 (format), never credit


def test_verl_reward_from_a_thread_pool_scores_a_mixed_batch():
    # verl's reward loop runs compute_score concurrently on a thread pool; right answers keep their credit:
    # 0.5 = 1/2, (x+1)^2 = x^2+2x+1, 2^10 = 1024, 5! = 120, C(5,2) = 10 -> 1.0 each; 17 vs 18 -> 0.0
    cases = [("0.5", r"\frac{1}{2}", 1.0), ("x^2+2x+1", "(x+1)^2", 1.0), (r"2^{10}", "1024", 1.0),
             ("5!", "120", 1.0), (r"\binom{5}{2}", "10", 1.0), ("17", "18", 0.0)]
    cases += [(answer, GOLD, 0.0) for answer in HOSTILE.values()]
    with ThreadPoolExecutor(max_workers=8) as threads:
        futures = [threads.submit(compute_score, solution_str=response(a), ground_truth=g,
                                  extra_info={"ability": "math"}, reward="math_equiv") for a, g, _ in cases]
        scores = [future.result(timeout=BOUND_S * 2) for future in futures]
    assert [s["acc"] for s in scores] == [expected for _, _, expected in cases]


# ---- the RL reward on the local engine's calling path: the main thread --------------------------------------------

@pytest.mark.parametrize("reward", ["math_equiv", "reference"])
def test_local_engine_reward_on_the_main_thread(reward):
    assert threading.current_thread() is threading.main_thread()
    answers = [*HOSTILE.values(), "0.5"]
    rewards = compute_rewards(reward, [response(a) for a in answers], [GOLD] * len(HOSTILE) + [r"\frac{1}{2}"],
                              ["math"] * len(answers))
    assert [r.correct for r in rewards[:-1]] == [False] * len(HOSTILE)
    assert all(r.score <= 0.0 for r in rewards[:-1])
    # 0.5 vs \frac{1}{2}: math_equiv finds them equal (1.0); the reference rule's F1 of '05' vs 'frac12' is 0
    assert rewards[-1].score == {"math_equiv": 1.0, "reference": 0.0}[reward]


# ---- the hard bound itself: answers the screen lets through ----------------------------------------------------

def test_the_issues_answer_unscreened_ends_in_the_worker():
    # straight to the worker, past the screen: its memory cap / soft timer / kill must end it
    equal, _ = within(1.0 + KILL_GRACE_S + SLACK_S, pool().equivalent, r"\boxed{10^{10^{10^{10}}}}", ["1"], 1.0)
    assert equal is False


def test_a_slow_answer_the_screen_misses_is_cut_at_its_timeout():
    assert screen_math(r"2^{99999}^{99999}") is None  # a double superscript: not read as a tower
    assert within(1.0 + KILL_GRACE_S + SLACK_S, math_equivalent, r"2^{99999}^{99999}", "1", timeout_s=1.0) is False
    assert within(BOUND_S, math_equivalent, "0.25", r"\frac{1}{4}") is True  # the worker still answers


FAKE_WORKER = r"""
import json, re, sys
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    request = json.loads(line)
    if request["pred"] == "hang":  # catastrophic backtracking: C code holding the GIL for ever
        re.match(r"(a+)+$", "a" * 64 + "b")
    print(json.dumps({"equal": request["pred"] in request["golds"]}), flush=True)
"""


def test_a_worker_stuck_in_c_code_is_killed_and_replaced():
    workers = MathWorkerPool(max_workers=1, command=[sys.executable, "-c", FAKE_WORKER])
    try:
        assert workers.equivalent("1", ["1"], 0.5) == (True, None)
        stuck = next(iter(workers._all)).proc
        equal, error = within(0.5 + KILL_GRACE_S + SLACK_S, workers.equivalent, "hang", ["1"], 0.5)
        assert (equal, error) == (False, f"no verdict within {0.5 + KILL_GRACE_S:g} s (worker exit code -9)")
        assert stuck.poll() is not None and workers.restarts == 1  # killed, not left spinning
        assert workers.equivalent("2", ["2"], 0.5) == (True, None)  # the replacement answers
    finally:
        workers.close()


def test_a_worker_that_cannot_start_is_an_error_not_a_wrong_answer():
    workers = MathWorkerPool(command=[sys.executable, "-c", "import sys; sys.exit(3)"])
    with pytest.raises(MathWorkerError, match="did not start"):
        within(SLACK_S, workers.equivalent, "1", ["1"], 0.5)
    workers.close()


# ---- evaluation: the eval scorer, the judge's reply parser, answer extraction --------------------------------------

def test_eval_scorer_scores_hostile_predictions_wrong(tmp_path):
    from stages.core.config.eval import EvalSection
    from stages.eval.rows import PredictionRow
    from stages.eval.scoring import score_samples

    predictions = [*HOSTILE.values(), "\\frac{1}{2}"]
    rows = [PredictionRow(id=str(i), sample=0, question="q", golds=[GOLD if i < len(HOSTILE) else "0.5"],
                          task_type="math", prediction=p, output=response(p)) for i, p in enumerate(predictions)]
    # the eval pool's bound per answer: 5 s x (2 x 1 gold + 1) + 30 s slack (MathVerifier), plus its start-up
    scored = within(5.0 * 3 + 30 + SLACK_S, score_samples, EvalSection(), rows, None, tmp_path)
    assert [s.math_equal for s in scored] == [0.0] * len(HOSTILE) + [1.0]  # 1/2 = 0.5
    assert [s.score for s in scored] == [0.0] * len(HOSTILE) + [1.0]


@pytest.mark.parametrize("reply, correct", [
    ("<judgment>" * 20_000 + "Correct", True),                # no closed span: the whole reply is read
    ("<judgment>" * 20_000 + "Incorrect", False),
    ("<judgment>Correct</judgment>" * 5_000, True),
    ("<think>" * 20_000 + "Correct", False),                  # an unclosed think block hides the rest
    ("\ud800\x00" * 20_000 + "<judgment>correct</judgment>", True),
])
def test_judge_reply_parser_is_linear_on_hostile_replies(reply, correct):
    assert within(SLACK_S, reply_says_correct, reply) is correct


@pytest.mark.parametrize("text", [
    "<answer>" + "\\boxed{" * 10_000 + "</answer>",              # thousands of unclosed boxes
    "<answer>\\boxed{" + "{" * 20_000 + "1" + "}" * 20_000 + "}</answer>",
    "<answer>" + "\\boxed{" * 5_000 + "1" + "}" * 5_000 + "</answer>",
    "<python>" * 10_000 + "<search>" * 10_000 + "<result>" * 10_000,
])
def test_answer_extraction_is_linear_on_hostile_responses(text):
    within(SLACK_S, check_format, text)
    within(SLACK_S, count_tool_calls, text)
    within(SLACK_S, extract_answer, text)


def test_nested_boxes_give_the_last_opened_box():
    # the innermost box opens last: its content is '1'
    assert extract_answer("<answer>" + "\\boxed{" * 5_000 + "1" + "}" * 5_000 + "</answer>") == "1"


def test_unwrap_text_handles_thousands_of_nested_macros():
    # 5000 nested \text{ around x: unwrapped to x (recursion would hit Python's limit at ~1000)
    assert within(SLACK_S, unwrap_text, "\\text{" * 5_000 + "x" + "}" * 5_000) == "x"
    assert unwrap_text("\\text{" * 5_000 + "x") == "\\text{" * 5_000 + "x"  # unclosed: left as is
