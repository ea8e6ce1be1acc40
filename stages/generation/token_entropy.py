"""The per-token entropy every generation backend reports: one quantity, registered by name, for every backend.

Registry `ENTROPY_QUANTITIES`, one signature `fn(view: LogprobView, vocab_size) -> H_B`, values divided by ln|V|
(config `rl.rollout.entropy_quantity`, `entropy_topk`). Every backend builds a `LogprobView` of each generation
step and calls `TokenEntropy`, so one rollout branches the same way on any backend:

- `topk` (default; docs/reference.md "Entropy"): -sum p log p over the k best log-probs of the position
  (`entropy_topk`, k = 10 as the reference requests from vLLM) plus the sampled token when it is not among them
  (vLLM returns it as an extra entry and the reference flattens every entry it gets); truncated, not
  renormalised.
- `full`: the whole-vocabulary entropy (only backends that see the full distribution: transformers).
- `surprisal`: -log p(sampled) (any backend; the only one verl's stock server allows).

How a segment's per-token values become one number (window, aggregation) is the RL stage's business
(stages/rl/entropy.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from stages.core.registry import Registry


@dataclass(frozen=True)
class LogprobView:
    """What a backend knows about one generation step of B rows, in one shape for every backend.

    top_BK            the k largest log-probs of each row, descending (-inf where fewer are known)
    sampled_B         log-prob of the sampled token
    sampled_in_top_B  whether the sampled token is one of those k
    full_BV           the whole log-distribution when the backend has it (transformers), else None (vLLM)
    """

    top_BK: torch.Tensor
    sampled_B: torch.Tensor
    sampled_in_top_B: torch.Tensor
    full_BV: torch.Tensor | None = None


EntropyFn = Callable[[LogprobView, int], torch.Tensor]
ENTROPY_QUANTITIES: Registry[EntropyFn] = Registry("entropy quantity")


def _plogp(logp: torch.Tensor) -> torch.Tensor:
    """-p log p elementwise; 0 where the log-prob is -inf (p = 0)."""
    finite = torch.isfinite(logp)
    safe = torch.where(finite, logp, torch.zeros_like(logp))
    return torch.where(finite, -safe.exp() * safe, torch.zeros_like(safe))


@ENTROPY_QUANTITIES.register("topk")
def topk_entropy(view: LogprobView, vocab_size: int) -> torch.Tensor:
    """(sum over the top k of -p log p, + -p log p of the sampled token outside them) / ln|V|."""
    h_B = _plogp(view.top_BK).sum(-1)
    extra_B = torch.where(view.sampled_in_top_B, torch.zeros_like(view.sampled_B), _plogp(view.sampled_B))
    return (h_B + extra_B) / math.log(vocab_size)


@ENTROPY_QUANTITIES.register("full")
def full_entropy(view: LogprobView, vocab_size: int) -> torch.Tensor:
    """-sum over the whole vocabulary of p log p / ln|V|."""
    if view.full_BV is None:
        raise ValueError("entropy quantity 'full' needs the whole distribution, and this backend returns only "
                         "top-k log-probs (vllm); set rl.rollout.entropy_quantity=topk or use the transformers backend")
    return _plogp(view.full_BV).sum(-1) / math.log(vocab_size)


@ENTROPY_QUANTITIES.register("surprisal")
def surprisal(view: LogprobView, vocab_size: int) -> torch.Tensor:
    """-log p(sampled token) / ln|V|: all a server that returns only the sampled log-prob (verl's stock vLLM
    server) can give. Its expectation under the sampling distribution is the full entropy, so a window of them is
    an unbiased, noisier estimate; 0 where the log-prob is not finite."""
    finite = torch.isfinite(view.sampled_B)
    nats = torch.where(finite, (-view.sampled_B).clamp(min=0.0), torch.zeros_like(view.sampled_B))
    return nats / math.log(vocab_size)


def view_from_logp(logp_BV: torch.Tensor, tok_B: torch.Tensor, k: int) -> LogprobView:
    """The view of a full log-distribution (transformers): its top k and the sampled token."""
    top = logp_BV.topk(min(k, logp_BV.shape[-1]), dim=-1)
    return LogprobView(top_BK=top.values, sampled_B=logp_BV.gather(-1, tok_B[:, None]).squeeze(-1),
                       sampled_in_top_B=(top.indices == tok_B[:, None]).any(-1), full_BV=logp_BV)


def view_from_positions(positions: Sequence[Mapping[int, Any]], ids: Sequence[int], k: int) -> LogprobView:
    """The view of per-position top log-prob dicts {token id: entry with .logprob and .rank (1 = best)}, as
    vLLM returns them (its top `logprobs` entries, plus the sampled token when it is not among them)."""
    top_BK = torch.full((len(ids), k), -math.inf, dtype=torch.float64)
    sampled_B = torch.empty(len(ids), dtype=torch.float64)
    in_top_B = torch.zeros(len(ids), dtype=torch.bool)
    for b, (position, tok) in enumerate(zip(positions, ids)):
        ranked = sorted(position.items(), key=lambda item: (getattr(item[1], "rank", None) or math.inf,
                                                            -item[1].logprob))[:k]
        top_BK[b, :len(ranked)] = torch.tensor([float(entry.logprob) for _, entry in ranked], dtype=torch.float64)
        sampled_B[b] = float(position[tok].logprob)
        in_top_B[b] = any(token == tok for token, _ in ranked)
    return LogprobView(top_BK=top_BK, sampled_B=sampled_B, sampled_in_top_B=in_top_B)


def view_from_sampled(logps: Sequence[float]) -> LogprobView:
    """The view of a server that returns only the sampled tokens' log-probs (no top-k: only `surprisal` applies)."""
    sampled_B = torch.tensor([float(x) for x in logps], dtype=torch.float64)
    return LogprobView(top_BK=sampled_B.new_empty(len(logps), 0), sampled_B=sampled_B,
                       sampled_in_top_B=torch.zeros(len(logps), dtype=torch.bool))


@dataclass(frozen=True)
class TokenEntropy:
    """The configured per-token quantity (`rl.rollout.entropy_quantity`, `entropy_topk`); every backend calls it."""

    quantity: str = "topk"
    k: int = 10

    def __post_init__(self) -> None:
        ENTROPY_QUANTITIES.get(self.quantity)  # an unknown name fails here, listing the known ones
        if self.k < 1:
            raise ValueError(f"entropy top-k={self.k} must be >= 1 (rl.rollout.entropy_topk)")

    def __call__(self, view: LogprobView, vocab_size: int) -> torch.Tensor:
        return ENTROPY_QUANTITIES.get(self.quantity)(view, vocab_size)

    def from_logp(self, logp_BV: torch.Tensor, tok_B: torch.Tensor) -> torch.Tensor:
        """Per row, from a full log-distribution over the (real) vocabulary."""
        return self(view_from_logp(logp_BV, tok_B, self.k), logp_BV.shape[-1])

    def from_sampled(self, logps: Sequence[float], vocab_size: int) -> list[float]:
        """Per generated token, from the sampled tokens' log-probs alone (needs `surprisal`)."""
        if not logps:
            return []
        return [float(h) for h in self(view_from_sampled(logps), vocab_size)]

    def from_positions(self, positions: Sequence[Mapping[int, Any]], ids: Sequence[int],
                       vocab_size: int) -> list[float]:
        """Per generated token, from vLLM-style per-position top log-prob dicts."""
        if not ids:
            return []
        return [float(h) for h in self(view_from_positions(positions, ids, self.k), vocab_size)]
