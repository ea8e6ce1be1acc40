"""The TIR step loop: what happens when a generated segment ends, one rule set for every driver.

A model writes a segment until EOS, its token budget or a stop string; `next_step` says what comes next:

| the segment ended with | step |
|---|---|
| EOS | done (`eos`) |
| the answer's closing tag (when it is a stop string) | done (`answer`), the environment ends the trajectory |
| its token budget, with budget left and text produced (a call cut by a per-request cap) | continue |
| its token budget, nothing left | done (`length`) |
| a closing tool tag after `call_limit` calls | done (`tool_limit`), the environment ends the trajectory |
| a closing tag without a parsable call, or an empty one | `empty_call: end`: done (`empty_call`), the environment ends it; `empty_call: ask`: the call runs and the ToolBox answers with its "empty" message |
| a closing tag with a call | call: the ToolBox runs it and `render_result(text)` is appended |

Two drivers use it:
- token level, batched over trajectories: `stages.generation.tool_rollout.ToolRollout` (RL rollouts and verl's rollout
  tree with RL's growth rule, SFT's sampled trajectories); "the environment ends it" = an EOS is appended;
- text level, one sample: `run_text_loop` below (evaluation over an OpenAI endpoint, SFT's teacher trajectories).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from stages.agent.protocol import ANSWER_STOP, STOP_TAGS, ToolCall, parse_tool_call, render_result


@dataclass(frozen=True)
class LoopRules:
    stops: tuple[str, ...] = STOP_TAGS       # what generation stops at: closing tool tags (and </answer> in eval)
    call_limit: int | None = None            # calls after which a further call ends the trajectory (RL's
    #                                          call_limit); None: the ToolBox's limits answer inside <result>
    empty_call: Literal["end", "ask"] = "end"


@dataclass(frozen=True)
class Segment:
    text: str                # the newly generated text, the stop string included when one fired
    finish: str              # stop | eos | length
    stop: str | None = None  # the stop string that fired
    budget_left: int = 0     # tokens the trajectory may still generate
    before: str = ""         # the model's text before this segment in the same turn (where a call may have opened)
    tokens: int = 0          # tokens generated in this segment


@dataclass(frozen=True)
class Step:
    kind: Literal["done", "call", "continue"]
    reason: str = ""                 # done: eos | answer | length | tool_limit | empty_call
    call: ToolCall | None = None
    ended_by_environment: bool = False   # answer / tool_limit / empty_call: the token driver appends EOS


def next_step(rules: LoopRules, segment: Segment, calls_made: int) -> Step:
    """What follows `segment` (see the module table)."""
    if segment.finish == "eos":
        return Step("done", "eos")
    if segment.finish == "length" or segment.stop is None:
        return Step("continue") if segment.budget_left > 0 and segment.tokens > 0 else Step("done", "length")
    if segment.stop == ANSWER_STOP:
        return Step("done", "answer", ended_by_environment=True)
    if rules.call_limit is not None and calls_made >= rules.call_limit:
        return Step("done", "tool_limit", ended_by_environment=True)
    call = parse_tool_call(segment.before + segment.text, stop=segment.stop)
    if call is None or not call.argument:
        if rules.empty_call == "end":
            return Step("done", "empty_call", ended_by_environment=True)
        call = call or ToolCall(segment.stop.strip("</>"), "")
    return Step("call", call=call)


def model_turn(output: str) -> str:
    """The model's text after the last environment result (where a call in progress opened)."""
    end = output.rfind("</result>")
    return output[end + len("</result>"):] if end >= 0 else output


# ---- the text-level driver -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TextSegment:
    text: str                # generated text, the stop string included when one fired
    finish: str              # stop | eos | length
    stop: str | None
    tokens: int              # completion tokens it cost


# generate(output so far, max_tokens, index of this generation call) -> the next segment
TextGenerator = Callable[[str, int, int], Awaitable[TextSegment]]


@dataclass
class TextLoopState:
    """Everything the loop learns, kept on the object, so a sample that times out still has its partial output."""

    output: str = ""
    finish_reason: str = "running"  # stop | length | max_calls | tool_limit | empty_call | timeout | error
    completion_tokens: int = 0
    llm_calls: int = 0
    tools_run: dict[str, int] = field(default_factory=lambda: {"python": 0, "search": 0})
    timing: dict[str, float] = field(default_factory=lambda: {"llm_s": 0.0, "python_s": 0.0, "search_s": 0.0})
    results: list[Any] = field(default_factory=list)  # the ToolResults, in order
    # Tool-Star's inference-time tools used on this sample (stages/agent/inference_tools.py)
    inference_tools: dict[str, int] = field(default_factory=lambda: {"debug": 0, "rollback": 0, "refine": 0})


@dataclass(frozen=True)
class TextBudget:
    max_tokens: int         # per generation call
    max_total_tokens: int   # per sample, across calls
    max_calls: int          # generation calls per sample


async def run_text_loop(generate: TextGenerator, box: Any, rules: LoopRules, budget: TextBudget,
                        state: TextLoopState, aids: Any = None) -> None:
    """Generate, step, run tools, until a step says done (the caller applies any timeout).

    `aids` (stages.agent.inference_tools.LoopAids): Tool-Star's refiner before each later generation and its
    rollback after a failed python call (the error is then not appended: the output is cut back instead)."""
    tool_state = box.new_state()
    while True:
        left = budget.max_total_tokens - state.completion_tokens
        if left <= 0:
            state.finish_reason = "length"
            return
        if state.llm_calls >= budget.max_calls:
            state.finish_reason = "max_calls"
            return
        if aids is not None and state.llm_calls > 0:
            await aids.refine(state)
        start = time.monotonic()
        seg = await generate(state.output, min(budget.max_tokens, left), state.llm_calls)
        state.timing["llm_s"] += time.monotonic() - start
        state.llm_calls += 1
        state.completion_tokens += seg.tokens
        before = model_turn(state.output)
        state.output += seg.text
        step = next_step(rules, Segment(seg.text, seg.finish, seg.stop, left - seg.tokens, before, seg.tokens),
                         sum(state.tools_run.values()))
        if step.kind == "continue":
            continue
        if step.kind == "done":
            state.finish_reason = "stop" if step.reason in ("eos", "answer") else step.reason
            return
        if hasattr(tool_state, "transcript"):  # the previous steps, for the browsing summariser's prompt
            tool_state.transcript = state.output
        result = await box.aexecute(step.call, tool_state)
        state.results.append(result)
        name = step.call.tool
        state.tools_run[name] = state.tools_run.get(name, 0) + 1
        state.timing[f"{name}_s"] = state.timing.get(f"{name}_s", 0.0) + float(result.latency_s)
        state.inference_tools["debug"] += bool((result.meta or {}).get("debug_attempted"))
        if aids is not None and aids.rollback(state, result):
            continue
        state.output += render_result(result.text)
