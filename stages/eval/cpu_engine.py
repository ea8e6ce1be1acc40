"""Batched generation over Hugging Face `generate`, with per-row sampling, stop strings and log-probs.

Each row (one requested sequence) carries its own sampling parameters and seed. `generate` runs the
decode loop (KV cache, left padding, attention masks); one logits processor picks every row's next token
with that row's own temperature / top-k / top-p / min-p / repetition penalty and `torch.Generator`, and
hands `generate` a one-hot score row so its greedy step takes exactly that token. One stopping criterion
ends each row on EOS, a stop token id, a stop string (checked on the decoded tail every step) or its own
`max_tokens`. Stop strings are cut from the returned text, as vLLM and OpenAI do.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import (
    DynamicCache,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from stages.eval.prefix_cache import PrefixCache, common_prefix_length

GREEDY_BELOW = 1e-5  # temperature under this = greedy (vLLM's rule)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                      # 0 or -1 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    logprobs: int | None = None         # None = none; k = the chosen token's log-prob plus the top k
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        checks = [(self.max_tokens >= 1, "max_tokens must be >= 1"),
                  (self.temperature >= 0, "temperature must be >= 0"),
                  (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
                  (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
                  (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
                  (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be between 0 and 20"),
                  (all(self.stop), "stop strings must be non-empty")]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


@dataclass
class Row:
    """One sequence to generate, and what was generated for it."""

    prompt_ids: list[int]
    params: SamplingParams
    tokens: list[int] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    generator: torch.Generator | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    logprob: float
    top: tuple[tuple[str, float], ...]


@dataclass(frozen=True)
class RowResult:
    text: str
    token_ids: list[int]
    finish_reason: str                  # "stop" (EOS, stop token or stop string) or "length"
    stop_reason: str | int | None       # the matched stop string / stop token id; None for EOS or length
    logprobs: list[TokenLogprob] | None
    text_offsets: list[int] | None


def penalize(scores_V: torch.Tensor, context_T: torch.Tensor, penalty: float) -> torch.Tensor:
    """vLLM/HF repetition penalty over one row's own tokens (prompt + generated, never its padding)."""
    if penalty == 1.0:
        return scores_V
    return RepetitionPenaltyLogitsProcessor(penalty)(context_T.unsqueeze(0), scores_V.unsqueeze(0).clone())[0]


