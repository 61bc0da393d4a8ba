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
the whole plan with :data:`FALLBACK`'s accountant (PLD, as tight; RDP where PLD cannot run either: memory) and say
so once, so calibration and report never mix accountants. Where the plain FFT composition's rounding could reach δ
(:func:`pld_rounding_margin`: N = 10⁹, one epoch, δ = 1e-10), PLD composes by an exponentially tilted FFT whose
rounding is bounded and added to δ (:func:`certified_pld`, :mod:`dpllm.privacy.tilted`).

Example:
    >>> round(compute_epsilon(noise_multiplier=1.0, sample_rate=0.16, steps=140, delta=1e-5,
    ...                       accountant="rdp"), 2)
    15.09
"""

from __future__ import annotations

import functools
import math
import sys
import warnings
from typing import Callable, Iterable, Sequence, TypeVar

from dpllm.privacy import prv, tilted
from dpllm.privacy.prv import AccountantUnavailable

T = TypeVar("T")

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


@functools.lru_cache(maxsize=4096)
def _rdp_of_one_step(sigma: float, q: float):
    """Opacus's RDP of one sampled-Gaussian step at its default orders (read-only array).

    Opacus's ``RDPAccountant`` computes ``compute_rdp(q, σ, steps)`` as this array times ``steps``, pure Python
    over ~150 orders (0.1-1 s each for σ below 1); runs ask for ε after every logged step and checkpoint with
    the same (σ, q), so it is computed once per pair. ``_epsilon_of`` then does Opacus's arithmetic exactly.
    """
    from opacus.accountants.analysis.rdp import compute_rdp
    from opacus.accountants.rdp import RDPAccountant

    rdp = compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=RDPAccountant.DEFAULT_ALPHAS)
    rdp.flags.writeable = False
    return rdp


def _epsilon_of(accountant: str, history: History, delta: float) -> float:
    if accountant == "rdp":  # Opacus's RDPAccountant.get_epsilon, with each (σ, q)'s orders computed once
        from opacus.accountants.analysis.rdp import get_privacy_spent
        from opacus.accountants.rdp import RDPAccountant

        pieces = [(float(s), float(q), int(t)) for s, q, t in history if int(t) > 0]
        if not pieces:
            return 0.0
        rdp = sum([_rdp_of_one_step(s, q) * t for s, q, t in pieces])
        return float(get_privacy_spent(orders=RDPAccountant.DEFAULT_ALPHAS, rdp=rdp, delta=delta)[0])
    from opacus.accountants import create_accountant  # imports torch: only for gdp

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
    stays an upper bound; where that margin would be too large a part of δ, the distributions are composed by
    :func:`certified_pld` instead (a bound on the rounding, not a measured margin). ``rounding_margin=False`` reads
    the plain composition at δ itself, as dpllm did before 2026-11-25 (only for checking ledgers written then:
    :func:`dpllm.ledger.verify`).

    Raises:
        AccountantUnavailable: dp-accounting could not build or compose the distributions (memory, numerics), or
            the tilted composition's window would be too large.
    """
    from dp_accounting.pld import privacy_loss_distribution as pld

    for sigma, q, steps in history:
        points = _pld_points(float(sigma), min(1.0, float(q)), value_discretization_interval)
        if int(steps) > 0 and q > 0 and points > PLD_MAX_POINTS:
            raise AccountantUnavailable(
                f"dp-accounting's PLD would need ~{points:.2g} grid points per step at σ={sigma:g}, q={q:g} "
                f"(more than {PLD_MAX_POINTS:,}: tens of GB)")
    try:
        margin = pld_rounding_margin(history, delta) if rounding_margin else 0.0
    except AccountantUnavailable:  # the plain FFT's rounding could reach δ: compose with a certified bound instead
        return certified_pld(history=history, delta=delta,
                             value_discretization_interval=value_discretization_interval)[0]
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


