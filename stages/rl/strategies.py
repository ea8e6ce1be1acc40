"""Rollout strategies (the branch rule of each algorithm): one registry, one signature
`factory(cfg: RolloutSection) -> RolloutStrategy`, registered under the algorithm's name (rl.algorithm).

A strategy answers three questions for the rollout driver, which owns the loop, the tools and the budget.
- how many root trajectories a group starts with (`initial_rollouts`; AEPO may ask for a probe first),
- whether a candidate makes a copy (`should_branch(u, dH, c)`, u ~ U[0,1) drawn by the driver),
- whether leftover budget is filled with fresh roots.

Whether a group grows as a tree at all (copies, fresh roots) is the algorithm's growth in
stages/core/algorithm_spec.py; the strategies read it there. Their own code:

    grpo  never branches
    arpo  initial_rollouts roots; P(branch) = clip(tau + w dH, 0, 1)
    aepo  like arpo with the consecutive-branch penalty clip((u + w dH)(1 - penalty c)) >= tau, and (with
          rl.rollout.dynamic_rollouts) entropy pre-monitoring for the initial count
"""

from __future__ import annotations

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


@dataclass(frozen=True)
class RolloutStrategy:
    name: str
    cfg: RolloutSection
    probe: bool = False  # AEPO entropy pre-monitoring decides the initial count

    @property
    def branching(self) -> bool:
        """A tree makes copies; independent samples never do (the algorithm's growth)."""
        return ALGORITHMS.get(self.name).branches

    @property
    def fill_fresh(self) -> bool:
        """A tree fills leftover budget with fresh roots; independent samples start all n at once."""
        return ALGORITHMS.get(self.name).branches

    def initial_rollouts(self, h_root: float | None = None, h_tool: float | None = None) -> int:
        if not self.branching:
            return self.cfg.n
        if self.probe and h_root is not None:
            return dynamic_initial_rollouts(self.cfg.n, h_root, h_root if h_tool is None else h_tool,
                                            self.cfg.dynamic_beta)
        return self.cfg.initial_rollouts

    def should_branch(self, u: float, dh: float, c: int) -> bool:
        raise NotImplementedError

    def branch_probability(self, dh: float, c: int) -> float:
        """P(should_branch) over u ~ U[0, 1), recorded beside each draw (the tree page shows it)."""
        raise NotImplementedError


@dataclass(frozen=True)
class GRPOStrategy(RolloutStrategy):
    def should_branch(self, u: float, dh: float, c: int) -> bool:
        return False

    def branch_probability(self, dh: float, c: int) -> float:
        return 0.0


@dataclass(frozen=True)
class ARPOStrategy(RolloutStrategy):
    def should_branch(self, u: float, dh: float, c: int) -> bool:
        return arpo_should_branch(u, self.cfg.branch_probability, self.cfg.entropy_weight, dh)

    def branch_probability(self, dh: float, c: int) -> float:
        return arpo_branch_probability(self.cfg.branch_probability, self.cfg.entropy_weight, dh)


@dataclass(frozen=True)
class AEPOStrategy(RolloutStrategy):
    def should_branch(self, u: float, dh: float, c: int) -> bool:
        return aepo_should_branch(u, self.cfg.branch_probability, self.cfg.entropy_weight, dh, c,
                                  self.cfg.branch_penalty)

    def branch_probability(self, dh: float, c: int) -> float:
        return aepo_branch_probability(self.cfg.branch_probability, self.cfg.entropy_weight, dh, c,
                                       self.cfg.branch_penalty)


StrategyFactory = Callable[[RolloutSection], RolloutStrategy]
ROLLOUT_STRATEGIES: Registry[StrategyFactory] = Registry("rollout strategy")


@ROLLOUT_STRATEGIES.register("grpo")
def grpo(cfg: RolloutSection) -> RolloutStrategy:
    return GRPOStrategy("grpo", cfg)


@ROLLOUT_STRATEGIES.register("arpo")
def arpo(cfg: RolloutSection) -> RolloutStrategy:
    return ARPOStrategy("arpo", cfg)


@ROLLOUT_STRATEGIES.register("aepo")
def aepo(cfg: RolloutSection) -> RolloutStrategy:
    return AEPOStrategy("aepo", cfg, probe=cfg.dynamic_rollouts)


def get_strategy(algorithm: str, cfg: RolloutSection) -> RolloutStrategy:
    """The branch rule of `algorithm` (rl.algorithm) over the rollout settings `cfg`."""
    return ROLLOUT_STRATEGIES.get(algorithm)(cfg)
