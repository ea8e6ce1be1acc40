"""The entropy a rollout measures for branching: one per-token quantity for every backend, and how a segment's
per-token values become one number.

**Per-token quantity** (`rl.rollout.entropy_quantity`, registry `ENTROPY_QUANTITIES`, one signature
`fn(view: LogprobView, vocab_size) -> H_B`, values divided by ln|V|). Every backend builds a `LogprobView` of
each generation step and calls `TokenEntropy`, so one rollout branches the same way on any backend:

- `topk` (default; research/arpo.md 2.3): -sum p log p over the k best log-probs of the position
  (`entropy_topk`, k = 10 as the reference requests from vLLM) plus the sampled token when it is not among them
  (vLLM returns it as an extra entry and the reference flattens every entry it gets); truncated, not
  renormalised.
- `full`: the whole-vocabulary entropy (only backends that see the full distribution: transformers).
Register another quantity (e.g. the surprisal -log p(sampled)) with `@ENTROPY_QUANTITIES.register("name")`.

**Segment aggregation** (`rl.rollout.entropy_aggregation`): `sum` (default, the reference code: the published
tau = 0.5, w = 0.2 were tuned on this scale; over k = 20 tokens dH spreads over about +-3, so
P = clip(tau + w dH) spreads over [0, 1]) or `mean` (dH about 20x smaller: P stays near tau).

**Window** (`rl.rollout.entropy_window`, the first `entropy_tokens` tokens of a segment):

- `reference` (default; ARPO code, research/arpo.md 2.3): every segment is measured; the decision after tool
  call t uses the segment that ended in call t (one round late: its tokens came after result t-1, or after the
  prompt), and a copy forks after result t is appended. Code-faithful also in what the baselines are: a copy
  starts without H_initial, so its first segment after the fork becomes its own baseline (the reference keys
  H_initial by the new trajectory index), and AEPO's H_tool is the mean over every segment of the probe
  rollout.
- `paper` (ARPO paper): after a tool result the model generates the next segment; the decision follows that
  segment and a copy forks right after the result (at the start of the measured segment), re-sampling exactly
  the continuation whose uncertainty was measured. A copy inherits its parent's H_initial (the first segment
  is shared) and H_tool averages the probe's post-result segments.

H_initial is the entropy of a trajectory's first segment (from the prompt); dH = H - H_initial. It lives in the
rollout's per-trajectory state, so it is reset on every rollout call (the reference keeps a dict keyed by a
trajectory index that restarts at 0 every step and is never cleared: a stale baseline).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from stages.core.registry import Registry

WindowMode = Literal["paper", "reference"]
WINDOW_MODES: tuple[str, ...] = ("paper", "reference")
Aggregation = Literal["sum", "mean"]
AGGREGATIONS: tuple[str, ...] = ("sum", "mean")


# ---- per-token quantity ------------------------------------------------------------------------------------
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

    def from_positions(self, positions: Sequence[Mapping[int, Any]], ids: Sequence[int],
                       vocab_size: int) -> list[float]:
        """Per generated token, from vLLM-style per-position top log-prob dicts."""
        if not ids:
            return []
        return [float(h) for h in self(view_from_positions(positions, ids, self.k), vocab_size)]


# ---- segment aggregation and window ------------------------------------------------------------------------
def window_mean(entropies: Sequence[float], k: int) -> float:
    """Mean of the first k values (all of them when the segment is shorter); 0.0 for an empty segment."""
    head = list(entropies[:k])
    return sum(head) / len(head) if head else 0.0


def window_sum(entropies: Sequence[float], k: int) -> float:
    """Sum of the first k values (the reference code's aggregation)."""
    return float(sum(entropies[:k]))


@dataclass(frozen=True)
class EntropyWindow:
    mode: WindowMode = "reference"
    k: int = 20
    aggregation: Aggregation = "sum"

    def __post_init__(self) -> None:
        if self.mode not in WINDOW_MODES:
            raise ValueError(f"entropy window {self.mode!r} is not one of {WINDOW_MODES}; "
                             "set rl.rollout.entropy_window to paper or reference")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"entropy aggregation {self.aggregation!r} is not one of {AGGREGATIONS}; "
                             "set rl.rollout.entropy_aggregation to sum or mean")
        if self.k < 1:
            raise ValueError(f"entropy window k={self.k} must be >= 1 (rl.rollout.entropy_tokens)")

    def segment_entropy(self, entropies: Sequence[float]) -> float:
        return window_sum(entropies, self.k) if self.aggregation == "sum" else window_mean(entropies, self.k)

    @property
    def decide_after_generation(self) -> bool:
        """paper: decide right after generating a post-result segment (fork at its start);
        reference: decide after a tool result is appended (fork after the result)."""
        return self.mode == "paper"

    @property
    def copies_inherit_baseline(self) -> bool:
        """paper: a copy keeps its parent's H_initial; reference: its first segment after the fork is its own."""
        return self.mode == "paper"

    def tool_entropy(self, segments: Sequence[tuple[int, int, bool, float]]) -> float | None:
        """AEPO H_tool of a probe rollout's segments (start, end, after_result, H): the mean over every segment
        (reference) or over the post-result ones (paper); None when there is none (the caller uses H_root)."""
        values = [h for _, _, after, h in segments if after or self.mode == "reference"]
        return sum(values) / len(values) if values else None


def delta_entropy(h_now: float, h_initial: float | None) -> float:
    """dH = H_now - H_initial; 0 when the trajectory has no baseline yet (its first segment is the baseline)."""
    return 0.0 if h_initial is None else h_now - h_initial
