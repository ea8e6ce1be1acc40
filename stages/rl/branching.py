"""Pure branching arithmetic of ARPO / AEPO rollouts (research/arpo.md 2.4, 3.1, 3.2; DESIGN.md section 5).

Every random draw is an argument (u ~ U[0, 1) from the engine's seeded generator), so each rule is a plain
function with hand-checkable values.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal


def clip01(x: float) -> float:
    return min(1.0, max(0.0, x))


def arpo_branch_probability(tau: float, w: float, dh: float) -> float:
    """ARPO: P = clip(tau + w * dH, 0, 1)."""
    return clip01(tau + w * dh)


def arpo_should_branch(u: float, tau: float, w: float, dh: float) -> bool:
    """Branch iff u < P. (The reference draws u and branches iff clip(u - w*dH, 0, 1) <= tau, which is the same
    event for tau < 1.)"""
    return u < arpo_branch_probability(tau, w, dh)


def penalty_factor(c: int, penalty: float) -> float:
    """AEPO consecutive-branch factor max(0, 1 - penalty * c); c = branches already made for the prompt."""
    return max(0.0, 1.0 - penalty * c)


def aepo_branch_score(u: float, w: float, dh: float, c: int, penalty: float) -> float:
    """AEPO: clip((u + w * dH) * max(0, 1 - penalty * c), 0, 1)."""
    return clip01((u + w * dh) * penalty_factor(c, penalty))


def aepo_should_branch(u: float, tau: float, w: float, dh: float, c: int, penalty: float) -> bool:
    """Branch iff the score reaches tau (the comparison is flipped relative to ARPO)."""
    return aepo_branch_score(u, w, dh, c, penalty) >= tau


def aepo_branch_probability(tau: float, w: float, dh: float, c: int, penalty: float) -> float:
    """P(score >= tau) for u ~ U[0, 1): with f = the penalty factor, (u + w dH) f >= tau <=> u >= tau/f - w dH,
    so P = clip(1 - tau/f + w dH, 0, 1); f = 0 gives score 0, which branches only when tau <= 0."""
    if tau <= 0:
        return 1.0
    f = penalty_factor(c, penalty)
    if f == 0:
        return 0.0
    return clip01(1.0 - tau / f + w * dh)


def plan_branches(candidates: Sequence[tuple[int, float]], remaining: int, beam_size: int, made: int,
                  decide: Callable[[float, int], bool]) -> list[int]:
    """Which candidates get a copy this round, in order (a parent appears once per copy).

    candidates: (trajectory id, dH) of one group, in creation order (earlier trajectories get priority, as in
    the reference); each may make up to beam_size - 1 copies; stop when `remaining` budget is used up.
    `decide(dH, c)` draws the random decision, c = branches the group already made this rollout (`made` + the
    copies planned so far).
    """
    parents: list[int] = []
    for traj_id, dh in candidates:
        for _ in range(max(0, beam_size - 1)):
            if len(parents) >= remaining:
                return parents
            if decide(dh, made + len(parents)):
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
