"""The learning bench's statistics (issue 44), pure numpy/scipy, so that a protocol fixed in advance can be
recomputed from the committed per-question counts.

The data are a policy's per-question accuracies over seeds x questions, `x_SQ`; two policies are compared through
their paired differences `d_SQ` (seed s of one with seed s of the other: they share the evaluation sampling seed).
Seeds and questions are crossed (every seed answers every question), so a bootstrap draw resamples the seeds and,
once for all seeds, the questions; its spread holds both the seed-to-seed and the question-to-question variation.
The same crossed model's variance components give the standard error of a design not yet run, hence its minimum
detectable difference (MDE) and power.

    .venv/bin/python -m bench.learning_protocol learning   # the tables of bench/results/per-question/learning.json
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats

BOOTSTRAP_SAMPLES = 4000


@dataclass(frozen=True)
class Estimate:
    """A difference's point estimate, its interval at `confidence` and its two-sided p-value (H0: no difference)."""
    mean: float
    low: float
    high: float
    p: float
    confidence: float


@dataclass(frozen=True)
class Components:
    """Crossed two-way random-effects variance components of d_SQ: seed, question, residual (interaction and
    evaluation sampling noise)."""
    seed: float
    question: float
    residual: float


# ---- the two-level bootstrap --------------------------------------------------------------------------------
def _counts(rng: np.random.Generator, n: int, samples: int) -> np.ndarray:
    """[samples, n] how often each of n units is drawn in a resample of n with replacement (one row per draw)."""
    drawn = rng.integers(0, n, size=(samples, n)) + (np.arange(samples) * n)[:, None]
    return np.bincount(drawn.ravel(), minlength=samples * n).reshape(samples, n).astype(float)


