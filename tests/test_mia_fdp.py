"""The f-DP one-run bound (mia.fdp) against exact computations and simulated mechanisms."""

import math

import numpy as np
import pytest
from scipy.optimize import linprog
from scipy.special import expit
from scipy.stats import binom

from mia import canaries, fdp


def exact_p_max(m, k, c, eps, delta, one_sided):
    """Largest P[C >= c] over all laws of C that satisfy the (ε, δ) f-DP constraints, by LP.

    The (ε, δ) trade-off curve is piecewise linear, so the constraints of the mia.fdp argument are
    exactly linear in p_j = P[C = j]; the LP optimum is the exact answer the recursion must reach.
    """
    n, e = k + 1, math.exp(eps)
    j = np.arange(n)
    A, b = [], []
    for i in range(1, k + 1):
        R = np.where(j >= i, j / m, 0.0)
        H = np.where(j >= i - 1, (k - j) / m, 0.0)
        s = 2.0 if one_sided else 1.0  # one-sided: 2 r_i <= F(2 h); two-sided: r_i <= F(h)
        A += [s * R, s * R - s * e * H, s * R - s / e * H]
        b += [1.0, delta, 1.0 - (1.0 - delta) / e]
    res = linprog(-(j >= c).astype(float), A_ub=np.array(A), b_ub=np.array(b), A_eq=np.ones((1, n)),
                  b_eq=[1.0], bounds=[(0, None)] * n)
    assert res.success
    return -res.fun


@pytest.mark.parametrize("m,k,eps,delta", [(10, 4, 1.0, 0.0), (10, 4, 1.0, 0.05), (20, 10, 0.5, 0.01),
                                           (30, 6, 2.0, 1e-3), (12, 12, 1.0, 0.02)])
def test_recursion_matches_the_exact_optimum(m, k, eps, delta):
    for c in range(k + 1):
        for one_sided in (True, False):
            exact = exact_p_max(m, k, c, eps, delta, one_sided)
            ours = fdp.p_value(m=m, k=k, c=c, family="epsdelta", theta=eps, delta=delta, one_sided=one_sided)
            assert ours >= exact - 1e-7  # never below the exact worst case: the bound is valid
            assert ours <= exact + 1e-3  # and not needlessly loose (seen: equal to 1e-6 but m = k)


def test_pure_dp_worst_case_is_randomized_response():
    # Randomized response at ε guessed on k << m canaries: C ~ Binomial(k, e^ε/(1+e^ε)) is achievable,
    # so the bound can never be below that tail; at c = k it equals it.
    for m, k, eps in [(200, 10, 1.0), (500, 20, 2.0), (1000, 100, 3.0)]:
        for c in range(k // 2, k + 1):
            tail = binom.sf(c - 1, k, expit(eps))
            p = fdp.p_value(m=m, k=k, c=c, family="epsdelta", theta=eps)
            assert p >= tail * (1 - 1e-6)
        assert p == pytest.approx(tail, rel=1e-6)


def test_gaussian_mechanism_never_beats_the_gdp_bound():
    # Each canary's score is N(μ·included, 1) independently: a μ-GDP mechanism. Top-k guessing.
    rng = np.random.default_rng(0)
    n = 20000
    for m, k, mu in [(40, 8, 2.0), (40, 20, 1.5), (200, 10, 3.0)]:
        inc = rng.random((n, m)) < 0.5
        top = np.argsort(-(rng.normal(size=(n, m)) + mu * inc), axis=1)[:, :k]
        correct = np.take_along_axis(inc, top, axis=1).sum(1)
        for c in range(k // 2, k + 1):
            freq = (correct >= c).mean()
            bound = fdp.p_value(m=m, k=k, c=c, family="gdp", theta=mu)
            assert freq <= bound + 4 * math.sqrt(max(freq * (1 - freq), 1e-4) / n)


def test_bound_is_monotone_and_reference_values():
    b = [fdp.lower_bound(m=1000, k=100, c=c, delta=1e-5) for c in range(50, 101, 5)]
    assert all(y >= x for x, y in zip(b, b[1:])) and b[0] == 0.0
    assert fdp.lower_bound(m=1000, k=100, c=100, delta=1e-5) == pytest.approx(3.49, abs=0.01)
    # The older ε-DP analysis (Steinke et al.) from the same guesses: about the same for ε,
    # while GDP reads far more from them.
    assert canaries.epsilon_lower_bound(m=1000, r=100, v=100, delta=1e-5) == pytest.approx(3.47, abs=0.02)
    mu = fdp.lower_bound(m=1000, k=100, c=100, family="gdp", delta=1e-5)
    assert fdp.gdp_epsilon(mu, 1e-5) > 4


def test_gdp_epsilon_conversion():
    for mu in (0.5, 1.0, 3.0):
        eps = fdp.gdp_epsilon(mu, 1e-5)
        assert fdp.gdp_delta(mu, eps) == pytest.approx(1e-5, rel=1e-5)
    assert fdp.gdp_epsilon(1.0, 1e-5) == pytest.approx(4.377, abs=1e-3)
    assert fdp.gdp_epsilon(0.0, 1e-5) == 0.0


def test_one_run_audit_power_and_null():
    inc = np.random.default_rng(1).random(1000) < 0.5
    perfect = canaries.one_run_audit(inc.astype(float), inc, delta=1e-5)
    assert perfect["epsilon_lower"] > 4.0 and perfect["correct"] == perfect["k"]
    assert perfect["per_test_confidence"] == pytest.approx(1 - 0.05 / (2 * len(perfect["grid"])))
    # Scores that ignore the coins: a valid 95% bound is 0 in (nearly) every one of 20 draws.
    rng = np.random.default_rng(2)
    zeros = sum(canaries.one_run_audit(rng.normal(size=1000), inc, delta=1e-5)["epsilon_lower"] == 0
                for _ in range(20))
    assert zeros >= 18
    with pytest.raises(ValueError, match="family"):
        canaries.one_run_audit(inc.astype(float), inc, delta=1e-5, family="rdp")
