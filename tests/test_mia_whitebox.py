"""White-box one-run audit (mia.whitebox): real DP-SGD through dpllm's engine with Dirac canaries."""

import numpy as np
import pytest

from mia.whitebox import score_updates, whitebox_audit


def test_dp_run_stays_under_its_epsilon_and_the_audit_has_power():
    rep = whitebox_audit(m=1000, num_records=100, steps=20, sample_rate=0.2, target_epsilon=8.0, seed=0)
    assert rep["accountant_epsilon"] == pytest.approx(8.0, abs=0.05)
    assert not rep["privacy_bug"]
    assert 0.8 < rep["epsilon_lower"] <= rep["accountant_epsilon"]  # seen: 1.6
    # The canaries' coordinates carry exactly the engine's noise: the summed noisy coordinate of an
    # excluded canary is N(0, σ² T) in units of C.
    sums = np.asarray(rep["scores_sum"])[~np.asarray(rep["included"])]
    assert np.std(sums) == pytest.approx(rep["noise_multiplier"] * np.sqrt(rep["steps"]), rel=0.1)


def test_no_noise_run_is_caught():
    # σ = 1e-3: every sampled included canary stands out; the bound must be large.
    rep = whitebox_audit(m=1000, num_records=100, steps=20, sample_rate=0.2, target_epsilon=None,
                         noise_multiplier=1e-3, seed=1)
    assert rep["epsilon_lower"] > 4.0  # seen: 4.5 (1000 canaries cap the bound near 4.5)
    assert rep["accountant_epsilon"] > 100


def test_scores():
    x = np.array([[1.0, 0.0], [1.0, 0.0]])
    lr = score_updates(x, q=0.5, sigma=1.0)
    assert lr[0] > lr[1]
    with pytest.raises(ValueError, match="score"):
        score_updates(x, q=0.5, sigma=1.0, kind="max")
