"""Branching arithmetic, budget filling, initial counts and entropy windows: hand-derived values."""

from __future__ import annotations

import pytest

from stages.core.config.rl import RolloutSection
from stages.core.registry import UnknownNameError
from stages.rl.branching import (
    aepo_branch_score,
    aepo_should_branch,
    arpo_should_branch,
    choose_branches,
    consecutive_rounds,
    dynamic_initial_rollouts,
    fresh_to_add,
    penalty_factor,
)
from stages.rl.entropy import EntropyWindow, delta_entropy, window_mean, window_sum
from stages.rl.strategies import get_strategy

GRID = [(i + 0.5) / 1000 for i in range(1000)]  # u on a uniform grid: fractions are exact to 1/1000


def arpo_branch_probability(tau: float, w: float, dh: float) -> float:
    """The closed form the decision rate is checked against: P(clip(u - w dH, 0, 1) <= tau) for u ~ U[0, 1) is
    clip(tau + w dH, 0, 1) for tau < 1, and 1 at tau = 1 (the clipped score never exceeds 1)."""
    return 1.0 if tau >= 1 else min(1.0, max(0.0, tau + w * dh))


def aepo_branch_probability(tau: float, w: float, dh: float, c: int, penalty: float) -> float:
    """P(score >= tau) for u ~ U[0, 1): with f = max(0, 1 - penalty c), (u + w dH) f >= tau <=> u >= tau/f - w dH,
    so P = clip(1 - tau/f + w dH, 0, 1); f = 0 gives score 0, which branches only when tau <= 0."""
    if tau <= 0:
        return 1.0
    f = penalty_factor(c, penalty)
    return 0.0 if f == 0 else min(1.0, max(0.0, 1.0 - tau / f + w * dh))


def test_arpo_probability_hand_values():
    assert arpo_branch_probability(0.5, 0.2, 0.5) == pytest.approx(0.6, abs=1e-12)   # 0.5 + 0.2*0.5
    assert arpo_branch_probability(0.5, 0.2, -1.0) == pytest.approx(0.3, abs=1e-12)  # 0.5 - 0.2
    assert arpo_branch_probability(0.5, 0.2, 3.0) == 1.0                             # 1.1 clipped
    assert arpo_branch_probability(0.5, 0.2, -3.0) == 0.0                            # -0.1 clipped
    # the reference's rule: branch iff clip(u - w dH, 0, 1) <= tau
    assert arpo_should_branch(0.59, 0.5, 0.2, 0.5)       # clip(0.59 - 0.1) = 0.49 <= 0.5
    assert not arpo_should_branch(0.61, 0.5, 0.2, 0.5)   # 0.51 > 0.5
    assert arpo_should_branch(0.05, 0.0, 0.2, 0.5)       # clip(-0.05) = 0 <= tau = 0: branches even at tau 0


def test_arpo_tau_one_always_branches_as_the_reference():
    # clip(u - w dH, 0, 1) <= 1 for every u: tau = 1 branches whatever dH (ARPO 473-477). The earlier rule
    # u < clip(1 + w dH) gave P = clip(1 - 0.2 * 3) = 0.4 at dH = -3.
    assert arpo_branch_probability(1.0, 0.2, -3.0) == 1.0
    assert all(arpo_should_branch(u, 1.0, 0.2, -3.0) for u in GRID)
    assert all(arpo_should_branch(u, 1.0, 0.2, 2.0) for u in GRID)


def test_arpo_decision_rate_matches_probability():
    # P = 0.5 + 0.2 * 0.7 = 0.64 -> 640 of the 1000 grid points branch
    assert sum(arpo_should_branch(u, 0.5, 0.2, 0.7) for u in GRID) == 640
    # tau < 1: the reference's event is u <= tau + w dH, so P = clip(tau + w dH) as before
    for tau, dh in [(0.3, 0.0), (0.5, -1.0), (0.9, 0.4), (0.2, -2.0)]:
        rate = sum(arpo_should_branch(u, tau, 0.2, dh) for u in GRID) / 1000
        assert rate == pytest.approx(arpo_branch_probability(tau, 0.2, dh), abs=1.5e-3)


def test_consecutive_rounds_counter():
    # c + 1 after a round that added trajectories (copies or fresh roots), 0 after one that added none
    c = 0
    trace = []
    for added in [1, 2, 0, 1, 1, 1, 0, 0, 3]:
        c = consecutive_rounds(c, added)
        trace.append(c)
    assert trace == [1, 2, 0, 1, 2, 3, 0, 0, 1]


