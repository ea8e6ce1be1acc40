"""What `arpo plan` needs beyond the stage sections to estimate a run's cost and its device memory (stages/cost/).

None of it changes what a stage computes, so no stage key reads this section: pricing a run recomputes nothing.
The memory keys also decide whether `arpo run` starts a verl run (stages/cost/memory.py, docs/plan.md "Memory").
"""

from __future__ import annotations

from pydantic import Field, field_validator

from stages.core.config.section import Section


class CostSection(Section):
    """Prices, measured runs and device memory for `arpo plan` (docs/plan.md); no stage key reads it."""

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
    tool_call_seconds: float = Field(
        1.5, gt=0, description="assumed wall time of one tool call (a search request, a sandbox run) for the plan's "
        "tool time when no measured run is found; a run's own is timing/tools_s over its calls")
    decode_tokens_per_second: float = Field(
        30.0, gt=0, description="assumed decode speed of ONE sequence inside a full rollout batch, for the plan's "
        "generate time (the longest trajectory sets a round's pace) when no measured run is found; a run's own "
        "is timing/generate_s")
    tolerance: float = Field(
        0.5, gt=0, description="stated relative error of quantities projected from a measured run (tool calls, "
        "tokens, step time): the policy's lengths and tool use drift as it trains; bounds from the limits have "
        "no error, they are never exceeded")
    gpu_memory_gib: float = Field(
        80.0, gt=0, description="memory of one GPU of the verl engine in GiB (an 80 GB H100/A100: 80); the memory "
        "model's per-phase peak must fit it, or `arpo run` refuses the config naming the setting that fixes it")
    response_length_mix: list[tuple[float, float]] = Field(
        [(0.35, 0.1), (0.45, 0.4), (0.2, 1.0)], min_length=1, description="the responses' length mix the memory "
        "model partitions into verl's micro-batches: [share of trajectories, response length as a fraction of "
        "rl.rollout.max_response_length] pairs (prompts at max_prompt_length). Default: 35% short answers, 45% "
        "with 1-3 tool calls, 20% using the whole budget")

    @field_validator("response_length_mix")
    @classmethod
    def _mix(cls, mix: list[tuple[float, float]]) -> list[tuple[float, float]]:
        if any(share <= 0 or not 0 < frac <= 1 for share, frac in mix):
            raise ValueError("cost.response_length_mix: every pair is [share > 0, fraction of the response budget in "
                             "(0, 1]]")
        if abs(sum(share for share, _ in mix) - 1) > 1e-6:
            raise ValueError(f"cost.response_length_mix: the shares sum to {sum(s for s, _ in mix):g}, not 1")
        return mix