def _weights(S: int, Q: int, samples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seed counts [samples, S] and question counts [samples, Q]: draw b resamples the seeds, and the questions once
    for all of its seeds (questions are crossed with seeds)."""
    rng = np.random.default_rng(seed)
    return _counts(rng, S, samples), _counts(rng, Q, samples)


def _summarize(point: float, draws: np.ndarray, confidence: float) -> Estimate:
    """Percentile interval and the two-sided bootstrap p, 2 min(P(d* <= 0), P(d* >= 0)), floored at 1/draws and
    capped at 1; draws that are not finite (an empty ratio) are left out."""
    draws = draws[np.isfinite(draws)]
    if draws.size == 0:
        return Estimate(point, math.nan, math.nan, math.nan, confidence)
    tail = (1 - confidence) / 2
    low, high = np.quantile(draws, [tail, 1 - tail])
    p = 2 * min(np.mean(draws <= 0), np.mean(draws >= 0))
    return Estimate(float(point), float(low), float(high), float(min(1.0, max(p, 1 / draws.size))), confidence)


def _check(d_SQ: np.ndarray) -> np.ndarray:
    d = np.asarray(d_SQ, dtype=float)
    if d.ndim != 2 or 0 in d.shape:
        raise ValueError(f"expected a [seeds, questions] array with at least one of each, got shape {d.shape}")
    return d


def two_level_bootstrap(d_SQ: np.ndarray, samples: int = BOOTSTRAP_SAMPLES, seed: int = 0,
                        confidence: float = 0.95) -> Estimate:
    """Mean of d_SQ with its two-level percentile interval and bootstrap p. A draw's mean over the drawn seeds and
    questions is w_s @ d @ w_q / (S Q) with the draw counts w_s, w_q: no loop over draws."""
    d = _check(d_SQ)
    return _summarize(d.mean(), two_level_draws(d, samples, seed), confidence)


def two_level_draws(d_SQ: np.ndarray, samples: int = BOOTSTRAP_SAMPLES, seed: int = 0) -> np.ndarray:
    """[samples] bootstrap means of d_SQ (seeds resampled, questions resampled once for all seeds)."""
    d = _check(d_SQ)
    S, Q = d.shape
    w_s, w_q = _weights(S, Q, samples, seed)
    return np.einsum("bq,bq->b", w_s @ d, w_q) / (S * Q)


def ratio_bootstrap(num_a_SQ: np.ndarray, den_a_SQ: np.ndarray, num_b_SQ: np.ndarray, den_b_SQ: np.ndarray,
                    samples: int = BOOTSTRAP_SAMPLES, seed: int = 0, confidence: float = 0.95) -> Estimate:
    """The paired difference of pooled ratios (e.g. correct / well-formed): per seed, r = sum_q num / sum_q den for
    each policy; the estimate is the mean over seeds of r_a - r_b. A draw resamples the questions (the same for
    every seed and both policies) and the seeds, and recomputes the ratios. A seed with no denominator gives nan."""
    arrays = _same_shape(num_a_SQ, den_a_SQ, num_b_SQ, den_b_SQ)
    point = pooled_ratio(*arrays[:2]) - pooled_ratio(*arrays[2:])
    return _summarize(point, ratio_draws(*arrays, samples=samples, seed=seed), confidence)


def ratio_draws(num_a_SQ: np.ndarray, den_a_SQ: np.ndarray, num_b_SQ: np.ndarray, den_b_SQ: np.ndarray,
                samples: int = BOOTSTRAP_SAMPLES, seed: int = 0) -> np.ndarray:
    """[samples] bootstrap values of mean_s (r_a - r_b), the ratios recomputed over each draw's questions."""
    na, da, nb, db = _same_shape(num_a_SQ, den_a_SQ, num_b_SQ, den_b_SQ)
    S, Q = na.shape
    w_s, w_q = _weights(S, Q, samples, seed)
    with np.errstate(divide="ignore", invalid="ignore"):
        diff_BS = (w_q @ na.T) / (w_q @ da.T) - (w_q @ nb.T) / (w_q @ db.T)
        return np.where(w_s > 0, w_s * diff_BS, 0.0).sum(axis=1) / S  # a seed not drawn adds nothing, nan or not


def _same_shape(*arrays_SQ: np.ndarray) -> list[np.ndarray]:
    arrays = [_check(a) for a in arrays_SQ]
    if len({a.shape for a in arrays}) != 1:
        raise ValueError(f"expected arrays of one [seeds, questions] shape, got {[a.shape for a in arrays]}")
    return arrays


def pooled_ratio(num_SQ: np.ndarray, den_SQ: np.ndarray) -> float:
    """Mean over seeds of sum_q num / sum_q den (one policy's accuracy among well-formed answers)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return float(np.mean(_check(num_SQ).sum(1) / _check(den_SQ).sum(1)))


# ---- the seed-level t-test ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class SeedTest:
    """One-sample t-test of the per-seed mean differences (df = S - 1) and its t interval."""
    mean: float
    low: float
    high: float
    p: float
    t: float
    df: int
    seed_means: tuple[float, ...]


def seed_t_test(d_SQ: np.ndarray, confidence: float = 0.95) -> SeedTest:
    """Each seed's mean difference over questions, tested against 0 with S - 1 degrees of freedom (questions fixed:
    it holds the seed-to-seed variation only, beside the bootstrap that holds both). One seed: nan."""
    m = _check(d_SQ).mean(axis=1)
    S, mean = m.size, float(m.mean())
    if S < 2:
        return SeedTest(mean, math.nan, math.nan, math.nan, math.nan, 0, tuple(m.tolist()))
    se = float(m.std(ddof=1)) / math.sqrt(S)
    if se == 0:
        p, t = (1.0, math.nan) if mean == 0 else (0.0, math.copysign(math.inf, mean))
        return SeedTest(mean, mean, mean, p, t, S - 1, tuple(m.tolist()))
    t = mean / se
    half = float(stats.t.ppf(1 - (1 - confidence) / 2, S - 1)) * se
    return SeedTest(mean, mean - half, mean + half, float(2 * stats.t.sf(abs(t), S - 1)), t, S - 1,
                    tuple(m.tolist()))


# ---- Holm's step-down ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HolmResult:
    """One hypothesis under Holm: its p, adjusted p, whether rejected, its rank (1 = smallest p) and the level of
    its step, alpha / (m - rank + 1): report its interval at 1 - level. These are Holm-stepped intervals, each at
    the level its own step tests, not simultaneous ones (a family-wide coverage guarantee would need Bonferroni's
    alpha / m for all)."""
    p: float
    adjusted: float
    rejected: bool
    rank: int
    level: float


def holm(pvalues: dict[str, float], alpha: float = 0.05) -> dict[str, HolmResult]:
    """Holm's step-down over `pvalues` (ties in the order given): the i-th smallest p is tested at alpha/(m-i+1),
    and rejection stops at the first that fails; adjusted p_(i) = max_{j<=i} min(1, (m-j+1) p_(j))."""
    order = sorted(pvalues, key=lambda name: pvalues[name])  # stable: ties keep the order given
    m, out, running, rejecting = len(order), {}, 0.0, True
    for rank, name in enumerate(order, start=1):
        level = alpha / (m - rank + 1)
        running = max(running, min(1.0, (m - rank + 1) * pvalues[name]))
        rejecting = rejecting and pvalues[name] <= level
        out[name] = HolmResult(pvalues[name], running, rejecting, rank, level)
    return {name: out[name] for name in pvalues}


# ---- variance components, MDE, power, design ----------------------------------------------------------------
def variance_components(d_SQ: np.ndarray) -> Components:
    """Method of moments for y_sq = mu + a_s + b_q + e_sq (crossed, one observation per cell): E[MS_seed] =
    s2_e + Q s2_s, E[MS_question] = s2_e + S s2_q, E[MS_residual] = s2_e; negative estimates are clipped at 0."""
    d = _check(d_SQ)
    S, Q = d.shape
    if S < 2 or Q < 2:
        raise ValueError(f"variance components need at least 2 seeds and 2 questions, got {S} x {Q}")
    grand, seed_m, question_m = d.mean(), d.mean(axis=1), d.mean(axis=0)
    ms_seed = Q * np.sum((seed_m - grand) ** 2) / (S - 1)
    ms_question = S * np.sum((question_m - grand) ** 2) / (Q - 1)
    resid = d - seed_m[:, None] - question_m[None, :] + grand
    ms_resid = np.sum(resid**2) / ((S - 1) * (Q - 1))
    return Components(seed=float(max(0.0, (ms_seed - ms_resid) / Q)),
                      question=float(max(0.0, (ms_question - ms_resid) / S)), residual=float(ms_resid))


def sampling_variance(correct_SQ: np.ndarray, samples: int) -> float:
    """The evaluation's own sampling noise in one policy's per-question accuracy x = c / k: the mean over seeds and
    questions of p(1 - p) / k, with p(1 - p) estimated without bias from the k samples, c (k - c) / (k (k - 1))."""
    c, k = np.asarray(correct_SQ, dtype=float), samples
    if k < 2:
        raise ValueError("the sampling variance needs at least 2 samples per question")
    return float(np.mean(c * (k - c) / (k * (k - 1))) / k)


def at_samples(components: Components, sampling_var: float, samples: int, new_samples: int) -> Components:
    """The components of a paired difference evaluated with `new_samples` per question instead of `samples`: its
    residual holds both policies' sampling noise (`sampling_var`, the sum of sampling_variance of the two), which
    scales as 1/k; the rest of the residual (seed x question interaction) does not."""
    residual = components.residual + sampling_var * (samples / new_samples - 1)
    return Components(components.seed, components.question, max(0.0, residual))


def se_of_mean(components: Components, S: int, Q: int) -> float:
    """Standard error of the mean difference over S seeds x Q questions under the crossed model."""
    c = components
    return math.sqrt(c.seed / S + c.question / Q + c.residual / (S * Q))


def mde(se: float, alpha: float = 0.05, power: float = 0.8) -> float:
    """The smallest true difference a two-sided test at `alpha` finds with probability `power`:
    (z_{1-alpha/2} + z_power) se (normal approximation)."""
    return float((stats.norm.ppf(1 - alpha / 2) + stats.norm.ppf(power)) * se)


def power_at(effect: float, se: float, alpha: float = 0.05) -> float:
    """Probability that a two-sided test at `alpha` rejects when the true difference is `effect`."""
    if se <= 0:
        return 1.0 if effect != 0 else alpha
    z, shift = stats.norm.ppf(1 - alpha / 2), abs(effect) / se
    return float(stats.norm.cdf(shift - z) + stats.norm.cdf(-shift - z))


def design_grid(components: Components, seeds_options: list[int], question_options: list[int], alpha: float,
                target_mde: float, power: float = 0.8) -> dict:
    """Every (seeds, questions) design's SE and MDE, and the cheapest meeting `target_mde`: fewest seeds, then
    fewest questions (seeds are the costly runs; questions are generated and cost an evaluation each). `best` is
    None when no design in the grid meets it."""
    grid, best = [], None
    for S in sorted(seeds_options):
        for Q in sorted(question_options):
            se = se_of_mean(components, S, Q)
            row = {"seeds": S, "questions": Q, "se": se, "mde": mde(se, alpha, power)}
            grid.append(row)
            if best is None and row["mde"] <= target_mde:
                best = row
    return {"best": best, "grid": grid}
