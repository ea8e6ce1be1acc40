"""The multi-turn tool rollout engine (GRPO / ARPO / AEPO), token-in/token-out.

    engine = RolloutEngine(backend, toolbox, tokenizer, cfg.rl.rollout, seed=0)
    batch = engine.rollout(build_prompt_items(rows, tokenizer, cfg.rl.rollout.max_prompt_length))

One round = one batched `backend.generate` over every active trajectory, stopping at `</search>` / `</python>`
/ EOS / the trajectory's response budget; then, per stopped trajectory: over `call_limit` -> EOS appended
(mask 1, finish `tool_limit`); an empty or unparsable call -> EOS appended (finish `empty_call`, counted, not
dropped); else the call is queued. Queued calls run concurrently (`toolbox.execute_many`), each result
` <result>\\n{text}\\n</result>` is tokenized standalone without special tokens (no BOS) and appended with loss
mask 0; tool tokens count against `max_response_length` (a result that does not fit is cut and the trajectory
ends with `length`). Model tokens are kept exactly as sampled (stop tags included); nothing is re-encoded.

Branching (strategy + entropy window, see strategies.py / entropy.py): candidates of a group are scanned in
creation order, each may make `beam_size - 1` copies while the group has budget (n minus trajectories created);
a copy shares the parent's response up to `fork_at`, its tool counters and a copy of its tool CallState, and
starts from the parent's KV cache (its entropy baseline: entropy.py). When a group has no active trajectory and
budget left, fresh roots fill it (`fresh_fill`). Every group ends with exactly n trajectories. All randomness comes from one numpy generator
seeded by (seed, rollout call index).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from stages.agent.protocol import STOP_TAGS, ToolCall, parse_tool_call, render_result
from stages.core.config.rl import RolloutSection
from stages.core.log import get_logger, progress
from stages.generation.base import (
    GenerationBackend,
    GenRequest,
    GenResult,
    SamplingSpec,
)
from stages.rl.branching import fresh_to_add, plan_branches
from stages.rl.entropy import EntropyWindow, delta_entropy
from stages.generation.prompts import PromptItem
from stages.generation.rollout_state import (
    GroupState,
    LiveTrajectory,
    to_batch,
    trajectory_metrics,
)
from stages.rl.strategies import get_strategy
from stages.generation.types import RolloutBatch, Trajectory

log = get_logger(__name__)


class ToolRunner(Protocol):
    """What the engine needs from `stages.agent.toolbox.ToolBox`."""

    def new_state(self) -> Any: ...

    def execute_many(self, calls: Sequence[tuple[ToolCall, Any]]) -> list[Any]: ...  # .tool .text .ok


class RolloutEngine:
    def __init__(self, backend: GenerationBackend, toolbox: ToolRunner, tokenizer, cfg: RolloutSection,
                 seed: int = 0, stop: Sequence[str] = STOP_TAGS, show_progress: bool = True) -> None:
        self.backend, self.toolbox, self.tokenizer, self.cfg = backend, toolbox, tokenizer, cfg
        self.seed, self.show_progress = seed, show_progress
        self.strategy = get_strategy(cfg)
        self.window = EntropyWindow(cfg.entropy_window, cfg.entropy_tokens, cfg.entropy_aggregation)
        self.sampling = SamplingSpec(cfg.temperature, cfg.top_p, cfg.top_k, tuple(stop))
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos_token; set model.eos_token so forced stops can append EOS")
        self.eos_id = int(tokenizer.eos_token_id)
        self.calls = 0
        self._timers: dict[str, float] = {}
        self._next_id = 0

    # ---- public ---------------------------------------------------------------------------------------------
    def rollout(self, prompts: Sequence[PromptItem], seed: int | None = None) -> RolloutBatch:
        """n trajectories per prompt; caches are dropped at the end (weights change between steps).

        Randomness: `seed` when given (a trainer passes one per step so a resumed run re-samples the same),
        else (engine seed, number of earlier rollout calls)."""
        _check_prompts(prompts, self.cfg)
        rng = np.random.default_rng([self.seed, self.calls] if seed is None else [seed])
        self.calls += 1
        self._timers, self._next_id = {"generate_s": 0.0, "tools_s": 0.0}, 0
        start, before = time.perf_counter(), self.backend.stats.copy()
        self.backend.refresh_weights()
        try:
            groups = [GroupState(p, self.cfg.n, self.strategy.initial_rollouts()) for p in prompts]
            self.backend.prefill([(g.prompt_key, g.item.prompt_ids) for g in groups])
            if self.strategy.probe:
                self._probe(groups, rng)
            for g in groups:
                for _ in range(g.initial):
                    self._new_root(g, "root")
            rounds = self._run(groups, rng, self.strategy.branching, self.strategy.fill_fresh, "rollout")
        finally:
            self.backend.release()
        metrics = {**trajectory_metrics(groups), "rounds": float(rounds),
                   **{k: float(v) for k, v in self.backend.stats.since(before).as_dict().items()}}
        metrics["forward_tokens_per_group"] = metrics["forward_tokens"] / len(groups)
        metrics.update({f"time_{k}": v for k, v in self._timers.items()})
        metrics["time_total_s"] = time.perf_counter() - start
        return to_batch(groups, self.tokenizer, metrics)

    # ---- the round loop ---------------------------------------------------------------------------------------
    def _run(self, groups: list[GroupState], rng: np.random.Generator, branching: bool, fill: bool,
             label: str, main: bool = True) -> int:
        """Rounds until no trajectory is active. Caches are freed as soon as nothing can use them: a finished
        trajectory's after its round (forks happen within the round), a group's prompt cache once the group has
        all n trajectories (kept through the AEPO probe: `main=False`)."""
        rounds = 0
        with progress(transient=True) as bar:
            task = bar.add_task(f"{label} rounds", total=None, visible=self.show_progress)
            while True:
                live = [m for g in groups for m in g.members if not m.done]
                if not live:
                    return rounds
                self._round(groups, live, rng, branching)
                self.backend.release([m.key for m in live if m.done])
                for g in groups:
                    if fill:
                        for _ in range(fresh_to_add(g.n, len(g.members), g.active, self.cfg.fresh_fill)):
                            self._new_root(g, "fresh")
                    if main and len(g.members) >= g.n:
                        self.backend.release([g.prompt_key])
                rounds += 1
                bar.update(task, advance=1, description=f"{label} round {rounds}: {len(live)} active")

    def _round(self, groups: list[GroupState], live: list[LiveTrajectory], rng: np.random.Generator,
               branching: bool) -> None:
        max_len = self.cfg.max_response_length
        requests = [GenRequest(m.key, m.context, m.budget(max_len)) for m in live]
        t0 = time.perf_counter()
        results = self.backend.generate(requests, self.sampling, seed=int(rng.integers(2**31 - 1)))
        self._timers["generate_s"] += time.perf_counter() - t0
        for m, res in zip(live, results):
            self._take_segment(m, res)
        if branching and self.window.decide_after_generation:
            self._branch(groups, [m for m in live if m.last_after_result], rng, at_segment_start=True)
        calls = [(m, call) for m, res in zip(live, results) if (call := self._after_segment(m, res)) is not None]
        self._run_tools(calls)
        if branching and not self.window.decide_after_generation:
            self._branch(groups, [m for m, _ in calls if not m.done], rng, at_segment_start=False)

    def _take_segment(self, m: LiveTrajectory, res: GenResult) -> None:
        m.seg_start = len(m.traj)
        m.append(res.token_ids, 1, res.logprobs, res.entropies)
        m.last_h = self.window.segment_entropy(res.entropies)
        m.last_after_result, m.after_result = m.after_result, False
        m.segments.append((m.seg_start, len(m.traj), m.last_after_result, m.last_h))
        if m.h_initial is None:
            m.h_initial = m.last_h

    def _after_segment(self, m: LiveTrajectory, res: GenResult) -> ToolCall | None:
        """Finish the trajectory or return the tool call its segment ends with."""
        if res.finish_reason == "eos":
            m.finish("eos")
        elif res.finish_reason == "length":
            m.finish("length")
        elif m.n_calls >= self.cfg.call_limit:
            self._force_eos(m, "tool_limit")
        else:
            text = self.tokenizer.decode(res.token_ids, skip_special_tokens=False)
            end = text.find(res.stop) if res.stop else -1
            text = text[:end + len(res.stop)] if end >= 0 else text
            call = parse_tool_call(text, stop=res.stop)
            if call is None and m.seg_start == 0:  # the opening tag may end the prompt (an assistant prefix)
                call = parse_tool_call(self._assistant_prefix(m.traj.prompt_ids) + text, stop=res.stop)
            if call is None or not call.argument:
                m.traj.meta["empty_call"] = text[-200:]
                self._force_eos(m, "empty_call")
            else:
                m.n_calls += 1
                return call
        return None

    def _assistant_prefix(self, prompt_ids: list[int]) -> str:
        """Text of the prompt after its last special token (a chat prompt's generation header), e.g. a primer
        such as '<think>…</think>\\n<search>' that opens the first tool call for the model."""
        special = set(getattr(self.tokenizer, "all_special_ids", None) or [self.eos_id])
        start = max((i + 1 for i, t in enumerate(prompt_ids) if t in special), default=0)
        return self.tokenizer.decode(prompt_ids[max(start, len(prompt_ids) - 256):], skip_special_tokens=False)

    def _force_eos(self, m: LiveTrajectory, reason: str) -> None:
        """End with an appended EOS (mask 1: the policy learns to stop there; its sample log-prob is 0)."""
        if m.budget(self.cfg.max_response_length) < 1:
            m.finish("length")
            return
        m.traj.meta["forced_eos"] = len(m.traj)
        m.append([self.eos_id], 1)
        m.finish(reason)

    def _run_tools(self, calls: list[tuple[LiveTrajectory, ToolCall]]) -> None:
        if not calls:
            return
        t0 = time.perf_counter()
        results = self.toolbox.execute_many([(call, m.state) for m, call in calls])
        self._timers["tools_s"] += time.perf_counter() - t0
        for (m, call), res in zip(calls, results):
            tool = getattr(res, "tool", None) or call.tool
            m.traj.tool_calls[tool] = m.traj.tool_calls.get(tool, 0) + 1
            meta = getattr(res, "meta", None) or {}
            if meta.get("rejected"):  # not run: over an agent limit, a repeated query, an unavailable tool
                m.traj.meta["tool_rejected"] = m.traj.meta.get("tool_rejected", 0) + 1
            elif not res.ok:
                m.traj.tool_errors += 1
            ids = self.tokenizer.encode(render_result(res.text), add_special_tokens=False)
            room = m.budget(self.cfg.max_response_length)
            m.append(ids[:room], 0)
            if len(ids) >= room:
                m.traj.meta["result_truncated"] = len(ids) > room
                m.finish("length")
            else:
                m.after_result = True

    # ---- branching, roots, probes -----------------------------------------------------------------------------
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

    def _take_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def _new_root(self, g: GroupState, kind: str, key_prefix: str | None = None) -> LiveTrajectory:
        traj_id = self._take_id()
        key = traj_id if key_prefix is None else (key_prefix, traj_id)
        traj = Trajectory(traj_id=traj_id, group=g.item.group, prompt_ids=list(g.item.prompt_ids), kind=kind)
        m = LiveTrajectory(traj, key, self.toolbox.new_state())
        self.backend.fork(g.prompt_key, key, len(traj.prompt_ids))
        g.members.append(m)
        g.fresh += kind == "fresh"
        return m

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


def _check_prompts(prompts: Sequence[PromptItem], cfg: RolloutSection) -> None:
    if not prompts:
        raise ValueError("rollout() got no prompts")
    groups = [p.group for p in prompts]
    if len(set(groups)) != len(groups):
        raise ValueError(f"PromptItem.group must be unique within a rollout call, got {groups}")
    for p in prompts:
        if not p.prompt_ids:
            raise ValueError(f"prompt of group {p.group} is empty; build prompts with build_prompt_items")
        if len(p.prompt_ids) > cfg.max_prompt_length:
            raise ValueError(f"prompt of group {p.group} has {len(p.prompt_ids)} tokens > rl.rollout."
                             f"max_prompt_length={cfg.max_prompt_length}; build prompts with build_prompt_items")
