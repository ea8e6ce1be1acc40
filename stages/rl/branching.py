"""Pure branching arithmetic of ARPO / AEPO rollouts, as the reference code decides (docs/rollout.md, docs/reference.md).

Every random draw is an argument (u ~ U[0, 1) from the rollout driver's seeded generator), so each rule is a plain
function with hand-checkable values.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal


def clip01(x: float) -> float:
    return min(1.0, max(0.0, x))


def arpo_should_branch(u: float, tau: float, w: float, dh: float) -> bool:
    """ARPO's branch rule as the reference decides it (ARPO vllm_rollout_with_tools.py 473-477); the formula the
    card states is BRANCH_RULES["arpo"] in stages/rl/strategies.py."""
    return clip01(u - w * dh) <= tau


def penalty_factor(c: int, penalty: float) -> float:
    """AEPO consecutive-branch factor max(0, 1 - penalty * c); c from `consecutive_rounds` (the reference)."""
    return max(0.0, 1.0 - penalty * c)


def consecutive_rounds(c: int, added: int) -> int:
    """AEPO's counter after a round: c + 1 when the round added trajectories to the prompt (copies or fresh
    roots), else 0. It is read, unchanged, by every draw of the next round (AEPO vllm_rollout_with_tools.py
    1025-1036)."""
    return c + 1 if added > 0 else 0


def aepo_branch_score(u: float, w: float, dh: float, c: int, penalty: float) -> float:
    """AEPO's score, the left side of its rule (BRANCH_RULES["aepo"] in stages/rl/strategies.py)."""
    return clip01((u + w * dh) * penalty_factor(c, penalty))


def aepo_should_branch(u: float, tau: float, w: float, dh: float, c: int, penalty: float) -> bool:
    """Branch iff the score reaches tau (the comparison is flipped relative to ARPO)."""
    return aepo_branch_score(u, w, dh, c, penalty) >= tau


def arpo_branch_probability(tau: float, w: float, dh: float) -> float:
    """P(branch) of ARPO's rule over u ~ U[0, 1): clip(u - w dH) <= tau  <=>  u <= tau + w dH (for tau in [0, 1)),
    so P = clip(tau + w dH, 0, 1); tau >= 1 always branches (the clip is <= 1), tau < 0 never."""
    if tau < 0:
        return 0.0
    return 1.0 if tau >= 1 else clip01(tau + w * dh)


def aepo_branch_probability(tau: float, w: float, dh: float, c: int, penalty: float) -> float:
    """P(branch) of AEPO's rule over u ~ U[0, 1): clip((u + w dH) f) >= tau with f = max(0, 1 - penalty c) holds
    for tau in (0, 1] iff u >= tau / f - w dH, so P = 1 - clip(tau / f - w dH, 0, 1); f = 0 never branches and
    tau <= 0 always does (the clip is >= 0)."""
    if tau <= 0:
        return 1.0
    f = penalty_factor(c, penalty)
    return 0.0 if f == 0 else 1.0 - clip01(tau / f - w * dh)


def choose_branches(candidates: Sequence[tuple[int, float]], remaining: int, beam_size: int,
                    decide: Callable[[float, int], bool],
                    on_draw: Callable[[int], None] | None = None) -> list[int]:
    """Which candidates get a copy this round, in order (a parent appears once per copy).

    candidates: (trajectory id, dH) of one group, in creation order (earlier trajectories get priority). As the
    reference (ARPO 464-467, AEPO 934-939), a candidate draws exactly min(beam_size - 1, budget left) times, the
    count fixed before its first draw; the scan stops once the budget (`remaining`) is used up.
    `decide(dH, planned)` draws one decision; `planned` = copies planned earlier in this round. `on_draw(id)`, when
    given, is told after each draw whose candidate it was (the rollout records every draw: stages/rl/rollout.py).
    """
    parents: list[int] = []
    for traj_id, dh in candidates:
        draws = min(beam_size - 1, remaining - len(parents))
        if draws <= 0:
            break
        for _ in range(draws):
            branched = decide(dh, len(parents))
            if on_draw is not None:
                on_draw(traj_id)
            if branched:
                parents.append(traj_id)
    return parents


def fresh_to_add(n: int, created: int, active: int, mode: Literal["one", "all"] = "one") -> int:
    """Fresh root samples to start for a group after a round.

    Only a group with no active trajectory and budget left gets any: `one` (reference) starts one per round,
    which keeps budget for that fresh sample's own branches; `all` fills the whole budget at once (fewer rounds).
    """
    if active > 0 or created >= n:
        return 0
    return 1 if mode == "one" else n - created


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def dynamic_initial_rollouts(n: int, h_root: float, h_tool: float, beta: float = 0.5) -> int:
    """AEPO entropy pre-monitoring: clamp(floor(n * sigmoid(beta * (H_root - H_tool))) + 1, 1, n)."""
    return max(1, min(n, math.floor(n * sigmoid(beta * (h_root - h_tool))) + 1))
