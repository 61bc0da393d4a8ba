"""Privacy accounting: thin, explicit wrappers over Opacus's accountants.

Every ε that dpllm prints goes through :func:`compute_epsilon`, which builds a fresh Opacus accountant
from the recorded ``(noise_multiplier, sample_rate, steps)`` history. Nothing here re-implements an
accountant; this module only picks one, validates its inputs, and keeps calibration and reporting on
the same accountant (Opacus's ``get_noise_multiplier`` defaults to RDP even when the engine uses PRV).

Example:
    >>> round(compute_epsilon(noise_multiplier=1.0, sample_rate=0.16, steps=140, delta=1e-5,
    ...                       accountant="rdp"), 2)
    15.09
"""

from __future__ import annotations

import math
import warnings
from typing import Callable, Iterable, Sequence

import numpy as np
from opacus.accountants import create_accountant
from opacus.accountants.utils import get_noise_multiplier

ACCOUNTANTS = ("prv", "rdp", "gdp")
# Opacus gives up above this noise multiplier; anything needing more is an impossible plan.
MAX_NOISE_MULTIPLIER = 1e6
# Above this RDP ε the PRV accountant is not tried: its discretisation domain grows with ε (at σ = 0.1,
# q = 1/7, 140 steps it works for about a minute, then returns inf), and ε this large says "no privacy"
# whichever accountant computes it. The RDP bound is reported instead.
PRV_SKIP_ABOVE = 1000.0

History = Sequence[tuple[float, float, int]]


class PrivacyPlanError(ValueError):
    """A privacy plan that cannot be met (unreachable ε, bad δ, empty data...)."""


def check_accountant(accountant: str) -> str:
    if accountant not in ACCOUNTANTS:
        raise PrivacyPlanError(
            f"accountant={accountant!r} is not known; choose one of {', '.join(ACCOUNTANTS)}"
        )
    return accountant


def check_delta(delta: float, num_records: int) -> None:
    """Refuse δ ≥ 1/N: such a δ allows releasing a whole record with non-negligible probability.

    Raises:
        PrivacyPlanError: if ``num_records`` is not positive or ``delta`` is not in (0, 1/N).
    """
    if num_records <= 0:
        raise PrivacyPlanError(f"num_records={num_records}: the private dataset is empty")
    if not (0.0 < delta < 1.0 / num_records):
        raise PrivacyPlanError(
            f"target_delta={delta:g} must be in (0, 1/N) = (0, {1.0 / num_records:.3g}) for "
            f"N={num_records:,} records; use e.g. delta={_suggest_delta(num_records):g}"
        )


def _suggest_delta(num_records: int) -> float:
    """A conventional δ: the power of ten at or below 1/(10·N)."""
    return 10.0 ** math.floor(math.log10(1.0 / (10 * num_records)))


def _epsilon_of(accountant: str, history: History, delta: float) -> float:
    acc = create_accountant(mechanism=accountant)
    acc.history = [(float(s), float(q), int(t)) for s, q, t in history if int(t) > 0]
    if not acc.history:
        return 0.0
    if accountant == "prv" and any(q >= 1 for _, q, _ in acc.history):
        # q = 1 (a batch of every record): Opacus's subsampled-Gaussian PRV takes log(1 - q) = -inf, the exact
        # limit its formula needs (it then is the plain Gaussian's), and numpy warns once per evaluation.
        with np.errstate(divide="ignore"):
            return float(acc.get_epsilon(delta=delta))
    return float(acc.get_epsilon(delta=delta))


def compute_epsilon_history(*, history: History, delta: float, accountant: str = "prv") -> float:
    """ε after composing every ``(noise_multiplier, sample_rate, steps)`` entry of ``history``.

    ``gdp`` (Opacus's Gaussian-DP accountant) is a central-limit approximation, not an upper bound, so
    for it the larger of its ε and the RDP ε is returned: dpllm never under-reports.
    PRV is numerically an upper bound (Opacus returns ``eps_upper``); when the PRV discretisation fails
    (extreme σ or tiny step counts) the RDP bound, also rigorous, is returned instead, with a warning.
    """
    check_accountant(accountant)
    if any(s <= 0 for s, _, _ in history):
        return math.inf
    if accountant == "gdp":
        rdp = _epsilon_of("rdp", history, delta)
        try:
            return max(_epsilon_of("gdp", history, delta), rdp)
        except Exception as err:  # Opacus's GDP root-finding fails in some (σ, q) regions
            warnings.warn(f"GDP accountant failed ({err}); reporting the RDP bound instead")
            return rdp
    if accountant == "prv":
        with warnings.catch_warnings():  # a screening bound: its "optimal order" notes are not for the user
            warnings.simplefilter("ignore")
            rdp = _epsilon_of("rdp", history, delta)
        if rdp > PRV_SKIP_ABOVE:
            # PRV's discretisation takes minutes and overflows out here; RDP is a valid bound too.
            return rdp
        try:
            eps = _epsilon_of("prv", history, delta)
            if math.isfinite(eps):
                return eps
        except Exception as err:  # PRV's numeric domain can fail where RDP does not
            warnings.warn(f"PRV accountant failed ({err}); reporting the RDP bound instead")
        return rdp
    return _epsilon_of(accountant, history, delta)


