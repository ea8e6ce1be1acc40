"""LLM-as-judge over any OpenAI-compatible endpoint, with the reference's prompt and parse rule.

Prompt (ARPO `llm_evaluator_sds.py`; docs/reference.md "Evaluation"): the question, the golden answer(s) and the predicted
answer; the judge replies "Correct" or "Incorrect". Parse: an optional `<judgment>...</judgment>` span is read
if present, else the whole reply (with any `<think>...</think>` block dropped first, so a reasoning judge's
musings do not count); the reply says correct iff it contains "correct" and none of "incorrect", "wrong",
"not correct". The sample's `llm_equal` is then `rule_equiv OR reply-says-correct`, as in the reference.

Calls go through the official `openai` client, retried with exponential backoff (tenacity); a call that still
fails falls back to the rule verdict and is recorded as an error (never cached). Verdicts are cached in SQLite
under the cache root, keyed by (question, golds, prediction, judge model identity, prompt hash), so a re-score
makes no judge calls. Each verdict keeps the `model` field of the judge's response (the OpenAI API's: the model id
that answered, e.g. the dated revision behind an API alias), cached with it: the report says which judge answered.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from stages.core.config.eval import JudgeSection
from stages.core.log import get_logger, progress
from stages.core.refs import EndpointRef
from stages.core.store import SQLiteStore, store_key

log = get_logger(__name__)

JUDGE_PROMPT = (
    "Given a Question and its Golden Answer, verify whether the Predicted Answer is correct. The prediction is "
    "correct if it fully aligns with the meaning and key information of the Golden Answer. Respond with "
    "\"Correct\" if the prediction is correct and \"Incorrect\" otherwise. Golden Answer may have multiple "
    "options, and matching any one of them is considered correct.\n\n"
    "Question: {question}\nGolden Answer: {gold}\nPredicted Answer: {prediction}"
)
PROMPT_HASH = hashlib.sha256(JUDGE_PROMPT.encode()).hexdigest()[:16]
NEGATIONS = ("incorrect", "wrong", "not correct")
_THINK = re.compile(r"<think>.*?(</think>|$)", re.S | re.I)


def format_prompt(question: str, golds: tuple[str, ...] | list[str], prediction: str) -> str:
    gold = golds[0] if len(golds) == 1 else str(list(golds))
    return JUDGE_PROMPT.format(question=question, gold=gold, prediction=prediction)


def _last_judgment(lower: str) -> str | None:
    """The last `<judgment>...</judgment>` span of a lower-cased reply (non-overlapping, leftmost first, as a
    lazy regex finds them), in one pass: a regex would rescan to the end from every unclosed `<judgment>`."""
    last, pos = None, 0
    while (start := lower.find("<judgment>", pos)) >= 0:
        end = lower.find("</judgment>", start + len("<judgment>"))
        if end < 0:
            break  # no later opener can close either
        last, pos = lower[start + len("<judgment>"):end], end + len("</judgment>")
    return last


def reply_says_correct(reply: str) -> bool:
    """The reference's parse rule on the judge's reply alone (see the module docstring); linear in the reply."""
    span = _last_judgment(reply.lower())
    text = span if span is not None else _THINK.sub(" ", reply).lower()
    return "correct" in text and not any(word in text for word in NEGATIONS)


@dataclass(frozen=True)
class JudgeRequest:
    question: str
    golds: tuple[str, ...]
    prediction: str


@dataclass(frozen=True)
class Verdict:
    says_correct: bool | None  # None when the judge could not be reached (then the rule decides)
    reply: str
    cached: bool
    error: str | None = None
    model: str | None = None  # the response's `model` field: who answered (None: not recorded, or no answer)


class VerdictCache(SQLiteStore):
    """Verdicts in the one SQLite store (stages/core/store.py): safe across threads and processes."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(path, "judge_verdicts")

    @staticmethod
    def key(request: JudgeRequest, identity: str, prompt_hash: str = PROMPT_HASH) -> str:
        return store_key(request.question, list(request.golds), request.prediction, identity, prompt_hash)

    def verdict(self, key: str) -> tuple[str, bool, str | None] | None:
        """(reply, says correct, the model id that answered: None in a verdict cached before it was kept)."""
        hit = self.get(key)
        return None if hit is None else (hit["reply"], bool(hit["correct"]), hit.get("model"))

    def record(self, key: str, identity: str, reply: str, correct: bool, model: str | None = None) -> None:
        self.put(key, {"reply": reply, "correct": correct, "model": model}, note=identity)


