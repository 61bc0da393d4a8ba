"""Privacy accounting: explicit wrappers over rigorous accountants, one accountant per plan.

Every ε that dpllm prints goes through :func:`compute_epsilon_history`, from the recorded
``(noise_multiplier, sample_rate, steps)`` history. ``rdp`` and ``gdp`` are Opacus's accountants; ``prv`` is
Opacus's PRV computation as :mod:`dpllm.privacy.prv` runs it (same algorithm and bound, read below δ by the
FFT's float rounding, an FFT-friendly domain, a memory check before it allocates, no torch import; compared with
Opacus's in tests/test_prv.py);
``pld`` is Google dp-accounting's privacy-loss-distribution accountant with pessimistic discretisation (an
upper bound at any grid; :data:`PLD_DISCRETIZATION`).

Calibration (:func:`calibrate_noise`) returns the smallest σ with 4 significant figures whose ε under the
*same* accountant is at most the target. When PRV cannot run for a plan (its domain grows with the steps
and the ε: 12 million points at N = 10⁹, one epoch; float rounding at δ ≈ 1e-10), it raises
:class:`AccountantUnavailable`; the planners (:func:`dpllm.privacy.plan.plan_privacy`, ``dpllm plan``) then redo
the whole plan with :data:`FALLBACK`'s accountant (PLD, as tight; RDP where PLD cannot run either: memory, or
float rounding that would reach δ, :func:`pld_rounding_margin`) and say so once, so calibration and report never
mix accountants.

Example:
    >>> round(compute_epsilon(noise_multiplier=1.0, sample_rate=0.16, steps=140, delta=1e-5,
    ...                       accountant="rdp"), 2)
    15.09
"""

from __future__ import annotations

import math
import sys
import warnings
from typing import Callable, Iterable, Sequence

from dpllm.privacy import prv
from dpllm.privacy.prv import AccountantUnavailable

ACCOUNTANTS = ("prv", "rdp", "gdp", "pld")
# The accountant a plan switches to, as a whole, when its own cannot run: PRV → dp-accounting's PLD (as tight,
# pessimistic; a smaller FFT domain than PRV's, so it runs where PRV's memory or rounding refuses, e.g. N = 10⁸,
# one epoch, δ = 1e-9) → RDP (rigorous, any step count, kilobytes of memory, no rounding to speak of; looser).
FALLBACK = {"prv": "pld", "pld": "rdp"}
# dp-accounting's grid for the PLD accountant: its pessimistic estimate is an upper bound at any interval; 1e-3 is
# within ~1.5% of 1e-4 at ten times the speed (0.1 s vs 1.1 s for 244,141 steps; tests/test_planning.py).
PLD_DISCRETIZATION = 1e-3
# Above this RDP ε the MLP studies do not ask for PRV (dpllm.mlp.train): ε this large says "no privacy"
# whichever accountant computes it, and PRV's domain there is refused or takes long.
PRV_SKIP_ABOVE = 1000.0
# Opacus gives up above this noise multiplier; anything needing more is an impossible plan.
MAX_NOISE_MULTIPLIER = 1e6
SIGMA_DIGITS = 4  # calibrated σ are the smallest meeting value with this many significant figures

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
    from opacus.accountants import create_accountant  # imports torch: only for rdp/gdp

    acc = create_accountant(mechanism=accountant)
    acc.history = [(float(s), float(q), int(t)) for s, q, t in history if int(t) > 0]
    if not acc.history:
        return 0.0
    return float(acc.get_epsilon(delta=delta))