def test_aepo_penalty_hand_values():
    assert penalty_factor(4, 0.05) == pytest.approx(0.8)       # 1 - 0.2
    assert penalty_factor(20, 0.05) == 0.0                     # 1 - 1.0
    assert penalty_factor(25, 0.05) == 0.0                     # max(0, -0.25)
    assert aepo_branch_score(0.7, 0.2, 0.5, 4, 0.05) == pytest.approx(0.64)   # (0.7 + 0.1) * 0.8
    assert aepo_should_branch(0.7, 0.5, 0.2, 0.5, 4, 0.05)                    # 0.64 >= 0.5
    assert not aepo_should_branch(0.7, 0.5, 0.2, 0.5, 10, 0.05)               # (0.8) * 0.5 = 0.4 < 0.5
    assert aepo_branch_score(0.95, 0.2, 1.0, 0, 0.05) == 1.0                  # 1.15 clipped


def test_aepo_probability_closed_form():
    # docs/reference.md "Branch rules": P = clip(1 - tau/f + w dH); c=0 -> 0.5, c=4 -> 1 - 0.5/0.8 = 0.375,
    # c=10 -> 1 - 0.5/0.5 + 0.2*1.0 = 0.2, c=20 -> f = 0 -> never
    assert aepo_branch_probability(0.5, 0.2, 0.0, 0, 0.05) == pytest.approx(0.5)
    assert aepo_branch_probability(0.5, 0.2, 0.0, 4, 0.05) == pytest.approx(0.375)
    assert aepo_branch_probability(0.5, 0.2, 1.0, 10, 0.05) == pytest.approx(0.2)
    assert aepo_branch_probability(0.5, 0.2, 5.0, 20, 0.05) == 0.0
    for c, dh in [(0, 0.0), (4, 0.3), (7, -0.4), (12, 1.0)]:
        rate = sum(aepo_should_branch(u, 0.5, 0.2, dh, c, 0.05) for u in GRID) / 1000
        assert rate == pytest.approx(aepo_branch_probability(0.5, 0.2, dh, c, 0.05), abs=1.5e-3)


def test_aepo_without_penalty_equals_arpo_at_tau_half():
    # with f = 1 and tau = 0.5: P_aepo = 1 - 0.5 + w dH = P_arpo
    for dh in (-1.0, -0.3, 0.0, 0.4, 1.0):
        assert aepo_branch_probability(0.5, 0.2, dh, 0, 0.0) == pytest.approx(arpo_branch_probability(0.5, 0.2, dh))


def test_plan_branches_scans_in_order_within_budget():
    always = lambda dh, planned: True
    cands = [(0, 0.0), (1, 0.0), (2, 0.0)]
    assert choose_branches(cands, remaining=3, beam_size=3, decide=always) == [0, 0, 1]
    assert choose_branches(cands, remaining=10, beam_size=3, decide=always) == [0, 0, 1, 1, 2, 2]
    assert choose_branches(cands, remaining=10, beam_size=1, decide=always) == []   # beam 1: no copies
    assert choose_branches(cands, remaining=0, beam_size=2, decide=always) == []
    by_dh = lambda dh, planned: dh > 0
    assert choose_branches([(0, -1.0), (1, 1.0)], remaining=5, beam_size=3, decide=by_dh) == [1, 1]


def test_plan_branches_draws_a_fixed_count_per_candidate():
    # the reference (ARPO 464-467, AEPO 934-939): min(beam - 1, budget left) draws, fixed before drawing.
    # beam 3, budget 3: candidate 0 draws twice (fails, succeeds: 1 planned), candidate 1 draws min(2, 3 - 1) = 2
    # times (both succeed: budget full), candidate 2 draws min(2, 0) = 0 times.
    outcomes = iter([False, True, True, True])
    seen = []

    def decide(dh, planned):
        seen.append((dh, planned))
        return next(outcomes)

    got = choose_branches([(0, 0.1), (1, 0.2), (2, 0.3)], remaining=3, beam_size=3, decide=decide)
    assert got == [0, 1, 1]
    assert seen == [(0.1, 0), (0.1, 0), (0.2, 1), (0.2, 2)]
    # budget 1 left, beam 3: exactly one draw; a failed draw is not retried (the earlier rule drew again)
    seen.clear()
    outcomes = iter([False, True])
    assert choose_branches([(0, 0.1)], remaining=1, beam_size=3, decide=decide) == []
    assert seen == [(0.1, 0)]


def test_fresh_to_add():
    assert fresh_to_add(8, 5, 0, "one") == 1
    assert fresh_to_add(8, 5, 0, "all") == 3
    assert fresh_to_add(8, 5, 1, "all") == 0      # active trajectories may still branch
    assert fresh_to_add(8, 8, 0, "one") == 0      # budget spent


