"""The `async` rollout schedule: every trajectory runs ahead on its own; the rounds stay, as logical rounds, only
where the growth rule decides.

    rollout = ToolRollout(backend, toolbox, tokenizer, settings, schedule="async")   # counter seeds implied

Under `rounds` and `early_tools` a round is a barrier: every active trajectory of every group generates, the tools
run, and only then does anyone take a next step, so the slowest generation or tool holds everyone. Here a
trajectory's next segment is requested the moment its previous one is complete (its generation, its TIR step and
its tool result), and a micro-batcher sends the backend whatever requests are ready whenever it is idle. The
driver loop:

1. generate every ready request in one call; each segment is taken, its TIR step applied and its tool call
   submitted as its answer comes back (`generate_iter` where the backend has one);
2. append the results of the calls that finished (those trajectories are ready again);
3. close every group round whose members all have that round's segment, in round order, group by group;
4. with nothing ready and nothing to close, wait for the first tool call to finish.

A group's round k closes when every member it had at the round's start has its k-th segment. The unchanged growth
rule then decides forks and fresh roots, in creation order, on the group's own generator, over *snapshots* of the
members at that round's boundary: taken when the segment was taken (before its call: what `after_generation` and a
paper-window fork at the segment's start see) and when the segment was complete (after its result: what
`after_tools`, a reference-window fork and `fill` see). A trajectory that has run further is untouched: a copy is
forked from the snapshot (its response up to the fork, its counters, its CallState), the draws are moved into the
live trajectory's record, and the copies and fresh roots join the group's next round.

Why the trees are those of `rounds` with counter seeds (stages/generation/counter_seeds.py), bit for bit on a
backend whose tokens do not depend on the batch (the scripted backend; batching changes a real model's
floating-point results, so there only the distribution is the same):
- a request's sampling seed derives from (tree seed, trajectory id, segment number), not from a batch;
- a trajectory's own segments depend only on its own context and seeds: the round's close never changes a
  trajectory that exists (it only records draws on it);
- the growth rule sees at each close exactly the members, states and order `rounds` shows it at that round's end,
  and draws from the group's own generator in the order of the group's rounds; trajectory ids are counted per
  group, so nothing depends on when another group's round closes.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from stages.core.log import progress
from stages.generation.base import GenRequest
from stages.generation.counter_seeds import MAIN

if TYPE_CHECKING:
    from stages.generation.rollout_state import GroupState, LiveTrajectory


@dataclass
class Runner:
    """One trajectory under `async`: the round of its next (or current) segment, its running call and its snapshots
    at each round's boundary (`taken`: segment taken, before its call; `complete`: after its result)."""

    m: LiveTrajectory
    round: int
    busy: bool = False
    call: Any = None
    running: Future | None = None
    called: dict[int, bool] = field(default_factory=dict)
    taken: dict[int, LiveTrajectory] = field(default_factory=dict)
    complete: dict[int, LiveTrajectory] = field(default_factory=dict)

    @property
    def ready(self) -> bool:
        return not self.m.done and not self.busy


@dataclass
class GroupClock:
    """A group's logical rounds: `closed` rounds are decided; `members[k]` the runners it had at round k's start."""

    group: GroupState
    closed: int = 0
    members: dict[int, list[Runner]] = field(default_factory=dict)

    def runners(self) -> list[Runner]:
        """Every trajectory still in play (all of them are in the open round's list), in creation order."""
        return self.members.get(self.closed + 1, [])

    def closable(self) -> bool:
        k = self.closed + 1
        return k in self.members and all(k in r.complete for r in self.members[k])


def snapshot(m: LiveTrajectory, state: Any) -> LiveTrajectory:
    """A frozen copy of `m` as it is now (its own lists and counters, `state` as its CallState, no draws yet)."""
    t = m.traj
    traj = dataclasses.replace(t, response_ids=list(t.response_ids), loss_mask=list(t.loss_mask),
                               sample_logprobs=list(t.sample_logprobs), entropies=list(t.entropies),
                               tool_calls=dict(t.tool_calls),
                               meta={**t.meta, "draws": [], "tool_spans": list(t.meta.get("tool_spans", []))})
    return dataclasses.replace(m, traj=traj, state=state, segments=list(m.segments))