def _quiet_rdp(history: History, delta: float) -> float:
    """Opacus's RDP ε without its "optimal order is the smallest/largest alpha" note: at a very large ε the
    best order sits below Opacus's smallest (1.1); the bound stays valid, only looser, and ε that large
    means no meaningful privacy whichever way it is computed."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Optimal order is the")
        return _epsilon_of("rdp", history, delta)


def compute_epsilon_history(*, history: History, delta: float, accountant: str = "prv",
                            strict: bool = False) -> float:
    """ε after composing every ``(noise_multiplier, sample_rate, steps)`` entry of ``history``.

    ``gdp`` (Opacus's Gaussian-DP accountant) is a central-limit approximation, not an upper bound, so
    for it the larger of its ε and the RDP ε is returned: dpllm never under-reports.
    ``prv`` is numerically an upper bound (Opacus's ``eps_upper``). When it cannot run (memory, numeric
    domain): with ``strict`` it raises :class:`AccountantUnavailable` (planners then switch the whole plan);
    otherwise it warns and returns the RDP bound, also rigorous (for ledgers and logs of finished runs).
    """
    check_accountant(accountant)
    history = [(float(s), float(q), int(t)) for s, q, t in history]
    if any(s <= 0 for s, _, _ in history):
        return math.inf
    if accountant == "gdp":
        rdp = _quiet_rdp(history, delta)
        try:
            return max(_epsilon_of("gdp", history, delta), rdp)
        except Exception as err:  # Opacus's GDP root-finding fails in some (σ, q) regions
            warnings.warn(f"GDP accountant failed ({err}); reporting the RDP bound instead", stacklevel=2)
            return rdp
    while accountant in ("prv", "pld"):
        try:
            if accountant == "pld":
                return _remembered(_PLD_CACHE, tuple(history), float(delta), pld_epsilon)
            return _remembered(_PRV_CACHE, tuple(history), float(delta), prv.prv_epsilon)
        except AccountantUnavailable as err:
            if strict:
                raise
            warnings.warn(f"{accountant.upper()} accountant cannot run ({err}); reporting the "
                          f"{FALLBACK[accountant].upper()} bound instead", stacklevel=2)
            accountant = FALLBACK[accountant]
    return _quiet_rdp(history, delta)


def pld_epsilon(*, history: History, delta: float, value_discretization_interval: float = PLD_DISCRETIZATION,
                rounding_margin: bool = True) -> float:
    """ε of ``history`` by dp-accounting's privacy loss distributions: each entry a Poisson-subsampled Gaussian
    under add/remove-one, pessimistic discretisation (an upper bound on the true ε at any interval), composed.

    The ε is read at δ less :func:`pld_rounding_margin` (the float64 rounding of the composition), so that it
    stays an upper bound; ``rounding_margin=False`` reads it at δ itself, as dpllm did before 2026-11-25 (only for
    checking ledgers written then: :func:`dpllm.ledger.verify`).

    Raises:
        AccountantUnavailable: dp-accounting could not build or compose the distributions (memory, numerics), or
            float64 rounding would reach δ (:func:`pld_rounding_margin`).
    """
    from dp_accounting.pld import privacy_loss_distribution as pld

    for sigma, q, steps in history:
        points = _pld_points(float(sigma), min(1.0, float(q)), value_discretization_interval)
        if int(steps) > 0 and q > 0 and points > PLD_MAX_POINTS:
            raise AccountantUnavailable(
                f"dp-accounting's PLD would need ~{points:.2g} grid points per step at σ={sigma:g}, q={q:g} "
                f"(more than {PLD_MAX_POINTS:,}: tens of GB)")
    margin = pld_rounding_margin(history, delta) if rounding_margin else 0.0
    try:
        total = None
        for sigma, q, steps in history:
            if int(steps) <= 0 or q <= 0:
                continue
            one = pld.from_gaussian_mechanism(standard_deviation=float(sigma), sampling_prob=min(1.0, float(q)),
                                              pessimistic_estimate=True,
                                              value_discretization_interval=value_discretization_interval)
            step = one.self_compose(int(steps))
            total = step if total is None else total.compose(step)
        return 0.0 if total is None else max(0.0, float(total.get_epsilon_for_delta(delta - margin)))
    except (MemoryError, ValueError, ArithmeticError, RuntimeError) as err:
        raise AccountantUnavailable(f"dp-accounting's PLD failed: {type(err).__name__}: {err}") from None


# dp-accounting composes T steps as the T-th power of the step's Fourier transform: a relative error of ~T·2⁻⁵² in
# every coefficient, so ~T·2⁻⁵² in probability, δ included. Measured (scripts/fft_rounding.py: 7 histories, T from
# 1,000 to 300,000, against the same composition in long double and at four FFT lengths): at most 1.14·T·2⁻⁵².
# ε is read at δ - PLD_ROUNDING·T·2⁻⁵² (PRV's margin, prv.ROUNDING), and PLD is refused where that margin exceeds
# PRECISION_FRACTION of δ.
PLD_ROUNDING = prv.ROUNDING


def pld_rounding_margin(history: History, delta: float) -> float:
    """What float64 rounding of a PLD composition of ``history`` may add to or take from δ (an upper estimate).

    Raises:
        AccountantUnavailable: the margin exceeds ``PRECISION_FRACTION·δ`` (at N = 10⁹, one epoch of B = 4,096,
            δ = 1e-10: 2.2e-10 > 3e-11): the composed distribution's tail at δ would be mostly rounding.
    """
    total = sum(int(t) for s, q, t in history if int(t) > 0 and q > 0)
    margin = PLD_ROUNDING * total * sys.float_info.epsilon
    if margin > prv.PRECISION_FRACTION * delta:
        raise AccountantUnavailable(
            f"{total:,} steps: float64 rounding in the PLD's FFT composition (~{margin:.1g}) would reach "
            f"δ={delta:g}")
    return margin


# Above this many grid points for one step, dp-accounting's PLD would take tens of GB (σ = 1e-3 asks for ~5e8):
# refused as unavailable, so the fallback goes on to RDP. Plans PRV cannot run (N = 1e9, δ = 1e-10) need ~1e4.
PLD_MAX_POINTS = 500_000


def _pld_points(sigma: float, q: float, interval: float) -> float:
    """Rough count of the grid points dp-accounting's PLD spans for one subsampled Gaussian step: the largest
    privacy loss it keeps (at ~8.5σ beyond the shifted mean, past which its tail truncation drops the mass),
    over the discretisation interval."""
    x = 1.0 + 8.5 * sigma
    loss = (2.0 * x - 1.0) / (2.0 * sigma * sigma)  # the Gaussian's privacy loss at x
    if q < 1.0:  # Poisson subsampling: log(1 - q + q·e^loss), ≈ loss + log q once e^loss dominates
        loss = loss + math.log(q) if loss > 50 else math.log1p(q * math.expm1(loss))
    return abs(loss) / interval


_PRV_CACHE: dict = {}
_PLD_CACHE: dict = {}


def _remembered(cache: dict, history: tuple, delta: float, compute) -> float:
    """``compute(history=..., delta=...)`` (:func:`dpllm.privacy.prv.prv_epsilon`, :func:`pld_epsilon`), remembered
    in ``cache``: a plan's table asks for the same σ more than once. At most 257 entries, then it starts afresh."""
    key = (history, delta)
    if key not in cache:
        if len(cache) > 256:
            cache.clear()
        cache[key] = compute(history=history, delta=delta)
    return cache[key]


def compute_epsilon(
    *, noise_multiplier: float, sample_rate: float, steps: int, delta: float, accountant: str = "prv",
    strict: bool = False,
) -> float:
    """ε of ``steps`` Poisson-subsampled Gaussian steps at rate ``sample_rate`` and noise ``noise_multiplier``."""
    return compute_epsilon_history(
        history=[(noise_multiplier, sample_rate, steps)], delta=delta, accountant=accountant, strict=strict
    )


def switch_note(accountant: str, err: Exception) -> str:
    """The one line a planner prints when it redoes a whole plan with :data:`FALLBACK`'s accountant."""
    return (f"the {accountant} accountant cannot run for this plan ({err}); the whole plan (σ and every ε) "
            f"uses the {FALLBACK[accountant]} accountant instead")


def calibrate_noise(
    *,
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = "prv",
    prior_history: Iterable[tuple[float, float, int]] = (),
    progress: Callable[[str], None] | None = None,
    epsilon_tolerance: float | None = None,
) -> float:
    """Smallest σ with :data:`SIGMA_DIGITS` significant figures whose ε, composed after ``prior_history``
    under ``accountant``, is ≤ target: the same accountant :func:`compute_epsilon_history` reports with.

    PRV searches on a coarse mesh and confirms on the full one (:func:`dpllm.privacy.prv.calibrate`); RDP
    and GDP bisect on the grid with Opacus's accountant. The bracket grows until it meets any target.
    With ``epsilon_tolerance`` (RDP/GDP only; bulk callers such as the scaling planner) the search stops at
    any σ whose ε is within that much under the target instead (:func:`smallest_noise`), unrounded.

    Raises:
        PrivacyPlanError: if the target cannot be met with σ ≤ 1e6 (e.g. too many steps, too high a
            sampling rate, or a prior stage already spent the budget).
        AccountantUnavailable: ``prv`` cannot run near the answer; the caller switches the whole plan.
    """
    check_accountant(accountant)
    if target_epsilon <= 0:
        raise PrivacyPlanError(f"target_epsilon={target_epsilon} must be positive")
    if not (0 < sample_rate <= 1):
        raise PrivacyPlanError(f"sample_rate={sample_rate} must be in (0, 1]")
    if steps <= 0:
        raise PrivacyPlanError(f"steps={steps} must be positive")
    prior = [tuple(h) for h in prior_history]
    if prior and compute_epsilon_history(history=prior, delta=delta, accountant=accountant,
                                         strict=True) >= target_epsilon:
        raise PrivacyPlanError(
            f"earlier stages already spent ε ≥ target_epsilon={target_epsilon}; raise the target"
        )
    if accountant == "prv":
        try:
            sigma, eps = prv.calibrate(target_epsilon=target_epsilon, delta=delta, sample_rate=sample_rate,
                                       steps=steps, prior=prior, digits=SIGMA_DIGITS,
                                       max_sigma=MAX_NOISE_MULTIPLIER, progress=progress)
        except ValueError as err:
            raise _unreachable(target_epsilon, delta, sample_rate, steps) from err
        _PRV_CACHE[(tuple((float(s), float(q), int(t)) for s, q, t in prior + [(sigma, sample_rate, steps)]),
                    float(delta))] = eps
        return sigma

    def eps(sigma: float) -> float:  # strict: a PLD that cannot run switches the whole plan, never one σ
        return compute_epsilon_history(history=prior + [(sigma, sample_rate, steps)], delta=delta,
                                       accountant=accountant, strict=True)

    def unreachable() -> PrivacyPlanError:
        return _unreachable(target_epsilon, delta, sample_rate, steps)

    if epsilon_tolerance is not None:
        return smallest_noise(eps, target_epsilon, epsilon_tolerance=epsilon_tolerance, unreachable=unreachable)
    return smallest_grid_noise(eps, target_epsilon, digits=SIGMA_DIGITS, unreachable=unreachable)


def smallest_grid_noise(eps: Callable[[float], float], target_epsilon: float, *, digits: int,
                        unreachable: Callable[[], Exception], max_sigma: float = MAX_NOISE_MULTIPLIER) -> float:
    """Smallest σ with ``digits`` significant figures and ``eps(σ) <= target_epsilon``, for ``eps`` decreasing in
    σ: bracket by doubling/halving, then bisect on the grid one significant figure finer than asked (so the
    bracket's decade does not matter), then round up.

    Raises:
        the exception ``unreachable()`` builds, when σ above ``max_sigma`` would be needed.
    """
    hi = 1.0
    while eps(hi) > target_epsilon:
        hi *= 2
        if hi > max_sigma:
            raise unreachable()
    lo = hi / 2
    while eps(lo) <= target_epsilon:
        hi, lo = lo, lo / 2
        if lo < 1e-6:
            return prv.round_up(hi, digits)
    step = prv.grid_step(lo, digits + 1)
    i_lo, i_hi = math.floor(lo / step), math.ceil(hi / step)  # eps(i_lo·step) > target ≥ eps(i_hi·step)
    while i_hi - i_lo > 1:
        mid = (i_lo + i_hi) // 2
        if eps(mid * step) <= target_epsilon:
            i_hi = mid
        else:
            i_lo = mid
    sigma = prv.round_up(i_hi * step, digits)
    # PLD's pessimistic grid makes ε jitter from one σ to the next (each value an upper bound): whatever the
    # bisection assumed, the σ returned meets the target.
    while eps(sigma) > target_epsilon:
        sigma = prv.round_up(sigma + prv.grid_step(sigma, digits), digits)
        if sigma > max_sigma:
            raise unreachable()
    return sigma


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
