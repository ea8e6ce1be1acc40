"""Deterministic fakes for rollout-driver unit tests: a toy tokenizer, a scripted backend, a toy toolbox.

ToyTokenizer: ids 0 = <eos>, 1 = <bos>, then multi-character tokens for the protocol tags (so `encode` of a
tag gives ONE id), then one id per printable character. The scripted model always writes character by
character, so its tags are a different tokenization than `encode` would produce: any decode/re-encode of
model output would change the ids, which the tests detect.

ScriptedBackend: the next segment is a pure function of the decoded context (and the request key), emitted
token by token with the same stop/eos/length rules as a real backend; entropies are scripted per segment.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from stages.agent.stops import StopMatcher
from stages.generation.base import (
    ForwardStats,
    GenRequest,
    GenResult,
    SamplingSpec,
)

MULTI = ["</search>", "<search>", "</python>", "<python>", "<result>", "</result>", "<answer>", "</answer>"]


class ToyTokenizer:
    eos_token_id = 0
    bos_token_id = 1
    pad_token_id = 0
    eos_token = "<eos>"
    all_special_ids = (0, 1)

    def __init__(self) -> None:
        self.vocab = ["<eos>", "<bos>", *MULTI, *string.printable]
        self.index = {tok: i for i, tok in enumerate(self.vocab)}

    def __len__(self) -> int:
        return len(self.vocab)

    def chars(self, text: str) -> list[int]:
        """Character-level ids (never the multi-character tag tokens): how the scripted model writes."""
        return [self.index[c] for c in text]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids, i = ([self.bos_token_id] if add_special_tokens else []), 0
        while i < len(text):
            tag = next((m for m in MULTI if text.startswith(m, i)), None)
            ids.append(self.index[tag] if tag else self.index[text[i]])
            i += len(tag) if tag else 1
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return "".join(self.vocab[i] for i in ids if not (skip_special_tokens and i in (0, 1)))

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        text = "<bos>" + "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        return [self.bos_token_id] + self.encode(text[5:], add_special_tokens=False)


Policy = Callable[[str, Hashable], tuple[str, float]]  # (context text, key) -> (segment text, entropy per token)


@dataclass
class ScriptedBackend:
    tokenizer: ToyTokenizer
    policy: Policy
    name: str = "scripted"
    stats: ForwardStats = field(default_factory=ForwardStats)
    forks: list[tuple[Hashable, Hashable, int]] = field(default_factory=list)
    prefilled: list[Hashable] = field(default_factory=list)
    released: list[object] = field(default_factory=list)
    requests: list[list[GenRequest]] = field(default_factory=list)
    refreshed: int = 0

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset({0})

    def refresh_weights(self) -> None:
        self.refreshed += 1

    def generate(self, requests: Sequence[GenRequest], sampling: SamplingSpec, seed: int | None = None):
        self.requests.append(list(requests))
        matcher = StopMatcher(self.tokenizer, sampling.stop)
        out = []
        for req in requests:
            text, entropy = self.policy(self.tokenizer.decode(req.token_ids), req.key)
            ids = [0 if piece == "\x00" else self.tokenizer.index[piece] for piece in text]
            res = GenResult([], [], [], "length")
            for tok in ids:
                res.token_ids.append(tok)
                res.logprobs.append(-0.5)
                res.entropies.append(entropy)
                if tok == 0:
                    res.finish_reason = "eos"
                    break
                if (stop := matcher.match(res.token_ids)) is not None:
                    res.finish_reason, res.stop = "stop", stop
                    break
                if len(res.token_ids) >= req.max_new_tokens:
                    break
            self.stats.prefill_tokens += len(req.token_ids)
            self.stats.decode_tokens += len(res.token_ids)
            out.append(res)
        return out

    def prefill(self, items) -> None:
        self.prefilled.extend(key for key, _ in items)

    def fork(self, src: Hashable, dst: Hashable, n_tokens: int) -> None:
        self.forks.append((src, dst, n_tokens))

    def release(self, keys: Iterable[Hashable] | None = None) -> None:
        self.released.append(None if keys is None else list(keys))


@dataclass
class ToyState:
    calls: list[str] = field(default_factory=list)

    def copy(self) -> ToyState:
        return ToyState(list(self.calls))


@dataclass
class ToyResult:
    tool: str
    text: str
    ok: bool


@dataclass
class ToyToolBox:
    """`search` answers R:<query>; a query 'fail' is an error; a 'long' query returns 200 characters."""

    batches: list[list[tuple[str, str]]] = field(default_factory=list)

    def new_state(self) -> ToyState:
        return ToyState()

    def execute_many(self, calls) -> list[ToyResult]:
        self.batches.append([(c.tool, c.argument) for c, _ in calls])
        out = []
        for call, state in calls:
            state.calls.append(call.argument)
            if call.argument == "fail":
                out.append(ToyResult(call.tool, "Error: failed", False))
            elif call.argument == "long":
                out.append(ToyResult(call.tool, "x" * 200, True))
            else:
                out.append(ToyResult(call.tool, f"R:{call.argument}", True))
        return out


EOS = "\x00"
