"""Coverage of scaling-law intervals beyond the data: parameter-only, in-range, and widened by validation.

    OMP_NUM_THREADS=1 python scripts/scaling_extrapolation.py --sweeps 10 --n-boot 100
    python scripts/scaling_extrapolation.py --table svg_extracted_data.csv --cut 2e9

Synthetic (default): sweeps of 6 sizes (1e6-1e8) × 4 token counts (1e8-1e10) from a truth the chinchilla form
does not contain (the same scenarios as tests/test_scaling_extrapolation.py, plus the well-specified law), fitted
with ``fit_form(validate=True)`` and asked about sizes 3e8 and 1e9 (×3, ×10 beyond) at the same token counts.

``--table``: a real sweep, fitted on its models up to ``--cut`` parameters and asked about all larger ones. It
reads columns N, D, loss, or the Chinchilla replication's ``Model Size``, ``Training FLOP``, ``loss``
(Besiroglu et al. 2024, github.com/epoch-research/analyzing-chinchilla, data/svg_extracted_data.csv: not
shipped here, that repository carries no licence; D = FLOP / 6N).

Prints, per case, the fraction of held-out runs inside each 95% interval and the median width (log-loss, %), and
the narrowest symmetric width that would have covered 95% of them.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from dpllm.scaling import fit_form  # noqa: E402


def _score(fit, x, y) -> dict:
    bands = {"parameter_only": fit.confidence_interval(**x), "in_range": fit.prediction_interval(widen=False, **x),
             "widened": fit.prediction_interval(**x)}
    err = np.log(y / fit.predict(**x))
    return {"inside": {k: ((lo <= y) & (y <= hi)).tolist() for k, (lo, hi) in bands.items()},
            "width": {k: np.log(hi / lo).tolist() for k, (lo, hi) in bands.items()}, "err": err.tolist()}


def _summary(scores: list[dict]) -> dict:
    cat = {k: np.concatenate([s["inside"][k] for s in scores]) for k in scores[0]["inside"]}
    wid = {k: np.concatenate([s["width"][k] for s in scores]) for k in scores[0]["width"]}
    err = np.concatenate([s["err"] for s in scores])
    return {"n_held_out": int(len(err)), "coverage": {k: round(float(v.mean()), 3) for k, v in cat.items()},
            "median_width_pct": {k: round(100 * float(np.median(v)), 2) for k, v in wid.items()},
            "needed_width_pct": round(200 * float(np.quantile(np.abs(err), 0.95)), 2),
            "mean_abs_error_pct": round(100 * float(np.mean(np.abs(err))), 2)}


def synthetic(sweeps: int, n_boot: int) -> dict:
    import test_scaling_extrapolation as t

    out = {}
    for kind in ("well_specified", "extra_term", "curvature", "heteroscedastic"):
        scores, kappas = [], []
        for rep in range(sweeps):
            rng = np.random.default_rng(100 + rep)
            n, d, y = t._runs(kind, rng, t.SIZES)
            fit = fit_form("chinchilla", loss=y, N=n, D=d, n_boot=n_boot, seed=rep, validate=True)
            hn, hd, hy = t._runs(kind, rng, t.BEYOND)
            scores.append(_score(fit, {"N": hn, "D": hd}, hy))
            kappas.append(fit.extrapolation["kappa"])
        out[kind] = {**_summary(scores), "kappa_median": float(np.median(kappas))}
        print(kind, json.dumps(out[kind]), flush=True)
    return out


def table(path: str, cut: float, n_boot: int) -> dict:
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    if "Model Size" in rows[0]:
        n = np.array([float(r["Model Size"]) for r in rows])
        d = np.array([float(r["Training FLOP"]) for r in rows]) / (6 * n)
    else:
        n, d = (np.array([float(r[k]) for r in rows]) for k in ("N", "D"))
    y = np.array([float(r["loss"]) for r in rows])
    small = n <= cut
    fit = fit_form("chinchilla", loss=y[small], N=n[small], D=d[small], n_boot=n_boot, seed=0, validate=True)
    res = {"rows": len(y), "fitted": int(small.sum()), "cut": cut, "params": fit.params,
           **_summary([_score(fit, {"N": n[~small], "D": d[~small]}, y[~small])]),
           "validation": {k: fit.extrapolation.get(k) for k in ("status", "kappa", "coverage", "median_width_pct")},
           "beyond_factor_N": [float(n[~small].min() / n[small].max()), float(n[~small].max() / n[small].max())]}
    print(json.dumps(res, indent=1))
    return res


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sweeps", type=int, default=10)
    p.add_argument("--n-boot", type=int, default=100)
    p.add_argument("--table", help="a CSV of a real sweep (see the module docstring)")
    p.add_argument("--cut", type=float, default=2e9, help="fit models up to this N, predict the larger (--table)")
    args = p.parse_args(argv)
    if args.table:
        table(args.table, args.cut, args.n_boot)
    else:
        synthetic(args.sweeps, args.n_boot)


if __name__ == "__main__":
    main()