def certified_pld(*, history: History, delta: float,
                  value_discretization_interval: float = PLD_DISCRETIZATION) -> tuple[float, str]:
    """ε of ``history`` from dp-accounting's PLDs (as :func:`pld_epsilon`), composed by :mod:`dpllm.privacy.tilted`: an
    exponentially tilted FFT whose float64 rounding is bounded (Higham 2002) and added to δ, so it needs no measured
    margin and runs at any step count. Used where :func:`pld_rounding_margin` refuses (at N = 10⁹, one epoch of
    B = 4,096, δ = 1e-10, σ = 0.3882: ε 6.8085, the bound 1.7e-7 of δ; RDP gives 8.00 there).

    Returns:
        ``(ε, note)``: the note says how ε was composed and what was added to δ (for the privacy report).

    Raises:
        AccountantUnavailable: the tilted window would be too large, or dp-accounting failed.
    """
    key = (tuple((float(s), float(q), int(t)) for s, q, t in history), float(delta), value_discretization_interval)
    if key not in _CERTIFIED_CACHE:
        if len(_CERTIFIED_CACHE) > 256:
            _CERTIFIED_CACHE.clear()
        _CERTIFIED_CACHE[key] = _certified_pld(key[0], delta, value_discretization_interval)
    return _CERTIFIED_CACHE[key]


def _certified_pld(history: History, delta: float, value_discretization_interval: float) -> tuple[float, str]:
    from dp_accounting.pld import privacy_loss_distribution as pld

    removes, adds = [], []
    try:
        for sigma, q, steps in history:
            if int(steps) <= 0 or q <= 0:
                continue
            one = pld.from_gaussian_mechanism(standard_deviation=float(sigma), sampling_prob=min(1.0, float(q)),
                                              pessimistic_estimate=True,
                                              value_discretization_interval=value_discretization_interval)
            for out, pmf in ((removes, one._pmf_remove), (adds, one._pmf_add)):
                pmf = pmf.to_dense_pmf()
                out.append(tilted.Piece(pmf._lower_loss, pmf._probs, pmf._infinity_mass, int(steps)))
        if not removes:
            return 0.0, "no private steps"
        kw = dict(interval=value_discretization_interval, delta=delta)
        res = tilted.certified_epsilon(removes, **kw)
        # dp-accounting's ε is the larger of the two directions; the add direction's Chernoff bound is usually
        # far below the remove direction's ε, which then stands for both (never lower than either)
        if tilted.chernoff_epsilon(adds, **kw) > res.epsilon:
            res = max(res, tilted.certified_epsilon(adds, **kw), key=lambda r: r.epsilon)
    except tilted.Unavailable as err:
        raise AccountantUnavailable(f"the tilted PLD composition cannot run ({err})") from None
    except (MemoryError, ValueError, ArithmeticError, RuntimeError) as err:
        raise AccountantUnavailable(f"dp-accounting's PLD failed: {type(err).__name__}: {err}") from None
    note = (f"dp-accounting PLD (pessimistic, grid {value_discretization_interval:g}) composed by an exponentially "
            f"tilted FFT (λ={res.tilt:.4g}, {res.bins:,} bins); certified rounding and window bound "
            f"{res.bound:.2g} (={res.bound / delta:.2g}·δ) added to δ")
    return res.epsilon, note


def method_note(*, history: History, delta: float, accountant: str) -> str:
    """How ``accountant`` composes ``history`` and what it allows for float rounding (the privacy report's
    ``accountant_method``)."""
    history = [(float(s), float(q), int(t)) for s, q, t in history]
    steps = sum(t for _, q, t in history if t > 0 and q > 0)
    margin = f"{prv.ROUNDING:g}·T·2⁻⁵² = {prv.ROUNDING * steps * sys.float_info.epsilon:.2g}"
    if accountant == "pld":
        try:
            pld_rounding_margin(history, delta)
        except AccountantUnavailable:
            return certified_pld(history=history, delta=delta)[1]
        return (f"dp-accounting PLD (pessimistic, grid {PLD_DISCRETIZATION:g}), FFT composition; ε read at δ less "
                f"the measured rounding margin {margin}")
    if accountant == "prv":
        return f"PRV (Gopi et al. 2021, dpllm.privacy.prv), FFT composition; ε read at δ less {margin}"
    if accountant == "gdp":
        return "the larger of Opacus's GDP and RDP ε"
    return "Opacus RDP (no FFT, no rounding margin needed)"


# dp-accounting composes T steps as the T-th power of the step's Fourier transform: a relative error of ~T·2⁻⁵² in
# every coefficient, so ~T·2⁻⁵² in probability, δ included. Measured (scripts/fft_rounding.py: 7 histories, T from
# 1,000 to 300,000, against the same composition in long double and at four FFT lengths): at most 1.14·T·2⁻⁵².
# ε is read at δ - PLD_ROUNDING·T·2⁻⁵² (PRV's margin, prv.ROUNDING); where that margin exceeds PRECISION_FRACTION of
# δ, pld_epsilon composes by certified_pld instead.
PLD_ROUNDING = prv.ROUNDING