class AsyncRounds:
    """ToolRollout's `async` schedule (a mixin: it uses the driver's own steps, hooks and timers)."""

    def _async_rounds(self, groups: list[GroupState], branching: bool, fill: bool, label: str) -> int:
        """Every group's main rounds, every trajectory at its own pace; returns the most rounds a group took."""
        if self._counters is None:
            raise RuntimeError("the async schedule runs on counter seeds; construct the driver with seeding='counter'")
        self._phase = MAIN
        clocks = []
        for g in groups:
            live = [Runner(m, 1) for m in g.members if not m.done]
            if live:
                clocks.append(GroupClock(g, members={1: live}))
        most = 1 if clocks else 0
        self._rounds += most
        width = max(1, sum(g.n for g in groups))
        with ThreadPoolExecutor(max_workers=width, thread_name_prefix="async-tools") as pool, \
                progress(transient=True) as bar:
            task = bar.add_task(f"{label} (async)", total=None, visible=self.show_progress)
            while clocks:
                ready = [r for c in clocks for r in c.runners() if r.ready]
                if ready:
                    self._generate_ready(ready, pool)
                self._collect_results(clocks)
                closing = [c for c in clocks if c.closable()]
                if not ready and not closing:
                    # a call that finished since the results were collected makes wait() return at once
                    pending = [r.running for c in clocks for r in c.runners() if r.running is not None]
                    if not pending:
                        raise RuntimeError("async rollout: nothing to generate, no tool running and no round to "
                                           "close; this is a bug in the schedule")
                    t0 = time.perf_counter()
                    wait(pending, return_when=FIRST_COMPLETED)
                    self._timers["tools_s"] += time.perf_counter() - t0
                for c in closing:
                    while c.closable():
                        self._close_round(c, branching, fill)
                    if c.closed + 1 not in c.members:
                        clocks.remove(c)
                    elif c.closed + 1 > most:
                        self._rounds += c.closed + 1 - most
                        most = c.closed + 1
                bar.update(task, description=f"{label} (async): {len(clocks)} groups open, round ≤ {most}")
        return most

    def _generate_ready(self, ready: list[Runner], pool: ThreadPoolExecutor) -> None:
        """One generate over every ready trajectory's next segment (each with its counter seed); each segment is
        taken, its step applied and its call submitted as its answer comes back."""
        max_len = self.cfg.max_response_length
        requests = [GenRequest(r.m.key, r.m.context, r.m.budget(max_len),
                               seed=self._counters.request_seed(r.m, MAIN)) for r in ready]
        for r in ready:
            r.busy = True
        answered = 0
        for j, res in self._generate_as_completed(requests, None, f"async batch: {len(requests)} requests"):
            r, m = ready[j], ready[j].m
            self._take_segment(m, res)
            r.taken[r.round] = snapshot(m, m.state.copy())
            call = self._take_step(m, self._decide(m, res))
            r.called[r.round] = call is not None
            answered += 1
            if call is None:
                self._complete(r)
            else:
                r.call, r.running = call, pool.submit(self._one_call, call, m.state)
        if answered != len(requests):
            raise RuntimeError(f"the backend answered {answered} of {len(requests)} requests of an async batch; "
                               "generate_iter must yield every request once")

    def _collect_results(self, clocks: list[GroupClock]) -> None:
        """Append the results of the calls that finished (creation order within a group)."""
        for c in clocks:
            for r in c.runners():
                if r.running is not None and r.running.done():
                    self._append_results([(r.m, r.call)], [r.running.result()])
                    r.call, r.running = None, None
                    self._complete(r)

    def _complete(self, r: Runner) -> None:
        r.complete[r.round] = snapshot(r.m, r.m.state.copy())
        r.round, r.busy = r.round + 1, False

    def _close_round(self, c: GroupClock, branching: bool, fill: bool) -> None:
        """Round k's end for one group, as `rounds` ends it, on the members' snapshots at that boundary."""
        g, k = c.group, c.closed + 1
        runners = c.members[k]
        rng = self._counters.group_rng(g)
        at_start = {id(r.m): r for r in runners}
        before = len(g.members)
        taken = self._shadow(g, {i: r.taken[k] for i, r in at_start.items()})
        self.growth.after_generation(self, [taken], [r.taken[k] for r in runners], rng, branching)
        added = taken.members[before:]
        done = self._shadow(g, {i: r.complete[k] for i, r in at_start.items()}, taken, added)
        self.growth.after_tools(self, [done], [r.complete[k] for r in runners if r.called[k] and
                                               not r.complete[k].done], rng, branching)
        if fill:
            self.growth.fill(self, done)
        ended = [r for r in runners if r.complete[k].done]
        ended_ids = {id(r) for r in ended}
        for r in runners:   # the draws made on the snapshots belong to the live trajectories
            for snap in (r.taken[k], r.complete[k]):
                if snap.traj.meta["draws"]:
                    r.m.traj.meta.setdefault("draws", []).extend(snap.traj.meta["draws"])
            del r.taken[k], r.complete[k], r.called[k]
        new = done.members[before:]
        g.members.extend(new)
        for attr in ("branches", "fresh", "consecutive", "added_round"):
            setattr(g, attr, getattr(done, attr))
        self.backend.release([r.m.key for r in ended])
        if len(g.members) >= g.n:
            self.backend.release([g.prompt_key])
        nxt = [r for r in runners if id(r) not in ended_ids] + [Runner(m, k + 1) for m in new]
        c.closed = k
        del c.members[k]
        if nxt:
            c.members[k + 1] = nxt

    @staticmethod
    def _shadow(g: GroupState, snaps: dict[int, LiveTrajectory], like: GroupState | None = None,
                added: list[LiveTrajectory] = ()) -> GroupState:
        """`g` as the growth rule must see it at a round's boundary: each member of the round as its snapshot, the
        members that ended earlier as they are, then `added` (copies made earlier in this close)."""
        base = like or g
        members = [snaps.get(id(m), m) for m in g.members] + list(added)
        return dataclasses.replace(base, members=members)