def warp(scores_BV: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p (in vLLM's order) over rows that share these settings."""
    scores_BV = TemperatureLogitsWarper(params.temperature)(None, scores_BV)
    if params.top_k > 0:
        scores_BV = TopKLogitsWarper(params.top_k)(None, scores_BV)
    if params.top_p < 1.0:
        scores_BV = TopPLogitsWarper(params.top_p)(None, scores_BV)
    if params.min_p > 0.0:
        scores_BV = MinPLogitsWarper(params.min_p)(None, scores_BV)
    return scores_BV


def pick_tokens(scores_BV: torch.Tensor, contexts: list[torch.Tensor], params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> list[int]:
    """Next token of every row from its raw logits, each with its own sampling parameters and generator.

    The penalty is applied per row; rows with the same temperature/top-k/top-p/min-p are warped as one
    sub-batch (one sort for top-p instead of one per row); each row then draws with its own generator.
    """
    scores_BV = torch.stack([penalize(scores_BV[i], contexts[i], p.repetition_penalty)
                             for i, p in enumerate(params)])
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault((p.temperature < GREEDY_BELOW, p.temperature, p.top_k, p.top_p, p.min_p), []).append(i)
    picks = [0] * len(params)
    for (greedy, *_), rows in groups.items():
        if greedy:
            for i, token in zip(rows, scores_BV[rows].argmax(dim=-1).tolist()):
                picks[i] = token
            continue
        probs_GV = torch.softmax(warp(scores_BV[rows], params[rows[0]]), dim=-1)
        for j, i in enumerate(rows):
            picks[i] = int(torch.multinomial(probs_GV[j], 1, generator=generators[i]))
    return picks


class RowSampler(LogitsProcessor):
    """Chooses every active row's token; returns scores whose argmax is that token (generate runs greedy)."""

    def __init__(self, rows: list[Row]) -> None:
        self.rows = rows

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        chosen_BV = torch.full_like(scores, float("-inf"))
        active = [i for i, row in enumerate(self.rows) if not row.done]
        chosen_BV[[i for i, row in enumerate(self.rows) if row.done], 0] = 0.0  # generate pads finished rows
        if not active:
            return chosen_BV
        raw_AV = scores[active].float()
        tokens = pick_tokens(raw_AV, [self._context(self.rows[i]) for i in active],
                             [self.rows[i].params for i in active], [self.rows[i].generator for i in active])
        for a, (i, token) in enumerate(zip(active, tokens)):
            row = self.rows[i]
            if row.params.logprobs is not None:
                self._record_logprobs(row, raw_AV[a], token)
            row.tokens.append(token)
            chosen_BV[i, token] = 0.0
        return chosen_BV

    @staticmethod
    def _context(row: Row) -> torch.Tensor:
        """The row's own tokens (prompt + generated, no padding), for the repetition penalty."""
        if row.params.repetition_penalty == 1.0:
            return torch.empty(0, dtype=torch.long)
        return torch.tensor(row.prompt_ids + row.tokens, dtype=torch.long)

    @staticmethod
    def _record_logprobs(row: Row, raw_V: torch.Tensor, token: int) -> None:
        logp_V = torch.log_softmax(raw_V, dim=-1)
        row.token_logprobs.append(float(logp_V[token]))
        k = row.params.logprobs or 0
        top = logp_V.topk(k) if k else None
        row.top_logprobs.append([] if top is None else [(int(t), float(v)) for v, t in zip(top.values, top.indices)])


class RowStopper(StoppingCriteria):
    """Ends each row on EOS, a stop token, a stop string or its own max_tokens."""

    def __init__(self, rows: list[Row], tokenizer: Any, eos_ids: set[int]) -> None:
        self.rows = rows
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        for row in self.rows:
            if not row.done:
                self._check(row)
        return torch.tensor([row.done for row in self.rows], dtype=torch.bool, device=input_ids.device)

    def _check(self, row: Row) -> None:
        last = row.tokens[-1]
        params = row.params
        if last in params.stop_token_ids:
            row.finish_reason, row.stop_reason = "stop", last
        elif last in self.eos_ids:
            row.finish_reason = "stop"
        elif params.stop and (hit := first_stop(self._tail(row), params.stop)) is not None:
            row.finish_reason, row.stop_reason = "stop", hit[1]
        elif len(row.tokens) >= params.max_tokens:
            row.finish_reason = "length"

    def _tail(self, row: Row) -> str:
        window = 2 * max(len(s) for s in row.params.stop) + 4
        return self.tokenizer.decode(row.tokens[-window:], skip_special_tokens=True)


def first_stop(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """(index, stop) of the stop string that starts earliest in `text` (longest wins a tie), or None."""
    hits = [(text.find(s), -len(s), s) for s in stops if s in text]
    if not hits:
        return None
    index, _, stop = min(hits)
    return index, stop


def make_generator(seed: int | None) -> torch.Generator:
    generator = torch.Generator()
    generator.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
    return generator


class Engine:
    """A causal LM and its tokenizer; `generate(rows)` runs one batched `generate` call over all rows."""

    def __init__(self, model: Any, tokenizer: Any, prefix_cache_entries: int = 8) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.prefix = PrefixCache(model, prefix_cache_entries)
        eos = model.generation_config.eos_token_id
        eos_list = eos if isinstance(eos, list) else [eos]
        if tokenizer.eos_token_id is not None:
            eos_list = [*eos_list, tokenizer.eos_token_id]
        self.eos_ids = {int(e) for e in eos_list if e is not None}
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids)
        self.pad_id = int(pad)
        self.max_model_len = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30)

    @classmethod
    def load(cls, model_path: str, dtype: str = "float32", device: str = "cpu",
             prefix_cache_entries: int = 8) -> Engine:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
        model.to(device).eval()
        return cls(model, tokenizer, prefix_cache_entries)

    def generate(self, rows: list[Row]) -> list[RowResult]:
        for row in rows:
            row.generator = make_generator(row.params.seed)
        ids_BT, mask_BT, cache = self._inputs(rows)
        config = GenerationConfig(max_new_tokens=max(r.params.max_tokens for r in rows), do_sample=False,
                                  num_beams=1, repetition_penalty=1.0, eos_token_id=sorted(self.eos_ids),
                                  pad_token_id=self.pad_id)
        with torch.inference_mode():
            self.model.generate(input_ids=ids_BT, attention_mask=mask_BT, generation_config=config,
                                past_key_values=cache,
                                logits_processor=LogitsProcessorList([RowSampler(rows)]),
                                stopping_criteria=StoppingCriteriaList([RowStopper(rows, self.tokenizer,
                                                                                   self.eos_ids)]))
        for row in rows:
            row.finish_reason = row.finish_reason or "length"
        return [self.finish(row) for row in rows]

    def _inputs(self, rows: list[Row]) -> tuple[torch.Tensor, torch.Tensor, DynamicCache | None]:
        """[shared prefix][pads][own suffix] per row, the mask hiding the pads, and the prefix's KV cache.

        The prefix is the rows' common start, at most all but one token of the shortest prompt (generate
        needs one new token per row); with no cached prefix this is plain left padding.
        """
        first = rows[0].prompt_ids
        shared = min(min(common_prefix_length(first, r.prompt_ids) for r in rows),
                     min(len(r.prompt_ids) for r in rows) - 1)
        cache = self.prefix.get(first[:shared]) if shared > 0 else None
        head = first[:shared] if cache is not None else []
        suffixes = [r.prompt_ids[len(head):] for r in rows]
        longest = max(map(len, suffixes))
        ids = [head + [self.pad_id] * (longest - len(s)) + s for s in suffixes]
        mask = [[1] * len(head) + [0] * (longest - len(s)) + [1] * len(s) for s in suffixes]
        if cache is not None and len(rows) > 1:
            cache.batch_repeat_interleave(len(rows))
        device = self.model.device
        return torch.tensor(ids, device=device), torch.tensor(mask, device=device), cache

    def finish(self, row: Row) -> RowResult:
        """Decode a row; cut the text at the earliest stop string (kept when include_stop_str_in_output)."""
        keep = [t for t in row.tokens if t not in self.eos_ids and t not in row.params.stop_token_ids]
        text = self.tokenizer.decode(keep, skip_special_tokens=True)
        if isinstance(row.stop_reason, str):
            index, stop = first_stop(text, row.params.stop) or (len(text), row.stop_reason)
            text = text[: index + (len(stop) if row.params.include_stop_str_in_output else 0)]
            row.stop_reason = stop
        if row.params.logprobs is None:
            return RowResult(text, keep, row.finish_reason or "length", row.stop_reason, None, None)
        entries, offsets, offset = [], [], 0
        for j, token in enumerate(row.tokens):
            if token in self.eos_ids or token in row.params.stop_token_ids or offset >= len(text):
                break
            piece = self.tokenizer.decode([token])
            top = tuple((self.tokenizer.decode([t]), lp) for t, lp in row.top_logprobs[j])
            entries.append(TokenLogprob(piece, row.token_logprobs[j], top))
            offsets.append(offset)
            offset += len(piece)
        return RowResult(text, keep, row.finish_reason or "length", row.stop_reason, entries, offsets)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def chat_prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.encode(text)
