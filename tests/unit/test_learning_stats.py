"""bench/learning_stats.py: the learning bench's statistics on arrays small enough to derive by hand."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from bench import learning_stats as st


# ---- the two-level bootstrap ----------------------------------------------------------------------------------
def test_a_constant_difference_has_a_point_interval_and_the_floor_p() -> None:
    e = st.two_level_bootstrap(np.full((3, 5), 0.25), samples=1000, seed=1)
    # every draw is 0.25: P(d* <= 0) = 0, so 2 min(...) = 0, floored at 1/samples
    assert (e.mean, e.low, e.high, e.p, e.confidence) == (0.25, 0.25, 0.25, 1 / 1000, 0.95)


def test_questions_are_drawn_once_for_all_seeds() -> None:
    # two seeds that agree per question: question 0 gives 1, question 1 gives 0. A draw of the questions shared by
    # the seeds gives a mean in {0, 1/2, 1} (both q0, one of each, both q1: probabilities 1/4, 1/2, 1/4); drawing
    # them per seed would also give 1/4 and 3/4
    draws = st.two_level_draws(np.array([[1.0, 0.0], [1.0, 0.0]]), samples=20000, seed=0)
    assert set(np.unique(draws)) <= {0.0, 0.5, 1.0}
    assert np.mean(draws == 1.0) == pytest.approx(0.25, abs=0.015)   # sd sqrt(.25 .75 / 20000) = 0.003
    assert np.mean(draws == 0.5) == pytest.approx(0.5, abs=0.015)


def test_seeds_are_resampled() -> None:
    # seed 0 gives 1 on every question, seed 1 gives 0: a draw's mean is the fraction of seed-0 draws, 0, 1/2 or 1
    draws = st.two_level_draws(np.array([[1.0, 1.0], [0.0, 0.0]]), samples=20000, seed=0)
    assert set(np.unique(draws)) <= {0.0, 0.5, 1.0}
    assert np.mean(draws == 0.0) == pytest.approx(0.25, abs=0.015)


def test_a_symmetric_difference_has_p_one_and_the_full_range() -> None:
    # one seed, d = (1, -1): draws 1, 0, -1 with probabilities 1/4, 1/2, 1/4; P(d* <= 0) = P(d* >= 0) = 3/4, so
    # 2 min(...) = 1.5, capped at 1; the 2.5% and 97.5% quantiles are -1 and +1
    e = st.two_level_bootstrap(np.array([[1.0, -1.0]]), samples=4000, seed=0)
    assert (e.mean, e.low, e.high, e.p) == (0.0, -1.0, 1.0, 1.0)


def test_the_bootstrap_p_of_a_skewed_difference() -> None:
    # one seed, d = (1, 1, -1): 27 equally likely draws of 3 questions; the mean is <= 0 when at least two are
    # q2 (the -1): 3 * 1/3^2 * 2/3 + 1/27 = 7/27, so p = 2 * 7/27 = 0.5185
    e = st.two_level_bootstrap(np.array([[1.0, 1.0, -1.0]]), samples=40000, seed=3)
    assert e.p == pytest.approx(14 / 27, abs=0.015) and e.mean == pytest.approx(1 / 3)


def test_the_bootstrap_is_seeded_and_fast_at_the_confirmatory_size() -> None:
    d = np.random.default_rng(0).normal(0.05, 0.5, size=(10, 400))
    start = time.perf_counter()
    a = st.two_level_bootstrap(d, samples=4000, seed=7)
    assert time.perf_counter() - start < 2.0            # vectorized: ~0.1 s here; a loop per draw takes ~10x that
    assert a == st.two_level_bootstrap(d, samples=4000, seed=7)
    assert a.low < a.mean < a.high


def test_a_shapeless_difference_is_refused() -> None:
    with pytest.raises(ValueError, match="seeds, questions"):
        st.two_level_bootstrap(np.zeros(4))


# ---- the ratio endpoint ---------------------------------------------------------------------------------------
def test_seed_mean_ratio_is_the_mean_over_seeds_of_sums() -> None:
    # seed 0: 2/3, seed 1: 1/3 -> 1/2
    assert st.seed_mean_ratio(np.array([[1, 1], [0, 1]]), np.array([[1, 2], [1, 2]])) == pytest.approx(0.5)


def test_the_ratio_difference_is_recomputed_per_draw() -> None:
    # one seed, two questions; a: correct (1, 1) of well-formed (1, 2) -> 2/3; b: (0, 1) of (1, 2) -> 1/3.
    # Draws: {q0, q0}: 1 - 0 = 1; {q1, q1}: 1/2 - 1/2 = 0; {q0, q1}: 1/3 (probability 1/2).
    # P(d* <= 0) = 1/4, P(d* >= 0) = 1 -> p = 1/2
    args = [np.array([[1, 1]]), np.array([[1, 2]]), np.array([[0, 1]]), np.array([[1, 2]])]
    draws = st.ratio_draws(*args, samples=20000, seed=0)
    assert set(np.round(np.unique(draws), 9)) <= {0.0, round(1 / 3, 9), 1.0}
    e = st.ratio_bootstrap(*args, samples=20000, seed=0)
    assert e.mean == pytest.approx(1 / 3) and e.p == pytest.approx(0.5, abs=0.02)
    assert (e.low, e.high) == (0.0, 1.0)


def test_a_draw_without_a_denominator_is_left_out() -> None:
    # a has no well-formed answer on q0: a draw of {q0, q0} is 0/0 and is dropped; the rest are finite
    args = [np.array([[0, 1]]), np.array([[0, 2]]), np.array([[0, 1]]), np.array([[1, 2]])]
    draws = st.ratio_draws(*args, samples=4000, seed=0)
    assert 0.15 < np.mean(np.isnan(draws)) < 0.35                   # 1/4 of the draws
    assert math.isfinite(st.ratio_bootstrap(*args, samples=4000, seed=0).low)


# ---- the seed-level t-test ------------------------------------------------------------------------------------
def test_seed_t_test_by_hand() -> None:
    # seed means 1, 2, 3: mean 2, sd 1, se 1/sqrt(3), t = 2 sqrt(3) = 3.4641, df 2. For df 2 the two-sided p is
    # 1 - t / sqrt(t^2 + 2) = 1 - sqrt(12/14) = 0.074180; t_{0.975, 2} = 4.302653, half width 4.302653/sqrt(3)
    r = st.seed_t_test(np.array([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]))
    assert (r.mean, r.df, r.seed_means) == (2.0, 2, (1.0, 2.0, 3.0))
    assert r.t == pytest.approx(3.4641016, rel=1e-6) and r.p == pytest.approx(0.0741799, rel=1e-5)
    assert (r.low, r.high) == pytest.approx((-0.484138, 4.484138), abs=1e-5)


def test_seed_t_test_edge_cases() -> None:
    assert math.isnan(st.seed_t_test(np.array([[1.0, 0.0]])).p)               # one seed: no test
    flat = st.seed_t_test(np.array([[0.5], [0.5]]))                            # no spread, mean 0.5
    assert (flat.p, flat.low, flat.high) == (0.0, 0.5, 0.5)


# ---- Holm -----------------------------------------------------------------------------------------------------
def test_holm_steps_down_and_stops_at_the_first_failure() -> None:
    # sorted: a 0.01 (level 0.05/3 = 0.0167: rejected), c 0.03 (level 0.025: not), b 0.04 (not: stopped).
    # adjusted: a 3 * 0.01 = 0.03; c max(0.03, 2 * 0.03) = 0.06; b max(0.06, 1 * 0.04) = 0.06
    r = st.holm({"a": 0.01, "b": 0.04, "c": 0.03}, alpha=0.05)
    assert list(r) == ["a", "b", "c"]
    assert [(r[k].rank, r[k].rejected) for k in "acb"] == [(1, True), (2, False), (3, False)]
    assert [r[k].adjusted for k in "acb"] == pytest.approx([0.03, 0.06, 0.06])
    assert [r[k].level for k in "acb"] == pytest.approx([0.05 / 3, 0.025, 0.05])


def test_holm_rejects_all_when_each_step_passes_and_caps_adjusted_at_one() -> None:
    r = st.holm({"x": 0.001, "y": 0.01, "z": 0.9})
    # x: 3 * 0.001 = 0.003 <= 0.05 (level 0.0167); y: 2 * 0.01 = 0.02 (level 0.025); z: 0.9 > 0.05
    assert [r[k].rejected for k in "xyz"] == [True, True, False]
    assert [r[k].adjusted for k in "xyz"] == pytest.approx([0.003, 0.02, 0.9])
    assert st.holm({"u": 0.6, "v": 0.7})["u"].adjusted == 1.0                  # 2 * 0.6 capped at 1


# ---- variance components, MDE, power, design ------------------------------------------------------------------
def test_variance_components_of_additive_effects() -> None:
    # d = [[1, 2], [3, 4]]: seed means 1.5, 3.5, question means 2, 3, grand 2.5, no interaction.
    # MS_seed = 2 * (1 + 1) / 1 = 4, MS_question = 2 * (0.25 + 0.25) / 1 = 1, MS_residual = 0
    c = st.variance_components(np.array([[1.0, 2.0], [3.0, 4.0]]))
    assert (c.seed, c.question, c.residual) == pytest.approx((2.0, 0.5, 0.0))
    # se = sqrt(2/2 + 0.5/2 + 0) = sqrt(1.25)
    assert st.se_of_mean(c, 2, 2) == pytest.approx(math.sqrt(1.25))


def test_variance_components_clip_negative_estimates() -> None:
    # d = [[1, 0], [0, 1]]: pure interaction; residuals +-0.5, SS 1 over 1 df -> MS_residual 1; MS_seed =
    # MS_question = 0, so (0 - 1) / 2 is clipped to 0
    c = st.variance_components(np.array([[1.0, 0.0], [0.0, 1.0]]))
    assert (c.seed, c.question, c.residual) == (0.0, 0.0, 1.0)
    with pytest.raises(ValueError, match="2 seeds"):
        st.variance_components(np.ones((1, 5)))


def test_mde_and_power() -> None:
    # z_0.975 = 1.959964, z_0.8 = 0.841621
    assert st.mde(1.0, 0.05, 0.8) == pytest.approx(2.801585, abs=1e-6)
    assert st.mde(0.02, 0.01, 0.8) == pytest.approx(0.02 * (2.575829 + 0.841621), abs=1e-6)
    # at the MDE the power is 0.8 (plus the far tail, Phi(-4.76) = 1e-6); at no effect it is alpha
    assert st.power_at(2.801585, 1.0, 0.05) == pytest.approx(0.8, abs=1e-5)
    assert st.power_at(0.0, 1.0, 0.05) == pytest.approx(0.05)
    # effect = z_0.975 se: Phi(0) + Phi(-3.92) = 0.5 + 4.4e-5
    assert st.power_at(1.959964, 1.0, 0.05) == pytest.approx(0.500044, abs=1e-6)


def test_design_grid_picks_fewest_seeds_then_fewest_questions() -> None:
    # t quantiles at df = S - 1 (t tables): S 16: 2.1314 + 0.8662 = 2.9976; S 20: 2.0930 + 0.8610 = 2.9540
    # seed variance only, 0.01: MDE = q 0.1 / sqrt(S): 16 seeds 2.9976 x 0.025 = 0.0749 miss 0.07, 20 seeds
    # 2.9540 x 0.02236 = 0.0661 meet it
    g = st.design_grid(st.Components(0.01, 0.0, 0.0), [4, 16, 20], [400, 80], 0.05, 0.07)
    assert (g["best"]["seeds"], g["best"]["questions"]) == (20, 80) and len(g["grid"]) == 6
    assert g["grid"][2]["mde"] == pytest.approx(2.9976 * 0.1 / 4, abs=1e-4)            # (16, 80)
    # question variance only, 0.04: MDE = q 0.2 / sqrt(Q); at 3 seeds (df 2: 4.3027 + 1.0607 = 5.3634) 80 questions
    # give 0.120, 400 give 0.0536: the fewest seeds, 3, with 400 questions
    g = st.design_grid(st.Components(0.0, 0.04, 0.0), [3, 5], [64, 80, 400], 0.05, 0.07)
    assert (g["best"]["seeds"], g["best"]["questions"]) == (3, 400)
    assert g["best"]["mde"] == pytest.approx(5.3634 * 0.2 / 20, abs=1e-4)
    assert st.design_grid(st.Components(1.0, 0.0, 0.0), [3], [80], 0.05, 0.07)["best"] is None


def test_sampling_noise_scales_with_the_samples_per_question() -> None:
    # 2 samples: c = 1 gives p(1-p) = 1*1/(2*1) = 0.5, c = 0 or 2 gives 0; mean over 4 cells 0.25, over k: 0.125
    assert st.sampling_variance(np.array([[1, 0], [2, 1]]), 2) == pytest.approx(0.125)
    c = st.Components(seed=1e-3, question=2e-3, residual=0.05)
    # from 4 samples to 1: the sampling part 0.04 becomes 0.16, the interaction 0.01 stays
    assert st.at_samples(c, 0.04, 4, 1) == st.Components(1e-3, 2e-3, pytest.approx(0.17))
    assert st.at_samples(c, 0.04, 4, 4) == c
    with pytest.raises(ValueError, match="at least 2 samples"):
        st.sampling_variance(np.ones((1, 3)), 1)


# ---- seed-level MDE, seeds needed, verdict lines (issue 54) -------------------------------------------------
def test_t_quantiles_make_the_mde_1_33_to_1_62_times_the_normal_one_at_5_seeds() -> None:
    # df 4 (t tables): t(0.975) 2.7764, t(0.995) 4.6041, t(0.8) 0.9410; normal: 1.9600, 2.5758, 0.8416
    # alpha 0.05: 3.7174 / 2.8016 = 1.327; alpha 0.01: 5.5451 / 3.4174 = 1.623
    assert st.mde(1.0, 0.05, 0.8, df=4) / st.mde(1.0, 0.05, 0.8) == pytest.approx(1.327, abs=1e-3)
    assert st.mde(1.0, 0.01, 0.8, df=4) / st.mde(1.0, 0.01, 0.8) == pytest.approx(1.623, abs=1e-3)


def test_t_mde_and_the_seeds_a_target_needs() -> None:
    # 4 seeds, per-seed sd 0.05: (t(0.975, 3) 3.1824 + t(0.8, 3) 0.9785) x 0.05 / 2 = 0.1040
    assert st.t_mde(0.05, 4) == pytest.approx(4.1609 * 0.025, abs=1e-4)
    assert math.isnan(st.t_mde(0.05, 1))
    # MDE <= 0.07 at sd 0.05: 6 seeds (2.5706 + 0.9195) x 0.05 / 2.4495 = 0.0712 miss; 7 seeds (2.4469 + 0.9057) x
    # 0.05 / 2.6458 = 0.0634 meet it
    assert st.seeds_needed(0.05, 0.07) == 7
    assert st.seeds_needed(0.05, -0.07) == 7          # the size of an effect, either sign
    assert st.seeds_needed(1.0, 0.01, most=50) is None


def test_verdict_lines_name_the_test_the_verdict_and_the_seeds_it_would_take() -> None:
    # per-seed differences 0.05, 0.07, 0.09, 0.11: mean 0.08, sd sqrt(0.002 / 3) = 0.02582, se 0.01291, t 6.197 on 3
    # df: p 0.0085; 95% interval 0.08 -/+ 3.1824 x 0.01291 = [0.039, 0.121]
    test = st.seed_t_test(np.array([[0.05], [0.07], [0.09], [0.11]]))
    assert test.t == pytest.approx(6.197, abs=1e-3) and test.p == pytest.approx(0.0085, abs=1e-4)
    line = st.verdict_line("content: grpo - format", test, test.p, True, st.t_mde(0.02582, 4), 0.07)
    assert line == "content: grpo - format: +0.080 [+0.039, +0.121], seed-level t-test p 0.0085 -> shown"
    # the same spread around 0: -0.03, -0.01, 0.01, 0.03: mean 0, p 1; MDE 4.1609 x 0.01291 = 0.0537 <= 0.07
    null = st.seed_t_test(np.array([[-0.03], [-0.01], [0.01], [0.03]]))
    assert st.verdict_line("c", null, 0.5, False, st.t_mde(0.02582, 4), 0.07) == (
        "c: +0.000 [-0.041, +0.041], seed-level t-test p 1, adjusted 0.5 -> not shown (the MDE was 0.054 <= 0.07)")
    # a wide spread: MDE 0.2 > 0.07, with the seeds that would give 0.07
    assert st.verdict_line("c", null, null.p, False, 0.2, 0.07, 33).endswith(
        "-> within noise at an MDE of 0.200; 33 seeds would give an MDE of 0.07")
    assert st.verdict_line("c", null, null.p, False, 0.2, 0.07, None).endswith(
        "no design of up to 500 seeds gives an MDE of 0.07")
