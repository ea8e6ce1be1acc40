"""Reward functions: plain batch functions with one signature, registered by name.

    fn(responses: list[str], ground_truths: list[str], abilities: list[str]) -> list[Reward]

`responses` are the decoded responses only (model text plus the environment's <result> blocks, no prompt),
as the reference scores `solution_str`. `abilities` is the row's ability (math | qa | ...).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

from stages.agent.answer_match import exact_match, f1_score, math_equivalent
from stages.agent.protocol import check_format, count_tool_calls, extract_answer
from stages.core.registry import Registry

MULTI_TOOL_BONUS = 0.1
FORMAT_PENALTY = -1.0


@dataclass(frozen=True)
class Reward:
    score: float          # the scalar the advantage uses
    correct: bool         # for the accuracy metric: exact match (reference) or math equivalence (math_equiv)
    reason: str           # why: the format problem, "f1=0", "f1>0", "multi-tool bonus", "math equal", ...
    answer: str | None    # the extracted final answer
    f1: float

    def to_json(self) -> dict:
        return asdict(self)


RewardFn = Callable[[list[str], list[str], list[str]], list[Reward]]
REWARDS: Registry[RewardFn] = Registry("reward function")


def _both_tools_used(response: str) -> bool:
    calls = count_tool_calls(response)
    return calls["search"] > 0 and calls["python"] > 0


def _answer_or_penalty(response: str) -> str | Reward:
    """The extracted answer, or the format penalty (-1) when the format check fails or no answer is found."""
    fmt = check_format(response)
    if not fmt.ok:
        return Reward(FORMAT_PENALTY, False, fmt.reason, None, 0.0)
    answer = extract_answer(response)
    if answer is None:
        return Reward(FORMAT_PENALTY, False, "cannot extract the answer", None, 0.0)
    return answer


def reference_one(response: str, ground_truth: str) -> Reward:
    """The reference reward (docs/reference.md "Reward"): -1 bad format or no extractable answer; 0 if F1 = 0;
    F1 otherwise, +0.1 when F1 > 0 and both search and python were called."""
    answer = _answer_or_penalty(response)
    if isinstance(answer, Reward):
        return answer
    f1 = f1_score(answer, ground_truth)
    correct = exact_match(answer, ground_truth) == 1.0
    if f1 == 0:
        return Reward(0.0, correct, "f1=0", answer, 0.0)
    if _both_tools_used(response):
        return Reward(f1 + MULTI_TOOL_BONUS, correct, "f1>0, multi-tool bonus", answer, f1)
    return Reward(f1, correct, "f1>0", answer, f1)


def _check_lengths(responses: list[str], ground_truths: list[str], abilities: list[str]) -> None:
    if not len(responses) == len(ground_truths) == len(abilities):
        raise ValueError(f"reward inputs must have one entry per trajectory: {len(responses)} responses, "
                         f"{len(ground_truths)} ground truths, {len(abilities)} abilities")


@REWARDS.register("reference")
def reference_reward(responses: list[str], ground_truths: list[str], abilities: list[str]) -> list[Reward]:
    """The ARPO/AEPO rule for every row (math answers are scored by token F1 too, as the reference does)."""
    _check_lengths(responses, ground_truths, abilities)
    return [reference_one(r, g) for r, g in zip(responses, ground_truths)]


def math_one(response: str, ground_truth: str) -> Reward:
    """Math rows: -1 bad format / no answer; 1 when math-verify finds the answer equal to the gold, else 0;
    +0.1 on a correct answer when both tools were called (the same bonus as the reference)."""
    answer = _answer_or_penalty(response)
    if isinstance(answer, Reward):
        return answer
    f1 = f1_score(answer, ground_truth)
    if not math_equivalent(answer, ground_truth):
        return Reward(0.0, False, "math not equal", answer, f1)
    if _both_tools_used(response):
        return Reward(1.0 + MULTI_TOOL_BONUS, True, "math equal, multi-tool bonus", answer, f1)
    return Reward(1.0, True, "math equal", answer, f1)


@REWARDS.register("math_equiv")
def math_equiv_reward(responses: list[str], ground_truths: list[str], abilities: list[str]) -> list[Reward]:
    """math-verify equivalence for rows whose ability is `math`, the reference rule for the others."""
    _check_lengths(responses, ground_truths, abilities)
    return [math_one(r, g) if a == "math" else reference_one(r, g)
            for r, g, a in zip(responses, ground_truths, abilities)]


def format_one(response: str, ground_truth: str, ability: str) -> Reward:
    """The task's format score alone: the format penalty (-1) for a malformed answer or one with no extractable
    answer, 0 for a well-formed one, right or wrong. `correct` is still graded (math_equiv's rule), for the accuracy
    metric only: nothing rewards it."""
    graded = math_one(response, ground_truth) if ability == "math" else reference_one(response, ground_truth)
    if graded.score == FORMAT_PENALTY:
        return graded
    return Reward(0.0, graded.correct, "format ok, correctness not rewarded", graded.answer, graded.f1)


@REWARDS.register("format_only")
def format_only_reward(responses: list[str], ground_truths: list[str], abilities: list[str]) -> list[Reward]:
    """The control arm of the learning bench (docs/learning.md): the format penalty of the task reward without its
    correctness term. RL under it repairs the format as RL under the task reward does, and cannot teach the answers,
    so RL(task) - RL(format_only) isolates what the correctness reward teaches."""
    _check_lengths(responses, ground_truths, abilities)
    return [format_one(r, g, a) for r, g, a in zip(responses, ground_truths, abilities)]


def compute_rewards(name: str, responses: list[str], ground_truths: list[str], abilities: list[str]) -> list[Reward]:
    """Look the reward up by its config name (rl.trainer.reward) and score the batch."""
    return REWARDS.get(name)(responses, ground_truths, abilities)
