"""The learning bench's statistics (issues 44, 54), pure numpy/scipy, so that a protocol fixed in advance can be
recomputed from the committed per-question counts. Every statistic of the bench lives here (docs/learning.md).

The data are a policy's per-question accuracies over seeds x questions, `x_SQ`; two policies are compared through
their paired differences `d_SQ` (seed s of one with seed s of the other: they share the evaluation sampling seed).
Seeds and questions are crossed (every seed answers every question), so a bootstrap draw resamples the seeds and,
once for all seeds, the questions; its spread holds both the seed-to-seed and the question-to-question variation.
The same crossed model's variance components give the standard error of a design not yet run, hence its minimum
detectable difference (MDE) and power. With few seeds the seed is the unit that decides (docs/learning.md): the
seed-level paired t-test, its MDE with t quantiles from the per-seed sd, and the seeds a target needs.

Two bootstraps over seeds and questions are here, and they differ: `two_level_bootstrap` resamples the seeds of a
*paired* difference d_SQ (seed s of one policy with seed s of the other), `unpaired_two_level_diff` resamples each
policy's seeds independently (the descriptive tables' comparison of two algorithms).

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
    """The paired difference of ratios (e.g. correct / well-formed): per seed, r = sum_q num / sum_q den for
    each policy; the estimate is the mean over seeds of r_a - r_b. A draw resamples the questions (the same for
    every seed and both policies) and the seeds, and recomputes the ratios. A seed with no denominator gives nan."""
    arrays = _same_shape(num_a_SQ, den_a_SQ, num_b_SQ, den_b_SQ)
    point = seed_mean_ratio(*arrays[:2]) - seed_mean_ratio(*arrays[2:])
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


def seed_mean_ratio(num_SQ: np.ndarray, den_SQ: np.ndarray) -> float:
    """Mean over seeds of sum_q num / sum_q den: one policy's accuracy among well-formed answers, the protocol's one
    definition (per seed over its questions, then averaged over seeds: the seed is the unit, as in every test here;
    not the ratio of sums pooled over seeds, which weights a seed by its well-formed count)."""
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


def mde(se: float, alpha: float = 0.05, power: float = 0.8, df: int | None = None) -> float:
    """The smallest true difference a two-sided test at `alpha` finds with probability `power`:
    (q_{1-alpha/2} + q_power) se, with t quantiles at `df` degrees of freedom (the seed-level test: df = S - 1), or
    normal ones when df is None (the approximation that, at 5 seeds, understates the MDE by 1.33-1.62x)."""
    q = stats.norm.ppf if df is None else (lambda x: stats.t.ppf(x, df))
    return float((q(1 - alpha / 2) + q(power)) * se)


def t_mde(seed_sd: float, seeds: int, alpha: float = 0.05, power: float = 0.8) -> float:
    """The seed-level paired t-test's MDE: (t_{1-alpha/2, S-1} + t_{power, S-1}) sd / sqrt(S), with `seed_sd` the
    sd of the per-seed mean differences (from a pilot). Fewer than 2 seeds: nan."""
    if seeds < 2:
        return math.nan
    return mde(seed_sd / math.sqrt(seeds), alpha, power, df=seeds - 1)


def seeds_needed(seed_sd: float, effect: float, alpha: float = 0.05, power: float = 0.8, most: int = 500) -> int | None:
    """The fewest seeds (>= 2) whose t_mde is at most |effect|: `power` to find it; None when `most` do not do."""
    return next((S for S in range(2, most + 1) if t_mde(seed_sd, S, alpha, power) <= abs(effect)), None)


def power_at(effect: float, se: float, alpha: float = 0.05) -> float:
    """Probability that a two-sided test at `alpha` rejects when the true difference is `effect`."""
    if se <= 0:
        return 1.0 if effect != 0 else alpha
    z, shift = stats.norm.ppf(1 - alpha / 2), abs(effect) / se
    return float(stats.norm.cdf(shift - z) + stats.norm.cdf(-shift - z))


def design_grid(components: Components, seeds_options: list[int], question_options: list[int], alpha: float,
                target_mde: float, power: float = 0.8) -> dict:
    # t quantiles at df = S - 1: the seed-level test decides, and its df is what a design of S seeds has
    """Every (seeds, questions) design's SE and MDE, and the cheapest meeting `target_mde`: fewest seeds, then
    fewest questions (seeds are the costly runs; questions are generated and cost an evaluation each). `best` is
    None when no design in the grid meets it."""
    grid, best = [], None
    for S in sorted(seeds_options):
        for Q in sorted(question_options):
            se = se_of_mean(components, S, Q)
            row = {"seeds": S, "questions": Q, "se": se, "mde": mde(se, alpha, power, df=S - 1)}
            grid.append(row)
            if best is None and row["mde"] <= target_mde:
                best = row
    return {"best": best, "grid": grid}


# ---- verdicts -----------------------------------------------------------------------------------------------
def verdict(mean: float, rejected: bool, mde_value: float, target: float) -> str:
    """The short verdict: shown / reversed (rejected, by sign), not shown (the design could have found an effect of
    the target size: its MDE was at most the target), or within noise at the MDE this run had."""
    if rejected:
        return "shown" if mean > 0 else "reversed"
    if math.isnan(mde_value):
        return "within noise (MDE not estimable: fewer than 2 seeds)"
    if mde_value <= target:
        return f"not shown (the MDE was {mde_value:.3f} <= {target:g})"
    return f"within noise at an MDE of {mde_value:.3f}"


def verdict_line(claim: str, test: SeedTest, adjusted_p: float, rejected: bool, mde_value: float, target: float,
                 seeds_for_target: int | None = None) -> str:
    """One generated line per claim: `<claim>: <mean> [<interval>], seed-level t-test p <p> (adjusted <p>) -> <verdict>`,
    and, when it is not shown, the seeds that would give the target's MDE."""
    p = "n/a" if math.isnan(test.p) else f"{test.p:.2g}"
    adjusted = "" if math.isnan(adjusted_p) or adjusted_p == test.p else f", adjusted {adjusted_p:.2g}"
    line = (f"{claim}: {test.mean:+.3f} [{test.low:+.3f}, {test.high:+.3f}], seed-level t-test p {p}{adjusted} -> "
            f"{verdict(test.mean, rejected, mde_value, target)}")
    if not rejected and mde_value > target:
        line += (f"; {seeds_for_target} seeds would give an MDE of {target:g}" if seeds_for_target
                 else f"; no design of up to 500 seeds gives an MDE of {target:g}")
    return line


