"""Rollout strategies: one registry, one signature `factory(cfg: RolloutSection) -> RolloutStrategy`.

A strategy answers three questions for the engine; the engine owns the loop, the tools and the budget.
- how many root trajectories a group starts with (`initial_rollouts`; AEPO may ask for a probe first),
- whether a candidate makes a copy (`should_branch(u, dH, c)`, u ~ U[0,1) drawn by the engine),
- whether leftover budget is filled with fresh roots.

    grpo  n independent samples, no branching
    arpo  initial_rollouts roots; P(branch) = clip(tau + w dH, 0, 1); fresh roots fill leftover budget
    aepo  like arpo with the consecutive-branch penalty clip((u + w dH)(1 - penalty c)) >= tau, and (with
          rl.rollout.dynamic_rollouts) entropy pre-monitoring for the initial count
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from stages.core.config.rl import RolloutSection
from stages.core.registry import Registry
from stages.rl.branching import (
    aepo_should_branch,
    arpo_should_branch,
    dynamic_initial_rollouts,
)


@dataclass(frozen=True)
class RolloutStrategy:
    name: str
    cfg: RolloutSection
    branching: bool = True
    fill_fresh: bool = True
    probe: bool = False  # AEPO entropy pre-monitoring decides the initial count

    def initial_rollouts(self, h_root: float | None = None, h_tool: float | None = None) -> int:
        if not self.branching:
            return self.cfg.n
        if self.probe and h_root is not None:
            return dynamic_initial_rollouts(self.cfg.n, h_root, h_root if h_tool is None else h_tool,
                                            self.cfg.dynamic_beta)
        return self.cfg.initial_rollouts

    def should_branch(self, u: float, dh: float, c: int) -> bool:
        raise NotImplementedError


@dataclass(frozen=True)
class GRPOStrategy(RolloutStrategy):
    branching: bool = False
    fill_fresh: bool = False

    def should_branch(self, u: float, dh: float, c: int) -> bool:
        return False


@dataclass(frozen=True)
class ARPOStrategy(RolloutStrategy):
    def should_branch(self, u: float, dh: float, c: int) -> bool:
        return arpo_should_branch(u, self.cfg.branch_probability, self.cfg.entropy_weight, dh)


@dataclass(frozen=True)
class AEPOStrategy(RolloutStrategy):
    def should_branch(self, u: float, dh: float, c: int) -> bool:
        return aepo_should_branch(u, self.cfg.branch_probability, self.cfg.entropy_weight, dh, c,
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


def get_strategy(cfg: RolloutSection) -> RolloutStrategy:
    return ROLLOUT_STRATEGIES.get(cfg.strategy)(cfg)
