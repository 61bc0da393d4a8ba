"""A worked scaling-law example on a synthetic CSV: fit, predict, plots, and held-out interval coverage.

    python scripts/scaling_example.py --out docs/results/scaling_fit_example

The runs are synthetic, so the truth is known: Besiroglu et al.'s (2024) Chinchilla law with 1.5%
log-normal run-to-run noise (sd 0.015 of log-loss), on an isoFLOP-style sweep that varies N and D
together (4 budgets × 6 sizes, D = C / 6N, 2 seeds): the case where fixed-D curves miss the scatter. The
script writes ``runs.csv`` (columns N, D, loss, seed: not the runs-table names, so the fit names them
with ``--params-col`` etc.), fits it with ``dpllm scaling fit``, predicts with ``dpllm scaling predict``,
and checks the intervals on ``held_out.csv``: 400 fresh runs at random compute and size inside the sweep's range.
``coverage.json`` has the fraction inside the 95% prediction interval and inside the 95% CI of the mean,
for this sweep and for ``--sweeps`` more synthetic sweeps (other seeds, fitted through the Python API with
``--n-boot-replicates`` resamples): one sweep's coverage varies with its draw of noise.
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

import numpy as np

from dpllm.scaling.cli import cli_main
from dpllm.scaling.fit import FitResult, fit_form, load_fit
from dpllm.scaling.published import PUBLISHED

TRUTH = PUBLISHED["chinchilla-besiroglu2024"]["params"]
NOISE = 0.015  # sd of log-loss between runs (seeds, data order)
BUDGETS = (3e16, 3e17, 3e18, 3e19)  # FLOPs, C = 6·N·D
SIZES = np.geomspace(1e7, 1e9, 6)


def law(n: np.ndarray, d: np.ndarray) -> np.ndarray:
    return TRUTH["E"] + TRUTH["A"] * n ** -TRUTH["alpha"] + TRUTH["B"] * d ** -TRUTH["beta"]


def sweep(rng: np.random.Generator) -> list[dict]:
    """One synthetic isoFLOP sweep: every (budget, size) with D in [1e8, 1e11], two seeds each."""
    rows = []
    for c in BUDGETS:
        for n in SIZES:
            d = c / (6 * n)
            if not 1e8 <= d <= 1e11:
                continue
            for seed in (0, 1):
                loss = float(law(n, d) * np.exp(rng.normal(0, NOISE)))
                rows.append({"N": f"{n:.6g}", "D": f"{d:.6g}", "loss": f"{loss:.5f}", "seed": seed})
    return rows


def held_out(rng: np.random.Generator, fit: FitResult, count: int = 400) -> tuple[np.ndarray, ...]:
    """Fresh runs from the sweep's own design space: a compute between the smallest and largest budget and a
    size in the fitted range (D = C / 6N, kept when inside the fitted D range), not the corners of the
    N × D box, which lie far outside every budget the sweep trained."""
    (n_lo, n_hi), (d_lo, d_hi) = fit.domain["N"], fit.domain["D"]
    n, d = [], []
    while len(n) < count:
        c = np.exp(rng.uniform(np.log(min(BUDGETS)), np.log(max(BUDGETS))))
        size = np.exp(rng.uniform(np.log(n_lo), np.log(n_hi)))
        if d_lo <= c / (6 * size) <= d_hi:
            n.append(size)
            d.append(c / (6 * size))
    n, d = np.array(n), np.array(d)
    return n, d, law(n, d) * np.exp(rng.normal(0, NOISE, len(n)))


def coverage(fit: FitResult, n: np.ndarray, d: np.ndarray, y: np.ndarray) -> dict:
    pi, ci = fit.prediction_interval(N=n, D=d), fit.confidence_interval(N=n, D=d)
    truth = law(n, d)
    return {"inside_95pct_prediction_interval": float(np.mean((pi[0] <= y) & (y <= pi[1]))),
            "inside_95pct_ci_of_mean": float(np.mean((ci[0] <= y) & (y <= ci[1]))),
            "law_inside_95pct_ci_of_mean": float(np.mean((ci[0] <= truth) & (truth <= ci[1]))),
            "median_width_prediction_interval": float(np.median(pi[1] - pi[0])),
            "median_width_ci_of_mean": float(np.median(ci[1] - ci[0]))}


def _write(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/scaling_fit_example")
    p.add_argument("--n-boot", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sweeps", type=int, default=9, help="further synthetic sweeps for the coverage figure")
    p.add_argument("--n-boot-replicates", type=int, default=200)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    rows = sweep(rng)
    _write(out / "runs.csv", rows)
    cols = ["--params-col", "N", "--tokens-col", "D", "--loss-col", "loss"]
    assert cli_main(["fit", "--runs", str(out / "runs.csv"), *cols, "--form", "chinchilla", "--out", str(out / "fit"),
                     "--n-boot", str(args.n_boot), "--seed", str(args.seed)]) == 0
    assert cli_main(["predict", "--fit", str(out / "fit" / "fit.json"), "--params", "1e8,3e8",
                     "--tokens", "3e9,1e10"]) == 0

    fit = FitResult.from_dict(load_fit(out / "fit" / "fit.json")["fits"]["non-private"])
    n, d, y = held_out(rng, fit)
    _write(out / "held_out.csv", [{"N": f"{a:.6g}", "D": f"{b:.6g}", "loss": f"{c:.5f}"} for a, b, c in zip(n, d, y)])
    replicates = []
    for k in range(1, args.sweeps + 1):
        r = np.random.default_rng(args.seed + k)
        rep = sweep(r)
        f = fit_form("chinchilla", N=[float(x["N"]) for x in rep], D=[float(x["D"]) for x in rep],
                     loss=[float(x["loss"]) for x in rep], n_boot=args.n_boot_replicates, seed=args.seed + k)
        replicates.append({"seed": args.seed + k, **coverage(f, *held_out(r, f))})
    pis = [r["inside_95pct_prediction_interval"] for r in [coverage(fit, n, d, y)] + replicates]
    cis = [r["inside_95pct_ci_of_mean"] for r in [coverage(fit, n, d, y)] + replicates]
    result = {
        "truth": TRUTH, "noise_sd_log_loss": NOISE, "n_runs": len(rows), "n_held_out": len(n),
        "this_sweep": {"seed": args.seed, "fitted": fit.params, "r2": fit.r2, **coverage(fit, n, d, y)},
        "replicate_sweeps": replicates,
        "all_sweeps": {"count": len(pis), "mean_inside_95pct_prediction_interval": float(np.mean(pis)),
                       "range_inside_95pct_prediction_interval": [float(min(pis)), float(max(pis))],
                       "mean_inside_95pct_ci_of_mean": float(np.mean(cis))},
    }
    (out / "coverage.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["all_sweeps"], indent=2))
    return result


if __name__ == "__main__":
    main()