def pld_rounding_margin(history: History, delta: float) -> float:
    """What float64 rounding of a PLD composition of ``history`` may add to or take from δ (an upper estimate).

    Raises:
        AccountantUnavailable: the margin exceeds ``PRECISION_FRACTION·δ`` (at N = 10⁹, one epoch of B = 4,096,
            δ = 1e-10: 2.2e-10 > 3e-11): the composed distribution's tail at δ would be mostly rounding
            (:func:`pld_epsilon` then uses :func:`certified_pld`).
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
_CERTIFIED_CACHE: dict = {}


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


def first_that_runs(accountant: str, run: Callable[[str], T], *,
                    on_switch: Callable[[str], None] = lambda note: None) -> T:
    """``run(accountant)``, redone whole with :data:`FALLBACK`'s next accountant while one cannot run (PRV, then
    PLD, then RDP); ``on_switch`` gets :func:`switch_note`'s line at each switch.

    Raises:
        PrivacyPlanError: the last accountant of the chain cannot run either.
    """
    while True:
        try:
            return run(accountant)
        except AccountantUnavailable as err:
            if accountant not in FALLBACK:
                raise PrivacyPlanError(f"the {accountant} accountant cannot run for this plan ({err})") from err
            on_switch(switch_note(accountant, err))
            accountant = FALLBACK[accountant]


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
    searches with :mod:`dpllm.privacy.rdp_series` (Opacus's ε to float rounding, ~20× faster) and decides each
    grid point it returns or rules out with Opacus's own ε (:func:`rdp_stand_in`); PLD runs false position from
    the RDP bound's σ (:func:`smallest_smooth_noise`; the certified PLD on a coarser grid first); GDP bisects on
    the grid with Opacus's accountant. The bracket grows until it meets any target.
    With ``epsilon_tolerance`` (RDP/GDP only; bulk callers such as the scaling planner) the search stops at
    any σ whose ε is within that much under the target instead (:func:`smallest_noise`), unrounded; RDP's search
    runs on the stand-in, and Opacus's ε at the answer confirms it.

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

    def history_of(sigma: float) -> list:
        return prior + [(sigma, sample_rate, steps)]

    def eps(sigma: float) -> float:  # strict: a PLD that cannot run switches the whole plan, never one σ
        return compute_epsilon_history(history=history_of(sigma), delta=delta, accountant=accountant, strict=True)

    def unreachable() -> PrivacyPlanError:
        return _unreachable(target_epsilon, delta, sample_rate, steps)

    if epsilon_tolerance is not None:
        return smallest_noise(eps, target_epsilon, epsilon_tolerance=epsilon_tolerance, unreachable=unreachable,
                              stand_in=rdp_stand_in(history_of, delta) if accountant == "rdp" else None)
    if accountant == "rdp":
        return smallest_smooth_noise(eps, target_epsilon, digits=SIGMA_DIGITS, unreachable=unreachable,
                                     start=_rdp_sigma(target_epsilon, delta, sample_rate, steps, prior),
                                     stand_in=rdp_stand_in(history_of, delta))
    if accountant == "pld" and _certified(prior + [(1.0, sample_rate, steps)], delta):
        # each certified ε costs ~0.7 s and is smooth in σ: search on a 10× coarser grid (~8× cheaper) from RDP's σ,
        # then confirm on the full one (about three full evaluations instead of twenty)
        def coarse(sigma: float) -> float:
            return certified_pld(history=history_of(sigma), delta=delta,
                                 value_discretization_interval=10 * PLD_DISCRETIZATION)[0]

        start = _rdp_sigma(target_epsilon, delta, sample_rate, steps, prior)
        return smallest_smooth_noise(eps, target_epsilon, digits=SIGMA_DIGITS, unreachable=unreachable, start=start,
                                     stand_in=coarse)
    if accountant == "pld":
        # 0.05-0.5 s per σ: false position from RDP's σ finds the grid point in 5-8 evaluations where bisecting from
        # σ = 1 took 18-19, the same σ on every plan compared (scripts/bench_accounting.py; N = 10⁸ at δ = 1e-9:
        # 4.9 -> 2.1 CPU-s)
        return smallest_smooth_noise(eps, target_epsilon, digits=SIGMA_DIGITS, unreachable=unreachable,
                                     start=_rdp_sigma(target_epsilon, delta, sample_rate, steps, prior))
    return smallest_grid_noise(eps, target_epsilon, digits=SIGMA_DIGITS, unreachable=unreachable)


def rdp_stand_in(history_of: Callable[[float], History], delta: float) -> Callable[[float], float]:
    """ε(σ) of ``history_of(σ)`` by :func:`dpllm.privacy.rdp_series.rdp_epsilon`: Opacus's RDP ε to float rounding
    (3e-8 relative at worst over 60 random plans, ε up to 10⁴) in milliseconds instead of 0.1-1 s per new σ.

    For :func:`smallest_smooth_noise` to search with: it lands on the answer's grid point, then Opacus's ε there and
    at the point below (two evaluations instead of ~18 bisecting) decide it, so the σ is the one
    :func:`smallest_grid_noise` finds with Opacus's ε alone (ε decreasing in σ) and no reported ε comes from here.
    """
    from dpllm.privacy import rdp_series

    return lambda sigma: rdp_series.rdp_epsilon(history=history_of(sigma), delta=delta)


def _certified(history: History, delta: float) -> bool:
    """Whether :func:`pld_epsilon` composes ``history`` by the tilted FFT (the plain one's margin would reach δ);
    σ does not enter."""
    try:
        pld_rounding_margin(history, delta)
    except AccountantUnavailable:
        return True
    return False


def _rdp_sigma(target_epsilon: float, delta: float, sample_rate: float, steps: int, prior: list) -> float:
    """σ where the integer-order RDP bound meets the target (microseconds; at or above the PLD's σ, which is
    tighter), to start a search from."""
    def rdp(sigma: float) -> float:
        return prv.rdp_int_epsilon(history=prior + [(sigma, sample_rate, steps)], delta=delta)

    hi = 1.0
    while rdp(hi) > target_epsilon and hi < MAX_NOISE_MULTIPLIER:
        hi *= 2
    lo = hi / 2
    for _ in range(30):
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if rdp(mid) <= target_epsilon else (mid, hi)
    return hi


def smallest_smooth_noise(eps: Callable[[float], float], target_epsilon: float, *, digits: int,
                          unreachable: Callable[[], Exception], start: float,
                          stand_in: Callable[[float], float] | None = None,
                          max_sigma: float = MAX_NOISE_MULTIPLIER) -> float:
    """:func:`smallest_grid_noise` for an ``eps`` that is costly and close to smooth and decreasing in σ (PLD, the
    certified PLD, Opacus's RDP decided after a stand-in): PLD's jitter from one σ to the next (a few thousandths
    of ε) only slows the search, since step 3 decides the answer by ``eps`` itself.

    1. The root of ``stand_in`` (a cheap, smooth ε such as the same accountant on a coarser grid; ``eps`` itself if
       None), by Illinois false position on log ε against log σ, bracketed from ``start`` by steps of 10% that
       square while they miss. ``eps`` itself is only read at grid points, and the search stops at two neighbours.
    2. With a stand-in: ``eps`` there, and the root again of the stand-in moved by that offset (it changes
       slowly with σ: 0.02295 to 0.02300 from σ = 0.3693 to 0.37 at the billion-record plan).
    3. That root rounded up to the grid, raised while ``eps`` misses the target and lowered while ``eps`` of the
       point below meets it: the σ returned meets the target whatever the search assumed.

    Raises:
        the exception ``unreachable()`` builds, when σ above ``max_sigma`` would be needed.
    """
    def root(f: Callable[[float], float], x0: float, *, on_grid: bool) -> float:
        # 1. a bracket (lo, hi] with f(lo) > target >= f(hi), from x0 by steps of 10% that square while they miss
        snap = (lambda sigma: prv.round_up(sigma, digits)) if on_grid else (lambda sigma: sigma)
        x0, step = snap(x0), 1.1
        fx = f(x0)
        if fx > target_epsilon:
            lo, f_lo = x0, fx
            while True:
                if lo >= max_sigma:
                    raise unreachable()
                hi = min(snap(lo * step), max_sigma)
                f_hi = f(hi)
                if f_hi <= target_epsilon:
                    break
                lo, f_lo, step = hi, f_hi, step * step
        else:
            hi, f_hi = x0, fx
            while True:
                lo = snap(hi / step)
                if lo < 1e-6:
                    return hi
                f_lo = f(lo)
                if f_lo > target_epsilon:
                    break
                hi, f_hi, step = lo, f_lo, step * step
        # 2. Illinois false position on log f against log σ. ``on_grid`` (f is ``eps`` itself, each value costly):
        # every σ tried is a grid point, and the search ends with neighbouring ones, which step 3 then reads again
        # (the accountants remember them)
        fa, fb = math.log(f_lo / target_epsilon), math.log(max(f_hi, 1e-300) / target_epsilon)
        side = 0
        for _ in range(60):
            xa, xb = math.log(lo), math.log(hi)
            ga, gb = prv.round_up(lo, digits), prv.round_up(hi, digits)
            if ga == gb or (on_grid and prv.grid_below(gb, digits) <= ga) or xb - xa < 1e-12:
                break
            x = xb - fb * (xb - xa) / (fb - fa) if fb != fa else (xa + xb) / 2
            if on_grid:  # a grid point strictly inside (there is one): the guess rounded up, or next to the end it
                # reached (f(hi) = target exactly puts the guess at hi, where bisecting would take ~log2(points) steps)
                sigma = prv.round_up(math.exp(min(max(x, xa), xb)), digits)
                if sigma >= hi:
                    sigma = prv.grid_below(hi, digits)
                elif sigma <= lo:
                    sigma = prv.grid_above(lo, digits)
            else:
                sigma = math.exp(x if xa < x < xb else (xa + xb) / 2)
            fx = math.log(max(f(sigma), 1e-300) / target_epsilon)
            if fx > 0:
                lo, fa = sigma, fx
                fb, side = (fb / 2 if side == -1 else fb), -1
            else:
                hi, fb = sigma, fx
                fa, side = (fa / 2 if side == 1 else fa), 1
        return hi

    sigma = root(stand_in or eps, prv.round_up(start, digits + 2), on_grid=stand_in is None)
    if stand_in is not None:
        at = prv.round_up(sigma, digits)
        offset = eps(at) - stand_in(at)
        sigma = root(lambda s: stand_in(s) + offset, at, on_grid=False)
    sigma = prv.round_up(sigma, digits)
    while eps(sigma) > target_epsilon:
        sigma = prv.grid_above(sigma, digits)
        if sigma > max_sigma:
            raise unreachable()
    while True:
        under = prv.grid_below(sigma, digits)
        if under <= 0 or eps(under) > target_epsilon:
            return sigma
        sigma = under


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
        sigma = prv.grid_above(sigma, digits)
        if sigma > max_sigma:
            raise unreachable()
    return sigma


def smallest_noise(eps: Callable[[float], float], target_epsilon: float, *, epsilon_tolerance: float,
                   unreachable: Callable[[], Exception], lo: float = 0.0, hi: float = 1.0,
                   max_sigma: float = MAX_NOISE_MULTIPLIER,
                   stand_in: Callable[[float], float] | None = None) -> float:
    """Smallest σ with ``eps(σ) <= target_epsilon``, to within ``epsilon_tolerance`` of the target (or a
    relative 1e-6 in σ), for ``eps`` decreasing in σ: double ``hi`` until it meets the target, then bisect
    keeping ``hi`` on the meeting side. The returned σ always meets the target.

    With ``stand_in`` (a cheap ε that agrees with ``eps`` to float rounding, such as :func:`rdp_stand_in` for
    Opacus's RDP: milliseconds per σ instead of 0.1-1 s) the search runs on it and ``eps`` at the answer confirms it:
    where it misses the target, σ steps up (1e-6 relative at first, each step twice the last) until it meets it.

    Raises:
        the exception ``unreachable()`` builds, when σ above ``max_sigma`` would be needed.
    """
    search = stand_in or eps
    eps_hi = search(hi)
    while eps_hi > target_epsilon:
        lo, hi = hi, 2 * hi
        if hi > max_sigma:
            raise unreachable()
        eps_hi = search(hi)
    while target_epsilon - eps_hi > epsilon_tolerance and hi - lo > 1e-6 * hi:
        mid = (lo + hi) / 2
        e = search(mid)
        if e <= target_epsilon:
            hi, eps_hi = mid, e
        else:
            lo = mid
    step = 1e-6
    while stand_in is not None and eps(hi) > target_epsilon:
        hi, step = hi * (1 + step), 2 * step
        if hi > max_sigma:
            raise unreachable()
    return hi


def _unreachable(target_epsilon: float, delta: float, sample_rate: float, steps: int) -> PrivacyPlanError:
    return PrivacyPlanError(
        f"target_epsilon={target_epsilon} cannot be met at delta={delta:g} with {steps:,} steps at "
        f"sampling rate {sample_rate:.4g} (needs noise multiplier > {MAX_NOISE_MULTIPLIER:g}); raise "
        f"target_epsilon, train fewer steps, use a smaller batch or more records"
    )
