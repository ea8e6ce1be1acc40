"""What a rehearsal says about the profile at its real scale: `arpo plan`'s estimate (steps, device-hours) and,
for the verl engine, the memory model's verdict (docs/plan.md). Nothing here runs the profile."""

from __future__ import annotations

from typing import Any


def real_scale_checks(cfg: Any) -> dict[str, str]:
    """Headline lines of the real profile's plan and memory estimate, for the rehearsal's report."""
    from stages.cost import plan_run
    from stages.cost.memory import memory_problem

    est = plan_run(cfg)
    out = {"RL steps": f"{est.steps if est.steps is not None else '?'} over "
                       f"{est.train_rows if est.train_rows is not None else '?'} prompts"}
    for line in est.lines:
        out[line.what] = (f"{line.per_run:,.0f} per run ({line.basis})" if line.per_run is not None
                          else f"unknown: {line.note}")
    if est.memory is not None:
        problem = memory_problem(est.memory)
        peak = max(est.memory.phases, key=lambda p: p.gib)
        out["memory per GPU"] = (f"peak ~{peak.gib:.1f} GiB ({peak.name}) of {est.memory.device_gib:g} GiB: "
                                 + ("fits" if problem is None else f"DOES NOT FIT: {problem}"))
    return out
