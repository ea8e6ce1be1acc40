"""The generation-backend protocol shared by the tool rollout and every backend.

Token-in/token-out: a request is the full context as token ids (prompt + everything appended so far); a result
is the newly sampled ids exactly as sampled, with per-token sampling log-probs and normalised entropies, the
finish reason and the stop string that fired. Stop strings are detected on the decoded text of the new tokens
only, and the token that completes a stop string is kept (the model wrote it).

Log-probs and entropies are those of the temperature-scaled distribution softmax(logits / T) before top-k /
top-p truncation (T = 1 for greedy decoding), i.e. what the trainer recomputes. Entropy is normalised by
ln |V| (|V| = the real vocabulary, padded embedding rows excluded), so it lies in [0, 1].
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol, runtime_checkable

FINISH_REASONS = ("stop", "eos", "length")


@dataclass(frozen=True)
class SamplingSpec:
    """How to sample. temperature <= 0 means greedy; top_k <= 0 and top_p >= 1 mean no truncation."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]; use 1.0 to disable nucleus sampling")
        if any(not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


@dataclass
class GenRequest:
    """Continue `token_ids` for at most `max_new_tokens`. `key` names the sequence whose KV cache may be reused;
    `seed`, when set, is the request's own sampling seed (counter-based seeding: stages/generation/counter_seeds.py),
    used instead of the call's `seed + index`, so its tokens do not depend on which batch it rides in."""

    key: Hashable
    token_ids: list[int]
    max_new_tokens: int
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError(f"request {self.key!r} has no context tokens; a prompt needs at least one token")
        if self.max_new_tokens < 1:
            raise ValueError(f"request {self.key!r} asks for max_new_tokens={self.max_new_tokens}; "
                             "the caller must finish a sequence whose budget is spent instead of asking for more")


@dataclass
class GenResult:
    token_ids: list[int]
    logprobs: list[float]
    entropies: list[float]
    finish_reason: str          # stop | eos | length
    stop: str | None = None     # the stop string that fired (finish_reason == "stop")

    def __post_init__(self) -> None:
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason {self.finish_reason!r} is not one of {FINISH_REASONS}")
        if not len(self.token_ids) == len(self.logprobs) == len(self.entropies):
            raise ValueError("token_ids, logprobs and entropies must have one entry per generated token")


@dataclass
class ForwardStats:
    """Tokens pushed through the model. prefill + decode = forward tokens (real, padding excluded)."""

    prefill_tokens: int = 0     # context tokens computed in prefill passes
    decode_tokens: int = 0      # one per sequence per decode step
    reused_tokens: int = 0      # context tokens served from a KV cache instead of being recomputed
    padded_tokens: int = 0      # positions computed including batch padding (compute actually spent)
    forward_calls: int = 0

    @property
    def forward_tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens

    def add_request(self, context_tokens: int, cached_tokens: int, generated_tokens: int) -> None:
        """Count one request of a server-side engine (vLLM), whose prefix cache served `cached_tokens`."""
        self.prefill_tokens += context_tokens - cached_tokens
        self.reused_tokens += cached_tokens
        self.decode_tokens += generated_tokens
        self.padded_tokens += context_tokens - cached_tokens + generated_tokens

    def copy(self) -> ForwardStats:
        return ForwardStats(**{f.name: getattr(self, f.name) for f in fields(self)})

    def since(self, before: ForwardStats) -> ForwardStats:
        return ForwardStats(**{f.name: getattr(self, f.name) - getattr(before, f.name) for f in fields(self)})

    def as_dict(self) -> dict[str, int]:
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "forward_tokens": self.forward_tokens}


@runtime_checkable
class GenerationBackend(Protocol):
    """What the tool rollout needs from a generator.

    KV handling is explicit so that the rollout driver can say what is shared: `prefill` warms a sequence's cache,
    `fork(src, dst, n)` starts `dst` from the first `n` context tokens of `src`'s cache, `release` drops caches
    (call it at the end of every rollout: weights change between steps). Backends without explicit caches
    (vLLM: automatic prefix caching) implement these as no-ops. `refresh_weights` makes the backend sample from
    the trainer's current weights (no-op when it shares the trainer's model object).
    """

    name: str
    vocab_size: int
    eos_token_ids: frozenset[int]
    stats: ForwardStats

    def refresh_weights(self) -> None: ...

    def generate(self, requests: Sequence[GenRequest], sampling: SamplingSpec,
                 seed: int | None = None) -> list[GenResult]: ...

    def prefill(self, items: Sequence[tuple[Hashable, list[int]]]) -> None: ...

    def fork(self, src: Hashable, dst: Hashable, n_tokens: int) -> None: ...

    def release(self, keys: Iterable[Hashable] | None = None) -> None: ...


class PrefixCached:
    """KV handling of an engine with automatic prefix caching (vLLM, in-process or behind verl's server): a
    branch's or a group's shared prefix is recognised from the tokens, so there is nothing to say."""

    def prefill(self, items: Sequence[tuple[Hashable, list[int]]]) -> None:
        """No-op: the prefix cache shares a group's prompt blocks."""

    def fork(self, src: Hashable, dst: Hashable, n_tokens: int) -> None:
        """No-op: a branch's context starts with its parent's tokens, which the prefix cache recognises."""

    def release(self, keys: Iterable[Hashable] | None = None) -> None:
        """No-op: the vLLM engine evicts blocks itself (and drops them when weights change)."""


class AnswersOneByOne:
    """A backend that answers each request as it finishes (`generate_iter`: (index, result) in finishing order, what
    the `early_tools` schedule reads); `generate` is those answers collected in request order."""

    def generate(self, requests: Sequence[GenRequest], sampling: SamplingSpec,
                 seed: int | None = None) -> list[GenResult]:
        results: list[GenResult | None] = [None] * len(requests)
        for i, res in self.generate_iter(requests, sampling, seed):
            results[i] = res
        return results


def eos_ids_of(tokenizer, generation_config=None) -> frozenset[int]:
    """The union of the tokenizer's eos id and the generation config's (which may be a list)."""
    ids: set[int] = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_eos = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
    if isinstance(gen_eos, int):
        ids.add(gen_eos)
    elif gen_eos:
        ids.update(int(i) for i in gen_eos)
    if not ids:
        raise ValueError("the tokenizer has no eos_token_id and the generation config names none; "
                         "set tokenizer.eos_token (model.eos_token in the config) before rolling out")
    return frozenset(ids)


def request_seed(request: GenRequest, call_seed: int | None, index: int) -> int | None:
    """A request's sampling seed: its own (counter-based) when set, else the call's seed + its index."""
    if request.seed is not None:
        return request.seed
    return None if call_seed is None else call_seed + index


def vllm_sampling_params(sampling: SamplingSpec, max_new_tokens: int, seed: int | None) -> dict[str, Any]:
    """The `vllm.SamplingParams` fields of one request that every vLLM engine gets, ours in-process and verl's
    servers alike: token ids out exactly as sampled, the stop string kept (the model wrote it); -1 = no top-k."""
    params: dict[str, Any] = {
        "temperature": max(0.0, sampling.temperature), "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else -1, "max_tokens": max_new_tokens,
        "stop": list(sampling.stop), "include_stop_str_in_output": True, "skip_special_tokens": False,
    }
    if seed is not None:
        params["seed"] = int(seed)
    return params

