"""The PRV accountant (Gopi et al. 2021) for Poisson-subsampled Gaussian steps, fast and memory-bounded.

This is Opacus's ``PRVAccountant.get_epsilon`` computation, step for step: the same safe domain rule
(Gopi et al., remark 5.6, from an RDP tail bound), the same mesh ``eps_error / sqrt(T·log(12/δ_err)/2)``,
the same discretisation with the continuous mean restored, FFT self-composition, and the same upper bound
``eps_upper``. It differs from Opacus's where that is measurably better, and nowhere else:

1. The domain is widened to the next length the FFT handles fast (even, 5-smooth). Opacus's length is
   whatever the domain rule gives (e.g. 385,338 = 2·3·64,223 at N = 10⁶, B = 1,024, one epoch), and a large
   prime factor makes the FFT several times slower. A wider domain truncates less mass; the mesh, and so
   the error bound, is unchanged (``tests/test_prv.py`` compares with Opacus on many plans).
2. The domain's RDP tail bound uses integer orders 2..256 in closed form (vectorised, microseconds);
   Opacus adds fractional orders (tens of milliseconds per σ). Any valid RDP bound gives a safe domain.
   Where the integer bound exceeds :data:`FRACTIONAL_ABOVE` (ε in the tens, best order below 2) Opacus's
   fractional orders are added too, so the domain is never wider than Opacus's there.
3. The number of points is known before anything is allocated (:func:`domain_points`). Opacus's domain
   grows with the steps and the ε (about 12 million points at N = 10⁹, B = 1,024, one epoch, δ = 1e-10;
   billions at a tiny σ), which is how a plan was once killed at 12.8 GB. Above ``max_points`` the
   accountant refuses with :class:`AccountantUnavailable` instead, and the caller switches the whole plan
   to another accountant.
4. No torch: this module needs numpy and scipy only, so ``dpllm plan`` starts in a fraction of a second.
5. ε is read at δ less the FFT composition's float rounding (:data:`ROUNDING`·T·2⁻⁵², measured against a
   long-double run by ``scripts/fft_rounding.py``), not at δ itself: Opacus's reading can fall below the
   bound by what the rounding moved δ. The margin is ~1e-5 of δ on ordinary plans (N = 10⁶, B = 1,024, one
   epoch, δ = 1e-7: ε moves by 1.4e-6) and at most ~2e-3 of δ where the precision check lets PRV run (at
   9e-4 of δ, 9,766 steps at δ = 1e-8, ε moved by 4.6e-5).

:func:`calibrate` finds the smallest σ on a printed grid (4 significant figures) whose ε is at most the
target. It searches with the same computation on a 10× coarser mesh (a cheap stand-in, never reported),
and confirms with the exact one: every ε it returns is this module's full-precision ε.

Example:
    >>> round(prv_epsilon(history=[(1.0, 0.16, 140)], delta=1e-5), 2)   # Opacus's PRV gives 13.74
    13.74
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
from scipy import integrate
from scipy.fft import irfft, next_fast_len, rfft
from scipy.special import erfc, gammaln, logsumexp

History = Sequence[tuple[float, float, int]]
EPS_ERROR = 0.01  # Opacus's default: the reported ε is an upper bound within 0.01 above the estimate.
# Float rounding (FFT length, power by squaring, summation order) moves ε by up to ~2e-7 relative either way
# from Opacus's own run of the same computation; the reported ε is raised by this much so it is never below it.
EPS_SLACK = 1e-6
# About 56 bytes a point at the peak (pmf, grid, cumulative sums, FFT buffers): 25 million points ≈ 1.4 GB.
MAX_POINTS = 25_000_000
BYTES_PER_POINT = 56
PRECISION_FRACTION = 0.3  # rounding noise (T·2⁻⁵²·√n) allowed, as a fraction of δ: see _check_precision
# The T-fold FFT power rounds δ(ε) by ~T·2⁻⁵² in probability: measured against the same composition in long
# double, at most 0.45·T·2⁻⁵² here and 1.14·T·2⁻⁵² in dp-accounting's PLD (scripts/fft_rounding.py). Both read ε
# at δ less ROUNDING·T·2⁻⁵² (:func:`prv_epsilon`, :func:`dpllm.privacy.accounting.pld_rounding_margin`): ε
# is then an upper bound whichever way the rounding fell. Opacus's PRV does not take this margin.
ROUNDING = 4.0
# Integer RDP orders: every one up to 32, then sparser (the bound moves little between neighbours up there).
ORDERS = np.array(list(range(2, 33)) + [40, 48, 56, 64, 80, 96, 128, 160, 192, 256], dtype=float)
SQRT2 = math.sqrt(2.0)


class AccountantUnavailable(RuntimeError):
    """The accountant cannot run for this history (memory, or its numeric domain fails)."""


def _log_binomials() -> tuple[np.ndarray, np.ndarray]:
    a = ORDERS[:, None]
    k = np.arange(int(ORDERS.max()) + 1, dtype=float)[None, :]
    valid = k <= a
    with np.errstate(invalid="ignore"):
        log_binom = np.where(valid, gammaln(a + 1) - gammaln(k + 1) - gammaln(np.maximum(a - k, 0) + 1), -np.inf)
    return log_binom, k


_LOG_BINOM, _K = _log_binomials()


@functools.lru_cache(maxsize=4096)
def _rdp_per_step(q: float, sigma: float) -> np.ndarray:
    """RDP of one Poisson-subsampled Gaussian step at the integer orders :data:`ORDERS` (Mironov et al. 2019,
    the binomial expansion, exact for integer orders)."""
    if q >= 1.0:
        return ORDERS / (2 * sigma**2)
    a = ORDERS[:, None]
    with np.errstate(invalid="ignore"):
        terms = _LOG_BINOM + _K * math.log(q) + (a - _K) * math.log1p(-q) + (_K * _K - _K) / (2 * sigma**2)
    return logsumexp(terms, axis=1) / (ORDERS - 1)


def _rdp_to_eps(rdp: np.ndarray, delta: float, orders: np.ndarray = ORDERS) -> float:
    """(ε, δ) from RDP (Balle et al. 2020, Thm 21), minimised over the orders; Opacus's conversion."""
    eps = rdp - (math.log(delta) + np.log(orders)) / (orders - 1) + np.log((orders - 1) / orders)
    return float(np.nanmin(eps))


