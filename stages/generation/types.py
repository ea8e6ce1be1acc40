"""Data passed between the tool rollout and the trainer.

Token-in/token-out: `response_ids` are the exact ids the model sampled plus the tokenized tool results; nothing is
decoded and re-encoded. Branch structure is kept per trajectory as (parent_id, fork_at): the first `fork_at`
response tokens were copied from the parent at the moment of the fork, so token t < fork_at is shared with the
parent (and, recursively, with whatever the parent shared at t). Hard advantage attribution and KV-cache reuse both
read this.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Trajectory:
    traj_id: int                     # unique within one rollout batch, creation order
    group: int                       # index of the prompt (GRPO group) it belongs to
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)      # 1 = sampled by the policy, 0 = tool result
    sample_logprobs: list[float] = field(default_factory=list)  # log pi_old(token) at sampling time; 0 on mask 0
    entropies: list[float] = field(default_factory=list)    # full-vocab entropy / ln|V| per token; 0 on mask 0
    parent_id: int | None = None     # trajectory it was forked from (None for a root or a fresh sample)
    fork_at: int = 0                 # response tokens copied from the parent at the fork
    kind: str = "root"               # root | branch | fresh
    tool_calls: dict[str, int] = field(default_factory=dict)
    tool_errors: int = 0
    infra_failures: int = 0          # tool results in it that the environment failed (fault "infra"), inherited
    #                                  ones included: > 0 keeps it out of the loss and its group's statistics
    finish_reason: str = ""          # eos | tool_limit | length | empty_call
    response_text: str = ""          # decoded response (model + results), for the reward function
    meta: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.response_ids)

    @property
    def masked(self) -> bool:
        """Touched by an infrastructure failure: RL trains on it nothing (stages/rl/update.py)."""
        return self.infra_failures > 0


@dataclass
class RolloutGroup:
    """Exactly n trajectories for one prompt."""

    group: int
    question: str
    ground_truth: str
    ability: str
    trajectories: list[Trajectory]
    initial_rollouts: int
    branches: int = 0
    fresh: int = 0
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class RolloutBatch:
    groups: list[RolloutGroup]
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for g in self.groups for t in g.trajectories]
