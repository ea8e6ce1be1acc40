"""pass@k (unbiased estimator), per-question aggregation and seeded bootstrap intervals; values derived by hand."""

from __future__ import annotations

from math import comb

import numpy as np
import pytest

from stages.core.passk import AGGREGATES, bootstrap_ci, pass_at_k, pass_at_k_Q, summarize


@pytest.mark.parametrize("k, expected", [
    (1, 0.4),  # 1 - C(3,1)/C(5,1) = 1 - 3/5
    (2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (3, 0.9),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
    (4, 1.0),  # only 3 wrong samples: any 4 contain a correct one
    (5, 1.0),
])
def test_pass_at_k_n5_c2(k, expected):
    assert pass_at_k(5, 2, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_edges_and_a_larger_case():
    assert pass_at_k(5, 0, 3) == 0.0 and pass_at_k(5, 5, 1) == 1.0
    # n=10, c=3, k=5: 1 - C(7,5)/C(10,5) = 1 - 21/252 = 11/12
    assert pass_at_k(10, 3, 5) == pytest.approx(11 / 12, abs=1e-12)
    # the product form agrees with the binomial definition everywhere up to n = 12
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k), abs=1e-12)


def test_pass_at_k_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"pass@6 needs 1 <= k <= n .*raise eval.samples"):
        pass_at_k(5, 1, 6)
    with pytest.raises(ValueError, match="0 <= c <= n"):
        pass_at_k(5, 6, 1)
    with pytest.raises(ValueError, match="binary correctness"):
        pass_at_k_Q(np.array([[0.5, 1.0]]), 1)


def test_per_question_pass_at_k_and_pass1_is_mean_accuracy():
    correct_QN = np.array([[1, 0, 1, 0, 0],   # c=2: pass@1 0.4, pass@2 0.7
                           [0, 0, 0, 0, 0],   # c=0: 0, 0
                           [1, 1, 1, 1, 1]])  # c=5: 1, 1
    assert pass_at_k_Q(correct_QN, 1).tolist() == pytest.approx([0.4, 0.0, 1.0])
    assert pass_at_k_Q(correct_QN, 2).tolist() == pytest.approx([0.7, 0.0, 1.0])
    # pass@1 averaged over questions = 1.4/3 = mean accuracy over all 15 samples = 7/15
    assert pass_at_k_Q(correct_QN, 1).mean() == pytest.approx(7 / 15)
    assert AGGREGATES.get("mean")(correct_QN).mean() == pytest.approx(7 / 15)


def test_bootstrap_is_seeded_and_hand_checkable():
    value_Q = np.array([0.0, 1.0, 1.0, 0.0, 1.0, 0.5])
    assert bootstrap_ci(value_Q, seed=3) == bootstrap_ci(value_Q, seed=3)
    assert bootstrap_ci(value_Q, seed=3) != bootstrap_ci(value_Q, seed=4)
    assert bootstrap_ci(np.ones(7), samples=50) == (1.0, 1.0)  # no spread, no interval width
    # two questions scored 0 and 1: a resample's mean is 0, 0.5 or 1 with probability 1/4, 1/2, 1/4, so the
    # 2.5% and 97.5% quantiles of 20,000 resamples are exactly 0 and 1
    assert bootstrap_ci(np.array([0.0, 1.0]), samples=20_000, seed=0) == (0.0, 1.0)
    low, high = bootstrap_ci(value_Q, samples=2000, seed=0)
    assert low < value_Q.mean() < high
    with pytest.raises(ValueError, match="non-empty 1-D"):
        bootstrap_ci(np.array([]))


def test_summarize_reports_accuracy_and_each_feasible_k():
    score_QN = np.array([[1.0, 0.5], [0.0, 0.0]])  # F1-like scores: accuracy = 1.5/4 = 0.375
    correct_QN = np.array([[1, 0], [0, 0]])  # pass@1 = (0.5 + 0)/2 = 0.25; pass@2 = (1 + 0)/2 = 0.5
    out = summarize(score_QN, correct_QN, [1, 2, 5], samples=200, seed=1)
    assert set(out) == {"accuracy", "pass@1", "pass@2"}  # k=5 > 2 samples is left out
    assert out["accuracy"]["value"] == pytest.approx(0.375)
    assert out["pass@1"]["value"] == pytest.approx(0.25) and out["pass@2"]["value"] == pytest.approx(0.5)
    for value in out.values():
        assert value["ci_low"] <= value["value"] <= value["ci_high"]
