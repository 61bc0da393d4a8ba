"""Prefix-sum RMSE of DP-SGD, BLT (2–5 buffers) and the square-root factorisation (issue 45's error table).

The metric is the matrix-factorisation literature's: the RMSE per step of the noisy prefix sums of the
gradient stream, with noise of std 1 on the strategy's output, times the strategy's sensitivity under
b-min-separation (k = epochs participations, b = ⌈T/epochs⌉ steps apart). At equal μ (Gaussian DP of the whole
run) the real RMSE is this number × clip/μ. Every mechanism here is accounted the same way (no amplification
by sampling), so the numbers compare directly; DP-SGD with Poisson sampling is accounted differently and is
not in this table. ``best Toeplitz`` is the optimum over all Toeplitz strategies with non-negative,
non-increasing coefficients (dense, O(T³) per step; only for T ≤ --dense-max-steps).

Run: PYTHONPATH=$PWD python scripts/mf_errors.py --out mf_errors.json   (about a minute on one core)
     PYTHONPATH=$PWD python scripts/mf_errors.py --smoke                 (tiny shapes, seconds)
"""

from __future__ import annotations

import argparse
import json
import time

from tqdm import tqdm

from dpllm.privacy.correlated import blt as B


def rows_for(steps: int, epochs: int, buffers: list[int], dense_max_steps: int) -> list[dict]:
    b = -(-steps // epochs)
    common = {"steps": steps, "epochs": epochs, "min_separation": b,
              "participations": B.participations(steps, b)}
    out = [dict(common, mechanism="dpsgd", buffers=0, rmse=B.dpsgd_prefix_sum_rmse(steps=steps, min_separation=b)),
           dict(common, mechanism="sqrt", buffers=None, rmse=B.sqrt_prefix_sum_rmse(steps=steps, min_separation=b))]
    for d in buffers:
        t = time.perf_counter()
        s = B.optimize_blt(steps, d, b)
        out.append(dict(common, mechanism="blt", buffers=d, rmse=s.prefix_sum_rmse(steps),
                        sensitivity=s.sensitivity(), optimise_s=round(time.perf_counter() - t, 2),
                        theta=s.blt.theta.tolist(), omega=s.blt.omega.tolist()))
    if steps <= dense_max_steps:
        c = B.optimal_toeplitz_coefs(steps=steps, min_separation=b)
        out.append(dict(common, mechanism="best_toeplitz", buffers=None,
                        rmse=B.toeplitz_prefix_sum_rmse(c, min_separation=b)))
    return out


def table(rows: list[dict]) -> str:
    lines = ["| T | epochs | b | mechanism | buffers | prefix-sum RMSE | × DP-SGD |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        base = next(x["rmse"] for x in rows if x["mechanism"] == "dpsgd" and x["steps"] == r["steps"]
                    and x["epochs"] == r["epochs"])
        lines.append(f"| {r['steps']} | {r['epochs']} | {r['min_separation']} | {r['mechanism']} | "
                     f"{'' if r['buffers'] is None else r['buffers']} | {r['rmse']:.4f} | {r['rmse'] / base:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, nargs="+", default=[100, 1000], help="T, the noised steps of the run")
    ap.add_argument("--epochs", type=int, nargs="+", default=[1, 4], help="participations per record (k)")
    ap.add_argument("--buffers", type=int, nargs="+", default=[2, 3, 4, 5], help="BLT buffer counts")
    ap.add_argument("--dense-max-steps", type=int, default=100, help="compute the best dense Toeplitz up to this T")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (T 16, epochs 1 and 2, 2 buffers)")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args(argv)
    if args.smoke:
        args.steps, args.epochs, args.buffers = [16], [1, 2], [2]
    rows = []
    cases = [(t, e) for t in args.steps for e in args.epochs]
    for steps, epochs in tqdm(cases, desc="mf_errors"):
        rows.extend(rows_for(steps, epochs, args.buffers, args.dense_max_steps))
    result = {"metric": "prefix-sum RMSE per step × sens(C, b, k), noise std 1 (× clip/μ at equal μ)",
              "accounting": "all rows: one Gaussian mechanism over the run, b-min-separated participation, "
                            "no amplification", "rows": rows}
    print(table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
