"""Reward functions (docs/reference.md "Reward"): -1 bad format, 0 if F1 = 0, F1, +0.1 with both tools."""

from __future__ import annotations

import pytest

from stages.agent.rewards import REWARDS, compute_rewards
from stages.core.registry import UnknownNameError

SEARCH = "<think>look it up</think><search>capital of France</search> <result>\nParis is the capital.\n</result>"
PYTHON = "<think>check</think><python>print(2+3)</python> <result>\n5\n</result>"


def answer(text: str) -> str:
    return f"<think>done</think><answer>The answer is \\boxed{{{text}}}</answer>"


def score(name: str, response: str, gold: str, ability: str = "qa") -> float:
    return compute_rewards(name, [response], [gold], [ability])[0].score


def test_reference_reward_cases():
    cases = [
        (SEARCH + PYTHON + answer("Paris"), "Paris", 1.1),   # F1 = 1, both tools called -> 1 + 0.1
        (SEARCH + answer("Paris"), "Paris", 1.0),            # one tool only -> no bonus
        (SEARCH + answer("Paris France"), "Paris", 2 / 3),   # P = 1/2, R = 1 -> F1 = 2*0.5/1.5 = 0.666667
        (SEARCH + PYTHON + answer("London"), "Paris", 0.0),  # F1 = 0 -> 0, even with both tools
        (SEARCH + answer("The Eiffel-Tower!"), "eiffel tower", 0.0),  # 'eiffeltower' vs 'eiffel tower': F1 0
        (answer("Lowy"), "['Frank Lowy', 'Lowy']", 1.0),     # list-string gold: max over golds
        (answer("no"), "yes", 0.0),                          # yes/no mismatch -> 0
        ("<answer>\\boxed{Paris}</answer>", "Paris", -1.0),  # no <think> -> bad format
        ("<think>x</think><answer>Paris</answer>", "Paris", -1.0),  # no \boxed{} -> bad format
        ("<think>x</think><search>q</search>" + answer("Paris"), "Paris", -1.0),  # call without <result>
        ("<think>x</think> The answer is Paris", "Paris", -1.0),  # no <answer>
    ]
    rewards = compute_rewards("reference", [c[0] for c in cases], [c[1] for c in cases], ["qa"] * len(cases))
    assert [r.score for r in rewards] == pytest.approx([c[2] for c in cases], abs=1e-9)
    assert [r.correct for r in rewards[:3]] == [True, True, False]
    assert rewards[0].answer == "Paris" and rewards[7].answer is None


def test_reference_scores_math_by_token_f1():
    # the reference scores math answers by token F1: '\frac{1}{2}' normalises to 'frac12', '0.5' to '05' -> 0
    assert score("reference", answer("\\frac{1}{2}"), "0.5", "math") == 0.0
    assert score("reference", answer("42"), "42", "math") == 1.0


def test_math_equiv_reward():
    # math rows: math-verify equality -> 1 (+0.1 with both tools), else 0; bad format -1
    assert score("math_equiv", answer("\\frac{1}{2}"), "0.5", "math") == 1.0
    assert score("math_equiv", SEARCH + PYTHON + answer("\\frac{1}{2}"), "0.5", "math") == pytest.approx(1.1)
    assert score("math_equiv", answer("3"), "0.5", "math") == 0.0
    assert score("math_equiv", "<think>x</think>0.5", "0.5", "math") == -1.0
    # qa rows fall back to the reference rule: 'Paris France' vs 'Paris' -> F1 2/3
    assert score("math_equiv", answer("Paris France"), "Paris", "qa") == pytest.approx(2 / 3)


def test_reward_inputs_are_checked_and_names_listed():
    with pytest.raises(ValueError, match="one entry per trajectory"):
        compute_rewards("reference", ["a", "b"], ["a"], ["qa", "qa"])
    with pytest.raises(UnknownNameError, match="math_equiv"):
        compute_rewards("math", [], [], [])
    assert set(REWARDS.names()) >= {"reference", "math_equiv"}


def test_format_only_reward_scores_the_format_alone():
    # the task reward's format term without its correctness term: -1 malformed or no answer, 0 well-formed (right or
    # wrong, with or without both tools: no bonus either); `correct` is still graded for the accuracy metric
    cases = [
        (answer("\\frac{1}{2}"), "0.5", "math", 0.0, True),             # right (math-verify) -> 0, not 1
        (SEARCH + PYTHON + answer("\\frac{1}{2}"), "0.5", "math", 0.0, True),  # no multi-tool bonus
        (answer("3"), "0.5", "math", 0.0, False),                       # wrong but well-formed -> 0, as right
        ("<think>x</think>0.5", "0.5", "math", -1.0, False),            # no <answer>: the format penalty
        ("<think>x</think><answer>0.5</answer>", "0.5", "math", -1.0, False),  # no \boxed{}: the penalty
        (answer("Paris"), "Paris", "qa", 0.0, True),                    # qa: exact match graded, not rewarded
        (answer("London"), "Paris", "qa", 0.0, False),
    ]
    rewards = compute_rewards("format_only", [c[0] for c in cases], [c[1] for c in cases], [c[2] for c in cases])
    assert [r.score for r in rewards] == [c[3] for c in cases]
    assert [r.correct for r in rewards] == [c[4] for c in cases]
    assert rewards[0].reason == "format ok, correctness not rewarded" and rewards[0].answer == "\\frac{1}{2}"
    assert "format_only" in REWARDS.names()


def test_format_only_is_selectable_by_config():
    from stages.core.config.loader import load_config

    cfg = load_config("tiny-cpu", ["rl.trainer.reward=format_only"])
    assert cfg.rl.trainer.reward == "format_only"