# Where the integer-order bound is this large, the best order is below 2: Opacus's fractional orders give a far
# smaller (still valid) domain. Importing them costs torch's import, so only plans this far out pay it.
FRACTIONAL_ABOVE = 30.0


@functools.lru_cache(maxsize=1024)
def _rdp_fractional(q: float, sigma: float) -> tuple[np.ndarray, np.ndarray]:
    """Opacus's RDP of one step at its default orders (fractional 1.1..10.9 and integers to 63)."""
    from opacus.accountants.analysis.rdp import compute_rdp
    from opacus.accountants.rdp import RDPAccountant

    orders = np.array(RDPAccountant.DEFAULT_ALPHAS, dtype=float)
    return orders, np.asarray(compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=list(orders)), dtype=float)


def _tail_bound(history: History, delta_error: float) -> float:
    """Remark 5.6's L: RDP ε of the whole history at δ_err/4 and of each single step at δ_err/(8T), the largest."""
    total = sum(int(t) for _, _, t in history)
    rdps = [_rdp_per_step(q, s) for s, q, _ in history]
    l_max = _rdp_to_eps(sum(r * int(t) for r, (_, _, t) in zip(rdps, history)), delta_error / 4)
    for r in rdps:
        l_max = max(l_max, _rdp_to_eps(r, delta_error / (8 * total)))
    if l_max > FRACTIONAL_ABOVE:
        frac = [_rdp_fractional(q, s) for s, q, _ in history]
        orders = frac[0][0]
        l_frac = _rdp_to_eps(sum(r * int(t) for (_, r), (_, _, t) in zip(frac, history)), delta_error / 4, orders)
        for _, r in frac:
            l_frac = max(l_frac, _rdp_to_eps(r, delta_error / (8 * total), orders))
        l_max = min(l_max, l_frac)  # both are valid bounds
    return l_max


