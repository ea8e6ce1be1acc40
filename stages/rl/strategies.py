"""Rollout strategies, built from the algorithm table (stages/core/algorithm_spec.py): `get_strategy(algorithm, cfg)`
reads the algorithm's line (its growth, the branch rule it names, whether it owns the entropy probe) and the rollout
settings `cfg`; no algorithm has code of its own here.

A strategy answers three questions for the rollout driver, which owns the loop, the tools and the budget.
- how many root trajectories a group starts with (`initial_rollouts`; AEPO may ask for a probe first),
- whether a candidate makes a copy (`should_branch(u, dH, c)`, u ~ U[0,1) drawn by the driver),
- whether leftover budget is filled with fresh roots.

The branch rules are BRANCH_RULES, one per rule the table names: the rule's code (stages/rl/branching.py, with the
reference's lines), its probability over u, and its condition, written once here: the algorithm card states it with
the run's values, and docs/rollout.md's table of rules is generated from it (`python -m flows.cli docs --write`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from stages.core.algorithm_spec import ALGORITHMS
from stages.core.config.rl import RolloutSection
from stages.core.registry import Registry
from stages.rl.branching import (
    aepo_branch_probability,
    aepo_should_branch,
    arpo_branch_probability,
    arpo_should_branch,
    dynamic_initial_rollouts,
)

PROBE = "rollout.dynamic_rollouts"  # the entropy pre-monitoring option: an algorithm that owns it may probe
# the settings a rule's condition may name, by the symbol it uses for each (`rl.rollout.<setting>`)
SYMBOLS = {"tau": "branch_probability", "w": "entropy_weight", "p": "branch_penalty"}


@dataclass(frozen=True)
class BranchRule:
    """condition: when a candidate makes a copy, over the draw u ~ U[0, 1), the entropy change dH, the penalty
    counter c and the settings' SYMBOLS. decide(ro, u, dH, c): whether a draw u branches. probability(ro, dH, c):
    P(branch) over u."""

    condition: str
    decide: Callable[[RolloutSection, float, float, int], bool]
    probability: Callable[[RolloutSection, float, int], float]

    @property
    def symbols(self) -> list[str]:
        """The SYMBOLS its condition names, in SYMBOLS' order."""
        return [s for s in SYMBOLS if re.search(rf"\b{s}\b", self.condition)]

    def formula(self, ro: RolloutSection) -> str:
        """The rule as the algorithm card states it, with the values of the rollout settings `ro`."""
        values = ", ".join(f"{s} = {getattr(ro, SYMBOLS[s])}" for s in self.symbols)
        return f"branch iff {self.condition}; {values}"


def _arpo_decide(ro: RolloutSection, u: float, dh: float, c: int) -> bool:
    return arpo_should_branch(u, ro.branch_probability, ro.entropy_weight, dh)


def _arpo_probability(ro: RolloutSection, dh: float, c: int) -> float:
    return arpo_branch_probability(ro.branch_probability, ro.entropy_weight, dh)


def _aepo_decide(ro: RolloutSection, u: float, dh: float, c: int) -> bool:
    return aepo_should_branch(u, ro.branch_probability, ro.entropy_weight, dh, c, ro.branch_penalty)


def _aepo_probability(ro: RolloutSection, dh: float, c: int) -> float:
    return aepo_branch_probability(ro.branch_probability, ro.entropy_weight, dh, c, ro.branch_penalty)


BRANCH_RULES: Registry[BranchRule] = Registry("branch rule", {
    "arpo": BranchRule("clip(u - w dH, 0, 1) <= tau", _arpo_decide, _arpo_probability),
    "aepo": BranchRule("clip((u + w dH) max(0, 1 - p c), 0, 1) >= tau", _aepo_decide, _aepo_probability),
})


@dataclass(frozen=True)
class RolloutStrategy:
    name: str
    cfg: RolloutSection
    rule: BranchRule | None = None  # None: independent samples, never a copy
    probe: bool = False  # AEPO entropy pre-monitoring decides the initial count

    @property
    def branching(self) -> bool:
        """A tree makes copies; independent samples never do (the algorithm's growth)."""
        return self.rule is not None

    @property
    def fill_fresh(self) -> bool:
        """A tree fills leftover budget with fresh roots; independent samples start all n at once."""
        return self.rule is not None

    def initial_rollouts(self, h_root: float | None = None, h_tool: float | None = None) -> int:
        if not self.branching:
            return self.cfg.n
        if self.probe and h_root is not None:
            return dynamic_initial_rollouts(self.cfg.n, h_root, h_root if h_tool is None else h_tool,
                                            self.cfg.dynamic_beta)
        return self.cfg.initial_rollouts

    def should_branch(self, u: float, dh: float, c: int) -> bool:
        return self.rule is not None and self.rule.decide(self.cfg, u, dh, c)

    def branch_probability(self, dh: float, c: int) -> float:
        """P(should_branch) over u ~ U[0, 1), recorded beside each draw (the tree page shows it)."""
        return self.rule.probability(self.cfg, dh, c) if self.rule is not None else 0.0


def get_strategy(algorithm: str, cfg: RolloutSection) -> RolloutStrategy:
    """The rollout strategy of `algorithm` (rl.algorithm; a typo names the nearest line) over the settings `cfg`."""
    spec = ALGORITHMS.get(algorithm)
    rule = BRANCH_RULES.get(spec.branch_rule) if spec.branches else None
    return RolloutStrategy(algorithm, cfg, rule, probe=spec.governs(PROBE) and cfg.dynamic_rollouts)
