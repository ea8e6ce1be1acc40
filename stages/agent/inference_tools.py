"""Tool-Star's optional inference-time tools (Tool-Star evaluation/run.py `--use_debug`, `--use_rollback`,
`--use_refiner`; facts in docs/agent.md), each used at most `max_*` times per sample.

- code debugger: on a python error an OpenAI-compatible LLM rewrites the code once; the fix is run instead
  (wired into the python tool when `agent.inference.debugger` is on; stages/agent/tools.py).
- rollback: on a python error (no debugger use left for this call) the output is cut back to before the line
  that opened the failing `<python>` and the policy regenerates that step (`rollback_cut`; the text loop through
  `LoopAids`).
- refiner: when prompt + output pass `refine_threshold_tokens`, the helper LLM compresses the output
  (`Refiner`; the text loop through `LoopAids`).
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stages.core.config.agent import InferenceToolsSection

_FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)

DEBUG_PROMPT = (
    "The following Python code failed.\n\nCode:\n```python\n{code}\n```\n\nError:\n```\n{error}\n```\n\n"
    "Rewrite the code so that it runs correctly and prints its result. Reply with the corrected code only, "
    "in one ```python code block.")
REFINE_PROMPT = (
    "Below is a question and a partial step-by-step solution that uses tools. Rewrite the solution more "
    "concisely: remove redundant or repeated reasoning and tool output, but preserve every key fact, "
    "intermediate result and the tags (<think>, <search>, <python>, <result>) needed to continue. Reply with the "
    "rewritten solution only.\n\nQuestion:\n{question}\n\nSolution so far:\n{response}")


def extract_code(reply: str) -> str:
    """The code in an LLM reply: the last fenced block if any, else the whole reply stripped."""
    blocks = _FENCE.findall(reply or "")
    return (blocks[-1] if blocks else reply or "").strip()


def rollback_cut(text: str) -> str | None:
    """Tool-Star's rollback (evaluation/tools/rollback_code.py): from the last `<python>` step back over spaces
    and newlines, over a `</think>` right there and the spaces before it, then cut after the last newline at or
    before that point. The line that led to the call goes too, so the model regenerates the whole step.
    None when there is no `<python>`; "" when no newline precedes it (the whole output is regenerated).

    `"<think>a\\nb </think>\\n<python>x"` -> `"<think>a\\n"`: back over "\\n" and `</think>` and " " to
    "b"; the last newline before it ends "a".
    """
    at = text.rfind("<python>")
    if at < 0:
        return None
    i = at - 1
    while i >= 0 and text[i] in " \n":
        i -= 1
    if text[max(0, i - len("</think>") + 1): i + 1] == "</think>":
        i -= len("</think>")
    while i >= 0 and text[i] in " \n":
        i -= 1
    newline = text.rfind("\n", 0, i + 1)
    return text[: newline + 1] if newline >= 0 else ""


@dataclass
class HelperLLM:
    """A small OpenAI-compatible chat client for the debugger and the refiner."""

    url: str
    model: str
    api_key: str = "EMPTY"
    temperature: float = 0.0
    max_tokens: int = 2048
    timeout_s: float = 120.0
    max_retries: int = 2

    @classmethod
    def from_config(cls, cfg: InferenceToolsSection, url: str | None = None, model: str | None = None) -> HelperLLM:
        url, model = cfg.llm_url or url, cfg.llm_model or model
        if not url or not model:
            raise ValueError("inference-time tools need a helper LLM: set agent.inference.llm_url and "
                             "agent.inference.llm_model (any OpenAI-compatible endpoint, e.g. the served policy)")
        key = os.environ.get(cfg.api_key_env, "") if cfg.api_key_env else ""
        return cls(url, model, key or "EMPTY", cfg.temperature, cfg.max_tokens, cfg.timeout_s)

    def complete(self, prompt: str) -> str:
        from openai import OpenAI

        client = OpenAI(base_url=self.url, api_key=self.api_key, timeout=self.timeout_s,
                        max_retries=self.max_retries)
        try:
            reply = client.chat.completions.create(
                model=self.model, messages=[{"role": "user", "content": prompt}],
                temperature=self.temperature, max_tokens=self.max_tokens)
        finally:
            client.close()
        return reply.choices[0].message.content or ""


class CodeDebugger:
    """`fix(code, error) -> corrected code or None` (None when the LLM fails or returns the same code)."""

    def __init__(self, llm: HelperLLM) -> None:
        self.llm = llm

    def fix(self, code: str, error: str) -> str | None:
        try:
            reply = self.llm.complete(DEBUG_PROMPT.format(code=code, error=error[-2000:]))
        except Exception:  # noqa: BLE001 - a failed debugger must not fail the tool call
            return None
        fixed = extract_code(reply)
        return fixed if fixed and fixed.strip() != code.strip() else None


class Refiner:
    """Compress a long response once it passes the token threshold."""

    def __init__(self, llm: HelperLLM, threshold_tokens: int) -> None:
        self.llm, self.threshold = llm, threshold_tokens

    def needed(self, prompt_tokens: int, response_tokens: int) -> bool:
        return prompt_tokens + response_tokens >= self.threshold

    def refine(self, question: str, response: str) -> str:
        """The compressed response; the original when the LLM fails or answers with nothing."""
        try:
            refined = self.llm.complete(REFINE_PROMPT.format(question=question, response=response)).strip()
        except Exception:  # noqa: BLE001 - keep the original context on any helper failure
            return response
        return refined or response


class LoopAids:
    """Rollback and refiner for one sample of the text loop (stages.agent.loop.run_text_loop), as Tool-Star's
    evaluation applies them; their uses are counted in `state.inference_tools`.

    count_tokens(text) -> tokens of text (the policy's tokenizer); prompt and question are the sample's.
    """

    def __init__(self, cfg: InferenceToolsSection, refiner: Refiner | None, count_tokens: Callable[[str], int],
                 prompt: str, question: str) -> None:
        self.cfg, self.refiner, self.count_tokens, self.question = cfg, refiner, count_tokens, question
        self.prompt_tokens = count_tokens(prompt) if refiner is not None else 0

    def rollback(self, state: Any, result: Any) -> bool:
        """After a tool call: on a python error, cut `state.output` back (instead of appending the error) and
        return True. Not for refused calls (limits), infrastructure failures, or a call the debugger already
        tried to fix (Tool-Star rolls back only when no debug is left: run.py 193-207)."""
        if not self.cfg.rollback or state.inference_tools.get("rollback", 0) >= self.cfg.max_rollback:
            return False
        meta = result.meta or {}
        if result.tool != "python" or result.ok or meta.get("rejected") or meta.get("internal_error") \
                or meta.get("debug_attempted"):
            return False
        cut = rollback_cut(state.output)
        if cut is None:
            return False
        state.output = cut
        state.inference_tools["rollback"] = state.inference_tools.get("rollback", 0) + 1
        return True

    async def refine(self, state: Any) -> None:
        """Before a generation: compress the output once prompt + output reach the threshold (Tool-Star checks
        every sequence still generating after each round: run.py 253-264)."""
        if self.refiner is None or state.inference_tools.get("refine", 0) >= self.cfg.max_refine:
            return
        if not self.refiner.needed(self.prompt_tokens, self.count_tokens(state.output)):
            return
        state.output = await asyncio.to_thread(self.refiner.refine, self.question, state.output)
        state.inference_tools["refine"] = state.inference_tools.get("refine", 0) + 1
