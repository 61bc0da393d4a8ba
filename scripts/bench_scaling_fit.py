"""CPU time of a scaling fit with its default 1,000 bootstrap resamples, for a 20-row and a 240-row table.

    OMP_NUM_THREADS=1 python scripts/bench_scaling_fit.py            # both tables, 1,000 resamples
    python scripts/bench_scaling_fit.py --validate                   # and with the extrapolation validation
    python scripts/bench_scaling_fit.py --rows 240 --n-boot 1000     # one table
    python scripts/bench_scaling_fit.py --table my_runs.csv          # your own N, D, loss CSV

Timing lives here, as printed figures, never in a test's assertion (issue 35). The 20-row table is the grid of
``tests/test_scaling_forms.py`` (5 sizes × 4 token counts, 0.3% noise); the 240-row one is an isoFLOP-like
scatter of the size of the Chinchilla replication's 240 points (sizes 50M-16B, compute 6e18-3e21, 1% noise,
Besiroglu et al.'s law as truth). Both are synthetic and seeded. CPU time is the process's (all threads), so
threads spinning against each other show up here even where wall time hides them.
"""

from __future__ import annotations

import argparse
import csv
import time

import numpy as np

from dpllm.scaling import fit_form, get_form
from dpllm.scaling.published import PUBLISHED

TRUTH_20 = {"E": 1.7, "A": 400.0, "alpha": 0.34, "B": 410.0, "beta": 0.28}


def table(rows: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(N, D, loss) of the synthetic table with ``rows`` rows (20: the test grid; else an isoFLOP scatter)."""
    rng = np.random.default_rng(seed)
    law = get_form("chinchilla")
    if rows == 20:
        n, d = (a.ravel() for a in np.meshgrid([1e6, 3e6, 1e7, 3e7, 1e8], [1e7, 1e8, 1e9, 1e10]))
        return n, d, law.predict(TRUTH_20, {"N": n, "D": d}) * np.exp(rng.normal(0, 0.003, n.size))
    n = np.exp(rng.uniform(np.log(5e7), np.log(1.6e10), rows))
    d = np.exp(rng.uniform(np.log(6e18), np.log(3e21), rows)) / (6 * n)
    truth = PUBLISHED["chinchilla-besiroglu2024"]["params"]
    return n, d, law.predict(truth, {"N": n, "D": d}) * np.exp(rng.normal(0, 0.01, rows))


def read_csv(path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    return tuple(np.array([float(r[k]) for r in rows]) for k in ("N", "D", "loss"))


def bench(name: str, n, d, y, n_boot: int, repeats: int, validate: bool = False) -> None:
    times = []
    for _ in range(repeats):
        t0, w0 = time.process_time(), time.perf_counter()
        res = fit_form("chinchilla", loss=y, N=n, D=d, n_boot=n_boot, seed=0, validate=validate)
        times.append((time.process_time() - t0, time.perf_counter() - w0))
    cpu, wall = min(t[0] for t in times), min(t[1] for t in times)
    name += " +validation" if validate else ""
    print(f"{name:>26}  rows={len(y):>4}  n_boot={n_boot}  fitted {res.bootstrap['n_ok']}/{n_boot}  "
          f"CPU {cpu:6.2f} s  wall {wall:6.2f} s  (best of {repeats})  alpha 95% CI "
          f"[{res.ci['alpha'][0]:.4f}, {res.ci['alpha'][1]:.4f}]" if res.ci else "", flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="*", default=[20, 240], help="synthetic table sizes (default 20 240)")
    p.add_argument("--n-boot", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--table", help="a CSV with columns N, D, loss to time instead")
    p.add_argument("--validate", action="store_true", help="also time the fit with its extrapolation validation "
                   "(what `dpllm scaling fit` runs: up to 4 more fits of n_boot/5 resamples)")
    args = p.parse_args(argv)
    tables = [(args.table, read_csv(args.table))] if args.table else [(f"synthetic {r}", table(r)) for r in args.rows]
    for name, data in tables:
        bench(name, *data, args.n_boot, args.repeats)
        if args.validate:
            bench(name, *data, args.n_boot, args.repeats, validate=True)


if __name__ == "__main__":
    main()
