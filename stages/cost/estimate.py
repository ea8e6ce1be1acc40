"""What a run will cost, from the config, the data size and (when one exists) a measured short run. Pure.

Each line is one quantity per RL step and per run, with its basis:
- `exact`: config arithmetic (prompts, trajectories, steps): the run does exactly this;
- `bound`: from the limits (response budget, call limits): the run never exceeds it;
- `measured`: a measured run's mean per step, projected; it holds within `cost.tolerance` (stated relative error);
- `given`: a step time from the config (`cost.step_seconds`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from stages.core.config.loader import RunConfig
from stages.core.engine_spec import ENGINES
from stages.cost.basis import Measured
from stages.cost.line import Line
from stages.cost.summarizer import eval_summarizer_lines, summarizer_assumption, summarizer_lines
from stages.cost.tool_time import tool_time_lines

ATTEMPTS = {"server": 3, "web": None}  # requests per failing search call (web: agent.search.web.retries)


@dataclass
class Estimate:
    profile: str
    steps: int | None
    train_rows: int | None
    measured: str | None
    lines: list[Line] = field(default_factory=list)
    assumptions: list[str] = field(default_factory=list)
    memory: Any = None          # stages.cost.memory.MemoryEstimate (verl engine), set by plan_run
    verdict: str = ""           # tool-bound or not (stages/cost/tool_time.py)

    def line(self, what: str) -> Line:
        return next(line for line in self.lines if line.what == what)

    def to_json(self) -> dict[str, Any]:
        return {"profile": self.profile, "steps": self.steps, "train_rows": self.train_rows,
                "measured": self.measured, "lines": [vars(line) for line in self.lines],
                "assumptions": self.assumptions, "memory": self.memory.to_json() if self.memory else None,
                "verdict": self.verdict}


def run_steps(cfg: RunConfig, train_rows: int | None) -> int | None:
    """Total RL steps: rl.trainer.total_steps, else full batches per epoch x epochs (the last one is dropped)."""
    trainer = cfg.rl.trainer
    if trainer.total_steps:
        return trainer.total_steps
    return None if train_rows is None else train_rows // trainer.train_batch_size * trainer.epochs


def devices(cfg: RunConfig) -> int:
    return ENGINES.get(cfg.rl.engine).devices(cfg.rl)


def _line(what: str, bound: float, steps: int | None, measured: float | None, tolerance: float,
          note: str = "") -> Line:
    """A measured mean when there is one, else the bound; per run = per step x steps."""
    if measured is not None:
        return Line(what, measured, None if steps is None else measured * steps, "measured", tolerance,
                    f"bound {bound:,.0f}/step" + (f"; {note}" if note else ""))
    return Line(what, bound, None if steps is None else bound * steps, "bound", 0.0, note)


def estimate(cfg: RunConfig, train_rows: int | None, measured: Measured | None = None,
             eval_questions: dict[str, int | None] | None = None) -> Estimate:
    ro, trainer, limits = cfg.rl.rollout, cfg.rl.trainer, cfg.agent.limits
    steps = run_steps(cfg, train_rows)
    tol = cfg.cost.tolerance
    out = Estimate(cfg.profile, steps, train_rows, measured.source if measured else None)
    prompts = trainer.train_batch_size
    trajs = prompts * ro.n
    probes = prompts if ro.dynamic_rollouts else 0   # AEPO's probe: one tool-using rollout per prompt
    calls_per_traj = min(ro.call_limit, limits.max_calls)
    mean = measured.mean if measured else (lambda name: None)
    out.lines += [Line("prompts", prompts, _times(prompts, steps), "exact"),
                  Line("trajectories", trajs, _times(trajs, steps), "exact",
                       note=f"+ {probes} probe rollouts (AEPO dynamic rollouts)" if probes else "")]
    tokens = mean("model_tokens_per_traj")
    out.lines.append(_line("generated tokens", (trajs + probes) * ro.max_response_length, steps,
                           None if tokens is None else tokens * trajs, tol,
                           "model tokens; tool results share the budget"))
    out.lines.append(_line("tool calls", (trajs + probes) * calls_per_traj, steps, mean("tool_calls"), tol,
                           "executed: a branch's copied calls counted once"))
    for tool, cap in (("search", limits.max_search), ("python", limits.max_python)):
        bound = (trajs + probes) * min(calls_per_traj, cap if cap is not None else calls_per_traj)
        out.lines.append(_line(f"{tool} calls", bound, steps, mean(f"{tool}_calls"), tol))
    time_lines, out.verdict = tool_time_lines(cfg, steps, out.line("tool calls"), out.line("search calls"),
                                              measured, tol)
    out.lines += time_lines
    out.lines += _search_bill(cfg, out.line("search calls"))
    out.lines += summarizer_lines(cfg, out.line("search calls"))
    out.lines += _device_hours(cfg, steps, mean("step_s"), tol)
    out.lines += _eval_lines(cfg, eval_questions or {})
    out.lines += eval_summarizer_lines(cfg, eval_questions or {})
    out.assumptions = _assumptions(cfg, out, measured)
    return out


def _times(value: float, steps: int | None) -> float | None:
    return None if steps is None else value * steps


def _attempts(cfg: RunConfig) -> int:
    backend = cfg.agent.search.backend
    return cfg.agent.search.web.retries if backend == "web" else ATTEMPTS.get(backend) or 1


def _search_bill(cfg: RunConfig, calls: Line) -> list[Line]:
    """Requests to the search provider (worst case: every call failing and retried) and their price; none for the
    in-process backends (local BM25, replay)."""
    if cfg.agent.search.backend not in ATTEMPTS:
        return []
    attempts = _attempts(cfg)
    worst = Line("search requests (all retried)", (calls.per_step or 0) * attempts,
                 None if calls.per_run is None else calls.per_run * attempts, calls.basis, calls.error,
                 f"{attempts} attempts per failing call ({cfg.agent.search.backend} backend)")
    price = cfg.cost.search_price_per_1000
    if price is None:
        return [worst]
    cost = Line("search cost", (calls.per_step or 0) * price / 1000,
                None if calls.per_run is None else calls.per_run * price / 1000, calls.basis, calls.error,
                f"{price:g} per 1000 requests (cost.search_price_per_1000); up to {attempts}x with failures")
    return [worst, cost]


def _device_hours(cfg: RunConfig, steps: int | None, measured_s: float | None, tol: float) -> list[Line]:
    n = devices(cfg)
    step_s, basis, error = measured_s, "measured", tol
    if step_s is None and cfg.cost.step_seconds is not None:
        step_s, basis, error = cfg.cost.step_seconds, "given", 0.0
    if step_s is None:
        note = "no measured run and no cost.step_seconds: run a short one (rl.trainer.total_steps=2) or give it"
        return [Line("step time (s)", None, None, "unknown", note=note),
                Line("device-hours", None, None, "unknown", note=note)]
    hours = None if steps is None else steps * step_s * n / 3600
    return [Line("step time (s)", step_s, None if steps is None else steps * step_s, basis, error),
            Line("device-hours", step_s * n / 3600, hours, basis, error, f"{n} device(s)")]


def _eval_lines(cfg: RunConfig, questions: dict[str, int | None]) -> list[Line]:
    """Evaluation (per run only): answers = questions x samples; tool calls bounded by the eval limits."""
    ev = cfg.eval
    if not ev.enabled or not questions:
        return []
    known = {name: q for name, q in questions.items() if q is not None}
    missing = sorted(set(questions) - set(known))
    if not known:
        return [Line("eval answers", None, None, "unknown", note=f"benchmark files not found here: {missing}")]
    answers = sum(known.values()) * ev.samples
    note = f"{len(known)} benchmark(s) x {ev.samples} samples" + (
        f"; not counted (files not here): {missing}" if missing else "")
    return [Line("eval answers", None, answers, "exact", note=note),
            Line("eval generated tokens", None, answers * ev.max_total_tokens, "bound"),
            Line("eval search calls", None, answers * ev.max_search, "bound"),
            Line("eval python calls", None, answers * ev.max_python, "bound")]


def _assumptions(cfg: RunConfig, est: Estimate, measured: Measured | None) -> list[str]:
    ro = cfg.rl.rollout
    notes = [f"{est.train_rows if est.train_rows is not None else 'unknown'} training prompts; "
             f"{est.steps if est.steps is not None else 'unknown'} RL steps "
             + ("(rl.trainer.total_steps)" if cfg.rl.trainer.total_steps else
                f"({cfg.rl.trainer.epochs} epochs of full batches of {cfg.rl.trainer.train_batch_size}; the last "
                "partial batch is dropped)"),
             f"bounds: every trajectory uses its whole response budget ({ro.max_response_length} tokens) and "
             f"{min(ro.call_limit, cfg.agent.limits.max_calls)} tool calls (rl.rollout.call_limit, "
             "agent.limits); the real run stays below them",
             "search calls: each executed call is one provider request when it succeeds; the tool cache "
             "(agent.cache) and rejected repeats send fewer, a failing call is retried (the worst case line)"]
    if measured is not None:
        notes.append(f"measured: the mean of {measured.steps} step(s) of {measured.source}, projected to the run; "
                     f"stated error +-{cfg.cost.tolerance:.0%} (the policy's lengths and tool use drift as it "
                     "trains)")
    else:
        notes.append("no measured run found for these per-step settings: tool calls and tokens are the bounds")
    notes += [note for note in [summarizer_assumption(cfg)] if note]
    notes.append("not estimated: SFT, merge, serving start-up, evaluation time")
    return notes
