"""One-run (Steinke, Nasr & Jagielski 2023) and Clopper-Pearson ε lower bounds."""

import numpy as np
import pytest

from mia import canaries


def test_one_run_reference_value():
    # m = 1000 canaries, 100 guesses all correct, δ = 1e-5, 95% confidence -> ε >= 3.47.
    eps = canaries.epsilon_lower_bound(m=1000, r=100, v=100, delta=1e-5, confidence=0.95)
    assert eps == pytest.approx(3.47, abs=0.05)
    # Pure DP: 0.05 = q^100 exactly, so the bound is logit(0.05 ** 0.01).
    q = 0.05 ** 0.01
    pure = canaries.epsilon_lower_bound(m=1000, r=100, v=100, delta=0.0)
    assert pure == pytest.approx(np.log(q / (1 - q)), abs=1e-4)
    assert pure > eps  # δ > 0 can only weaken the bound


def test_one_run_monotone_and_chance():
    bounds = [canaries.epsilon_lower_bound(m=1000, r=100, v=v, delta=1e-5) for v in range(50, 101)]
    assert all(b2 >= b1 for b1, b2 in zip(bounds, bounds[1:]))
    assert bounds[0] == 0.0  # 50% correct is chance
    assert canaries.epsilon_lower_bound(m=1000, r=100, v=0, delta=1e-5) == 0.0


def test_p_value_is_a_binomial_tail_without_delta():
    from scipy.stats import binom
    p = canaries.one_run_p_value(m=100, r=20, v=15, epsilon=1.0, delta=0.0)
    assert p == pytest.approx(binom.sf(14, 20, np.exp(1) / (1 + np.exp(1))))
    with pytest.raises(ValueError):
        canaries.one_run_p_value(m=10, r=20, v=5, epsilon=1.0, delta=0.0)


def test_optimised_over_guesses_and_selection_modes():
    rng = np.random.default_rng(0)
    included = rng.random(1000) < 0.5
    scores = 3.0 * included + rng.normal(size=1000)
    valid = canaries.one_run_epsilon(scores, included, delta=1e-5, selection="bonferroni")
    optimistic = canaries.one_run_epsilon(scores, included, delta=1e-5, selection="none")
    split = canaries.one_run_epsilon(scores, included, delta=1e-5, selection="split")
    assert 0 < valid["epsilon_lower"] < optimistic["epsilon_lower"]
    assert split["m"] == 500 and split["epsilon_lower"] > 0
    assert valid["per_test_confidence"] > 0.95
    # Scores unrelated to inclusion give (nearly always) no evidence at all.
    noise = canaries.one_run_epsilon(rng.normal(size=1000), included, delta=1e-5)
    assert noise["epsilon_lower"] < 0.3


def test_clopper_pearson_bound():
    included = np.r_[np.ones(500, bool), np.zeros(500, bool)]
    perfect = canaries.clopper_pearson_epsilon(np.r_[np.ones(500), np.zeros(500)], included,
                                               delta=1e-5, selection="none")
    # FPR = 0 and FNR = 0 of 500: CP upper limit 1 - (β/2)^(1/500) for both.
    u = 1 - (0.025) ** (1 / 500)
    assert perfect["epsilon_lower"] == pytest.approx(np.log((1 - 1e-5 - u) / u), rel=1e-6)
    corrected = canaries.clopper_pearson_epsilon(np.r_[np.ones(500), np.zeros(500)], included,
                                                 delta=1e-5)
    assert corrected["epsilon_lower"] <= perfect["epsilon_lower"]
    rng = np.random.default_rng(0)
    assert canaries.clopper_pearson_epsilon(rng.normal(size=1000), included,
                                            delta=1e-5)["epsilon_lower"] < 0.3
