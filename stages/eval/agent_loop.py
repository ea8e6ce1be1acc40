"""One evaluation sample: a tool-integrated reasoning loop over the OpenAI completions API.

The chat template is applied locally to [system, user]; the loop then continues that raw text: generate
until `</search>`, `</python>` or `</answer>` (the stops are really sent, unlike the reference, 8.5.4);
servers cut the stop string, so it is re-appended; a tool call runs through the ToolBox and
` <result>\\n{text}\\n</result>` is appended; generation continues. A call cut by `max_tokens` is continued
while the sample's total token budget lasts. Everything the loop learns is kept on a `SampleState`, so a
sample that times out still has its partial output.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from stages.agent.protocol import ANSWER_STOP, STOP_TAGS, ToolCall, parse_tool_call, render_result
from stages.agent.stops import cut_at_stop

EVAL_STOPS: tuple[str, ...] = (*STOP_TAGS, ANSWER_STOP)


@dataclass(frozen=True)
class LoopSettings:
    model: str
    max_tokens: int                 # per generation call
    max_total_tokens: int           # per sample, across calls
    temperature: float
    top_p: float
    extras: dict[str, Any]          # top_k / min_p / repetition_penalty, when the server accepts them
    max_llm_calls: int
    stops: tuple[str, ...] = EVAL_STOPS

    def request(self, prompt: str, max_tokens: int, seed: int) -> dict[str, Any]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": self.temperature,
                "top_p": self.top_p, "stop": list(self.stops), "seed": seed}
        return body | ({"extra_body": dict(self.extras)} if self.extras else {})


@dataclass
class SampleState:
    output: str = ""
    finish_reason: str = "running"  # stop | length | max_calls | timeout | error
    completion_tokens: int = 0
    llm_calls: int = 0
    tools_run: dict[str, int] = field(default_factory=lambda: {"python": 0, "search": 0})
    timing: dict[str, float] = field(default_factory=lambda: {"llm_s": 0.0, "python_s": 0.0, "search_s": 0.0})


def matched_stop(choice: Any, text: str, so_far: str, stops: tuple[str, ...]) -> tuple[str, str | None]:
    """(text, stop): the generated text without a stop string, and which stop ended it (None: EOS/length).

    Trusts the server's `stop_reason` (vLLM sends it). A server that ignores stops
    is handled by cutting at the first stop tag in the text; one without `stop_reason` that ended on
    "stop" is read from the tags: a call still open is the tool's stop, an open <answer> is </answer>.
    """
    cut, hit = cut_at_stop(text, stops)
    if hit is not None:
        return cut[: -len(hit)], hit
    extra = choice.model_extra or {}
    if "stop_reason" in extra:
        reason = extra["stop_reason"]
        return text, reason if isinstance(reason, str) and reason in stops else None
    if choice.finish_reason != "stop":
        return text, None
    call = parse_tool_call(so_far + text)
    if call is not None:
        return text, f"</{call.tool}>"
    full = so_far + text
    return text, ANSWER_STOP if full.rfind("<answer>") > full.rfind("</answer>") else None


async def run_sample(client: Any, settings: LoopSettings, prompt: str, box: Any, seed: int,
                     state: SampleState) -> None:
    """Run the loop to the end, updating `state` as it goes (the caller applies the timeout)."""
    tool_state = box.new_state()
    while True:
        left = settings.max_total_tokens - state.completion_tokens
        if left <= 0:
            state.finish_reason = "length"
            return
        if state.llm_calls >= settings.max_llm_calls:
            state.finish_reason = "max_calls"
            return
        start = time.monotonic()
        response = await client.completions.create(
            **settings.request(prompt + state.output, min(settings.max_tokens, left), seed + state.llm_calls))
        state.timing["llm_s"] += time.monotonic() - start
        state.llm_calls += 1
        choice = response.choices[0]
        state.completion_tokens += response.usage.completion_tokens if response.usage else len(choice.text) // 4 + 1
        text, stop = matched_stop(choice, choice.text, state.output, settings.stops)
        state.output += text
        if stop is None:
            if choice.finish_reason == "length":
                continue  # cut by the per-call max_tokens: keep generating while the sample budget lasts
            state.finish_reason = "stop"
            return
        state.output += stop
        if stop == ANSWER_STOP:
            state.finish_reason = "stop"
            return
        await run_tool(box, tool_state, state, stop)


async def run_tool(box: Any, tool_state: Any, state: SampleState, stop: str) -> None:
    """Execute the call that `stop` closed and append its result (limit feedback comes from the ToolBox)."""
    tool = stop.strip("</>")
    call = parse_tool_call(state.output, stop) or ToolCall(tool, "")
    result = await box.aexecute(call, tool_state)
    state.tools_run[call.tool] = state.tools_run.get(call.tool, 0) + 1
    state.timing[f"{call.tool}_s"] = state.timing.get(f"{call.tool}_s", 0.0) + float(result.latency_s)
    state.output += render_result(result.text)
