"""The most any membership attack can reach at a few ε, against the old compliance ceiling e^ε/(1+e^ε).

For each ε: σ calibrated with dpllm's own planner (PRV accountant) for N records, logical batch B and the given
epochs (q = 1/⌈N/B⌉), then :mod:`dpllm.privacy.tradeoff`'s bounds (AUC, TPR at FPR 1% and 0.1%) from that
history, and the same at user level for users of k records under ELS.

    python scripts/tradeoff_table.py                       # N = 50,000, B = 256, 1 epoch, δ = 1e-6
    python scripts/tradeoff_table.py --epochs 3 --user-k 4
"""

from __future__ import annotations

import argparse
import math
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-records", type=int, default=50_000)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--epochs", type=float, default=1.0)
    ap.add_argument("--delta", type=float, default=1e-6)
    ap.add_argument("--epsilons", default="1,3,8")
    ap.add_argument("--user-k", type=int, default=0, help="also the user-level bounds for users of k records (ELS)")
    args = ap.parse_args()

    from dpllm.privacy.accounting import calibrate_noise
    from dpllm.privacy.tradeoff import plain_reading, privacy_curve

    q = 1 / math.ceil(args.num_records / args.batch)
    steps = math.ceil(args.epochs / q)
    print(f"N = {args.num_records:,}, B = {args.batch}, q = {q:.5g}, steps = {steps}, δ = {args.delta:g}")
    print("| ε | σ | old ceiling e^ε/(1+e^ε) | AUC ≤ | TPR@1% ≤ | TPR@0.1% ≤ | seconds |")
    print("|---|---|---|---|---|---|---|")
    for eps in (float(x) for x in args.epsilons.split(",")):
        sigma = calibrate_noise(target_epsilon=eps, delta=args.delta, sample_rate=q, steps=steps)
        t = time.process_time()
        b = privacy_curve(history=[(sigma, q, steps)]).bounds()
        cpu = time.process_time() - t
        print(f"| {eps:g} | {sigma:.4g} | {math.exp(eps) / (1 + math.exp(eps)):.4f} | {b['auc']:.4f} | "
              f"{b['tpr@fpr=0.01']:.4f} | {b['tpr@fpr=0.001']:.4f} | {cpu:.2f} |")
        if args.user_k > 1:
            u = privacy_curve(history=[(sigma, q, steps)], group_size=args.user_k).bounds()
            print(f"| (users of {args.user_k} records) | | | {u['auc']:.4f} | {u['tpr@fpr=0.01']:.4f} | "
                  f"{u['tpr@fpr=0.001']:.4f} | |")
        print(f"|  | {plain_reading(b)} | | | | | |")


if __name__ == "__main__":
    main()
