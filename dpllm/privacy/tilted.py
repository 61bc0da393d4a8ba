"""A certified ε from privacy-loss distributions composed by an exponentially tilted FFT.

dp-accounting composes T steps of a privacy-loss distribution (PLD) as the T-th power of one step's discrete Fourier
transform. Float64 rounding then errs by about T·2⁻⁵² *in absolute probability* in every bin, the tail at δ = 1e-10
included: at T = 244,141 (N = 10⁹, one epoch of B = 4,096) that is half of δ, so :mod:`dpllm.privacy.accounting`
refused PLD there and the plan fell back to RDP (17% looser). This module composes the same discretised PLD so that
the rounding is *relative to the tail it is read from*, and bounds it:

1. **Tilt.** For λ > 0 let x_i = p_i·e^{λ·l_i}/M (l_i the grid's losses, M any constant; here ≈ Σ p_i·e^{λ·l_i}).
   Tilting commutes with convolution: the T-fold composition is p^{*T}_l = M^T·e^{-λ·l}·x^{*T}_l, exactly. λ is
   chosen so that the tilted composition's mean is near ε, where δ(ε) is read: the tail that holds δ is then the
   bulk of x^{*T}, and the FFT's absolute error there is small *relative to* that bulk.
2. **Compose** x by a power-of-two complex FFT, a power by squaring of each coefficient, and the inverse FFT, on a
   window of n bins around ε. The circular convolution adds the mass outside the window into it (aliasing adds
   non-negative mass, so δ can only grow), and the mass above the window, which it misses, is at most
   M^T·e^{-λ·top} (Markov's inequality on e^{λL}); that is added to δ.
3. **Bound the rounding.** A radix-2 FFT of length n = 2^p is p stages of butterflies a ± ω·b, each rounding by at
   most η·(|a| + |b|), η = μ + γ₄(√2 + μ) with μ the twiddle factors' error (Higham 2002, *Accuracy and Stability
   of Numerical Algorithms*, 2nd ed., §24.1 and Thm 24.2; a complex product errs by ≤ √2·γ₂, Lemma 3.5). The
   butterflies' inputs at any stage are partial transforms, of modulus at most the ℓ1 norm of the entries they
   sum, so by induction over the stages every coefficient errs by at most φ = η_F·‖x‖₁, η_F = p·η/(1 − p·η) (the
   componentwise form of Higham's normwise Thm 24.2). The composed coefficient Y_k = Π_j X_{j,k}^{T_j} then errs by
   at most P_k·(Σ_j T_j·φ_j/(|X̃_{j,k}| + φ_j) + m), P_k = Π_j (|X̃_{j,k}| + φ_j)^{T_j} (computed from the
   transform itself, so coefficients that the power damps contribute little) and m the compounded rounding of the
   2T-odd complex products of a power by squaring. By Parseval the window's ℓ2 error is at most ‖ΔY‖₂/√n plus the
   inverse transform's own η_F·‖ỹ‖₂/(1 − η_F), and by Cauchy–Schwarz its effect on δ(ε) is at most that times
   (Σ_{l>ε} (M^T·e^{-λ·l})²)^½: the same Chernoff factor that sizes δ itself, so the bound is a small fraction of δ
   (~1e-7 of it at the plan above) instead of T·2⁻⁵² ≈ 5e-11. Relative rounding of the tilt, of exp and of the sums
   is bounded the same way and multiplies δ by 1 + ~1e-7. The FFT is scipy's pocketfft (radix-4 and -2 passes at
   these lengths), not the textbook radix-2 network: η_F is taken :data:`FFT_SAFETY` times the bound above, with
   μ = 4u; ``scripts/fft_rounding.py`` measures the actual error against the same composition in long double
   (10³ to 10⁵ times below the bound).

The result is an upper bound on the ε of the discretised PLD that dp-accounting builds (pessimistic, itself an
upper bound on the mechanism's), read at δ with every error above added to δ's side: never below the true ε.

Example:
    >>> from dp_accounting.pld import privacy_loss_distribution as pld
    >>> p = pld.from_gaussian_mechanism(standard_deviation=1.0, sampling_prob=0.01,
    ...                                 value_discretization_interval=1e-3)._pmf_remove
    >>> res = certified_epsilon([Piece(p._lower_loss, p._probs, p._infinity_mass, 1000)], interval=1e-3, delta=1e-6)
    >>> round(res.epsilon, 4), res.bound < 1e-12   # dp-accounting gives 2.1253
    (2.1253, True)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy.fft import fft, ifft
from scipy.special import logsumexp

U = 2.0**-53  # unit roundoff of float64
# The forward transforms and the power are computed in long double (x86: 2⁻⁶⁴, its rounding ~2,000× smaller): it is
# the rounding there that the T-fold power amplifies. Where numpy's long double is float64 the bound follows.
UL = float(np.finfo(np.longdouble).eps) / 2
# pocketfft is mixed-radix: its error is taken as this many times the radix-2 bound of Higham's Thm 24.2
FFT_SAFETY = 8.0
TWIDDLE_ERROR = 4.0  # μ, in units of the roundoff: pocketfft computes its twiddle factors to about an ulp
MAX_BINS = 2**22  # 128 MiB of complex long double per array: the windows seen are 2¹⁵ to 2¹⁸ bins
WINDOW_SDS = 6.0  # the window reaches this many tilted standard deviations (and 30/λ) each side of ε
EXP_FLOOR = -700.0  # tilted masses below e^-700 are dropped (their total is bounded and added to the error)
MAX_EPSILON = 500.0  # above this the caller's RDP bound stands in (dpllm.privacy.accounting's fallback)


class Unavailable(RuntimeError):
    """The composition cannot be certified for these inputs (a window too large, numerics)."""


@dataclass(frozen=True)
class Piece:
    """``times`` steps of one PLD on the grid: losses ``(lower + i)·interval``, masses ``probs``, and ``inf_mass``
    on an infinite loss (dp-accounting's ``DensePLDPmf`` fields)."""

    lower: int
    probs: np.ndarray
    inf_mass: float
    times: int


@dataclass(frozen=True)
class Certified:
    """ε and what was added to δ for it: ``bound`` (rounding and window, in probability at that ε), ``tilt`` (λ),
    ``bins`` (the FFT's length), ``start`` (the window's first bin), ``l2_bound`` (the bound on the tilted
    composition's ℓ2 rounding error over the window)."""

    epsilon: float
    bound: float
    tilt: float = 0.0
    bins: int = 0
    start: int = 0
    l2_bound: float = 0.0


def _fft_error(n: int, u: float = U) -> float:
    """η_F for a length-n = 2^p transform at unit roundoff ``u`` (Higham 2002, Thm 24.2), times :data:`FFT_SAFETY`."""
    p = math.log2(n)
    gamma4 = 4 * u / (1 - 4 * u)
    mu = TWIDDLE_ERROR * u
    eta = mu + gamma4 * (math.sqrt(2) + mu)
    return FFT_SAFETY * p * eta / (1 - p * eta)


def _log_mgf(pieces: Sequence[Piece], interval: float, lam: float) -> tuple[float, float, float]:
    """log E[e^{λL}] of the composition's finite part, and the tilted composition's mean and variance."""
    log_m = mean = var = 0.0
    for pc in pieces:
        with np.errstate(divide="ignore"):
            logp = np.log(pc.probs)
        losses = (pc.lower + np.arange(len(pc.probs))) * interval
        a = logp + lam * losses
        lm = float(logsumexp(a))
        w = np.exp(a - lm)
        mu = float(np.dot(w, losses))
        log_m += pc.times * lm
        mean += pc.times * mu
        var += pc.times * float(np.dot(w, (losses - mu) ** 2))
    return log_m, mean, var


def _tilt_for(pieces: Sequence[Piece], interval: float, target: float) -> float:
    """λ ≥ 1 whose tilted composition has its mean near ``target`` (bisection on log λ; the mean grows with λ)."""
    step_max = max(pc.lower + len(pc.probs) - 1 for pc in pieces) * interval
    lo, hi = 1.0, max(2.0, 2000.0 / max(step_max, interval))
    if _log_mgf(pieces, interval, lo)[1] >= target:
        return lo
    if _log_mgf(pieces, interval, hi)[1] <= target:
        return hi
    for _ in range(30):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if _log_mgf(pieces, interval, mid)[1] < target else (lo, mid)
    return math.sqrt(lo * hi)


def _compose(pieces: Sequence[Piece], interval: float, lam: float, start: int, n: int, reference: bool = False):
    """The tilted composition on the window of bins ``start .. start+n-1``, with its rounding bounds.

    Returns ``(y, log_m, e2, rel)``: the computed tilted masses of the window (real part), log of the constant M^T,
    the ℓ2 bound on the window's rounding error, and a relative error bound on the tilted inputs' computation
    (compounded over the steps, as a factor on the composed masses). The forward transforms and the power run in
    long double, the inverse transform in float64; ``reference``: the inverse too, and ``y`` is returned in long
    double (``scripts/fft_rounding.py``'s reference; the bounds stay those of the mixed computation)."""
    eta_l = _fft_error(n, UL)
    total_steps = sum(pc.times for pc in pieces)
    product = None
    log_m = log_g = 0.0
    log_p = np.zeros(n)  # log Π_j (|X̃_j,k| + φ_j)^{T_j}: bounds every composed coefficient, exact or computed
    amplified = np.zeros(n)  # Σ_j T_j·φ_j / (|X̃_j,k| + φ_j): the input error, as the power amplifies it
    rel_exponent = 0.0  # Σ_j T_j·ρ_j: the composed masses are within e^{±that} of the exact tilt's
    offset = 0
    for pc in pieces:
        with np.errstate(divide="ignore"):
            logp = np.log(pc.probs)
        losses = (pc.lower + np.arange(len(pc.probs))) * interval
        arg = logp + lam * losses
        lm = float(logsumexp(arg))
        arg -= lm
        keep = arg > EXP_FLOOR
        x = np.zeros(len(arg))
        x[keep] = np.exp(arg[keep])
        dropped = float(np.count_nonzero(np.isfinite(arg) & ~keep)) * math.exp(EXP_FLOOR)
        scale = float(np.max(np.abs(lam * losses[keep]))) if keep.any() else 0.0
        # log p (relative u, so ≤ 745u absolute), λ·l, − log M and exp each round: ρ relative per tilted mass
        rho = 8 * U * (750.0 + scale + abs(lm))
        rel_exponent += pc.times * rho
        if len(x) > n:  # a step wider than the window: fold it (circular composition of folded steps = folded result)
            folded = np.bincount(np.arange(len(x)) % n, weights=x, minlength=n)
        else:
            folded = np.pad(x, (0, n - len(x)))
        s = float(np.sum(folded)) * (1 + 2 * len(x) * U) + dropped  # ≥ ‖x‖₁, the dropped masses included
        phi = eta_l * s + dropped  # ≥ |X̃_k − X_k| for every k: the componentwise FFT bound, the dropped masses
        log_g += pc.times * math.log(s + phi)
        spectrum = fft(folded.astype(np.clongdouble))
        magnitude = np.abs(spectrum).astype(float) * (1 + 4 * U) + phi
        log_p += pc.times * np.log(magnitude)
        amplified += pc.times * phi / magnitude
        power = _power(spectrum, pc.times)
        product = power if product is None else product * power
        log_m += pc.times * lm
        offset += pc.times * pc.lower
    if log_g > 1.0:
        raise Unavailable(f"the tilted transform's rounding is not small (log G = {log_g:.3g})")
    products = 2 * total_steps + 2 * sum(math.ceil(math.log2(pc.times + 1)) for pc in pieces) + len(pieces)
    mult = math.expm1(products * math.sqrt(2) * 2 * UL / (1 - 2 * UL))
    # |ΔY_k| ≤ P_k·(Σ_j T_j·φ_j/(|X̃_j,k| + φ_j) + mult + u): the transforms' error as the power amplifies it, the
    # products' compounded rounding, and the cast to float64. log P_k errs by ≤ (3 + J)·u·|log P_k| ≤ 1e-12 where
    # P_k does not underflow; where it does, its true value is below 1e-300
    bound_k = np.exp(log_p) * (1 + 1e-11) * (amplified + mult + U) + 1e-300
    spectrum_err = float(np.sqrt(np.sum(bound_k * bound_k))) * (1 + 2 * n * U)
    eta_f = _fft_error(n, UL if reference else U)
    y = ifft(product if reference else product.astype(np.complex128))
    # ‖ỹ − y‖₂ ≤ ‖ΔY‖₂/√n (the exact inverse of the spectrum's error) + the inverse transform's own, η_F·‖ỹ‖₂/(1 − η_F)
    e2 = spectrum_err / math.sqrt(n) + eta_f * float(np.linalg.norm(y)) * (1 + 2 * n * U) / (1 - eta_f)
    y = np.roll(np.real(y), -((start - offset) % n))
    return y, log_m, e2, math.expm1(rel_exponent / (1 - rel_exponent)) if rel_exponent < 0.5 else math.inf


def _power(f: np.ndarray, steps: int) -> np.ndarray:
    """``f ** steps`` by repeated squaring (each product rounds by ≤ √2·γ₂; counted in :func:`_compose`)."""
    acc, e = None, steps
    while True:
        if e & 1:
            acc = f.copy() if acc is None else acc * f
        e >>= 1
        if not e:
            return acc
        f = f * f


def _read(y, log_m, e2, rel, *, lam, start, n, interval, delta, inf_mass, top_tail):
    """The smallest ε (and the bound added at it) with δ_upper(ε) ≤ δ on this window, or ``"below"``/``"above"``
    where the answer lies outside it.

    For ε in (l_{b-1}, l_b], δ_upper(ε) = F·(A_b − e^ε·B_b + R_b·E₂ + γ·C_b) + tail + inf: A_b, B_b the sums of the
    untilted masses w and of w·e^{-l} over bins ≥ b, R_b = (Σ_{j≥b} W_j²)^½ with W_j the untilting factor (so that
    Σ_{j≥b} W_j·|err_j| ≤ R_b·‖err‖₂ by Cauchy–Schwarz), C_b the sum of |w| (for the sums' rounding), F the
    relative factor."""
    losses = (start + np.arange(n)) * interval
    expo = log_m - lam * losses
    # where W·E₂ alone exceeds δ no ε can be certified (and e^{expo} may overflow): only the bins above count
    ok = expo < min(600.0, math.log(delta) - math.log(max(e2, 1e-300)))
    if not ok.any():
        return "above"
    first = int(np.argmax(ok))  # the factor only shrinks up the window
    losses, expo, y = losses[first:], expo[first:], y[first:]
    weight = np.exp(expo)
    w = y * weight
    rev = lambda v: np.cumsum(v[::-1])[::-1]  # noqa: E731  sums over bins ≥ b
    a_sum = rev(w)
    b_sum = rev(w * np.exp(-losses))
    c_sum = 3.0 * rev(np.abs(w))
    # the sums' rounding (≤ n·u of the absolute terms) and that of the untilting factor (log M^T, λ·l, exp, e^{-l})
    gamma = (2 * len(w) + 16 + 16 * (abs(log_m) + lam * float(np.max(np.abs(losses))) + float(np.max(np.abs(expo)))
                                     + float(np.max(np.abs(losses))))) * U
    factor = (1 + rel) * (1 + gamma)
    extra = np.sqrt(rev(weight * weight)) * e2 + gamma * c_sum  # added inside F
    budget = (delta - inf_mass - top_tail) / factor
    if budget <= 0:
        return "above"
    # at ε = l_b the bins above are b+1..: δ_upper(l_b) with the sums from b+1
    above = np.append(a_sum[1:] - np.exp(losses[:-1]) * b_sum[1:] + extra[1:], 0.0)
    meets = np.nonzero(above[:-1] <= budget)[0]
    if len(meets) == 0:
        return "above"
    b = int(meets[0])  # δ_upper(l_{b-1}) > budget ≥ δ_upper(l_b): ε in (l_{b-1}, l_b], counting bins b, b+1, ...
    if b == 0:
        return "below"  # the answer may lie below the window
    need = a_sum[b] + extra[b] - budget
    eps = losses[b - 1] if need <= 0 or b_sum[b] <= 0 else max(losses[b - 1], math.log(need / b_sum[b]))
    eps = min(float(eps), float(losses[b]))
    bound = factor * float(extra[b]) + (factor - 1) * delta + top_tail
    return eps, bound


def chernoff_epsilon(pieces: Sequence[Piece], *, interval: float, delta: float) -> float:
    """An upper bound on the composition's ε from Markov's inequality on e^{λL}, min over a few λ: δ(ε) ≤ P(L > ε) +
    inf ≤ M(λ)^T·e^{-λε} + inf (cheap: no composition; tens of per cent above :func:`certified_epsilon`)."""
    pieces = [pc for pc in pieces if pc.times > 0]
    inf_mass = -math.expm1(sum(pc.times * math.log1p(-pc.inf_mass) for pc in pieces)) * (1 + 1e-12)
    if not pieces:
        return 0.0
    if inf_mass >= delta:
        return math.inf
    max_loss = sum(pc.times * (pc.lower + len(pc.probs) - 1) for pc in pieces) * interval
    best = min((_log_mgf(pieces, interval, lam)[0] - math.log(delta - inf_mass)) / lam
               for lam in np.geomspace(0.5, 2000.0, 12))
    return max(0.0, min(max_loss, best * (1 + 1e-9) + 1e-12))


def certified_epsilon(pieces: Sequence[Piece], *, interval: float, delta: float) -> Certified:
    """The smallest ε (on the PLD's own piecewise formula) whose δ, with every rounding and window error added, is at
    most ``delta``, for the composition of ``pieces``.

    Raises:
        Unavailable: the window would exceed :data:`MAX_BINS`, or no window reaches the answer.
    """
    pieces = [pc for pc in pieces if pc.times > 0]
    inf_mass = -math.expm1(sum(pc.times * math.log1p(-pc.inf_mass) for pc in pieces))
    inf_mass = min(1.0, inf_mass * (1 + 1e-12) + 1e-300)
    if not pieces:
        return Certified(0.0, 0.0)
    if inf_mass >= delta:
        return Certified(math.inf, 0.0)
    max_loss = sum(pc.times * (pc.lower + len(pc.probs) - 1) for pc in pieces) * interval
    if max_loss <= 0:
        return Certified(0.0, 0.0)
    guess = chernoff_epsilon(pieces, interval=interval, delta=delta)  # a first guess, tens of per cent high
    if guess > MAX_EPSILON:  # e.g. 50,000 unsampled steps at σ = 1: windows of millions of bins, no privacy to tell
        raise Unavailable(f"ε ≈ {guess:.3g} (Chernoff bound) is above {MAX_EPSILON:g}: no privacy to speak of")
    best = None
    for _ in range(4):
        lam = _tilt_for(pieces, interval, guess)
        log_m, _, var = _log_mgf(pieces, interval, lam)
        half = WINDOW_SDS * math.sqrt(var) + 30.0 / lam + 4 * interval
        n = 1 << max(10, math.ceil(math.log2(2 * half / interval + 2)))
        if n > MAX_BINS:
            raise Unavailable(f"a {n:,}-bin window (tilted spread {math.sqrt(var):.3g}) exceeds {MAX_BINS:,} bins")
        start = math.floor(guess / interval) - n // 2
        top = (start + n) * interval
        y, log_m_c, e2, rel = _compose(pieces, interval, lam, start, n)
        top_tail = math.exp(min(700.0, log_m - lam * top)) * (1 + rel) * (1 + 1e-9)
        got = _read(y, log_m_c, e2, rel, lam=lam, start=start, n=n, interval=interval, delta=delta,
                    inf_mass=inf_mass, top_tail=top_tail)
        if isinstance(got, str):  # the answer lies outside this window: move toward it
            guess = min(max_loss, guess + half) if got == "above" else guess - half
            continue
        eps, bound = got
        if best is None or eps < best.epsilon:
            best = Certified(max(0.0, eps), bound, lam, n, start, e2)
        if bound <= 1e-3 * delta or abs(eps - guess) < 1e-3 * max(1.0, eps):
            break  # the rounding is a negligible part of δ, or the tilt already centres the answer
        guess = eps
    if best is None:
        raise Unavailable("no window of the tilted composition reached δ")
    return best
