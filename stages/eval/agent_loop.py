"""One evaluation sample: the agent runtime's text loop (stages.agent.loop) over the OpenAI completions API.

The chat template is applied locally to [system, user]; the loop then continues that raw text: generate until
`</search>`, `</python>` or `</answer>` (the stops are really sent, unlike the reference, 8.5.4); servers cut the
stop string, so it is re-appended; a tool call runs through the ToolBox and ` <result>\\n{text}\\n</result>` is
appended; generation continues. A call cut by `max_tokens` is continued while the sample's total token budget
lasts. Everything the loop learns is kept on a `SampleState`, so a sample that times out still has its partial
output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stages.agent.loop import LoopRules, TextBudget, TextLoopState, TextSegment, run_text_loop
from stages.agent.protocol import ANSWER_STOP, STOP_TAGS, parse_tool_call
from stages.agent.stops import cut_at_stop

EVAL_STOPS: tuple[str, ...] = (*STOP_TAGS, ANSWER_STOP)
SampleState = TextLoopState


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

    @property
    def rules(self) -> LoopRules:
        """Evaluation lets the ToolBox answer limits and empty calls inside <result> (the reference's feedback)."""
        return LoopRules(stops=self.stops, call_limit=None, empty_call="ask")

    @property
    def budget(self) -> TextBudget:
        return TextBudget(self.max_tokens, self.max_total_tokens, self.max_llm_calls)


def matched_stop(choice: Any, text: str, so_far: str, stops: tuple[str, ...]) -> tuple[str, str | None]:
    """(text, stop): the generated text without a stop string, and which stop ended it (None: EOS/length).

    A server that ignores stops is handled by cutting at the first stop (stages.agent.stops, the one rule); else
    the server's `stop_reason` (vLLM sends it) is trusted; one without `stop_reason` that ended on "stop" is read
    from the tags: a call still open is the tool's stop, an open <answer> is </answer>.
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


def completions_generator(client: Any, settings: LoopSettings, prompt: str, seed: int):
    """The loop's generator over an OpenAI-compatible completions endpoint (the stop string re-appended)."""

    async def generate(output: str, max_tokens: int, call: int) -> TextSegment:
        response = await client.completions.create(**settings.request(prompt + output, max_tokens, seed + call))
        choice = response.choices[0]
        tokens = response.usage.completion_tokens if response.usage else len(choice.text) // 4 + 1
        text, stop = matched_stop(choice, choice.text, output, settings.stops)
        if stop is not None:
            return TextSegment(text + stop, "stop", stop, tokens)
        return TextSegment(text, "length" if choice.finish_reason == "length" else "eos", None, tokens)

    return generate


async def run_sample(client: Any, settings: LoopSettings, prompt: str, box: Any, seed: int,
                     state: SampleState, aids: Any = None) -> None:
    """Run the loop to the end, updating `state` as it goes (the caller applies the timeout); `aids`: Tool-Star's
    rollback and refiner (stages.agent.inference_tools.LoopAids), None when both are off."""
    await run_text_loop(completions_generator(client, settings, prompt, seed), box, settings.rules,
                        settings.budget, state, aids)
