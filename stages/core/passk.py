"""pass@k and confidence intervals over a question x sample correctness matrix.

pass@k uses the unbiased estimator of Chen et al. (2021): with n samples of which c are correct,
pass@k = 1 - C(n-c, k) / C(n, k), computed as a product so large n does not overflow. pass@1 is then exactly the
mean accuracy over samples. Confidence intervals are percentile bootstraps over questions (samples of one
question stay together), seeded so a report is reproducible.

Aggregates are registered by name (`AGGREGATES`), each mapping a score matrix `score_QN` (questions x samples,
values in [0, 1]) to one value per question `value_Q`; the benchmark figure is the mean of `value_Q`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from stages.core.registry import Registry

AGGREGATES: Registry[Callable[[np.ndarray], np.ndarray]] = Registry("per-question aggregate")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased probability that at least one of k samples drawn without replacement from n is correct."""
    if not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n samples per question (n={n}); lower eval.pass_k or raise "
                         f"eval.samples")
    if n - c < k:
        return 1.0
    # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i)
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def pass_at_k_Q(correct_QN: np.ndarray, k: int) -> np.ndarray:
    """Per-question pass@k from a boolean/0-1 matrix (questions x samples, same n for every question)."""
    correct_QN = _matrix(correct_QN)
    if np.any((correct_QN != 0) & (correct_QN != 1)):
        raise ValueError("pass@k needs binary correctness (0/1) per sample; got fractional scores")
    n = correct_QN.shape[1]
    counts_Q = correct_QN.sum(axis=1).astype(int)
    return np.array([pass_at_k(n, int(c), k) for c in counts_Q], dtype=float)


@AGGREGATES.register("mean")
def mean_Q(score_QN: np.ndarray) -> np.ndarray:
    """Mean score over a question's samples (pass@1 / mean accuracy when scores are 0/1)."""
    return _matrix(score_QN).mean(axis=1)


def bootstrap_ci(value_Q: np.ndarray, samples: int = 1000, confidence: float = 0.95,
                 seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of mean(value_Q), resampling questions with replacement."""
    value_Q = np.asarray(value_Q, dtype=float)
    if value_Q.ndim != 1 or value_Q.size == 0:
        raise ValueError(f"bootstrap needs a non-empty 1-D array of per-question values, got shape {value_Q.shape}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    rng = np.random.default_rng(seed)
    index_BQ = rng.integers(0, value_Q.size, size=(samples, value_Q.size))
    means_B = value_Q[index_BQ].mean(axis=1)
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(means_B, [tail, 1.0 - tail])
    return float(low), float(high)


def summarize(score_QN: np.ndarray, correct_QN: np.ndarray, ks: list[int], samples: int = 1000,
              confidence: float = 0.95, seed: int = 0) -> dict[str, dict[str, float]]:
    """{"accuracy": {value, ci_low, ci_high}, "pass@k": {...} for each k <= n} with seeded bootstrap CIs.

    `accuracy` is the mean of `score_QN` (F1 for QA without a judge); pass@k uses the binary `correct_QN`.
    k larger than the samples per question is left out (and logged by the caller).
    """
    out: dict[str, dict[str, float]] = {}
    n = _matrix(correct_QN).shape[1]
    series = {"accuracy": mean_Q(score_QN)}
    for k in sorted(set(ks)):
        if k <= n:
            series[f"pass@{k}"] = pass_at_k_Q(correct_QN, k)
    for offset, (name, value_Q) in enumerate(series.items()):
        low, high = bootstrap_ci(value_Q, samples=samples, confidence=confidence, seed=seed + offset)
        out[name] = {"value": float(value_Q.mean()), "ci_low": low, "ci_high": high}
    return out


def _matrix(values: np.ndarray) -> np.ndarray:
    array = np.asarray(values, dtype=float)
    if array.ndim != 2 or array.shape[0] == 0 or array.shape[1] == 0:
        raise ValueError(f"expected a questions x samples matrix, got shape {array.shape}")
    return array
