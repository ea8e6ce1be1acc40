"""The token-level driver of the agent runtime: n tool-using trajectories per prompt over a GenerationBackend.

    rollout = ToolRollout(backend, toolbox, tokenizer, settings, seed=0)    # settings: GenerationSettings
    batch = rollout.rollout(build_prompt_items(rows, tokenizer, settings.max_prompt_length))

One round = one batched `backend.generate` over every active trajectory, stopping at the stop tags / EOS / the
trajectory's response budget; then each trajectory takes the TIR step (stages.agent.loop.next_step, the rule the
text loop of evaluation and the SFT teacher follows too): `eos` / `length` finish it; over `call_limit`, or an
empty or unparsable call, the environment ends it with an appended EOS (mask 1: the policy learns to stop there;
finish `tool_limit` / `empty_call`, counted); a call is queued. Queued calls run concurrently
(`toolbox.execute_many`); each result ` <result>\\n{text}\\n</result>` is tokenized standalone without special
tokens (no BOS) and appended with loss mask 0; tool tokens count against `max_response_length` (a result that
does not fit is cut and the trajectory ends with `length`). Model tokens are kept exactly as sampled (stop tags
included); nothing is re-encoded.

How a group grows is the growth rule (`GrowthRule`) passed in. The default, `IndependentRoots`, gives every group n
independent roots (GRPO sampling: what SFT's self-critic pairs use). RL's tree rollout (stages.rl.rollout) passes
its growth rule, which answers the same few questions: how many roots to start, what to do before they start
(AEPO's probe), what to note of a new segment (its entropy), which trajectories to fork after a round's
generation or tools, and how to refill a group between rounds. It acts on the driver only through the driver's
public methods (`run_rounds`, `generate`, `new_root`, `take_id`, `fork`, `add_time`, `restart_ids`). Randomness:
one numpy generator seeded by (seed, rollout call index), or counter-based seeds (`seeding="counter"`, counter_seeds.py).

The schedule (`schedule`, rl.rollout.schedule) orders a round's work: `rounds` runs every generation, then every
tool call; `early_tools` (early_tools.py) starts each call as its own generation returns, every decision at the
round's end (the same batch bit for bit); `async` (async_rounds.py) runs each group's rounds at its own pace.

Nothing waits forever: each round's `generate` runs within `generate_timeout_s` (stages/generation/generate_watch.py)
and each tool call within agent.tool_timeout_s (stages/agent/tool_pool.py). The batch's metrics split the time:
`time_generate_s`, `time_tools_s`, `time_tool_queue_s` (per round, the longest wait of a call for a pool thread or
a rate-limit slot) and `tool_calls_per_round`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from stages.agent.loop import LoopRules, Segment, Step, next_step
from stages.agent.protocol import STOP_TAGS, ToolCall, render_result
from stages.agent.stops import cut_at_stop
from stages.core.config.generation import GenerationSettings
from stages.core.log import progress
from stages.generation.async_rounds import AsyncRounds
from stages.generation.base import GenerationBackend, GenRequest, GenResult, SamplingSpec
from stages.generation.counter_seeds import MAIN, PROBE, SEEDINGS, CounterSeeds, tree_seed_of
from stages.generation.early_tools import SCHEDULES, EarlyToolsRound
from stages.generation.generate_watch import GenerateWatch
from stages.generation.prompt_items import PromptItem
from stages.generation.rollout_state import GroupState, LiveTrajectory, to_batch, trajectory_metrics
from stages.generation.types import RolloutBatch, Trajectory


class ToolRunner(Protocol):
    """What the driver needs from `stages.agent.toolbox.ToolBox`."""

    def new_state(self) -> Any: ...

    def execute_many(self, calls: Sequence[tuple[ToolCall, Any]]) -> list[Any]: ...  # .tool .text .ok .meta


class GrowthRule(Protocol):
    """How the groups of a rollout grow: the questions the driver asks (RL's `TreeGrowth` answers them)."""

    branching: bool   # whether the main rounds may fork trajectories
    fill_fresh: bool  # whether groups are refilled between rounds (`fill`)

    def initial_count(self) -> int:
        """Roots each group starts with (before `before_roots` may set a group's own `initial`)."""

    def before_roots(self, rollout: ToolRollout, groups: list[GroupState], rng: np.random.Generator) -> None:
        """Before the roots start (AEPO measures a probe here)."""

    def measure(self, m: LiveTrajectory, res: GenResult) -> None:
        """Bookkeeping of a newly generated segment (RL: its entropy)."""

    def after_generation(self, rollout: ToolRollout, groups: list[GroupState], live: list[LiveTrajectory],
                         rng: np.random.Generator, branching: bool) -> None:
        """After a round's segments are taken, before tools run."""

    def after_tools(self, rollout: ToolRollout, groups: list[GroupState], called: list[LiveTrajectory],
                    rng: np.random.Generator, branching: bool) -> None:
        """After the round's tool results are appended."""

    def fill(self, rollout: ToolRollout, g: GroupState) -> None:
        """Between rounds: start more roots in a group that needs them."""


class IndependentRoots:
    """n independent roots per group, nothing forked or refilled (GRPO sampling)."""

    branching = False
    fill_fresh = False

    def __init__(self, n: int) -> None:
        self.n = n

    def initial_count(self) -> int:
        return self.n

    def before_roots(self, rollout: ToolRollout, groups: list[GroupState], rng: np.random.Generator) -> None:
        pass

    def measure(self, m: LiveTrajectory, res: GenResult) -> None:
        pass

    def after_generation(self, rollout: ToolRollout, groups: list[GroupState], live: list[LiveTrajectory],
                         rng: np.random.Generator, branching: bool) -> None:
        pass

    def after_tools(self, rollout: ToolRollout, groups: list[GroupState], called: list[LiveTrajectory],
                    rng: np.random.Generator, branching: bool) -> None:
        pass

    def fill(self, rollout: ToolRollout, g: GroupState) -> None:
        pass


class ToolRollout(EarlyToolsRound, AsyncRounds):
    def __init__(self, backend: GenerationBackend, toolbox: ToolRunner, tokenizer, cfg: GenerationSettings,
                 seed: int = 0, stop: Sequence[str] = STOP_TAGS, show_progress: bool = True,
                 growth: GrowthRule | None = None, schedule: str = "rounds", seeding: str | None = None) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown rollout schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
        # counter seeds (stages/generation/counter_seeds.py): async needs them; rounds may use them to compare
        seeding = seeding or ("counter" if schedule == "async" else "stream")
        if seeding not in SEEDINGS or (schedule == "async" and seeding != "counter"):
            raise ValueError(f"seeding={seeding!r} with schedule={schedule!r}: choose one of {', '.join(SEEDINGS)}; "
                             "the async schedule needs counter seeds")
        self.seeding = seeding
        self._counters: CounterSeeds | None = None
        self._phase = MAIN
        self.backend, self.toolbox, self.tokenizer, self.cfg = backend, toolbox, tokenizer, cfg
        self.schedule = schedule
        self.growth = IndependentRoots(cfg.n) if growth is None else growth
        self.seed, self.show_progress = seed, show_progress
        self.rules = LoopRules(stops=tuple(stop), call_limit=cfg.call_limit, empty_call="end")
        self.sampling = SamplingSpec(cfg.temperature, cfg.top_p, cfg.top_k, tuple(stop))
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos_token; set model.eos_token so forced stops can append EOS")
        self.eos_id = int(tokenizer.eos_token_id)
        self.calls = 0
        self._timers: dict[str, float] = {}
        self._next_id = 0
        self._segment_states: dict[Any, Any] = {}  # early_tools: a caller's CallState at its segment's start

    # ---- public ---------------------------------------------------------------------------------------------
    def rollout(self, prompts: Sequence[PromptItem], seed: int | None = None) -> RolloutBatch:
        """n trajectories per prompt; caches are dropped at the end (weights change between steps).

        Randomness: `seed` when given (a trainer passes one per step so a resumed run re-samples the same),
        else (the driver's seed, number of earlier rollout calls)."""
        check_prompts(prompts, self.cfg)
        rng = np.random.default_rng([self.seed, self.calls] if seed is None else [seed])
        tree_seed = tree_seed_of(self.seed, self.calls, seed)
        self.calls += 1
        self._timers, self._next_id = {"generate_s": 0.0, "tools_s": 0.0, "tool_queue_s": 0.0}, 0
        self._rounds = self._tool_calls = 0
        start, before = time.perf_counter(), self.backend.stats.copy()
        self.backend.refresh_weights()
        try:
            groups = [GroupState(p, self.cfg.n, self.growth.initial_count()) for p in prompts]
            if self.seeding == "counter":
                self._counters = CounterSeeds(tree_seed, groups, self.cfg.n)
            self.backend.prefill([(g.prompt_key, g.item.prompt_ids) for g in groups])
            self.growth.before_roots(self, groups, rng if self._counters is None else self._counters.probe_rng())
            for g in groups:
                for _ in range(g.initial):
                    self.new_root(g, "root")
            rounds = self.run_rounds(groups, rng, self.growth.branching, self.growth.fill_fresh, "rollout")
        finally:
            self.backend.release()
        metrics = {**trajectory_metrics(groups), "rounds": float(rounds),
                   **{k: float(v) for k, v in self.backend.stats.since(before).as_dict().items()}}
        metrics["forward_tokens_per_group"] = metrics["forward_tokens"] / len(groups)
        metrics.update({f"time_{k}": v for k, v in self._timers.items()})
        metrics["tool_calls_per_round"] = self._tool_calls / max(1, self._rounds)
        metrics["tools_offered"] = float(len(getattr(self.toolbox, "tools", ()) or ()))
        metrics["time_total_s"] = time.perf_counter() - start
        return to_batch(groups, self.tokenizer, metrics)

    # ---- the round loop (a growth rule may run it on probe groups) ----------------------------------------------
    def run_rounds(self, groups: list[GroupState], rng: np.random.Generator, branching: bool, fill: bool,
             label: str, main: bool = True) -> int:
        """Rounds until no trajectory is active. Caches are freed as soon as nothing can use them: a finished
        trajectory's after its round (forks happen within the round), a group's prompt cache once the group has
        all n trajectories (kept through a probe: `main=False`)."""
        if self.schedule == "async" and main:
            return self._async_rounds(groups, branching, fill, label)
        rounds, self._phase = 0, MAIN if main else PROBE
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
                        self.growth.fill(self, g)
                    if main and len(g.members) >= g.n:
                        self.backend.release([g.prompt_key])
                rounds += 1
                bar.update(task, advance=1, description=f"{label} round {rounds}: {len(live)} active")

    def _round(self, groups: list[GroupState], live: list[LiveTrajectory], rng: np.random.Generator,
               branching: bool) -> None:
        if self.schedule == "early_tools":
            return self._early_tools_round(groups, live, rng, branching)
        requests, seed = self._requests(live, rng)
        self._rounds += 1
        results = self.generate(requests, self.sampling, seed, f"round {self._rounds}: {len(requests)} requests")
        for m, res in zip(live, results):
            self._take_segment(m, res)
        self._grow(self.growth.after_generation, groups, live, rng, branching)
        calls = [(m, call) for m, res in zip(live, results) if (call := self._step(m, res)) is not None]
        self._run_tools(calls)
        self._grow(self.growth.after_tools, groups, [m for m, _ in calls if not m.done], rng, branching)

    def _requests(self, live: list[LiveTrajectory], rng: np.random.Generator) -> tuple[list[GenRequest], int | None]:
        """A round's requests and the call's seed: stream seeding draws it from the rollout's generator; counter
        seeding gives each request its own seed instead (and draws nothing)."""
        max_len = self.cfg.max_response_length
        if self._counters is None:
            return [GenRequest(m.key, m.context, m.budget(max_len)) for m in live], int(rng.integers(2**31 - 1))
        return [GenRequest(m.key, m.context, m.budget(max_len), seed=self._counters.request_seed(m, self._phase))
                for m in live], None

    def _grow(self, hook: Any, groups: list[GroupState], trajs: list[LiveTrajectory], rng: np.random.Generator,
              branching: bool) -> None:
        """A growth-rule hook (after_generation / after_tools) on the round's groups: all at once on the rollout's
        generator (stream seeding), or group by group, each on its own generator (counter seeding)."""
        if self._counters is None:
            return hook(self, groups, trajs, rng, branching)
        for g in groups:
            hook(self, [g], [m for m in trajs if m.traj.group == g.item.group], self._counters.group_rng(g),
                 branching)

    def _take_segment(self, m: LiveTrajectory, res: GenResult) -> None:
        m.seg_start, m.generated = len(m.traj), m.generated + 1
        m.append(res.token_ids, 1, res.logprobs, res.entropies)
        m.last_after_result, m.after_result = m.after_result, False
        self.growth.measure(m, res)

    def generate(self, requests: list[GenRequest], sampling: SamplingSpec, seed: int, what: str) -> list[GenResult]:
        """`backend.generate` within cfg.generate_timeout_s (GenerateTimeout past it, unless the backend limits
        its own requests: verl's server), timed as `generate_s`."""
        t0 = time.perf_counter()
        limit = None if getattr(self.backend, "enforces_timeout", False) else self.cfg.generate_timeout_s
        with GenerateWatch(limit, what):
            results = self.backend.generate(requests, sampling, seed=seed)
        self._timers["generate_s"] += time.perf_counter() - t0
        return results

    def _step(self, m: LiveTrajectory, res: GenResult) -> ToolCall | None:
        """The TIR step after a segment: finish the trajectory, or return the call it ends with."""
        return self._take_step(m, self._decide(m, res))

    def _decide(self, m: LiveTrajectory, res: GenResult) -> tuple[Step, str]:
        """The TIR step a new segment leads to (changes nothing: `_take_step` applies it)."""
        text = ""
        if res.finish_reason == "stop":
            text = cut_at_stop(self.tokenizer.decode(res.token_ids, skip_special_tokens=False), (res.stop,))[0]
        # the opening tag may end the prompt (an assistant prefix such as '<think>…</think>\n<search>')
        before = self._assistant_prefix(m.traj.prompt_ids) if res.finish_reason == "stop" and m.seg_start == 0 \
            else ""
        # a request asks for the trajectory's whole remaining budget: a length finish leaves none
        left = 0 if res.finish_reason == "length" else m.budget(self.cfg.max_response_length)
        return next_step(self.rules, Segment(text, res.finish_reason, res.stop, left, before, len(res.token_ids)),
                         m.n_calls), text

    def _take_step(self, m: LiveTrajectory, decided: tuple[Step, str]) -> ToolCall | None:
        step, text = decided
        if step.kind == "call":
            m.n_calls += 1
            return step.call
        if step.kind == "done" and step.ended_by_environment:
            if step.reason == "empty_call":
                m.traj.meta["empty_call"] = text[-200:]
            self._force_eos(m, step.reason)
        elif step.kind == "done":
            m.finish(step.reason)
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
        self._append_results(calls, results)

    def _append_results(self, calls: list[tuple[LiveTrajectory, ToolCall]], results: list[Any]) -> None:
        """Each call's result appended to its trajectory (loss mask 0), in the order of `calls`."""
        # the round's tool phase lasts at least its longest-queued call's wait (a pool thread, a rate-limit slot)
        self._timers["tool_queue_s"] += max(float(getattr(r, "queued_s", 0.0)) for r in results)
        self._tool_calls += len(calls)
        for (m, call), res in zip(calls, results):
            tool = getattr(res, "tool", None) or call.tool
            m.traj.tool_calls[tool] = m.traj.tool_calls.get(tool, 0) + 1
            meta = getattr(res, "meta", None) or {}
            if meta.get("rejected"):  # not run: over an agent limit, a repeated query, an unavailable tool
                m.traj.meta["tool_rejected"] = m.traj.meta.get("tool_rejected", 0) + 1
            elif not res.ok:
                m.traj.tool_errors += 1
            if getattr(res, "fault", None) == "infra":  # the provider / sandbox failed: not the policy's doing
                m.traj.infra_failures += 1
            ids = self.tokenizer.encode(render_result(res.text), add_special_tokens=False)
            room = m.budget(self.cfg.max_response_length)
            start = len(m.traj)
            m.append(ids[:room], 0)
            # the result's span [start, end, tool, status, call] (RL's rollout dump draws its trees with it)
            m.traj.meta.setdefault("tool_spans", []).append([start, len(m.traj), tool, result_status(res, meta),
                                                             m.n_calls])
            if len(ids) >= room:
                m.traj.meta["result_truncated"] = len(ids) > room
                m.finish("length")
            else:
                m.after_result = True

    # ---- trajectories (what a growth rule may do) ------------------------------------------------------------
    def take_id(self, g: GroupState | None = None) -> int:
        """The next trajectory id of this rollout (counter seeding: of group `g`, whose ids are counted apart)."""
        if self._counters is not None:
            if g is None:
                raise ValueError("counter seeding counts trajectory ids per group: call take_id(group)")
            return self._counters.take_id(g)
        self._next_id += 1
        return self._next_id - 1

    def restart_ids(self) -> None:
        """Number trajectories from 0 again (after a probe, whose trajectories are dropped)."""
        self._next_id = 0
        if self._counters is not None:
            self._counters.restart_ids()

    def add_time(self, timer: str, seconds: float) -> None:
        self._timers[timer] += seconds

    def fork(self, parent: LiveTrajectory, child_id: int, fork_at: int, h_initial: float | None) -> LiveTrajectory:
        """A copy of `parent` sharing its first `fork_at` response tokens, its tool state copied and its KV cache
        forked; the caller adds it to a group."""
        # a fork at the segment's start (paper window) takes the CallState from before the segment's own call
        state = self._segment_states.get(parent.key) if fork_at == parent.seg_start else None
        child = parent.fork(child_id, child_id, fork_at, (parent.state if state is None else state).copy(),
                            h_initial=h_initial)
        self.backend.fork(parent.key, child.key, len(parent.traj.prompt_ids) + fork_at)
        return child

    def new_root(self, g: GroupState, kind: str, key_prefix: str | None = None) -> LiveTrajectory:
        traj_id = self.take_id(g)
        key = traj_id if key_prefix is None else (key_prefix, traj_id)
        traj = Trajectory(traj_id=traj_id, group=g.item.group, prompt_ids=list(g.item.prompt_ids), kind=kind)
        m = LiveTrajectory(traj, key, self.toolbox.new_state())
        self.backend.fork(g.prompt_key, key, len(traj.prompt_ids))
        g.members.append(m)
        g.fresh += kind == "fresh"
        return m


def result_status(res: Any, meta: dict[str, Any]) -> str:
    """ok | error | rejected (not run: an agent limit, a repeated query) | infra (the environment failed)."""
    if getattr(res, "fault", None) == "infra":
        return "infra"
    return "rejected" if meta.get("rejected") else ("ok" if res.ok else "error")


def check_prompts(prompts: Sequence[PromptItem], cfg: GenerationSettings) -> None:
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
