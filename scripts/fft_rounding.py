"""How much float64 rounding moves δ(ε) in the two FFT accountants, in units of T·2⁻⁵² (T: the composed steps).

Both compose T steps as the T-th power of one step's discrete Fourier transform: dp-accounting's PLD (the plan's
fallback) and dpllm's PRV (:mod:`dpllm.privacy.prv`, Opacus's algorithm). Each is run here as it runs in dpllm,
in float64, and again in long double (x86: 2⁻⁶³, so its own rounding is ~2,000× smaller) as the reference; for
the PLD also at four FFT lengths, which change only the rounding. dpllm reads ε at δ less ``ROUNDING``·T·2⁻⁵²
(:data:`dpllm.privacy.prv.ROUNDING`, the same for both) and refuses an accountant where that margin would exceed
``PRECISION_FRACTION``·δ; this prints the largest error seen and the margin, per history. Where that margin is too
large, PLD composes by the tilted FFT of :mod:`dpllm.privacy.tilted`, whose rounding is bounded instead: the last
table checks its ε against long-double compositions and its measured rounding against the bound.

    python scripts/fft_rounding.py            # 7 PLD, 4 PRV and 5 tilted histories, ~2 min on one CPU core
    python scripts/fft_rounding.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys

# (steps, σ, q): N = 10⁹ one epoch of B = 4,096 first (the plan PLD used to report at δ = 1e-10), then ordinary runs
HISTORIES = [(244_141, 0.37, 4.1e-6), (97_657, 0.5, 1.02e-5), (20_000, 0.8, 1e-3), (5_000, 1.0, 0.01),
             (1_000, 0.7, 0.05), (100_000, 0.6, 1e-4), (300_000, 1.0, 1e-3)]
# (steps, σ, q, δ) PRV runs (its own precision check refuses the long ones): the last is near that check's limit
PRV_HISTORIES = [(1_000, 0.7, 0.05, 1e-6), (5_000, 1.0, 0.01, 1e-6), (20_000, 0.8, 1e-3, 1e-7),
                 (9_766, 0.75, 1.02e-4, 1e-8)]
# (steps, σ, q, δ) for the tilted composition: the billion-record plan at σ = 0.3882 (RDP's σ for ε = 8) and at
# σ = 0.58 (ε ≈ 0.53), then plans where the plain FFT's rounding is a smaller part of δ
CERTIFIED = [(244_141, 0.3882, 4.096e-6, 1e-10), (244_141, 0.58, 4.096e-6, 1e-10), (97_657, 0.5, 1.024e-5, 1e-9),
             (20_000, 0.8, 1e-3, 1e-9), (1_000, 1.0, 0.01, 1e-6)]
PADDINGS = (0, 700, 3000, 9000)
EPSILONS = (1.0, 2.0, 4.0, 8.0)


def _delta_at(losses, pmf, eps: float) -> float:
    import numpy as np

    above = losses > eps
    return float(np.sum((1 - np.exp(eps - losses[above])) * pmf[above]))


def spread(steps: int, sigma: float, q: float, *, interval: float = 1e-3, paddings=PADDINGS) -> list[dict]:
    """dp-accounting's PLD: δ(ε) at :data:`EPSILONS` of ``steps`` composed (σ, q) steps at each FFT length, the
    largest difference between lengths and the largest distance from the long-double composition, in
    steps·2⁻⁵²."""
    import numpy as np
    from dp_accounting.pld import common
    from dp_accounting.pld import privacy_loss_distribution as pld
    from scipy import fft

    from dpllm.privacy.prv import _power

    one = pld.from_gaussian_mechanism(standard_deviation=sigma, sampling_prob=q, pessimistic_estimate=True,
                                      value_discretization_interval=interval)
    probs, lowest = one._pmf_remove._probs, one._pmf_remove._lower_loss  # the dense pmf dp-accounting composes
    lo, hi = common.compute_self_convolve_bounds(probs, steps, 1e-15)
    n = hi - lo + 1
    losses = (np.arange(n) + lo + lowest * steps) * interval
    composed = []
    for pad in paddings:
        length = fft.next_fast_len(max(n, len(probs)) + pad)
        composed.append(np.roll(np.real(fft.ifft(fft.fft(probs, length) ** steps)), -lo)[:n])
    length = fft.next_fast_len(max(n, len(probs)))
    exact = np.roll(np.real(fft.ifft(_power(fft.fft(probs.astype(np.longdouble), length), steps))), -lo)[:n]
    losses_ld = losses.astype(np.longdouble)
    unit = steps * sys.float_info.epsilon
    rows = []
    for eps in EPSILONS:
        deltas = [_delta_at(losses, y, eps) for y in composed]
        ref = _delta_at(losses_ld, exact, eps)
        rows.append({"epsilon": eps, "delta": ref, "spread_in_T_eps": (max(deltas) - min(deltas)) / unit,
                     "error_in_T_eps": max(abs(d - ref) for d in deltas) / unit})
    return rows


def prv_error(steps: int, sigma: float, q: float, delta: float) -> dict:
    """dpllm's PRV: its ε for the history, and δ at ε/2, ε, 2ε from its float64 composition against the same
    composition in long double, in steps·2⁻⁵² (and its precision check's estimate T·2⁻⁵²·√n, as a fraction of δ)."""
    import math

    import numpy as np

    from dpllm.privacy import prv

    history = [(sigma, q, steps)]
    eps = prv.prv_epsilon(history=history, delta=delta)
    dom = prv._domain(history, delta / 1000, prv.EPS_ERROR)
    pmf, shift = prv._discretise(q, sigma, dom)
    losses = dom.t_min + shift * steps + dom.dt * np.arange(dom.size)
    ours = prv._self_compose(pmf, steps)
    exact = prv._self_compose(pmf.astype(np.longdouble), steps)  # the same code, in long double
    losses_ld, unit = losses.astype(np.longdouble), steps * sys.float_info.epsilon
    rows = []
    for e in (eps / 2, eps, 2 * eps):
        ref = _delta_at(losses_ld, exact, e)
        rows.append({"epsilon": e, "delta": ref, "error_in_T_eps": abs(_delta_at(losses, ours, e) - ref) / unit})
    return {"steps": steps, "sigma": sigma, "q": q, "delta": delta, "prv_epsilon": eps, "points": dom.size,
            "check_over_delta": unit * math.sqrt(dom.size) / delta, "rows": rows}


def certified_check(steps: int, sigma: float, q: float, delta: float, *, interval: float = 1e-3,
                    untilted: bool = True) -> dict:
    """:mod:`dpllm.privacy.tilted` against references: its ε; δ at that ε from the same tilted composition in long
    double at another tilt (0.8λ) and a window twice as wide (tilting is an exact identity, so only rounding and
    aliasing can tell the two apart: must be ≤ δ); δ there from the *untilted* composition in long double at two FFT
    lengths (independent of the tilt, but its own rounding, ~T·2⁻⁶⁴ absolute, shows as their spread; ``untilted``
    False: skipped, it is the slow part); the float64
    window's ℓ2 distance from the long-double one, against the ℓ2 bound the ε was certified with; and
    dp-accounting's own float64 ε at δ."""
    import math

    import numpy as np
    from dp_accounting.pld import common
    from dp_accounting.pld import privacy_loss_distribution as pld
    from scipy import fft

    from dpllm.privacy import tilted
    from dpllm.privacy.prv import _power

    one = pld.from_gaussian_mechanism(standard_deviation=sigma, sampling_prob=q, pessimistic_estimate=True,
                                      value_discretization_interval=interval)
    pmf = one._pmf_remove
    pieces = [tilted.Piece(pmf._lower_loss, pmf._probs, pmf._infinity_mass, steps)]
    res = tilted.certified_epsilon(pieces, interval=interval, delta=delta)
    eps = np.longdouble(res.epsilon)
    ours = tilted._compose(pieces, interval, res.tilt, res.start, res.bins)[0]
    ref = tilted._compose(pieces, interval, res.tilt, res.start, res.bins, reference=True)[0]
    measured = float(np.sqrt(np.sum((ours.astype(np.longdouble) - ref) ** 2)))
    lam, n = 0.8 * res.tilt, 2 * res.bins
    start = res.start - res.bins // 2
    other, log_m = tilted._compose(pieces, interval, lam, start, n, reference=True)[:2]
    losses = ((start + np.arange(n)) * interval).astype(np.longdouble)
    above = losses > eps
    tilted_delta = float(np.sum((1 - np.exp(eps - losses[above])) * other[above]
                                * np.exp(np.longdouble(log_m) - np.longdouble(lam) * losses[above])))
    tilted_delta += math.exp(min(700.0, log_m - lam * (start + n) * interval))  # above the window (Markov)
    probs, lowest = pmf._probs, pmf._lower_loss
    lo, hi = common.compute_self_convolve_bounds(probs, steps, 1e-15)
    size = hi - lo + 1
    grid = ((np.arange(size) + lo + lowest * steps) * interval).astype(np.longdouble)
    deltas = []
    for pad in (0, 3000) if untilted else ():
        length = fft.next_fast_len(max(size, len(probs)) + pad)
        exact = np.roll(np.real(fft.ifft(_power(fft.fft(probs.astype(np.longdouble), length), steps))), -lo)[:size]
        deltas.append(_delta_at(grid, exact, res.epsilon) - float(np.expm1(steps * np.log1p(-pmf._infinity_mass))))
    return {"steps": steps, "sigma": sigma, "q": q, "delta": delta, "epsilon": res.epsilon,
            "bound_over_delta": res.bound / delta, "tilted_reference_delta": tilted_delta,
            "untilted_delta": max(deltas, default=math.nan),
            "untilted_spread": abs(deltas[1] - deltas[0]) if deltas else math.nan,
            "measured_l2": measured, "l2_bound": res.l2_bound, "bins": res.bins,
            "dp_accounting_epsilon": float(one.self_compose(steps).get_epsilon_for_delta(delta))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    from dpllm.privacy.prv import ROUNDING

    out, worst = {"pld": [], "prv": []}, 0.0
    print("PLD (dp-accounting): δ(ε) from the long-double run; float64 error and spread over FFT lengths, ·T·2⁻⁵²")
    print(f"{'steps':>8} {'σ':>5} {'q':>8}  " + "  ".join(f"δ(ε={e:g}) err spread" for e in EPSILONS))
    for steps, sigma, q in HISTORIES:
        rows = spread(steps, sigma, q)
        worst = max(worst, *(max(r["spread_in_T_eps"], r["error_in_T_eps"]) for r in rows))
        out["pld"].append({"steps": steps, "sigma": sigma, "q": q, "rows": rows})
        print(f"{steps:>8,} {sigma:>5g} {q:>8g}  " + "  ".join(
            f"{r['delta']:9.2e} {r['error_in_T_eps']:4.2f} {r['spread_in_T_eps']:4.2f}" for r in rows), flush=True)
    print("PRV (dpllm.privacy.prv): float64 error of δ at ε/2, ε, 2ε, ·T·2⁻⁵²")
    for steps, sigma, q, delta in PRV_HISTORIES:
        r = prv_error(steps, sigma, q, delta)
        worst = max(worst, *(row["error_in_T_eps"] for row in r["rows"]))
        out["prv"].append(r)
        errors = "  ".join(f"{row['error_in_T_eps']:.2f}" for row in r["rows"])
        print(f"{steps:>8,} {sigma:>5g} {q:>8g}  δ={delta:g} ε={r['prv_epsilon']:.4f} ({r['points']:,} points; "
              f"check {r['check_over_delta']:.2g}·δ)  {errors}", flush=True)
    print(f"largest: {worst:.2f}·T·2⁻⁵²; dpllm's margin: {ROUNDING:g}·T·2⁻⁵² "
          f"({ROUNDING / max(worst, 1e-12):.1f}× the largest)")
    print("Tilted PLD (dpllm.privacy.tilted): certified ε; δ there in long double; ℓ2 error against its bound")
    out["tilted"] = []
    for steps, sigma, q, delta in CERTIFIED:
        r = certified_check(steps, sigma, q, delta)
        out["tilted"].append(r)
        print(f"{steps:>8,} {sigma:>5g} {q:>8g}  δ={delta:g} ε={r['epsilon']:.5f} (dp-accounting "
              f"{r['dp_accounting_epsilon']:.5f})  δ(ε)/δ in long double: tilted "
              f"{r['tilted_reference_delta'] / delta:.7f}, untilted {r['untilted_delta'] / delta:.6f} ± "
              f"{r['untilted_spread'] / delta:.1g}  bound {r['bound_over_delta']:.2g}·δ  "
              f"ℓ2 error {r['measured_l2']:.2g} ≤ {r['l2_bound']:.2g}", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"paddings": PADDINGS, "rounding": ROUNDING, **out}, fh, indent=1)


if __name__ == "__main__":
    main()
