"""RL's rollout engine (GRPO / ARPO / AEPO): the agent runtime's token-level driver plus branching.

    engine = RolloutEngine(backend, toolbox, tokenizer, cfg.rl.rollout, seed=0)
    batch = engine.rollout(build_prompt_items(rows, tokenizer, cfg.rl.rollout.max_prompt_length))

Rounds, the TIR step, tools and budgets are `stages.generation.engine.TIRRollout` (the loop SFT's sampled
trajectories run too). This engine adds what the strategy (strategies.py) and the entropy window (entropy.py)
decide: the initial root count (AEPO may probe first), each segment's entropy, and branching: candidates of a
group are scanned in creation order, each may make `beam_size - 1` copies while the group has budget (n minus
trajectories created); a copy shares the parent's response up to `fork_at`, its tool counters and a copy of its
tool CallState, and starts from the parent's KV cache (its entropy baseline: entropy.py). When a group has no
active trajectory and budget left, fresh roots fill it (`fresh_fill`). Every group ends with exactly n
trajectories.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from stages.agent.protocol import STOP_TAGS
from stages.core.config.rl import RolloutSection
from stages.generation.base import GenerationBackend, GenRequest, GenResult, SamplingSpec
from stages.generation.engine import TIRRollout, ToolRunner
from stages.generation.rollout_state import GroupState, LiveTrajectory
from stages.rl.branching import fresh_to_add, plan_branches
from stages.rl.entropy import EntropyWindow, delta_entropy
from stages.rl.strategies import get_strategy


class RolloutEngine(TIRRollout):
    def __init__(self, backend: GenerationBackend, toolbox: ToolRunner, tokenizer, cfg: RolloutSection,
                 seed: int = 0, stop: Sequence[str] = STOP_TAGS, show_progress: bool = True) -> None:
        super().__init__(backend, toolbox, tokenizer, cfg, seed, stop, show_progress)
        self.strategy = get_strategy(cfg)
        self.branching, self.fill_fresh = self.strategy.branching, self.strategy.fill_fresh
        self.window = EntropyWindow(cfg.entropy_window, cfg.entropy_tokens, cfg.entropy_aggregation)

    # ---- the driver's hooks -------------------------------------------------------------------------------
    def _initial_count(self) -> int:
        return self.strategy.initial_rollouts()

    def _before_roots(self, groups: list[GroupState], rng: np.random.Generator) -> None:
        if self.strategy.probe:
            self._probe(groups, rng)

    def _measure(self, m: LiveTrajectory, res: GenResult) -> None:
        m.last_h = self.window.segment_entropy(res.entropies)
        m.segments.append((m.seg_start, len(m.traj), m.last_after_result, m.last_h))
        if m.h_initial is None:
            m.h_initial = m.last_h

    def _after_generation(self, groups: list[GroupState], live: list[LiveTrajectory], rng: np.random.Generator,
                          branching: bool) -> None:
        if branching and self.window.decide_after_generation:
            self._branch(groups, [m for m in live if m.last_after_result], rng, at_segment_start=True)

    def _after_tools(self, groups: list[GroupState], called: list[LiveTrajectory], rng: np.random.Generator,
                     branching: bool) -> None:
        if branching and not self.window.decide_after_generation:
            self._branch(groups, called, rng, at_segment_start=False)

    def _fill(self, g: GroupState) -> None:
        for _ in range(fresh_to_add(g.n, len(g.members), g.active, self.cfg.fresh_fill)):
            self._new_root(g, "fresh")

    # ---- branching and probes -----------------------------------------------------------------------------------
    def _branch(self, groups: list[GroupState], candidates: list[LiveTrajectory], rng: np.random.Generator,
                at_segment_start: bool) -> None:
        by_id = {m.traj.traj_id: m for m in candidates}
        for g in groups:
            cands = [(m.traj.traj_id, delta_entropy(m.last_h, m.h_initial)) for m in g.members if
                     m.traj.traj_id in by_id]
            remaining = g.n - len(g.members)
            if not cands or remaining <= 0:
                continue
            decide = lambda dh, c: self.strategy.should_branch(float(rng.random()), dh, c)
            for parent_id in plan_branches(cands, remaining, self.cfg.beam_size, g.branches, decide):
                parent = by_id[parent_id]
                fork_at = parent.seg_start if at_segment_start else len(parent.traj)
                child_id = self._take_id()
                baseline = parent.h_initial if self.window.copies_inherit_baseline else None
                child = parent.fork(child_id, child_id, fork_at, parent.state.copy(), h_initial=baseline)
                self.backend.fork(parent.key, child.key, len(parent.traj.prompt_ids) + fork_at)
                g.members.append(child)
                g.branches += 1

    def _probe(self, groups: list[GroupState], rng: np.random.Generator) -> None:
        """AEPO entropy pre-monitoring: H_root from a short probe generation, H_tool from one tool-using probe
        rollout per prompt (mean entropy of its segments: all of them in the reference window, the post-result
        ones in the paper window; H_root when there is none)."""
        probes = [GroupState(g.item, 1, 1) for g in groups]
        roots = [self._new_root(p, "root", key_prefix="probe") for p in probes]
        spec = SamplingSpec(self.cfg.temperature, self.cfg.top_p, self.cfg.top_k, ())
        requests = [GenRequest(("probe-gen", m.key), m.context, self.cfg.probe_tokens) for m in roots]
        for g, req in zip(groups, requests):
            self.backend.fork(g.prompt_key, req.key, len(req.token_ids))
        t0 = time.perf_counter()
        results = self.backend.generate(requests, spec, seed=int(rng.integers(2**31 - 1)))
        self._timers["generate_s"] += time.perf_counter() - t0
        self._run(probes, rng, branching=False, fill=False, label="probe", main=False)
        for g, res, m in zip(groups, results, roots):
            g.h_root = self.window.segment_entropy(res.entropies)
            h_tool = self.window.tool_entropy(m.segments)
            g.h_tool = g.h_root if h_tool is None else h_tool
            g.initial = self.strategy.initial_rollouts(g.h_root, g.h_tool)
        self.backend.release([r.key for r in requests] + [m.key for m in roots])
        self._next_id = 0
