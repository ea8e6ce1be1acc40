"""Where the rollout measures entropy for branching, and how a segment's per-token entropies become one number.

Per-token entropies come from the backend already normalised by ln|V| (in [0, 1]). Two windows (config
`rl.rollout.entropy_window`):

- `paper` (default; ARPO paper): after a tool result the model generates the next segment; H = the MEAN entropy
  of its first k tokens. The branch decision follows that segment, and a copy forks right after the result
  (at the start of the measured segment), so it re-samples exactly the continuation whose uncertainty was
  measured. Decisions happen on segments that follow a tool result.
- `reference` (ARPO code, research/arpo.md 2.3): H = the SUM of the entropies of the first k tokens of every
  segment; the decision after tool call t uses the segment that ended in call t (one round late: its tokens
  came after result t-1, or after the prompt), and a copy forks after result t is appended.

H_initial is the entropy of a trajectory's first segment (from the prompt) in the same window; dH = H - H_initial.
It lives in the rollout's per-trajectory state, so it is reset on every rollout call (the reference keeps a
dict keyed by a trajectory index that restarts at 0 every step and is never cleared — a stale baseline). A
branch inherits its parent's H_initial (its first segment is the parent's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

WindowMode = Literal["paper", "reference"]
WINDOW_MODES: tuple[str, ...] = ("paper", "reference")


def window_mean(entropies: Sequence[float], k: int) -> float:
    """Mean of the first k values (all of them when the segment is shorter); 0.0 for an empty segment."""
    head = list(entropies[:k])
    return sum(head) / len(head) if head else 0.0


def window_sum(entropies: Sequence[float], k: int) -> float:
    """Sum of the first k values (the reference code's aggregation)."""
    return float(sum(entropies[:k]))


@dataclass(frozen=True)
class EntropyWindow:
    mode: WindowMode = "paper"
    k: int = 20

    def __post_init__(self) -> None:
        if self.mode not in WINDOW_MODES:
            raise ValueError(f"entropy window {self.mode!r} is not one of {WINDOW_MODES}; "
                             "set rl.rollout.entropy_window to paper or reference")
        if self.k < 1:
            raise ValueError(f"entropy window k={self.k} must be >= 1 (rl.rollout.entropy_tokens)")

    def segment_entropy(self, entropies: Sequence[float]) -> float:
        return window_mean(entropies, self.k) if self.mode == "paper" else window_sum(entropies, self.k)

    @property
    def decide_after_generation(self) -> bool:
        """paper: decide right after generating a post-result segment (fork at its start);
        reference: decide after a tool result is appended (fork after the result)."""
        return self.mode == "paper"


def delta_entropy(h_now: float, h_initial: float | None) -> float:
    """dH = H_now - H_initial; 0 when the trajectory has no baseline yet (its first segment is the baseline)."""
    return 0.0 if h_initial is None else h_now - h_initial
