"""A step's tool time against its generate time (`arpo plan`): is the profile tool-bound?

Per RL step, from the config (or a measured run's `timing/*` split, stages/rl/step_metrics.py):
- rounds: a trajectory's calls each end a round, plus its last: `calls + 1`, calls = min(rl.rollout.call_limit,
  agent.limits.max_calls);
- tool calls per round per worker: the step's tool calls (the plan's bound or measured line) spread over the call
  rounds and over the processes that own a tool pool (verl: rl.verl.agent_workers; local engine: 1);
- tool time: per round, `ceil(calls per round per worker / agent.concurrency)` waves of `cost.tool_call_seconds`;
  the waves after the first are queueing (a call waiting for a pool thread). With web search, the provider's rate
  limit (`agent.search.web.requests_per_second`, one limit for every process on the cache root) makes a floor:
  the step's search calls / rate. Tool time is the larger of the two;
- generate time: the longest trajectory decoded at `cost.decode_tokens_per_second` (sequences of a round decode in
  parallel, so the longest one sets the pace): its whole response budget, rl.rollout.max_response_length.
The step is tool-bound when its tool time exceeds its generate time; the verdict names the first lever.
"""

from __future__ import annotations

import math

from stages.core.config.loader import RunConfig
from stages.cost.basis import Measured
from stages.cost.line import Line


def tool_workers(cfg: RunConfig) -> int:
    """Processes with a tool pool of their own: verl's agent-loop workers, or the local trainer."""
    return cfg.rl.verl.agent_workers if cfg.rl.engine == "verl" else 1


def _run(value: float, steps: int | None) -> float | None:
    return None if steps is None else value * steps


def tool_time_lines(cfg: RunConfig, steps: int | None, tool_calls: Line, search_calls: Line,
                    measured: Measured | None, tol: float) -> tuple[list[Line], str]:
    """The lines (generate time, tool time, queueing, rate floor, calls per round per worker) and the verdict."""
    ro, agent, cost = cfg.rl.rollout, cfg.agent, cfg.cost
    calls_per_traj = max(1, min(ro.call_limit, agent.limits.max_calls))
    workers, threads = tool_workers(cfg), agent.concurrency
    per_round = (tool_calls.per_step or 0.0) / calls_per_traj / workers
    waves = math.ceil(per_round / threads) if per_round else 0
    tools_s = calls_per_traj * waves * cost.tool_call_seconds
    queue_s = calls_per_traj * max(0, waves - 1) * cost.tool_call_seconds
    floor_s = None
    if agent.search.backend == "web":
        floor_s = (search_calls.per_step or 0.0) / agent.search.web.requests_per_second
    generate_s = ro.max_response_length / cost.decode_tokens_per_second
    basis = "given"
    mean = measured.mean if measured else (lambda name: None)
    if mean("generate_s") is not None and mean("tools_s") is not None:
        generate_s, tools_s, basis = mean("generate_s"), mean("tools_s"), "measured"
        queue_s = mean("tool_queue_s") or 0.0
        per_round = mean("calls_per_round") or per_round
    error = tol if basis == "measured" else 0.0
    step_tools = max(tools_s, floor_s or 0.0) if basis == "given" else tools_s
    lines = [
        Line("generate time (s)", generate_s, _run(generate_s, steps), basis, error,
             "measured rollout split" if basis == "measured" else
             f"the longest trajectory ({ro.max_response_length} tokens) at cost.decode_tokens_per_second="
             f"{cost.decode_tokens_per_second:g}"),
        Line("tool time (s)", step_tools, _run(step_tools, steps), basis, error,
             "measured rollout split" if basis == "measured" else
             f"{calls_per_traj} call rounds x {waves} wave(s) of {threads} threads (agent.concurrency) x "
             f"cost.tool_call_seconds={cost.tool_call_seconds:g}" + (", or the web rate floor" if floor_s else "")),
        Line("tool queueing (s)", queue_s, _run(queue_s, steps), basis, error,
             "calls waiting for a pool thread (timing/tool_queue_s on a run)"),
        Line("tool calls per round per worker", per_round, None, tool_calls.basis if basis == "given" else basis,
             error, f"{workers} tool pool(s) of {threads} threads"),
    ]
    if floor_s is not None:
        rate = agent.search.web.requests_per_second
        lines.append(Line("web rate-limit floor (s)", floor_s, _run(floor_s, steps), search_calls.basis, 0.0,
                          f"search calls / agent.search.web.requests_per_second={rate:g} (one limit for every "
                          "worker on the cache root); the tool cache sends fewer"))
    # a measured tool time already holds the rate limit's waits (in its queueing)
    return lines, verdict(generate_s, step_tools, queue_s, floor_s if basis == "given" else None, tools_s,
                          agent.concurrency)


def verdict(generate_s: float, step_tools: float, queue_s: float, floor_s: float | None, pool_s: float,
            threads: int) -> str:
    """One sentence: tool-bound or not, and the first lever."""
    head = f"tool time {step_tools:,.0f} s against generate time {generate_s:,.0f} s per step"
    if step_tools <= generate_s:
        return f"Not tool-bound: {head}."
    if floor_s is not None and floor_s >= pool_s:
        return (f"**Tool-bound**: {head}; the web rate limit sets it ({floor_s:,.0f} s per step): raise "
                "agent.search.web.requests_per_second as far as the provider's plan allows, or cache more "
                "(agent.cache)")
    if queue_s > 0:
        return (f"**Tool-bound**: {head}, {queue_s:,.0f} s of it queueing for the {threads} tool threads: raise "
                "agent.concurrency")
    return f"**Tool-bound**: {head}; the calls themselves are slow (async rollouts would overlap them)"
