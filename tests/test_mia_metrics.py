"""Metrics are exact on hand-computed examples and agree with scikit-learn."""

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score
from sklearn.metrics import roc_curve as sk_roc_curve

from mia import metrics


def test_perfect_separation():
    m, n = np.arange(10, 20.0), np.arange(0, 10.0)
    out = metrics.evaluate(m, n, n_bootstrap=50)
    assert out["auc"] == 1.0
    assert out["tpr@fpr=0.01"] == 1.0 and out["tpr@fpr=0.001"] == 1.0
    assert out["balanced_accuracy"] == 1.0
    assert out["ci"]["auc"] == [1.0, 1.0]


def test_reversed_and_equal_scores():
    assert metrics.auc([0.0, 1.0], [5.0, 6.0]) == 0.0
    # All tied: AUC 1/2, and a threshold cannot split a tie, so TPR at FPR < 1 is 0.
    assert metrics.auc([1.0] * 3, [1.0] * 4) == 0.5
    assert metrics.tpr_at_fpr([1.0] * 3, [1.0] * 4, 0.5) == 0.0
    assert metrics.balanced_accuracy([1.0] * 3, [1.0] * 4) == 0.5


def test_hand_computed_with_ties():
    m, n = [3.0, 2.0, 2.0], [2.0, 1.0]
    fpr, tpr, thr = metrics.roc_curve(m, n)
    np.testing.assert_allclose(fpr, [0, 0, 0.5, 1])
    np.testing.assert_allclose(tpr, [0, 1 / 3, 1, 1])
    assert thr[0] == np.inf and list(thr[1:]) == [3.0, 2.0, 1.0]
    # 6 pairs: (3,2) (3,1) (2,1) (2,1) win, the two (2,2) ties count 1/2 -> 5/6.
    assert metrics.auc(m, n) == pytest.approx(5 / 6)
    assert metrics.tpr_at_fpr(m, n, 0.0) == pytest.approx(1 / 3)
    assert metrics.tpr_at_fpr(m, n, 0.49) == pytest.approx(1 / 3)
    assert metrics.tpr_at_fpr(m, n, 0.5) == 1.0
    assert metrics.balanced_accuracy(m, n) == pytest.approx(0.75)
    assert metrics.loss_gap([1.0, 2.0], [4.0]) == pytest.approx(2.5)


def test_fpr_bound_is_inclusive_at_exact_multiples():
    # 100 non-members: FPR = 1/100 exactly must count as <= 1%.
    n = np.arange(100.0)
    m = np.array([99.5, 98.5])  # above all non-members / above all but the top one
    assert metrics.tpr_at_fpr(m, n, 0.01) == 1.0
    assert metrics.tpr_at_fpr(m, n, 0.001) == 0.5
    assert metrics.tpr_at_fpr(m[1:], n, 0.001) == 0.0


def test_agrees_with_sklearn_on_tied_random_scores():
    rng = np.random.default_rng(0)
    m = rng.integers(0, 8, 300).astype(float) + 0.5 * rng.integers(0, 2, 300)
    n = rng.integers(0, 7, 250).astype(float)
    y = np.r_[np.ones(m.size), np.zeros(n.size)]
    s = np.r_[m, n]
    assert metrics.auc(m, n) == pytest.approx(roc_auc_score(y, s), abs=1e-12)
    fpr, tpr, _ = metrics.roc_curve(m, n)
    sk_fpr, sk_tpr, _ = sk_roc_curve(y, s, drop_intermediate=False)
    np.testing.assert_allclose(fpr, sk_fpr)
    np.testing.assert_allclose(tpr, sk_tpr)


def test_bootstrap_is_seeded_and_covers_the_estimate():
    rng = np.random.default_rng(1)
    m, n = rng.normal(0.5, 1, 200), rng.normal(0, 1, 200)
    a = metrics.evaluate(m, n, n_bootstrap=200, seed=3)
    b = metrics.evaluate(m, n, n_bootstrap=200, seed=3)
    assert a["ci"] == b["ci"]
    lo, hi = a["ci"]["auc"]
    assert lo < a["auc"] < hi and hi - lo < 0.2
    lo, hi = metrics.bootstrap_ci(metrics.auc, m, n, n_bootstrap=100)
    assert lo < hi


def test_bad_scores():
    with pytest.raises(ValueError, match="at least one member"):
        metrics.auc([], [1.0])
    with pytest.raises(ValueError, match="NaN"):
        metrics.auc([np.nan], [1.0])
