"""The deep-search summariser: browsed pages + the reasoning so far -> the search tool's result.

Prompt, step truncation and extraction are the reference's (`search_tool_sds.py` / `search_tool_sds_cn.py`,
docs/reference.md "Deep-search browsing"): the previous steps numbered `Step i: …`, all of them when there are at
most 5, else the first, the last 4, every step holding a whole `<search>…</search>` and every `<result>` that
follows one, others elided as `...`; the current query; the pages as `**Web Page i:**` + JSON. The summary is the
text after the last `**Final Information**` marker (`**最终信息**` in the Chinese variant), newlines removed, as
the reference does; without a marker, after `**Modified Reasoning Steps**`, else the whole reply.

The summariser is any OpenAI-compatible endpoint (`agent.search.summarizer.url`: a server the user runs, or the one
the evaluation serves from `agent.search.summarizer.path`, stages/eval/search_mode.py), called with the `openai` client
and retried with exponential backoff (tenacity); what still fails is a SummaryError (an infrastructure failure of
the search tool). Summaries are cached in SQLite keyed by (prompt, query, pages, model, sampling).
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Any

from stages.core.config.browse import SummarizerSection
from stages.core.store import SQLiteStore, store_key

STEP_MARKER = "**Modified Reasoning Steps**"
MARKERS = {"en": "**Final Information**", "zh": "**最终信息**"}
_RESULT_BLOCK = re.compile(r"(<result>.*?</result>)", re.S)

PROMPT_EN = """**Task Instruction:**

You are tasked with reading and analyzing web pages based on the following inputs: **Previous Reasoning Steps**, **Current Search Query**, and **Searched Web Pages**. Your objective is to extract relevant and helpful information for **Current Search Query** from the **Searched Web Pages** and seamlessly integrate this information into the **Previous Reasoning Steps** to continue reasoning for the original question.

**Guidelines:**

1. **Analyze the Searched Web Pages:**
- Carefully review the content of each searched web page.
- Identify factual information that is relevant to the **Current Search Query** and can aid in the reasoning process for the original question.

2. **Extract Relevant Information:**
- Select the information from the Searched Web Pages that directly contributes to advancing the **Previous Reasoning Steps**.
- Ensure that the extracted information is accurate and relevant.

3. **Output Format:**
- Present the helpful information for current search query: beginning with `**Final Information**` as shown below.
**Final Information**

[Helpful information]

**Inputs:**
- **Previous Reasoning Steps:**
{prev_reasoning}

- **Current Search Query:**
{search_query}

- **Searched Web Pages:**
{document}

Now you should analyze each web page and find helpful information based on the current search query "{search_query}" and previous reasoning steps.
"""  # noqa: E501 - the reference's text, line for line

PROMPT_ZH = """***任务说明***：

你的任务是根据以下输入内容阅读并分析网页：**前序推理步骤**、**当前搜索查询** 和 **已搜索网页内容**。你的目标是从 **已搜索网页内容** 中提取与 **当前搜索查询** 相关且有用的信息，并将这些信息无缝整合进 **前序推理步骤** 中，以继续对原始问题的推理。

**操作指南：**

1. **分析已搜索网页内容：**
- 仔细审阅每一条搜索结果页面的内容。
- 识别出与 **当前搜索查询** 相关的事实信息，这些信息可以帮助原始问题的推理过程。

2. **提取相关信息：**
- 从已搜索网页中选择能够直接推进 **前序推理步骤** 的内容。确保提取的信息准确且相关。

3. **输出格式：**
- 使用如下格式展示当前搜索查询的有用信息：以 **最终信息** 开头，如下所示。
**最终信息**

[有用的信息]

- **输入内容：**

- **前序推理步骤：**
{prev_reasoning}

- **当前搜索查询：**
{search_query}

- **已搜索网页内容：**
{document}

现在你应该分析每一条网页内容，并基于当前搜索查询 "{search_query}" 和前序推理步骤找出有用信息。
"""  # noqa: E501 - the reference's text, line for line
PROMPTS = {"en": PROMPT_EN, "zh": PROMPT_ZH}
PROMPT_HASHES = {k: hashlib.sha256(v.encode()).hexdigest()[:16] for k, v in PROMPTS.items()}


class SummaryError(RuntimeError):
    """The summariser could not be reached or gave nothing, after the retries."""


def steps_from_output(output: str) -> list[str]:
    """The trajectory so far as the reference's log entries: each model segment and each `<result>…</result>`."""
    return [part.strip() for part in _RESULT_BLOCK.split(output) if part.strip()]