def test_dynamic_initial_rollouts_hand_values():
    # sigmoid(0.5) = 0.622459 -> floor(16 * 0.622459) = floor(9.959) = 9 -> 10
    assert dynamic_initial_rollouts(16, 1.0, 0.0, 0.5) == 10
    # sigmoid(0) = 0.5 -> 8 + 1 = 9
    assert dynamic_initial_rollouts(16, 0.3, 0.3, 0.5) == 9
    # sigmoid(-10) = 4.5e-5 -> 0 + 1 = 1
    assert dynamic_initial_rollouts(16, -10.0, 10.0, 0.5) == 1
    # sigmoid(50) = 1.0 -> 16 + 1 = 17 -> clamped to n
    assert dynamic_initial_rollouts(16, 100.0, 0.0, 0.5) == 16
    # sigmoid(-0.5) = 0.377541 -> floor(1.51) = 1 -> 2
    assert dynamic_initial_rollouts(4, 0.0, 1.0, 0.5) == 2


def test_entropy_windows():
    ents = [0.2, 0.4, 0.6]
    assert window_mean(ents, 2) == pytest.approx(0.3, abs=1e-12)    # (0.2 + 0.4) / 2
    assert window_sum(ents, 2) == pytest.approx(0.6, abs=1e-12)     # 0.2 + 0.4
    assert window_mean(ents, 20) == pytest.approx(0.4, abs=1e-12)   # shorter segment: all of it
    assert window_mean([], 5) == 0.0
    assert EntropyWindow("paper", 2, "mean").segment_entropy(ents) == pytest.approx(0.3, abs=1e-12)
    assert EntropyWindow("reference", 2).segment_entropy(ents) == pytest.approx(0.6, abs=1e-12)  # sum by default
    assert EntropyWindow("paper", 2).segment_entropy(ents) == pytest.approx(0.6, abs=1e-12)
    assert EntropyWindow("paper").decide_after_generation and EntropyWindow("paper").copies_inherit_baseline
    assert not EntropyWindow("reference").decide_after_generation
    assert not EntropyWindow().copies_inherit_baseline and EntropyWindow().mode == "reference"
    # AEPO H_tool from probe segments (start, end, after_result, H): reference = mean of all, paper = post-result
    segments = [(0, 5, False, 0.9), (8, 12, True, 0.3), (15, 20, True, 0.6)]
    assert EntropyWindow("reference").tool_entropy(segments) == pytest.approx(0.6)   # (0.9 + 0.3 + 0.6) / 3
    assert EntropyWindow("paper").tool_entropy(segments) == pytest.approx(0.45)      # (0.3 + 0.6) / 2
    assert EntropyWindow("paper").tool_entropy(segments[:1]) is None                  # no call: caller uses H_root
    with pytest.raises(ValueError, match="entropy_aggregation"):
        EntropyWindow("paper", 2, "max")  # type: ignore[arg-type]
    assert delta_entropy(0.7, 0.2) == pytest.approx(0.5)
    assert delta_entropy(0.7, None) == 0.0
    with pytest.raises(ValueError, match="entropy_window"):
        EntropyWindow("late")  # type: ignore[arg-type]


def test_strategies_from_the_algorithm_table():
    cfg = RolloutSection(n=6, initial_rollouts=2)
    grpo = get_strategy("grpo", cfg)
    assert grpo.initial_rollouts() == 6 and not grpo.branching and not grpo.fill_fresh
    arpo = get_strategy("arpo", cfg)
    assert arpo.initial_rollouts() == 2 and arpo.branching and arpo.fill_fresh
    aepo = get_strategy("aepo", cfg.model_copy(update={"dynamic_rollouts": True}))
    assert aepo.probe and aepo.initial_rollouts(0.0, 1.0) == dynamic_initial_rollouts(6, 0.0, 1.0, 0.5)
    with pytest.raises(UnknownNameError, match="Known: \\['aepo', 'arpo', 'grpo'\\]"):
        get_strategy("apro", cfg)


def test_docs_rollout_holds_the_generated_branch_rules() -> None:
    # each rule's condition is written once (BRANCH_RULES); docs/rollout.md's table is generated from it
    from stages.rl import rules_doc
    from stages.rl.strategies import BRANCH_RULES

    assert rules_doc.documented() == rules_doc.table(), \
        "docs/rollout.md's branch rules are stale: run python -m flows.cli docs --write"
    # by hand: ARPO's rule names tau and w, AEPO's also the penalty p; the card fills in the run's values
    assert [BRANCH_RULES.get(n).symbols for n in ("arpo", "aepo")] == [["tau", "w"], ["tau", "w", "p"]]
    ro = RolloutSection(branch_probability=0.5, entropy_weight=0.2, branch_penalty=0.05)
    assert BRANCH_RULES.get("aepo").formula(ro) == \
        "branch iff clip((u + w dH) max(0, 1 - p c), 0, 1) >= tau; tau = 0.5, w = 0.2, p = 0.05"
