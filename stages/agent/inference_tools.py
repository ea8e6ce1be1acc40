"""Tool-Star's optional inference-time tools (research/arpo.md 5.5), each used at most a few times per sample.

- code debugger: on a python error an OpenAI-compatible LLM rewrites the code once; the fix is run instead.
  (wired into ToolBox when `agent.inference.debugger` is on)
- rollback: on a python error cut the response back to before the failing `<python>` so the policy
  regenerates that step: `rollback_cut` (text) and `rollback_keep_tokens` (token ids), pure functions for the
  generation loop.
- refiner: when prompt + response pass `refine_threshold_tokens`, an LLM compresses the response (`Refiner`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

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
    """Cut `text` back to the last newline before its last `<python>` (dropping a `</think>` just before it),
    so the model regenerates that step. None when there is no `<python>` to roll back.

    `"<think>a\\nb </think>\\n<python>x</python>"` -> `"<think>a\\nb "`: the newline before `<python>` is the
    one after `</think>`; the kept part then ends with `</think>\\n`, whose `</think>` is dropped.
    """
    at = text.rfind("<python>")
    if at < 0:
        return None
    head = text[:at]
    newline = head.rfind("\n")
    kept = head[: newline + 1] if newline >= 0 else head
    stripped = kept.rstrip()
    if stripped.endswith("</think>"):
        kept = stripped[: -len("</think>")]
    return kept


def rollback_keep_tokens(token_texts: list[str], cut_chars: int) -> int:
    """How many leading tokens to keep so that their text is at most `cut_chars` characters long.

    `token_texts[i]` is the text of token i (e.g. from decoding each id with the offsets of a fast
    tokenizer); with `cut_chars = len(rollback_cut(text))` this keeps the token ids as generated.
    """
    total = 0
    for count, piece in enumerate(token_texts):
        if total + len(piece) > cut_chars:
            return count
        total += len(piece)
    return len(token_texts)


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
