"""dpllm.privacy.mixture: dp-accounting's mixture-of-Gaussians PLD with its grid inversion run for all points at
once gives what dp-accounting's own recursive construction gives (the user-level ε rests on it)."""

import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution
from dp_accounting.pld.privacy_loss_mechanism import AdjacencyType, MixtureGaussianPrivacyLoss

from dpllm.privacy.mixture import inverse_with_range, mixture_pld, step_probabilities

CASES = [(1.0, 0.05, 4), (0.7, 0.2, 3), (2.0, 0.01, 16)]


def stock_loss(sigma, q, k, adjacency):
    return MixtureGaussianPrivacyLoss(sigma, [float(j) for j in range(k + 1)], step_probabilities(q, k),
                                      adjacency_type=adjacency)


@pytest.mark.parametrize("adjacency", [AdjacencyType.REMOVE, AdjacencyType.ADD])
@pytest.mark.parametrize("sigma, q, k", CASES)
def test_each_inverse_lies_where_dp_accounting_s_search_puts_it(sigma, q, k, adjacency):
    loss = stock_loss(sigma, q, k, adjacency)
    precision, bounds = 1e-6, (-30.0, 30.0)
    lo, hi = float(loss.privacy_loss(bounds[1])), float(loss.privacy_loss(bounds[0]))  # the loss falls in x
    targets = np.sort(np.random.default_rng(0).uniform(lo, hi, 400))
    ours = inverse_with_range(loss, targets, bounds, precision)
    theirs = loss._inverse_privacy_losses_with_range(targets, bounds, precision)
    assert np.abs(ours - theirs).max() <= precision * 1.01  # the same walk (a tie at a midpoint: one step apart)
    assert np.mean(ours == theirs) > 0.99
    steps = ours / precision
    assert np.allclose(steps, np.round(steps), atol=1e-6)  # on the grid
    after = np.array([loss.privacy_loss(x + precision) for x in ours])
    before = np.array([loss.privacy_loss(x - precision) for x in ours])
    assert (after <= targets + 1e-12).all() and (before > targets - 1e-12).all()  # within a grid step of the inverse


@pytest.mark.parametrize("sigma, q, k", CASES)
def test_epsilon_and_delta_equal_dp_accounting_mixture_mechanism(sigma, q, k):
    ours = mixture_pld(sigma=sigma, sample_rate=q, group_size=k)
    theirs = privacy_loss_distribution.from_mixture_gaussian_mechanism(
        standard_deviation=sigma, sensitivities=[float(j) for j in range(k + 1)],
        sampling_probs=step_probabilities(q, k), value_discretization_interval=1e-2)
    for steps in (1, 60):
        a, b = ours.self_compose(steps), theirs.self_compose(steps)
        for delta in (1e-3, 1e-6):
            assert a.get_epsilon_for_delta(delta) == pytest.approx(b.get_epsilon_for_delta(delta), rel=1e-9)
        assert a.get_delta_for_epsilon(2.0) == pytest.approx(b.get_delta_for_epsilon(2.0), rel=1e-9, abs=1e-15)


def test_one_record_per_user_is_the_subsampled_gaussian():
    """k = 1 is the Poisson-subsampled Gaussian: dp-accounting's closed-form PLD of it, on the same grid."""
    sigma, q, steps = 1.1, 0.05, 100
    ours = mixture_pld(sigma=sigma, sample_rate=q, group_size=1).self_compose(steps)
    closed = privacy_loss_distribution.from_gaussian_mechanism(
        sigma, sampling_prob=q, value_discretization_interval=1e-2).self_compose(steps)
    assert ours.get_epsilon_for_delta(1e-5) == pytest.approx(closed.get_epsilon_for_delta(1e-5), rel=2e-3)


def test_module_example_holds():
    import doctest

    from dpllm.privacy import mixture

    result = doctest.testmod(mixture)
    assert result.attempted >= 1 and result.failed == 0
