"""Per-trajectory and per-group bookkeeping of one rollout call, and the RolloutBatch it turns into."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from stages.generation.prompt_items import PromptItem
from stages.generation.types import RolloutBatch, RolloutGroup, Trajectory


@dataclass
class LiveTrajectory:
    """A trajectory being generated: the Trajectory it fills plus rollout-only state (reset every call)."""

    traj: Trajectory
    key: Hashable                   # backend cache key
    state: Any                      # the toolbox CallState (copied on a fork)
    n_calls: int = 0                # tool calls made (counts against call_limit)
    h_initial: float | None = None  # entropy of the first segment (window of the rollout); see EntropyWindow
    after_result: bool = False      # the next segment follows a tool result
    seg_start: int = 0              # response index where the last generated segment starts
    last_h: float = 0.0             # window entropy of the last generated segment
    last_after_result: bool = False  # whether that segment followed a tool result
    done: bool = False
    generated: int = 0              # segments this trajectory generated itself (counter seeds number them)
    segments: list[tuple[int, int, bool, float]] = field(default_factory=list)  # (start, end, after_result, H)

    @property
    def context(self) -> list[int]:
        return self.traj.prompt_ids + self.traj.response_ids

    def budget(self, max_response_length: int) -> int:
        return max_response_length - len(self.traj.response_ids)

    def append(self, ids: list[int], mask: int, logprobs: list[float] | None = None,
               entropies: list[float] | None = None) -> None:
        t = self.traj
        t.response_ids.extend(ids)
        t.loss_mask.extend([mask] * len(ids))
        t.sample_logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))
        t.entropies.extend(entropies if entropies is not None else [0.0] * len(ids))

    def finish(self, reason: str) -> None:
        self.done = True
        self.traj.finish_reason = reason

    def fork(self, traj_id: int, key: Hashable, fork_at: int, state: Any,
             h_initial: float | None = None) -> LiveTrajectory:
        """A copy sharing the first `fork_at` response tokens, the tool counters and (a copy of) the tool state;
        `h_initial` is its entropy baseline (None: its next segment becomes it)."""
        p = self.traj
        child = Trajectory(
            traj_id=traj_id, group=p.group, prompt_ids=p.prompt_ids, response_ids=p.response_ids[:fork_at],
            loss_mask=p.loss_mask[:fork_at], sample_logprobs=p.sample_logprobs[:fork_at],
            entropies=p.entropies[:fork_at], parent_id=p.traj_id, fork_at=fork_at, kind="branch",
            tool_calls=dict(p.tool_calls), tool_errors=p.tool_errors, infra_failures=p.infra_failures,
            meta={"inherited_tool_calls": sum(p.tool_calls.values()), "inherited_by_tool": dict(p.tool_calls),
                  "inherited_infra_failures": p.infra_failures,
                  "tool_spans": [s for s in p.meta.get("tool_spans", []) if s[1] <= fork_at]})
        segments = [s for s in self.segments if s[1] <= fork_at]
        return LiveTrajectory(child, key, state, n_calls=self.n_calls, h_initial=h_initial,
                              after_result=True, seg_start=fork_at, segments=segments)


@dataclass
class GroupState:
    item: PromptItem
    n: int
    initial: int
    members: list[LiveTrajectory] = field(default_factory=list)
    branches: int = 0
    fresh: int = 0
    consecutive: int = 0   # AEPO's c: consecutive rounds that added trajectories (stages.rl.branching)
    added_round: int = 0   # trajectories added in the current round (copies + fresh roots)
    h_root: float | None = None
    h_tool: float | None = None

    @property
    def prompt_key(self) -> tuple[str, int]:
        return ("prompt", self.item.group)

    @property
    def active(self) -> int:
        return sum(not m.done for m in self.members)


def to_batch(groups: list[GroupState], tokenizer, metrics: dict[str, float]) -> RolloutBatch:
    out = []
    for g in groups:
        members = sorted(g.members, key=lambda m: m.traj.traj_id)
        if len(members) != g.n:
            raise RuntimeError(f"group {g.item.group} ended with {len(members)} trajectories, expected {g.n}; "
                               "this is a bug in the rollout budget accounting")
        for m in members:
            m.traj.response_text = tokenizer.decode(m.traj.response_ids, skip_special_tokens=True)
            m.traj.meta.update(h_initial=m.h_initial, tool_calls_total=m.n_calls,
                               segments=[[s, e, a, round(h, 6)] for s, e, a, h in m.segments])
        meta = {k: v for k, v in (("h_root", g.h_root), ("h_tool", g.h_tool)) if v is not None}
        out.append(RolloutGroup(group=g.item.group, question=g.item.question, ground_truth=g.item.ground_truth,
                                ability=g.item.ability, trajectories=[m.traj for m in members],
                                initial_rollouts=g.initial, branches=g.branches, fresh=g.fresh, meta=meta))
    return RolloutBatch(groups=out, metrics=metrics)


def trajectory_metrics(groups: list[GroupState]) -> dict[str, float]:
    trajs = [m.traj for g in groups for m in g.members]
    finish = Counter(t.finish_reason for t in trajs)
    n = max(1, len(trajs))
    executed = sum(sum(t.tool_calls.values()) - t.meta.get("inherited_tool_calls", 0) for t in trajs)
    row: dict[str, float] = {
        "groups": float(len(groups)), "trajectories": float(len(trajs)),
        "roots": float(sum(t.kind == "root" for t in trajs)),
        "branches": float(sum(g.branches for g in groups)), "fresh": float(sum(g.fresh for g in groups)),
        "tool_calls": float(sum(sum(t.tool_calls.values()) for t in trajs)),
        "tool_errors": float(sum(t.tool_errors for t in trajs)),
        "tool_calls_per_traj": sum(sum(t.tool_calls.values()) for t in trajs) / n,
        # calls the tools actually ran: a branch's copied calls counted once, in its parent (ARPO's tool budget)
        "tool_calls_executed": float(executed),
        "tool_calls_executed_per_traj": executed / n,
        "response_tokens_per_traj": sum(len(t) for t in trajs) / n,
        "tool_rejected": float(sum(t.meta.get("tool_rejected", 0) for t in trajs)),
        # infrastructure failures the tools returned (a branch's copies counted once, in its parent), and the
        # trajectories they touched (copies included): those carry no loss
        "infra_failures": float(sum(t.infra_failures - t.meta.get("inherited_infra_failures", 0) for t in trajs)),
        "masked_trajectories": float(sum(t.masked for t in trajs)),
        "forced_eos": float(sum("forced_eos" in t.meta for t in trajs)),
    }
    for tool in sorted({k for t in trajs for k in t.tool_calls}):  # executed per tool (ARPO's search budget)
        row[f"{tool}_calls_executed"] = float(sum(t.tool_calls.get(tool, 0) - t.meta.get("inherited_by_tool", {})
                                                  .get(tool, 0) for t in trajs))
    for reason in ("eos", "tool_limit", "length", "empty_call"):
        row[f"finish_{reason}"] = float(finish.get(reason, 0))
    return row
