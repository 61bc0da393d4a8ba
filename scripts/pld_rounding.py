"""How much float64 rounding moves dp-accounting's PLD δ(ε), in units of T·2⁻⁵² (T: the composed steps).

dp-accounting composes T steps as the T-th power of one step's discrete Fourier transform. The length of that
transform changes only the rounding (the composed distribution fits either way), so running the same composition
at several lengths and comparing δ(ε) measures the rounding. dpllm reads ε at δ - PLD_ROUNDING·T·2⁻⁵² and refuses
PLD where that margin exceeds PRECISION_FRACTION·δ (:func:`dpllm.privacy.accounting.pld_rounding_margin`); this
prints the spread seen and the margin dpllm takes, per history.

    python scripts/pld_rounding.py            # 7 histories, ~3 s on one CPU core
    python scripts/pld_rounding.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys

# (steps, σ, q): N = 10⁹ one epoch of B = 4,096 first (the plan PLD used to report at δ = 1e-10), then ordinary runs
HISTORIES = [(244_141, 0.37, 4.1e-6), (97_657, 0.5, 1.02e-5), (20_000, 0.8, 1e-3), (5_000, 1.0, 0.01),
             (1_000, 0.7, 0.05), (100_000, 0.6, 1e-4), (300_000, 1.0, 1e-3)]
PADDINGS = (0, 700, 3000, 9000)
EPSILONS = (1.0, 2.0, 4.0, 8.0)


def spread(steps: int, sigma: float, q: float, *, interval: float = 1e-3, paddings=PADDINGS) -> list[dict]:
    """δ(ε) at :data:`EPSILONS` of ``steps`` composed (σ, q) steps, at each FFT length: the first length's δ and
    the largest difference between lengths, in units of steps·2⁻⁵²."""
    import numpy as np
    from dp_accounting.pld import common
    from dp_accounting.pld import privacy_loss_distribution as pld
    from scipy import fft

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
    unit = steps * sys.float_info.epsilon
    rows = []
    for eps in EPSILONS:
        above = losses > eps
        deltas = [float(np.sum((1 - np.exp(eps - losses[above])) * y[above])) for y in composed]
        rows.append({"epsilon": eps, "delta": deltas[0], "spread_in_T_eps": (max(deltas) - min(deltas)) / unit})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    from dpllm.privacy.accounting import PLD_ROUNDING

    out, worst = [], 0.0
    print(f"{'steps':>8} {'σ':>5} {'q':>8}  " + "  ".join(f"δ(ε={e:g}) spread" for e in EPSILONS))
    for steps, sigma, q in HISTORIES:
        rows = spread(steps, sigma, q)
        worst = max(worst, *(r["spread_in_T_eps"] for r in rows))
        out.append({"steps": steps, "sigma": sigma, "q": q, "rows": rows})
        print(f"{steps:>8,} {sigma:>5g} {q:>8g}  " + "  ".join(f"{r['delta']:9.2e} {r['spread_in_T_eps']:5.2f}"
                                                              for r in rows), flush=True)
    print(f"largest spread: {worst:.2f}·T·2⁻⁵²; dpllm's margin: {PLD_ROUNDING:g}·T·2⁻⁵² "
          f"({PLD_ROUNDING / max(worst, 1e-12):.1f}× the largest spread)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"paddings": PADDINGS, "pld_rounding": PLD_ROUNDING, "histories": out}, fh, indent=1)


if __name__ == "__main__":
    main()