# ---- the descriptive tables' bootstraps ---------------------------------------------------------------------
def paired_gain(sft_Q: list[float], rl_Q: list[float], samples: int = 2000, seed: int = 0,
                confidence: float = 0.95) -> tuple[float, float, float]:
    """(mean of rl - sft, low, high): percentile bootstrap over questions, both policies resampled together (one
    run against SFT's evaluation with its sampling seed)."""
    sft, rl = np.asarray(sft_Q, dtype=float), np.asarray(rl_Q, dtype=float)
    if sft.shape != rl.shape or sft.size == 0:
        raise ValueError(f"paired gain needs the same questions for both policies, got {sft.shape} and {rl.shape}")
    diff = rl - sft
    index = np.random.default_rng(seed).integers(0, diff.size, size=(samples, diff.size))
    tail = (1 - confidence) / 2
    low, high = np.quantile(diff[index].mean(axis=1), [tail, 1 - tail])
    return float(diff.mean()), float(low), float(high)


def unpaired_two_level_diff(a_QS: np.ndarray, b_QS: np.ndarray, samples: int = 4000, seed: int = 0,
                            confidence: float = 0.95) -> tuple[float, float, float]:
    """(mean of a - b, low, high) for per-question accuracies [Q, seeds] of two algorithms on the same questions:
    every draw resamples the questions (the same ones for both) and each algorithm's seeds independently (no
    pairing by seed: the descriptive tables'; the protocol pairs, `two_level_bootstrap`)."""
    a, b = np.asarray(a_QS, dtype=float), np.asarray(b_QS, dtype=float)
    if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[0] or a.shape[0] == 0:
        raise ValueError(f"unpaired_two_level_diff needs [questions, seeds] arrays over the same questions, got "
                         f"{a.shape} and {b.shape}")
    rng = np.random.default_rng(seed)
    q = rng.integers(0, a.shape[0], size=(samples, a.shape[0]))
    sa = rng.integers(0, a.shape[1], size=(samples, a.shape[1]))
    sb = rng.integers(0, b.shape[1], size=(samples, b.shape[1]))
    means_a = np.array([a[q[i]][:, sa[i]].mean() for i in range(samples)])
    means_b = np.array([b[q[i]][:, sb[i]].mean() for i in range(samples)])
    tail = (1 - confidence) / 2
    low, high = np.quantile(means_a - means_b, [tail, 1 - tail])
    return float(a.mean() - b.mean()), float(low), float(high)
