"""One DP-SGD step for a group of k Poisson-sampled records, as dp-accounting builds it, without its slow inversion.

A user of at most k records under record-level sampling (ELS, ``user_sampling: record``) is protected by the
mixture-of-Gaussians mechanism: J ~ Bin(k, q) of its records are sampled, so the step's output is dominated by
Σⱼ P(J = j)·N(j·C, σ²C²) against N(0, σ²C²) (see :mod:`dpllm.privacy.user_level`). dp-accounting's
``from_mixture_gaussian_mechanism`` builds its privacy loss distribution (PLD) by inverting the privacy loss
at every point of the loss grid. It does that by one shared binary search, recursive and one scalar privacy loss
per tree node: ~130,000 Python calls per adjacency at k = 4 (2.5 s), ~9 s at k = 16, most of a user-level
calibration's time.

:func:`mixture_pld` builds the same PLD through dp-accounting's own classes, with one change: the binary search
runs over every grid point at once (numpy arrays, one privacy-loss evaluation per level of the search, ~30 in
all). Every grid point walks the same path as in the recursive search: the same midpoints ((lo + hi)/2 of the
same floats), the same comparison with the loss there, the same stopping width and the same rounding of the
result up to the grid of ``precision``. So it returns the smallest multiple of ``precision`` whose privacy loss
is at most the target, as dp-accounting's does, and the PLD keeps its pessimistic (upper-bound) discretisation.
``tests/test_mixture_pld.py`` checks the inverses and ε against dp-accounting's own construction.

Example:
    >>> pld = mixture_pld(sigma=1.0, sample_rate=0.1, group_size=3)
    >>> round(pld.self_compose(10).get_epsilon_for_delta(1e-5), 1)
    9.8
"""

from __future__ import annotations

import functools

import numpy as np

# The PLD's loss grid for k > 1: ε moves by ~0.1% from 1e-3's, always upward (pessimistic rounding).
DISCRETIZATION = 1e-2


def _privacy_losses(loss, x: np.ndarray) -> np.ndarray:
    """``loss.privacy_loss`` at every point of ``x`` (the library's scalar formula, one row per point)."""
    from dp_accounting.pld.privacy_loss_mechanism import AdjacencyType

    x_loss = np.asarray(loss.sensitivities)[None, :] * x[:, None] / loss._variance
    if loss.adjacency_type == AdjacencyType.ADD:
        return -np.logaddexp.reduce(loss._precompute_privacy_loss_constants[None, :] + x_loss, axis=1)
    return np.logaddexp.reduce(loss._precompute_privacy_loss_constants[None, :] - x_loss, axis=1)


def inverse_with_range(loss, privacy_losses: np.ndarray, bounds: tuple[float, float],
                       precision: float = 1e-6) -> np.ndarray:
    """For each target in ``privacy_losses``, the smallest multiple of ``precision`` in ``bounds`` whose privacy
    loss under ``loss`` (a dp-accounting ``MixtureGaussianPrivacyLoss``) is at most the target: the library's
    recursive binary search, run for every target at once."""
    targets = np.asarray(privacy_losses, dtype=np.float64)
    lo = np.full(targets.shape, float(bounds[0]))
    hi = np.full(targets.shape, float(bounds[1]))
    active = hi - lo > precision
    while active.any():
        idx = np.flatnonzero(active)
        mid = (lo[idx] + hi[idx]) / 2
        below = targets[idx] < _privacy_losses(loss, mid)  # the loss falls as x grows: the answer is above mid
        lo[idx[below]] = mid[below]
        hi[idx[~below]] = mid[~below]
        active[idx] = hi[idx] - lo[idx] > precision
    return np.floor(hi / precision) * precision


@functools.lru_cache(maxsize=1)
def _fast_loss_class():
    from dp_accounting.pld.privacy_loss_mechanism import MixtureGaussianPrivacyLoss

    class FastMixtureGaussianPrivacyLoss(MixtureGaussianPrivacyLoss):
        """dp-accounting's mixture privacy loss; its grid inversion searches every point at once."""

        def _inverse_privacy_losses_with_range(self, privacy_losses, bounds, precision=1e-6):
            if len(privacy_losses) == 0:
                return []
            return inverse_with_range(self, privacy_losses, bounds, precision)

    return FastMixtureGaussianPrivacyLoss


def step_probabilities(sample_rate: float, group_size: int) -> list[float]:
    """P(J = j), j = 0..k: how many of a user's k records one Poisson draw at ``sample_rate`` takes."""
    from scipy.stats import binom

    k = int(group_size)
    return [float(binom.pmf(j, k, float(sample_rate))) for j in range(k + 1)]


@functools.lru_cache(maxsize=64)
def mixture_pld(*, sigma: float, sample_rate: float, group_size: int, discretization: float = DISCRETIZATION):
    """dp-accounting's PLD (both adjacencies, pessimistic, connect-the-dots) of one DP-SGD step at noise
    multiplier ``sigma`` and sampling rate ``sample_rate`` for a group of ``group_size`` records: the
    mixture Σⱼ P(J = j)·N(j, σ²) against N(0, σ²), J ~ Bin(k, q)."""
    from dp_accounting.pld import privacy_loss_distribution as pld_lib
    from dp_accounting.pld.privacy_loss_mechanism import AdjacencyType

    k = int(group_size)
    sensitivities, probs = [float(j) for j in range(k + 1)], step_probabilities(sample_rate, k)
    fast = _fast_loss_class()

    def pmf(adjacency):
        loss = fast(float(sigma), sensitivities, probs, pessimistic_estimate=True, log_mass_truncation_bound=-50,
                    adjacency_type=adjacency)
        return pld_lib._create_pld_pmf_from_monotone_privacy_loss(
            loss, pessimistic_estimate=True, value_discretization_interval=float(discretization),
            use_connect_dots=True)

    return pld_lib.PrivacyLossDistribution(pmf(AdjacencyType.REMOVE), pmf(AdjacencyType.ADD))
