"""What `arpo plan` needs beyond the stage sections to estimate a run's cost (stages/cost/).

None of it changes what a stage computes, so no stage key reads this section: pricing a run recomputes nothing.
"""

from __future__ import annotations

from pydantic import Field

from stages.core.config.section import Section


class CostSection(Section):
    search_price_per_1000: float | None = Field(
        None, ge=0, description="what the search provider charges per 1000 requests (in your currency), to price "
        "a run's search calls; None = not priced (a local index or retrieval server costs nothing per call)")
    step_seconds: float | None = Field(
        None, gt=0, description="given wall time of one RL step on the configured devices, for device-hours when "
        "no measured run is found; None = device-hours only from a measured run")
    measured: str | None = Field(
        None, description="a measured RL run to project from: its stage folder or metrics.jsonl; None = the newest "
        "RL stage folder under run.output_root whose per-step settings equal this config's (a short run with "
        "fewer steps counts)")
    tolerance: float = Field(
        0.5, gt=0, description="stated relative error of quantities projected from a measured run (tool calls, "
        "tokens, step time): the policy's lengths and tool use drift as it trains; bounds from the limits have "
        "no error, they are never exceeded")
