"""`arpo plan`: what a run will cost before it starts (docs/plan.md).

    est = plan_run(cfg)                 # from the config, the data, and a measured short run when one exists
    print(render_markdown(est))         # per step and per run, each line with its basis and stated error;
                                        # and the verl engine's peak memory per GPU by phase (stages/cost/memory.py)
"""

from __future__ import annotations

from stages.core.config.loader import RunConfig
from stages.cost.basis import Measured, find_measured, read_measured
from stages.cost.estimate import Estimate, estimate
from stages.cost.inputs import eval_questions, train_rows
from stages.cost.line import Line
from stages.cost.memory import MemoryEstimate, memory_estimate
from stages.rl.step_identity import step_identity

BASIS_TEXT = {"exact": "exact", "bound": "upper bound", "measured": "measured", "given": "given", "unknown": "unknown"}


def measured_run(cfg: RunConfig) -> Measured | None:
    """cost.measured, else the newest RL stage folder under run.output_root with this config's per-step identity."""
    if cfg.cost.measured:
        return read_measured(cfg.cost.measured)
    identity = step_identity(cfg.rl, cfg.agent, cfg.model.name, cfg.model.dtype)
    return find_measured(cfg.run.output_root, identity)


def plan_run(cfg: RunConfig, measured: Measured | None = None) -> Estimate:
    est = estimate(cfg, train_rows(cfg), measured if measured is not None else measured_run(cfg),
                   eval_questions(cfg))
    est.memory = memory_estimate(cfg)
    return est


def _number(value: float | None) -> str:
    if value is None:
        return "-"
    if abs(value) >= 100 or value == int(value):
        return f"{value:,.0f}"
    return f"{value:,.3g}" if abs(value) < 1 else f"{value:,.2f}"


def _basis(line: Line) -> str:
    text = BASIS_TEXT[line.basis]
    return f"{text} +-{line.error:.0%}" if line.error else text


def render_markdown(est: Estimate) -> str:
    rows = ["| quantity | per RL step | per run | basis | note |", "|---|---|---|---|---|"]
    rows += [f"| {line.what} | {_number(line.per_step)} | {_number(line.per_run)} | {_basis(line)} | {line.note} |"
             for line in est.lines]
    title = (f"## Plan: profile {est.profile}, {est.steps if est.steps is not None else '?'} RL steps "
             f"over {est.train_rows if est.train_rows is not None else '?'} prompts")
    out = [title, "", *rows, "", *([est.verdict, ""] if est.verdict else []), "Assumptions:",
           *[f"- {a}" for a in est.assumptions], ""]
    return "\n".join(out + (render_memory(est.memory) if est.memory else []))


def render_memory(mem: MemoryEstimate) -> list[str]:
    """The memory model's table: peak GiB per GPU of each phase against the device, its parts and its fix."""
    rows = [f"## Memory per GPU ({mem.model}, {mem.gpus} GPU(s) of {mem.device_gib:g} GiB: cost.gpu_memory_gib)", "",
            "| phase | peak GiB | fits | parts (GiB) | worst micro-batch | if it does not fit |",
            "|---|---|---|---|---|---|"]
    for p in mem.phases:
        parts = ", ".join(f"{k} {v:.1f}" for k, v in p.parts.items())
        rows.append(f"| {p.name} | {p.gib:.1f} | {'yes' if p.gib <= mem.device_gib else '**no**'} | {parts} | "
                    f"{p.micro_batch or '-'} | {p.fix} |")
    return rows + ["", "Memory assumptions:", *[f"- {n}" for n in mem.notes], ""]


__all__ = ["Estimate", "Line", "Measured", "MemoryEstimate", "estimate", "measured_run", "memory_estimate",
           "plan_run", "read_measured", "render_markdown", "step_identity"]