def compute_epsilon(
    *, noise_multiplier: float, sample_rate: float, steps: int, delta: float, accountant: str = "prv"
) -> float:
    """ε of ``steps`` Poisson-subsampled Gaussian steps at rate ``sample_rate`` and noise ``noise_multiplier``."""
    return compute_epsilon_history(
        history=[(noise_multiplier, sample_rate, steps)], delta=delta, accountant=accountant
    )


def calibrate_noise(
    *,
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = "prv",
    prior_history: Iterable[tuple[float, float, int]] = (),
    epsilon_tolerance: float = 0.01,
) -> float:
    """Smallest noise multiplier (to ``epsilon_tolerance``) whose ε, composed after ``prior_history``, is ≤ target.

    The search runs the same accountant :func:`compute_epsilon_history` reports with, so the reported ε
    lands at or just under ``target_epsilon``.

    Raises:
        PrivacyPlanError: if the target cannot be met with σ ≤ 1e6 (e.g. too many steps, too high a
            sampling rate, or a prior stage already spent the budget).
    """
    check_accountant(accountant)
    if target_epsilon <= 0:
        raise PrivacyPlanError(f"target_epsilon={target_epsilon} must be positive")
    if not (0 < sample_rate <= 1):
        raise PrivacyPlanError(f"sample_rate={sample_rate} must be in (0, 1]")
    if steps <= 0:
        raise PrivacyPlanError(f"steps={steps} must be positive")
    prior = list(prior_history)

    def eps(sigma: float) -> float:
        return compute_epsilon_history(
            history=prior + [(sigma, sample_rate, steps)], delta=delta, accountant=accountant
        )

    if prior and compute_epsilon_history(history=prior, delta=delta, accountant=accountant) >= target_epsilon:
        raise PrivacyPlanError(
            f"earlier stages already spent ε ≥ target_epsilon={target_epsilon}; raise the target"
        )
    if not prior and accountant == "rdp":
        # Opacus's own bisection; same accountant, same result shape.
        try:
            return float(
                get_noise_multiplier(
                    target_epsilon=target_epsilon, target_delta=delta, sample_rate=sample_rate,
                    steps=steps, accountant=accountant, epsilon_tolerance=epsilon_tolerance,
                )
            )
        except ValueError as err:
            raise _unreachable(target_epsilon, delta, sample_rate, steps) from err

    lo, hi = 0.0, 1.0
    if accountant != "rdp" and not prior:
        # Bracket with the fast RDP calibration: at equal σ PRV's ε is (in practice) below RDP's and the
        # reported GDP ε is max(GDP, RDP), so σ_RDP is an upper bracket. It is checked, never assumed:
        # the loop below doubles σ while ε(σ) > target.
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                sigma_rdp = calibrate_noise(target_epsilon=target_epsilon, delta=delta, sample_rate=sample_rate,
                                            steps=steps, accountant="rdp", epsilon_tolerance=epsilon_tolerance)
            hi = sigma_rdp
            if eps(hi / 2) > target_epsilon:
                lo = hi / 2
        except PrivacyPlanError:
            pass
    return smallest_noise(eps, target_epsilon, lo=lo, hi=hi, epsilon_tolerance=epsilon_tolerance,
                          unreachable=lambda: _unreachable(target_epsilon, delta, sample_rate, steps))


def smallest_noise(eps: Callable[[float], float], target_epsilon: float, *, epsilon_tolerance: float,
                   unreachable: Callable[[], Exception], lo: float = 0.0, hi: float = 1.0,
                   max_sigma: float = MAX_NOISE_MULTIPLIER) -> float:
    """Smallest σ with ``eps(σ) <= target_epsilon``, to within ``epsilon_tolerance`` of the target (or a
    relative 1e-6 in σ), for ``eps`` decreasing in σ: double ``hi`` until it meets the target, then bisect
    keeping ``hi`` on the meeting side. The returned σ always meets the target.

    Raises:
        the exception ``unreachable()`` builds, when σ above ``max_sigma`` would be needed.
    """
    eps_hi = eps(hi)
    while eps_hi > target_epsilon:
        lo, hi = hi, 2 * hi
        if hi > max_sigma:
            raise unreachable()
        eps_hi = eps(hi)
    while target_epsilon - eps_hi > epsilon_tolerance and hi - lo > 1e-6 * hi:
        mid = (lo + hi) / 2
        e = eps(mid)
        if e <= target_epsilon:
            hi, eps_hi = mid, e
        else:
            lo = mid
    return hi


def _unreachable(target_epsilon: float, delta: float, sample_rate: float, steps: int) -> PrivacyPlanError:
    return PrivacyPlanError(
        f"target_epsilon={target_epsilon} cannot be met at delta={delta:g} with {steps:,} steps at "
        f"sampling rate {sample_rate:.4g} (needs noise multiplier > {MAX_NOISE_MULTIPLIER:g}); raise "
        f"target_epsilon, train fewer steps, use a smaller batch or more records"
    )