class Judge:
    """Judges (question, golds, prediction) triples against one endpoint, concurrently, through the cache."""

    def __init__(self, endpoint: EndpointRef, cfg: JudgeSection, cache_path: str | Path) -> None:
        self.endpoint = endpoint
        self.cfg = cfg
        self.identity = endpoint.identity
        self.cache = VerdictCache(cache_path)
        self.calls = 0  # requests actually sent (retries included)

    def judge_many(self, requests: list[JudgeRequest]) -> list[Verdict]:
        """Blocking wrapper; runs the async loop in a helper thread when one is already running here."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.ajudge_many(requests))
        box: dict[str, list[Verdict]] = {}
        worker = threading.Thread(target=lambda: box.setdefault("out", asyncio.run(self.ajudge_many(requests))))
        worker.start()
        worker.join()
        return box["out"]

    async def ajudge_many(self, requests: list[JudgeRequest]) -> list[Verdict]:
        from stages.eval.serving import async_client

        client = async_client(self.endpoint, timeout_s=self.cfg.timeout_s, max_retries=0)  # tenacity retries
        limit = asyncio.Semaphore(self.cfg.concurrency)
        try:
            with progress() as bar:
                task = bar.add_task(f"judge ({self.endpoint.model})", total=len(requests))

                async def one(request: JudgeRequest) -> Verdict:
                    async with limit:
                        verdict = await self._judge_one(client, request)
                    bar.advance(task)
                    return verdict

                return list(await asyncio.gather(*(one(r) for r in requests)))
        finally:
            await client.close()

    async def _judge_one(self, client, request: JudgeRequest) -> Verdict:
        key = VerdictCache.key(request, self.identity)
        hit = self.cache.verdict(key)
        if hit is not None:
            return Verdict(says_correct=hit[1], reply=hit[0], cached=True, model=hit[2])
        try:
            reply, model = await self._ask(client, format_prompt(request.question, request.golds, request.prediction))
        except Exception as err:  # noqa: BLE001 - after retries: the rule decides, nothing is cached
            message = f"{type(err).__name__}: {err}"
            log.warning("judge call failed after %d attempts (%s); using the rule verdict", self.cfg.max_retries,
                        message[:200])
            return Verdict(says_correct=None, reply="", cached=False, error=message)
        correct = reply_says_correct(reply)
        self.cache.record(key, self.identity, reply, correct, model)
        return Verdict(says_correct=correct, reply=reply, cached=False, model=model)

    async def _ask(self, client, prompt: str) -> tuple[str, str | None]:
        """(the reply, the response's `model` field)."""
        import openai
        from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.cfg.max_retries),
            wait=wait_exponential(multiplier=self.cfg.retry_backoff_s, max=30),
            retry=retry_if_exception_type((openai.APIConnectionError, openai.APITimeoutError,
                                           openai.InternalServerError, openai.RateLimitError, ValueError)),
            reraise=True)
        async for attempt in retrying:
            with attempt:
                self.calls += 1
                response = await client.chat.completions.create(
                    model=self.endpoint.model, messages=[{"role": "user", "content": prompt}],
                    temperature=self.cfg.temperature, max_tokens=self.cfg.max_tokens)
                content = response.choices[0].message.content if response.choices else None
                if content is None:
                    raise ValueError("judge returned no message content")
                return content, getattr(response, "model", None) or None
        raise AssertionError("unreachable: tenacity re-raises the last error")
