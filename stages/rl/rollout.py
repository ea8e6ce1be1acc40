"""RL's tree rollout (GRPO / ARPO / AEPO): the agent runtime's token-level driver with a growth rule passed in.

    rollout = TreeRollout(backend, toolbox, tokenizer, cfg.rl.rollout, cfg.rl.algorithm, seed=0)
    batch = rollout.rollout(build_prompt_items(rows, tokenizer, cfg.rl.rollout.max_prompt_length))

Rounds, the TIR step, tools and budgets are `stages.generation.tool_rollout.ToolRollout` (the loop SFT's sampled
trajectories run too). `TreeRollout` is that driver with `TreeGrowth` (its `GrowthRule`), which adds what the
strategy of rl.algorithm (strategies.py) and the entropy window (entropy.py) decide: the initial root count (AEPO may
probe first), each segment's entropy, and branching: candidates of a group are scanned in creation order, each may
make `beam_size - 1` copies while the group has budget (n minus trajectories created); a copy shares the parent's
response up to `fork_at`, its tool counters and a copy of its tool CallState, and starts from the parent's KV cache
(its entropy baseline: entropy.py). When a group has no active trajectory and budget left, fresh roots fill it
(`fresh_fill`). After each round the group's AEPO penalty counter moves (`penalty_counter`: consecutive rounds that
added trajectories, as the reference). Every group ends with exactly n trajectories. Every branch draw is kept in
its candidate's meta `draws` (`record_draw`: dH, c, u, P(branch), the copy it made), for the rollout dump and the
tree page (stages/rl/trees.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from stages.agent.protocol import STOP_TAGS
from stages.core.config.rl import RolloutSection
from stages.generation.base import GenerationBackend, GenRequest, GenResult, SamplingSpec
from stages.generation.rollout_state import GroupState, LiveTrajectory
from stages.generation.tool_rollout import ToolRollout, ToolRunner
from stages.rl.branching import choose_branches, consecutive_rounds, fresh_to_add
from stages.rl.entropy import EntropyWindow, delta_entropy
from stages.rl.strategies import get_strategy


class TreeGrowth:
    """RL's growth rule (how its groups grow): the strategy's root count and branch rule, the entropy window's
    measurements, AEPO's probe, fresh roots and the penalty counter. Acts on the rollout only through ToolRollout's
    public methods."""

    def __init__(self, cfg: RolloutSection, algorithm: str) -> None:
        self.cfg = cfg
        self.strategy = get_strategy(algorithm, cfg)
        self.branching, self.fill_fresh = self.strategy.branching, self.strategy.fill_fresh
        self.window = EntropyWindow(cfg.entropy_window, cfg.entropy_tokens, cfg.entropy_aggregation)

    def initial_count(self) -> int:
        return self.strategy.initial_rollouts()

    def before_roots(self, rollout: ToolRollout, groups: list[GroupState], rng: np.random.Generator) -> None:
        if self.strategy.probe:
            self._probe(rollout, groups, rng)

    def measure(self, m: LiveTrajectory, res: GenResult) -> None:
        m.last_h = self.window.segment_entropy(res.entropies)
        m.segments.append((m.seg_start, len(m.traj), m.last_after_result, m.last_h))
        if m.h_initial is None:
            m.h_initial = m.last_h

    def after_generation(self, rollout: ToolRollout, groups: list[GroupState], live: list[LiveTrajectory],
                         rng: np.random.Generator, branching: bool) -> None:
        if branching and self.window.decide_after_generation:
            self._branch(rollout, groups, [m for m in live if m.last_after_result], rng, at_segment_start=True)

    def after_tools(self, rollout: ToolRollout, groups: list[GroupState], called: list[LiveTrajectory],
                    rng: np.random.Generator, branching: bool) -> None:
        if branching and not self.window.decide_after_generation:
            self._branch(rollout, groups, called, rng, at_segment_start=False)

    def fill(self, rollout: ToolRollout, g: GroupState) -> None:
        """Fresh roots, then the round's end for the penalty counter (the reference updates it after both)."""
        for _ in range(fresh_to_add(g.n, len(g.members), g.active, self.cfg.fresh_fill)):
            rollout.new_root(g, "fresh")
            g.added_round += 1
        g.consecutive = consecutive_rounds(g.consecutive, g.added_round)
        g.added_round = 0

    def _penalty_count(self, g: GroupState, planned: int) -> int:
        """c for a draw: consecutive rounds that added trajectories (reference; constant within a round), or
        `branches`: every copy the group made this rollout, those planned earlier in this round included."""
        return g.consecutive if self.cfg.penalty_counter == "consecutive_rounds" else g.branches + planned

    # ---- branching and probes -----------------------------------------------------------------------------------
    def _branch(self, rollout: ToolRollout, groups: list[GroupState], candidates: list[LiveTrajectory],
                rng: np.random.Generator, at_segment_start: bool) -> None:
        by_id = {m.traj.traj_id: m for m in candidates}
        for g in groups:
            cands = [(m.traj.traj_id, delta_entropy(m.last_h, m.h_initial)) for m in g.members if
                     m.traj.traj_id in by_id]
            if cands and g.n - len(g.members) > 0:
                self._branch_group(rollout, g, cands, by_id, rng, at_segment_start)

    def _branch_group(self, rollout: ToolRollout, g: GroupState, cands: list[tuple[int, float]],
                      by_id: dict[int, LiveTrajectory], rng: np.random.Generator, at_segment_start: bool) -> None:
        draws: list[dict[str, Any]] = []
        decide = lambda dh, planned: self._draw(g, dh, planned, float(rng.random()), draws)
        parents = choose_branches(cands, g.n - len(g.members), self.cfg.beam_size, decide,
                                  on_draw=lambda traj_id: draws[-1].update(parent=traj_id))
        copies = iter([d for d in draws if d["branch"]])
        for parent_id in parents:
            parent = by_id[parent_id]
            fork_at = parent.seg_start if at_segment_start else len(parent.traj)
            baseline = parent.h_initial if self.window.copies_inherit_baseline else None
            child = rollout.fork(parent, rollout.take_id(g), fork_at, baseline)
            next(copies)["child"] = child.traj.traj_id
            g.members.append(child)
            g.branches += 1
            g.added_round += 1
        for draw in draws:
            record_draw(by_id[draw.pop("parent")], draw, at_segment_start)

    def _draw(self, g: GroupState, dh: float, planned: int, u: float, draws: list[dict[str, Any]]) -> bool:
        """One branch draw, kept with what decided it: dH, the penalty counter c, u and P(branch)."""
        c = self._penalty_count(g, planned)
        branch = self.strategy.should_branch(u, dh, c)
        draws.append({"dh": dh, "c": c, "p": self.strategy.branch_probability(dh, c), "u": u, "branch": branch,
                      "child": None})
        return branch

    def _probe(self, rollout: ToolRollout, groups: list[GroupState], rng: np.random.Generator) -> None:
        """AEPO entropy pre-monitoring: H_root from a short probe generation, H_tool from one tool-using probe
        rollout per prompt (mean entropy of its segments: all of them in the reference window, the post-result
        ones in the paper window; H_root when there is none)."""
        probes = [GroupState(g.item, 1, 1) for g in groups]
        roots = [rollout.new_root(p, "root", key_prefix="probe") for p in probes]
        spec = SamplingSpec(self.cfg.temperature, self.cfg.top_p, self.cfg.top_k, ())
        requests = [GenRequest(("probe-gen", m.key), m.context, self.cfg.probe_tokens) for m in roots]
        for g, req in zip(groups, requests):
            rollout.backend.fork(g.prompt_key, req.key, len(req.token_ids))
        results = rollout.generate(requests, spec, int(rng.integers(2**31 - 1)), f"AEPO probe: {len(requests)} requests")
        rollout.run_rounds(probes, rng, branching=False, fill=False, label="probe", main=False)
        for g, res, m in zip(groups, results, roots):
            g.h_root = self.window.segment_entropy(res.entropies)
            h_tool = self.window.tool_entropy(m.segments)
            g.h_tool = g.h_root if h_tool is None else h_tool
            g.initial = self.strategy.initial_rollouts(g.h_root, g.h_tool)
        rollout.backend.release([r.key for r in requests] + [m.key for m in roots])
        rollout.restart_ids()


