"""`arpo plan`: what a run will cost before it starts (docs/plan.md).

    est = plan_run(cfg)                 # from the config, the data, and a measured short run when one exists
    print(render_markdown(est))         # per step and per run, each line with its basis and stated error
"""

from __future__ import annotations

from stages.core.config import RunConfig
from stages.cost.basis import Measured, find_measured, read_measured, step_identity
from stages.cost.estimate import Estimate, Line, estimate
from stages.cost.inputs import eval_questions, train_rows

BASIS_TEXT = {"exact": "exact", "bound": "upper bound", "measured": "measured", "given": "given", "unknown": "unknown"}


def measured_run(cfg: RunConfig) -> Measured | None:
    """cost.measured, else the newest RL stage folder under run.output_root with this config's per-step identity."""
    if cfg.cost.measured:
        return read_measured(cfg.cost.measured)
    identity = step_identity(cfg.rl, cfg.agent, cfg.model.name, cfg.model.dtype)
    return find_measured(cfg.run.output_root, identity)


def plan_run(cfg: RunConfig, measured: Measured | None = None) -> Estimate:
    return estimate(cfg, train_rows(cfg), measured if measured is not None else measured_run(cfg),
                    eval_questions(cfg))


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
    return "\n".join([title, "", *rows, "", "Assumptions:", *[f"- {a}" for a in est.assumptions], ""])


__all__ = ["Estimate", "Line", "Measured", "estimate", "measured_run", "plan_run", "read_measured", "render_markdown",
           "step_identity"]
