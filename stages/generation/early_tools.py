"""The `early_tools` rollout schedule: each tool call starts as soon as its own generation returns; every decision
stays at the round's end, so the same seed gives the same rollout batch, bit for bit, as `rounds`.

    rollout = ToolRollout(backend, toolbox, tokenizer, settings, schedule="early_tools")

Under `rounds` a round is: one generate over every active trajectory, then the TIR steps, then every tool call at
once (`toolbox.execute_many`), then the growth rule's draws. A server that answers requests one by one (verl's
LLM server: `ServerBackend.generate_iter`) leaves tools idle while the round's slowest generation finishes; here
each call is submitted the moment its generation is back, so a round lasts max_i(gen_i + tool_i) instead of
max_i gen_i + max_i tool_i. A backend without `generate_iter` answers the whole batch at once (the transformers and
in-process vLLM backends): the schedule then runs exactly as `rounds`.

Why the trees cannot change:
- The branch draws, copies and fresh roots happen at the round's end (`after_generation`, `after_tools`, `fill`)
  on the same candidates in creation order, with the same generator; generation's seed is drawn before any result.
- A tool call reads and moves only its own trajectory's CallState (admission counters, seen queries); the early
  step only decides the call (`_decide` changes nothing) and submits it; `n_calls`, forced EOS and finishes are
  applied at the round's end (`_take_step`), and the results are appended in the order `rounds` appends them.
- The paper entropy window forks at the segment's start in `after_generation`, before `rounds` would run the
  segment's call: the copy must not see that call's admission. The caller's CallState is therefore copied before
  its call is submitted, and a fork at the segment's start takes that copy (`ToolRollout.fork`).

Timers: `generate_s` runs until the round's last generation is back; `tools_s` is the tool time left after it (the
part generation did not hide).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from stages.generation.base import GenRequest, GenResult
from stages.generation.generate_watch import GenerateWatch

if TYPE_CHECKING:
    from stages.generation.rollout_state import GroupState, LiveTrajectory

SCHEDULES = ("rounds", "early_tools", "async")


class EarlyToolsRound:
    """ToolRollout's `early_tools` round (a mixin: it uses the driver's own steps and timers)."""

    def _early_tools_round(self, groups: list[GroupState], live: list[LiveTrajectory], rng: np.random.Generator,
                           branching: bool) -> None:
        requests, seed = self._requests(live, rng)
        self._rounds += 1
        decided: dict[int, tuple[Any, str]] = {}
        running: dict[int, Future] = {}
        with ThreadPoolExecutor(max_workers=max(1, len(live)), thread_name_prefix="early-tools") as pool:
            for i, res in self._generate_as_completed(requests, seed, f"round {self._rounds}: {len(requests)} "
                                                      "requests"):
                m = live[i]
                self._take_segment(m, res)
                decided[i] = self._decide(m, res)
                step = decided[i][0]
                if step.kind == "call":
                    self._segment_states[m.key] = m.state.copy()
                    running[i] = pool.submit(self._one_call, step.call, m.state)
            if len(decided) != len(live):
                raise RuntimeError(f"the backend answered {len(decided)} of {len(live)} requests of round "
                                   f"{self._rounds}; generate_iter must yield every request once")
            try:
                self._grow(self.growth.after_generation, groups, live, rng, branching)
            finally:
                self._segment_states.clear()
            calls = [(i, call) for i, m in enumerate(live) if (call := self._take_step(m, decided[i])) is not None]
            t0 = time.perf_counter()
            results = [running[i].result() for i, _ in calls]
            self._timers["tools_s"] += time.perf_counter() - t0
        if calls:
            self._append_results([(live[i], call) for i, call in calls], results)
        self._grow(self.growth.after_tools, groups, [live[i] for i, _ in calls if not live[i].done], rng, branching)

    def _one_call(self, call: Any, state: Any) -> Any:
        """One call through the toolbox (its pool, rate limits and tool_timeout_s apply as to a round's batch)."""
        return self.toolbox.execute_many([(call, state)])[0]

    def _generate_as_completed(self, requests: list[GenRequest], seed: int | None,
                               what: str) -> Iterator[tuple[int, GenResult]]:
        """(request index, result) in the order the backend answers (`generate_iter` where it has one), within
        cfg.generate_timeout_s; consumed as it comes (the caller submits tools between answers)."""
        t0 = time.perf_counter()
        limit = None if getattr(self.backend, "enforces_timeout", False) else self.cfg.generate_timeout_s
        iterate = getattr(self.backend, "generate_iter", None)
        with GenerateWatch(limit, what):
            if iterate is None:
                yield from enumerate(self.backend.generate(requests, self.sampling, seed=seed))
            else:
                yield from iterate(requests, self.sampling, seed=seed)
        self._timers["generate_s"] += time.perf_counter() - t0