@dataclass(frozen=True)
class _Domain:
    t_min: float  # before the mean shifts
    dt: float
    size: int


def _domain(history: History, delta_error: float, eps_error: float) -> _Domain:
    """Opacus's safe domain for ``history`` (``compute_safe_domain_size`` and ``create_aligned``), widened to an
    even FFT-friendly length; symmetric as Opacus's (t_min = -(n/2 - 1)·dt), which its composition relies on."""
    total = sum(int(t) for _, _, t in history)
    half_width = max(_tail_bound(history, delta_error), eps_error) + 3
    dt = eps_error / math.sqrt(total * math.log(12 / delta_error) / 2)
    # Beyond ~700 e^{±t} overflows float64 (the ε there is in the hundreds: no privacy to speak of).
    k = math.ceil(half_width / dt) if half_width < 700 else None
    if k is None or k > 10**12:
        return _Domain(-math.inf, dt, 10**13)
    n = 2 * k + 2
    while True:  # the smallest even 5-smooth length ≥ n
        n = next_fast_len(n, real=True)
        if n % 2 == 0:
            break
        n += 1
    return _Domain(-(n // 2 - 1) * dt, dt, n)


def _check_precision(history: History, delta: float, size: int) -> None:
    """Refuse when float64 rounding in the FFT composition would reach δ.

    The T-fold power of the pmf's transform carries a relative error of about T·2⁻⁵² per coefficient, and the
    tail sums that find ε add the inverse transform's errors over up to n bins: about T·2⁻⁵²·√n in
    probability. Measured (B = 1,024, one epoch, ε ≈ 8, σ steps of 1e-4): at N = 10⁷ (T·2⁻⁵²·√n ≈ δ/4) ε moves
    by 0.0058 ± 0.00004 a step; at N = 10⁸ (≈ 43·δ) it is no longer monotone in σ (-0.005, -0.016, +0.005).
    """
    total = sum(int(t) for _, _, t in history)
    noise = total * np.finfo(float).eps * math.sqrt(size)
    if noise > PRECISION_FRACTION * delta:
        raise AccountantUnavailable(
            f"{total:,} steps on a {size:,}-point domain: float64 rounding in PRV's FFT (~{noise:.1g}) "
            f"would reach δ={delta:g}")


def domain_points(*, history: History, delta: float, eps_error: float = EPS_ERROR) -> int:
    """Points of the discretisation :func:`prv_epsilon` would use (its memory is ~56 bytes a point)."""
    return _domain(history, delta / 1000, eps_error).size


class _StepPRV:
    """Privacy loss of one Poisson-subsampled Gaussian step (Gopi et al., prop. B4), truncated to [a, b)."""

    def __init__(self, q: float, sigma: float, a: float, b: float):
        self.q, self.sigma, self.a, self.b = q, sigma, a, b
        self.mass = self._cdf(np.array(b)) - self._cdf(np.array(a))

    def _cdf(self, t):
        q, s = self.q, self.sigma
        t = np.asarray(t, dtype=float)
        inside = t > math.log1p(-q) if q < 1 else np.ones_like(t, dtype=bool)
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            # log((e^t + q - 1)/q), written so large t does not overflow
            z = np.where(inside, t - math.log(q) + np.log1p((q - 1) * np.exp(-np.where(inside, t, 0.0))), 0.0)
        val = (-q * erfc((2 * z * s**2 - 1) / (2 * SQRT2 * s)) / 2
               - (1 - q) * erfc((2 * z * s**2 + 1) / (2 * SQRT2 * s)) / 2 + 1.0)
        return np.where(inside, val, 0.0)

    def cdf(self, t):
        t = np.asarray(t, dtype=float)
        inner = (self._cdf(t) - self._cdf(np.array(self.a))) / self.mass
        return np.where(t < self.a, 0.0, np.where(t < self.b, inner, 1.0))

    def _cdf_scalar(self, t: float) -> float:
        """:meth:`cdf` at one point with ``math`` (quad calls it hundreds of times per σ)."""
        if t < self.a:
            return 0.0
        if t >= self.b:
            return 1.0
        q, s = self.q, self.sigma
        if q < 1 and t <= math.log1p(-q):
            raw = 0.0
        else:
            z = t - math.log(q) + math.log1p((q - 1) * math.exp(-t))  # log((e^t + q - 1)/q) without overflow
            raw = (-q * math.erfc((2 * z * s**2 - 1) / (2 * SQRT2 * s)) / 2
                   - (1 - q) * math.erfc((2 * z * s**2 + 1) / (2 * SQRT2 * s)) / 2 + 1.0)
        return (raw - self._cdf_a) / self.mass

    def mean(self) -> float:
        """E[L] of the truncated loss by parts, ∫ t dF = [t F] - ∫ F, over Opacus's breakpoints."""
        self._cdf_a = float(self._cdf(np.array(self.a)))
        lo, hi = int(np.log10(abs(self.a))), int(np.log10(self.b))
        points = np.concatenate([[self.a], -np.logspace(lo, -5, num=10), [0],
                                 np.logspace(-5, hi, num=10), [self.b]])
        f = self._cdf_scalar
        mean = 0.0
        for left, right in zip(points[:-1], points[1:]):
            integral, _ = integrate.quad(f, left, right, limit=500)
            mean += right * f(right) - left * f(left) - integral
        return mean


def _discretise(q: float, sigma: float, dom: _Domain) -> tuple[np.ndarray, float]:
    """PMF on the grid and the shift that restores the continuous mean (Opacus's ``discretize``)."""
    t_max = dom.t_min + (dom.size - 1) * dom.dt
    prv = _StepPRV(q, sigma, dom.t_min, t_max)
    edges = dom.t_min + dom.dt * (np.arange(dom.size + 1, dtype=float) - 0.5)
    pmf = np.diff(prv.cdf(edges))
    del edges
    ts = dom.t_min + dom.dt * np.arange(dom.size, dtype=float)
    shift = prv.mean() - float(np.dot(ts, pmf))
    if not abs(shift) < dom.dt / 2:
        raise AccountantUnavailable("the discrete mean differs from the continuous one (σ or q too extreme)")
    return pmf, shift


def _power(f: np.ndarray, steps: int) -> np.ndarray:
    """``f ** steps`` by repeated squaring, in ``f``'s precision, overwriting ``f``: ~2·log2(steps) complex
    products, several times faster than numpy's complex power at equal accuracy (relative error ~ steps·1e-16
    in float64, |f| ≤ 1)."""
    acc, e = None, steps
    while True:
        if e & 1:
            acc = f.copy() if acc is None else np.multiply(acc, f, out=acc)
        e >>= 1
        if not e:
            return acc
        np.multiply(f, f, out=f)


def _self_compose(pmf: np.ndarray, steps: int) -> np.ndarray:
    """``steps``-fold convolution by FFT, rolled back onto the symmetric grid (Opacus's ``_compose_fourier``)."""
    n = len(pmf)
    out = irfft(_power(rfft(pmf), steps), n)
    m = steps - 1 + (n // 2 if steps % 2 == 0 else 0)
    return np.roll(out, m)


def _convolve_same(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``scipy.signal.convolve(a, b, mode="same")`` for equal lengths, by FFT (scipy.signal costs 0.5 s to import)."""
    n = len(a)
    m = next_fast_len(2 * n - 1, real=True)
    full = irfft(rfft(a, m) * rfft(b, m), m)[: 2 * n - 1]
    start = (n - 1) // 2
    return full[start:start + n]


def _epsilon_from_pmf(pmf: np.ndarray, t_min: float, dt: float, delta: float, delta_error: float,
                      eps_error: float) -> float:
    """Opacus's ``DiscretePRV.compute_epsilon`` upper bound: ε at δ - δ_err, plus ``eps_error`` (``delta_error``
    here includes the rounding margin)."""
    n = len(pmf)
    if np.finfo(np.longdouble).eps * n > delta - delta_error:
        raise AccountantUnavailable(f"δ={delta:g} is too small for a {n:,}-point PRV domain (float rounding)")
    t = t_min + dt * np.arange(n, dtype=float)
    w = np.exp(-t)
    w *= pmf
    d2 = np.cumsum(w[::-1])[::-1]
    del w
    d1 = np.cumsum(pmf[::-1])[::-1]
    np.exp(t, out=t)
    t *= d2
    t -= d1  # ndelta(ε_i) = e^{t_i}·d2_i - d1_i, increasing
    target = delta - delta_error
    i = int(np.searchsorted(t, -target, side="left"))
    if i <= 0 or i >= n:
        raise AccountantUnavailable("the PRV domain does not reach this δ")
    eps = float(np.log((d1[i] - target) / d2[i])) + eps_error
    return eps + EPS_SLACK * max(1.0, abs(eps))


def prv_epsilon(*, history: History, delta: float, eps_error: float = EPS_ERROR,
                max_points: int = MAX_POINTS, rounding_margin: bool = True) -> float:
    """ε after composing ``history`` (``(σ, q, steps)`` entries), Opacus's PRV upper bound at δ_err = δ/1000,
    read at δ less the composition's float rounding (:data:`ROUNDING`·T·2⁻⁵²; ``rounding_margin=False``: at δ
    itself, as Opacus and dpllm before 2026-11-25 read it).

    Raises:
        AccountantUnavailable: the domain would exceed ``max_points`` (memory), or the discretisation fails.
    """
    history = [(float(s), float(q), int(t)) for s, q, t in history if int(t) > 0]
    if not history:
        return 0.0
    delta_error = delta / 1000
    dom = _domain(history, delta_error, eps_error)
    if dom.size >= 10**13:
        raise AccountantUnavailable("the privacy loss exceeds PRV's float range (ε in the hundreds)")
    _check_precision(history, delta, dom.size)
    if dom.size > max_points:
        raise AccountantUnavailable(
            f"PRV would need a {dom.size:,.3g}-point domain (~{dom.size * BYTES_PER_POINT / 2**30:,.3g} GiB; "
            f"limit {max_points:,} points)")
    try:
        composed, shift = None, 0.0
        for sigma, q, steps in history:
            pmf, s = _discretise(q, sigma, dom)
            pmf = _self_compose(pmf, steps)
            shift += s * steps
            # Heterogeneous histories: convolve the self-compositions (Opacus's convolution tree, in order).
            composed = pmf if composed is None else _convolve_same(composed, pmf)
            del pmf
        margin = ROUNDING * sum(t for _, _, t in history) * np.finfo(float).eps if rounding_margin else 0.0
        return _epsilon_from_pmf(composed, dom.t_min + shift, dom.dt, delta, delta_error + margin, eps_error)
    except MemoryError as err:
        raise AccountantUnavailable(f"out of memory for a {dom.size:,}-point PRV domain ({err})") from err
    except FloatingPointError as err:
        raise AccountantUnavailable(str(err)) from err


def rdp_int_epsilon(*, history: History, delta: float) -> float:
    """The integer-order RDP bound this module uses for its domain (an upper bound on ε; cheap)."""
    rdp = sum(_rdp_per_step(q, s) * int(t) for s, q, t in history)
    return _rdp_to_eps(np.asarray(rdp, dtype=float), delta)


def grid_step(x: float, digits: int) -> float:
    """The spacing of ``digits``-significant-figure numbers around ``x``."""
    return 10.0 ** (math.floor(math.log10(x)) - digits + 1)


def round_up(x: float, digits: int = 4) -> float:
    """Round ``x > 0`` up to ``digits`` significant figures (so a printed σ never adds ε).

    >>> round_up(0.4338378)
    0.4339
    """
    scale = grid_step(x, digits)
    return round(math.ceil(x / scale - 1e-9) * scale, 12)


def grid_above(x: float, digits: int = 4) -> float:
    """The ``digits``-significant-figure number just above the grid point ``x``.

    >>> grid_above(0.4338), grid_above(0.9999)
    (0.4339, 1.0)
    """
    return round_up(x + grid_step(x, digits), digits)


def grid_below(x: float, digits: int = 4) -> float:
    """The ``digits``-significant-figure number just below ``x``, itself such a number (at a power of ten, the
    finer spacing below it).

    >>> grid_below(0.4339), grid_below(1.0)
    (0.4338, 0.9999)
    """
    return round(x - grid_step(x * (1 - 1e-12), digits), 12)


class _Curve:
    """ε(σ) of one plan shape (prior stages, q, steps, δ): the coarse stand-in and the full-precision PRV, each
    remembered, so a plan's table rows share their work."""

    def __init__(self, prior: tuple, sample_rate: float, steps: int, delta: float, max_points: int):
        self.prior, self.q, self.steps, self.delta, self.max_points = list(prior), sample_rate, steps, delta, max_points
        self.coarse_at: dict[float, float] = {}
        self.fine_at: dict[float, float] = {}
        self.substitutes: dict[float, str] = {}  # σ where PRV could not run (why), and the RDP bound stood in

    def history(self, sigma: float) -> list:
        return self.prior + [(sigma, self.q, self.steps)]

    def coarse(self, sigma: float) -> float:
        """The same computation on a 10× coarser mesh, with the fine ``eps_error``: within ~1e-4 of :meth:`fine`
        on ordinary plans (0.3-10 at N = 10⁶), ~10× cheaper. Only ever searched with, never reported."""
        if sigma not in self.coarse_at:
            try:
                self.coarse_at[sigma] = prv_epsilon(history=self.history(sigma), delta=self.delta,
                                                    eps_error=10 * EPS_ERROR, max_points=self.max_points) \
                    - 9 * EPS_ERROR
            except AccountantUnavailable as err:  # far from the answer (tiny σ) the RDP bound orders σ as well
                self.coarse_at[sigma] = rdp_int_epsilon(history=self.history(sigma), delta=self.delta)
                self.substitutes[sigma] = str(err)
        return self.coarse_at[sigma]

    def fine(self, sigma: float) -> float:
        sigma = round(sigma, 12)
        if sigma not in self.fine_at:
            self.fine_at[sigma] = prv_epsilon(history=self.history(sigma), delta=self.delta,
                                              max_points=self.max_points)
        return self.fine_at[sigma]

    def bracket(self, target: float, start: float) -> tuple[float, float]:
        """``(a, b)`` with coarse(a) > target ≥ coarse(b): from earlier rows where possible, else stepping from
        ``start`` (the RDP-calibrated σ, just above the answer) by 15%, so that σ far below the answer, where
        the domain is huge, is never evaluated."""
        above = [s for s, e in self.coarse_at.items() if e > target]
        below = [s for s, e in self.coarse_at.items() if e <= target]
        if above and below and max(above) < min(below):
            return max(above), min(below)
        b = min([s for s in below if s >= start] or [start])
        while self.coarse(b) > target:
            b *= 1.25
            if b > 1e6:
                raise ValueError("unreachable")
        a = max([s for s in above if s < b], default=b * 0.85)
        while self.coarse(a) <= target:
            a, b = a * 0.85, a
            if a < 1e-6:
                raise ValueError("σ below 1e-6")
        return a, b


_CURVES: dict = {}


def calibrate(*, target_epsilon: float, delta: float, sample_rate: float, steps: int, prior: History = (),
              digits: int = 4, max_sigma: float = 1e6, max_points: int = MAX_POINTS,
              progress: Optional[Callable[[str], None]] = None) -> tuple[float, float]:
    """Smallest σ with ``digits`` significant figures whose PRV ε (after ``prior``) is ≤ ``target_epsilon``.

    1. Root of the coarse stand-in in log σ (Illinois false position, bracketed by earlier rows or doubling).
    2. Full-precision ε at that root rounded up to the grid; up one grid step while it misses the target.
    3. Down one step while the next σ below also meets it: decided by the coarse value there corrected by
       the measured fine-minus-coarse offset (it changes by ~1e-8 a grid step), and by a full-precision ε
       whenever that prediction is within 1e-4 of the target. Minimality rests on that prediction; that
       ε ≤ target rests on full-precision values only.

    Returns:
        ``(σ, ε)``, ε from :func:`prv_epsilon` at exactly that σ.

    Raises:
        AccountantUnavailable: PRV cannot run near the answer (memory, numerics).
        ValueError: the target needs σ > ``max_sigma``.
    """
    key = (tuple(tuple(h) for h in prior), float(sample_rate), int(steps), float(delta), max_points)
    if key not in _CURVES:
        if len(_CURVES) > 16:
            _CURVES.clear()
        _CURVES[key] = _Curve(*key)
    curve = _CURVES[key]
    # Fail fast: the σ the RDP bound calibrates is above the answer, and the domain only grows as σ falls,
    # so if PRV cannot run there (memory, precision) it cannot run at the answer either.
    hi = 1.0
    while rdp_int_epsilon(history=curve.history(hi), delta=delta) > target_epsilon and hi < max_sigma:
        hi *= 2
    lo = hi / 2
    for _ in range(30):
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if rdp_int_epsilon(history=curve.history(mid), delta=delta) <= target_epsilon else (mid, hi)
    size = domain_points(history=curve.history(hi), delta=delta)
    _check_precision(curve.history(hi), delta, size)
    if size > max_points:
        raise AccountantUnavailable(f"PRV would need more than {size:,.3g} points "
                                    f"(~{size * BYTES_PER_POINT / 2**30:,.3g} GiB; limit {max_points:,} points)")
    a, b = curve.bracket(target_epsilon, start=hi)
    if b > max_sigma:
        raise ValueError("unreachable")
    xa, xb = math.log(a), math.log(b)
    fa, fb = math.log(curve.coarse(a) / target_epsilon), math.log(curve.coarse(b) / target_epsilon)
    side = 0
    for _ in range(60):  # Illinois: false position that halves a stale end's value, superlinear
        x = xb - fb * (xb - xa) / (fb - fa) if fb != fa else (xa + xb) / 2
        if not min(xa, xb) < x < max(xa, xb):
            x = (xa + xb) / 2
        fx = math.log(curve.coarse(math.exp(x)) / target_epsilon)
        if fx > 0:
            xa, fa = x, fx
            if side == -1:
                fb /= 2
            side = -1
        else:
            xb, fb = x, fx
            if side == 1:
                fa /= 2
            side = 1
        if abs(xb - xa) < 1e-9 or round_up(math.exp(xa), digits) == round_up(math.exp(xb), digits):
            break  # both ends round to the same grid point: the coarse answer is known
    if math.exp(xa) in curve.substitutes:
        # PRV cannot run just below the answer, so the smallest σ it accepts cannot be certified there.
        raise AccountantUnavailable(f"at σ={math.exp(xa):.4g}, next to the answer: "
                                    f"{curve.substitutes[math.exp(xa)]}")
    sigma = round_up(math.exp(xb), digits)
    if progress:
        progress(f"σ ≈ {sigma:.{digits}g}; confirming with the full-precision PRV")
    while curve.fine(sigma) > target_epsilon:
        sigma = grid_above(sigma, digits)
        if sigma > max_sigma:
            raise ValueError("unreachable")
    while True:
        below = grid_below(sigma, digits)
        if below <= 0:
            break
        predicted = curve.coarse(below) + curve.fine(sigma) - curve.coarse(sigma)
        if predicted > target_epsilon + 1e-4 or curve.fine(below) > target_epsilon:
            break  # clearly above the target, or measured above it: σ is the smallest that meets it
        sigma = below
    return sigma, curve.fine(sigma)