def record_draw(m: LiveTrajectory, draw: dict[str, Any], at_segment_start: bool) -> None:
    """A draw on candidate `m`, in its meta `draws` (the rollout dump and the tree page read it): the measured
    segment [start, end), its H and the baseline, where a copy forks (`at`: the segment's start in the paper window,
    after the tool result in the reference one) and the tool call that fork follows (`call`, 1-based)."""
    start, end, _, h = m.segments[-1]
    at = m.seg_start if at_segment_start else len(m.traj)
    m.traj.meta.setdefault("draws", []).append({
        "seg": [start, end], "h": round(h, 6), "h0": None if m.h_initial is None else round(m.h_initial, 6),
        "at": at, "call": m.n_calls, **{k: round(v, 6) if isinstance(v, float) else v for k, v in draw.items()}})


class TreeRollout(ToolRollout):
    """ToolRollout with RL's growth rule (TreeGrowth); the constructor RL's callers (trainer, verl's agent loop) use."""

    def __init__(self, backend: GenerationBackend, toolbox: ToolRunner, tokenizer, cfg: RolloutSection,
                 algorithm: str, seed: int = 0, stop: Sequence[str] = STOP_TAGS, show_progress: bool = True,
                 seeding: str | None = None) -> None:
        super().__init__(backend, toolbox, tokenizer, cfg.generation(), seed, stop, show_progress,
                         growth=TreeGrowth(cfg, algorithm), schedule=cfg.schedule, seeding=seeding)


def tree_rollouts(cfg: RolloutSection,
                  algorithm: str) -> Callable[[GenerationBackend, ToolRunner, Any, int], TreeRollout]:
    """RolloutSession's `make_rollout` for RL: a TreeRollout per call, seeded by the call's seed."""
    return lambda backend, toolbox, tokenizer, seed: TreeRollout(backend, toolbox, tokenizer, cfg, algorithm,
                                                                 seed=seed, show_progress=False)