def truncate_steps(steps: list[str]) -> str:
    """The reference's `get_truncated_prev_reasoning` (see the module docstring); no steps -> ''."""
    numbered = [f"Step {i + 1}: {step}" for i, step in enumerate(steps)]
    if len(numbered) <= 5:
        return "\n\n".join(numbered).strip("\n")
    out = ""
    for i, step in enumerate(numbered):
        keep = (i == 0 or i >= len(numbered) - 4 or ("<search>" in step and "</search>" in step)
                or ("<result>" in step and "</result>" in step and "<search>" in numbered[i - 1]))
        if keep:
            out += step + "\n\n"
        elif out[-len("\n\n...\n\n"):] != "\n\n...\n\n":
            out += "...\n\n"
    return out.strip("\n")


def format_prompt(steps: list[str], query: str, documents: str, language: str = "en") -> str:
    return PROMPTS[language].format(prev_reasoning=truncate_steps(steps), search_query=query, document=documents)


def extract_summary(reply: str | None, language: str = "en") -> str:
    """The text after the last marker (newlines removed, fences stripped), as the reference's `extract_answer`."""
    reply = "None" if reply is None else reply
    marker = MARKERS[language]
    if marker in reply:
        return reply.split(marker)[-1].replace("\n", "").strip("`").strip()
    if STEP_MARKER in reply:
        return reply.split(STEP_MARKER)[-1].strip("`").strip()
    return reply


class SummaryCache(SQLiteStore):
    def __init__(self, path: str | Path) -> None:
        super().__init__(path, "search_summaries")


class Summarizer:
    """`summarize(steps, query, documents) -> str` against `cfg.url`; `client` (an `openai.OpenAI`) for tests."""

    def __init__(self, cfg: SummarizerSection, language: str, cache_root: str | Path, client: Any = None) -> None:
        from openai import OpenAI

        if not cfg.model or not cfg.url:
            raise ValueError("the summariser needs agent.search.summarizer.model and .url (an OpenAI-compatible …/v1); "
                             "one given as .path is served by the evaluation only, which passes its address here")
        self.cfg, self.language = cfg, language
        key = os.environ.get(cfg.api_key_env, "") if cfg.api_key_env else ""
        self.client = client or OpenAI(base_url=cfg.url, api_key=key or "EMPTY", timeout=cfg.timeout_s,
                                       max_retries=0)  # tenacity retries
        self.cache = SummaryCache(Path(cache_root) / "summary_cache.sqlite") if cfg.cache else None
        self.calls = 0

    @property
    def identity(self) -> str:
        """What writes the summaries (never where it runs): model, prompt and sampling."""
        c = self.cfg
        served = f"|{c.path}" if c.path else ""  # the weights it serves (a served name alone may be reused)
        return f"{c.model}{served}|{PROMPT_HASHES[self.language]}|{c.temperature}|{c.top_p}|{c.max_tokens}"

    def summarize(self, steps: list[str], query: str, documents: str) -> tuple[str, bool]:
        """(summary, cached)."""
        key = store_key("summary", self.identity, query, documents)
        if self.cache is not None:
            hit = self.cache.get(key)
            if hit is not None:
                return hit["summary"], True
        reply = self._ask(format_prompt(steps, query, documents, self.language))
        summary = extract_summary(reply, self.language)
        if self.cache is not None:
            self.cache.put(key, {"summary": summary, "reply": reply}, note=f"{self.cfg.model}: {query[:200]}")
        return summary, False

    def _ask(self, prompt: str) -> str:
        import openai
        from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential

        retrying = Retrying(
            stop=stop_after_attempt(self.cfg.max_retries), wait=wait_exponential(multiplier=1.0, max=30),
            retry=retry_if_exception_type((openai.APIConnectionError, openai.APITimeoutError,
                                           openai.InternalServerError, openai.RateLimitError, ValueError)),
            reraise=True)
        try:
            for attempt in retrying:
                with attempt:
                    self.calls += 1
                    response = self.client.chat.completions.create(
                        model=self.cfg.model, messages=[{"role": "user", "content": prompt}],
                        temperature=self.cfg.temperature, top_p=self.cfg.top_p, max_tokens=self.cfg.max_tokens)
                    content = response.choices[0].message.content if response.choices else None
                    if not content:
                        raise ValueError("the summariser returned no text")
                    return content
        except (openai.OpenAIError, ValueError) as err:
            raise SummaryError(f"summariser {self.cfg.model} at {self.cfg.url} failed after {self.calls} "
                               f"attempt(s): {type(err).__name__}: {str(err)[:200]}") from err
        raise AssertionError("unreachable: tenacity re-raises the last error")

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()
        self.client.close()
