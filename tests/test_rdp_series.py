"""The RDP stand-in (dpllm/privacy/rdp_series.py): Opacus's RDP series summed as arrays, searched with by RDP
calibration, whose σ is still decided by Opacus's own ε."""

from __future__ import annotations

import doctest
import warnings

import numpy as np
import pytest

from dpllm.privacy import accounting, rdp_series
from dpllm.privacy.schedule import NoiseSchedule, calibrate


def test_doctests():
    assert doctest.testmod(rdp_series).failed == 0


@pytest.mark.parametrize("sigma, q", [(0.5963, 16 / 92), (0.837, 0.11), (1.352, 0.0011), (5.192, 0.41),
                                      (7.322, 0.85), (2.0, 1.0), (0.9, 0.0)])
def test_each_order_is_opacus_compute_rdp(sigma, q):
    from opacus.accountants.analysis.rdp import compute_rdp
    from opacus.accountants.rdp import RDPAccountant

    theirs = np.asarray(compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=RDPAccountant.DEFAULT_ALPHAS))
    assert list(rdp_series.ORDERS) == RDPAccountant.DEFAULT_ALPHAS
    # the series cancels (A ≈ 1 from far larger terms): both sums round; 1e-7 is ~10× the largest gap seen
    assert np.allclose(rdp_series.rdp_of_one_step(sigma, q), theirs, rtol=1e-9, atol=1e-7)


def test_epsilon_is_opacus_rdp_accountant_to_float_rounding():
    histories = [[(1.0, 0.16, 140)], [(0.6, 0.17, 2)], [(1.5, 0.05, 30), (2.0, 0.05, 10), (1.5, 0.1, 5)],
                 [(0.55, 0.42, 2000)], [(3.0, 0.2, 0)]]
    for history in histories:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs = accounting.compute_epsilon_history(history=history, delta=1e-5, accountant="rdp")
        assert rdp_series.rdp_epsilon(history=history, delta=1e-5) == pytest.approx(theirs, rel=1e-7, abs=1e-12)


def _grid_search(history_of, target, delta):
    """The σ a bisection over Opacus's ε alone finds (what calibrate_noise returned before the stand-in)."""
    def eps(sigma):
        return accounting.compute_epsilon_history(history=history_of(sigma), delta=delta, accountant="rdp")

    return accounting.smallest_grid_noise(eps, target, digits=accounting.SIGMA_DIGITS,
                                          unreachable=lambda: accounting.PrivacyPlanError("unreachable"))


# plans whose σ is above 1, where Opacus's series is short: the reference bisection evaluates ~18 σ
@pytest.mark.parametrize("target, q, steps, delta, prior", [
    (0.8, 0.02, 300, 1e-6, []),
    (3.0, 0.05, 40, 1e-5, [(1.2, 0.1, 20)]),  # after an earlier stage
    (1.0, 1.0, 5, 1e-5, []),                 # every record in every step: no subsampling
])
def test_calibration_returns_what_the_search_over_opacus_epsilon_returns(target, q, steps, delta, prior):
    accounting._rdp_of_one_step.cache_clear()
    sigma = accounting.calibrate_noise(target_epsilon=target, delta=delta, sample_rate=q, steps=steps,
                                       accountant="rdp", prior_history=prior)
    assert accounting._rdp_of_one_step.cache_info().misses <= 2 + len(prior)  # the answer, the point below, the prior
    assert sigma == _grid_search(lambda s: prior + [(s, q, steps)], target, delta)


@pytest.mark.parametrize("target, q, steps, prior", [(0.8, 0.02, 300, []), (3.0, 0.05, 40, [(1.2, 0.1, 20)])])
def test_a_calibration_to_a_tolerance_searches_with_the_stand_in_and_meets_the_target_by_opacus(target, q, steps,
                                                                                                  prior):
    # the scaling planner's screen: σ within 0.05 of ε under the target, unrounded; before, every bisection step was
    # an Opacus evaluation (~20 per (batch, steps) of the plan's grid)
    accounting._rdp_of_one_step.cache_clear()
    sigma = accounting.calibrate_noise(target_epsilon=target, delta=1e-5, sample_rate=q, steps=steps,
                                       accountant="rdp", prior_history=prior, epsilon_tolerance=0.05)
    assert accounting._rdp_of_one_step.cache_info().misses <= 1 + len(prior)  # the answer's check and the prior

    def opacus(s):
        return accounting.compute_epsilon_history(history=prior + [(s, q, steps)], delta=1e-5, accountant="rdp")

    assert target - 0.05 <= opacus(sigma) <= target
    reference = accounting.smallest_noise(opacus, target, epsilon_tolerance=0.05,
                                          unreachable=lambda: accounting.PrivacyPlanError("unreachable"))
    assert sigma == pytest.approx(reference, rel=1e-5)  # the same bisection, unless rounding flips a comparison


def test_a_stand_in_that_reads_low_cannot_make_a_calibration_miss_its_target(monkeypatch):
    # a stand-in 10% under Opacus's ε (far beyond the float rounding it has): the answer it finds misses the target by
    # Opacus's ε, and the calibration steps σ up until Opacus's ε meets it
    def opacus(sigma):
        return accounting.compute_epsilon_history(history=[(sigma, 0.02, 300)], delta=1e-5, accountant="rdp")

    monkeypatch.setattr(accounting, "rdp_stand_in", lambda history_of, delta: lambda s: 0.9 * opacus(s))
    found = accounting.smallest_noise(lambda s: 0.9 * opacus(s), 1.0, epsilon_tolerance=0.05, unreachable=None)
    assert opacus(found) > 1.0  # what the stand-in alone would return
    sigma = accounting.calibrate_noise(target_epsilon=1.0, delta=1e-5, sample_rate=0.02, steps=300, accountant="rdp",
                                       epsilon_tolerance=0.05)
    assert sigma > found and 0.8 <= opacus(sigma) <= 1.0  # met, and the doubling steps overshot by little


def test_a_schedule_calibrates_as_the_search_over_opacus_epsilon_does():
    s = NoiseSchedule(kind="linear", end=0.5, pieces=3)
    sigma0 = calibrate(s, target_epsilon=1.0, delta=1e-5, sample_rate=0.05, steps=60, accountant="rdp")
    assert sigma0 == _grid_search(lambda s0: s.history(s0, 0.05, 60), 1.0, 1e-5)
