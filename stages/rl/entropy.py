"""How the entropy a rollout measures for branching becomes one number per segment.

The per-token quantity (`rl.rollout.entropy_quantity`: topk | full | surprisal) is what every generation backend
reports (stages/generation/token_entropy.py, registry `ENTROPY_QUANTITIES`); this module turns a segment's
per-token values into its H and says which segment a branching decision reads.

**Segment aggregation** (`rl.rollout.entropy_aggregation`): `sum` (default, the reference code: the published
tau = 0.5, w = 0.2 were tuned on this scale; over k = 20 tokens dH spreads over about +-3, so
P = clip(tau + w dH) spreads over [0, 1]) or `mean` (dH about 20x smaller: P stays near tau).

**Window** (`rl.rollout.entropy_window`, the first `entropy_tokens` tokens of a segment):

- `reference` (default; ARPO code, docs/reference.md "Entropy"): every segment is measured; the decision after tool
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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

WindowMode = Literal["paper", "reference"]
WINDOW_MODES: tuple[str, ...] = ("paper", "reference")
Aggregation = Literal["sum", "mean"]
AGGREGATIONS: tuple[str, ...] = ("sum", "mean")


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
