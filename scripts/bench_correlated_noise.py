"""Cost of banded correlated noise per optimizer step: the noise draw alone (DP-SGD) against draw + recurrence.

    python scripts/bench_correlated_noise.py --params 31000000 --bands 1 2 4 8 --repeats 3 --json out.json

For each b it times, on one thread, what the bk optimizer does per step for a model of ``--params`` float32
parameters held as one tensor: ``_generate_noise`` (Opacus's Gaussian draw) and ``BandedRecurrence.apply`` (b−1
in-place multiply-adds and the history update). It prints seconds per step and the extra memory the recurrence
holds (b−1 model-sized tensors), and writes them as JSON. The draw is the same for every b (b = 1 adds nothing).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from opacus.optimizers.optimizer import _generate_noise

from dpllm.privacy.correlated.banded import BandMF


def measure(params: int, bands: int, repeats: int) -> dict:
    ref = torch.zeros(params)
    g = torch.Generator().manual_seed(0)
    rec = BandMF.optimized(bands=bands, steps=max(bands, 64)).recurrence()
    for _ in range(bands):  # fill the history first: the steady state keeps b−1 tensors
        rec.apply(0, _generate_noise(std=1.0, reference=ref, generator=g))
        rec.end_step()
    draw = apply = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        z = _generate_noise(std=1.0, reference=ref, generator=g)
        t1 = time.perf_counter()
        rec.apply(0, z)
        rec.end_step()
        t2 = time.perf_counter()
        draw, apply = draw + t1 - t0, apply + t2 - t1
    return {"params": params, "bands": bands, "draw_s": draw / repeats, "recurrence_s": apply / repeats,
            "step_noise_ratio": (draw + apply) / draw, "extra_bytes": rec.extra_tensors_per_parameter * params * 4}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=int, default=31_000_000, help="float32 parameters (GPT-2 small: 124M)")
    p.add_argument("--bands", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = [measure(args.params, b, args.repeats) for b in args.bands]
    for r in rows:
        print(f"b={r['bands']:>3}  draw {r['draw_s']:.3f} s  recurrence {r['recurrence_s']:.3f} s  "
              f"noise cost ×{r['step_noise_ratio']:.2f}  extra memory {r['extra_bytes'] / 2**30:.2f} GiB")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"command": "python scripts/bench_correlated_noise.py", "rows": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
