"""Throughput of ``data.packing: true`` against one record per row, at equal ε: tokens/s of real tokens.

Both runs are the real recipe (:func:`dpllm.train.train`) on the same short chat records (``stdlib_qa``: a stdlib
function's signature → its docstring's first paragraph, 808 records shipped with Python), the same model, plan,
σ, q, steps and ε, and the same stage key, so they draw the same records and the same noise: what differs is how
each step's records are laid out (padded rows of one record, or packed rows of ``max_length``). A run's figure is
its real tokens (the records' own, never padding) over the process CPU seconds of its training steps (one thread:
the work itself, whatever else the machine runs; wall seconds are printed beside it). Packed and unpacked runs
alternate ``--rounds`` times; the ratio quoted is the median of the per-round ratios.

    OMP_NUM_THREADS=1 python scripts/bench_packing.py --out docs/results/packing/stdlib_qa_cpu.json
    OMP_NUM_THREADS=1 python scripts/bench_packing.py --smoke --out /tmp/packing.json     # seconds, tiny shapes

Figures, not a test: tests/test_packing.py proves the two layouts train the same model.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path


def run_once(args, packing: bool, out: Path) -> dict:
    """One recipe run; its training steps timed (process CPU and wall), its report's figures."""
    from dpllm import resume
    from dpllm.config import parse_config
    from dpllm.privacy.report import PrivacyReport
    from dpllm.train import Trainer

    cfg = parse_config([
        "--model_name_or_path", "tiny-llama", "--finetuning", args.finetuning, "--tiny_hidden_size", str(args.hidden),
        "--tiny_num_layers", str(args.layers), "--tiny_num_heads", str(args.heads),
        "--tiny_intermediate_size", str(4 * args.hidden), "--tiny_max_positions", str(args.max_length),
        "--dataset", "stdlib_qa", "--max_length", str(args.max_length), "--packing", str(packing).lower(),
        "--grad_sample_mode", "bk", "--target_epsilon", str(args.epsilon), "--max_steps", str(args.steps),
        "--logical_batch_size", str(args.logical_batch), "--physical_batch_size", str(args.physical_batch),
        "--eval_every", "0", "--eval_max_records", "8", "--output_dir", str(out), "--progress", "false",
        "--reproducible_noise", "true", "--seed", "0", *(["--max_records", "160"] if args.smoke else [])])
    import dpllm.train as train_module

    timed, seen = {}, {"positions": 0}
    original, loss = Trainer.train_steps, train_module.forward_loss

    def forward_loss(model, batch, *a, **kw):  # unpacked rows: the positions computed, padding included
        seen["positions"] += int(batch["input_ids"].numel())
        return loss(model, batch, *a, **kw)

    def train_steps(self):
        cpu, wall = time.process_time(), time.perf_counter()
        original(self)
        timed.update(cpu=time.process_time() - cpu, wall=time.perf_counter() - wall)

    key = resume.config_key  # the unpacked run's key for both: the same Poisson draws and noise
    same_key = lambda c: key(dataclasses.replace(c, data=dataclasses.replace(c.data, packing=False)))  # noqa: E731
    Trainer.train_steps, resume.config_key, train_module.forward_loss = train_steps, same_key, forward_loss
    try:
        summary = Trainer(cfg).run()
    finally:
        Trainer.train_steps, resume.config_key, train_module.forward_loss = original, key, loss
    report = PrivacyReport.read(out)
    positions = report.packing["row_tokens"] if packing else seen["positions"]
    return {"packing": packing, "tokens": summary["tokens_seen"], "cpu_s": round(timed["cpu"], 3),
            "wall_s": round(timed["wall"], 3), "tokens_per_cpu_s": summary["tokens_seen"] / timed["cpu"],
            "tokens_per_wall_s": summary["tokens_seen"] / timed["wall"], "epsilon": report.epsilon,
            "delta": report.delta, "noise_multiplier": report.noise_multiplier, "sample_rate": report.sample_rate,
            "steps": report.steps, "num_records": report.num_records, "accountant": report.accountant,
            "positions": positions, "real_share": summary["tokens_seen"] / max(1, positions),
            "packing_stats": report.packing, "final_eval_loss": summary["final_eval_loss"]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--finetuning", default="full", choices=("full", "lora"))
    ap.add_argument("--max-length", type=int, default=512, help="tokens per row (and per record, unpacked)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--logical-batch", type=int, default=64)
    ap.add_argument("--physical-batch", type=int, default=8, help="rows per backward pass, either layout")
    ap.add_argument("--epsilon", type=float, default=8.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, one round: checks that the script runs")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.smoke:
        args.hidden, args.layers, args.heads, args.max_length = 32, 1, 2, 256
        args.steps, args.logical_batch, args.physical_batch, args.rounds = 1, 16, 4, 1
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = (False, True) if r % 2 == 0 else (True, False)  # alternate which layout runs first
            got = {p: run_once(args, p, Path(tmp) / f"r{r}_{'packed' if p else 'plain'}") for p in order}
            plain, packed = got[False], got[True]
            if (plain["epsilon"], plain["tokens"]) != (packed["epsilon"], packed["tokens"]):
                raise SystemExit(f"round {r}: the layouts differ in ε or tokens: {plain} {packed}")
            rounds.append({"plain": plain, "packed": packed,
                           "speedup_cpu": packed["tokens_per_cpu_s"] / plain["tokens_per_cpu_s"],
                           "speedup_wall": packed["tokens_per_wall_s"] / plain["tokens_per_wall_s"]})
            k = packed["packing_stats"]
            print(f"round {r}: ε = {plain['epsilon']:.3f}, {plain['tokens']:,} real tokens; one record per row "
                  f"{plain['tokens_per_cpu_s']:,.0f} tokens/CPU-s ({plain['tokens_per_wall_s']:,.0f}/wall-s), packed "
                  f"{packed['tokens_per_cpu_s']:,.0f} ({packed['tokens_per_wall_s']:,.0f}): "
                  f"{rounds[-1]['speedup_cpu']:.2f}× (wall {rounds[-1]['speedup_wall']:.2f}×); positions real: "
                  f"{plain['real_share']:.0%} one per row, {packed['real_share']:.0%} packed ({k['records']:,} "
                  f"records in {k['rows']:,} rows)")
    result = {
        "what": "tokens/s of real tokens, data.packing true vs false, same records, noise, plan and ε (bk, CPU)",
        "command": "OMP_NUM_THREADS=1 python scripts/bench_packing.py " + " ".join(argv if argv is not None
                                                                                else sys.argv[1:]),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "speedup_cpu_median": statistics.median(r["speedup_cpu"] for r in rounds),
        "speedup_wall_median": statistics.median(r["speedup_wall"] for r in rounds),
        "rounds": rounds,
    }
    print(f"packing: {result['speedup_cpu_median']:.2f}× the real tokens per CPU second of one record per row "
          f"(median of {len(rounds)} rounds; wall {result['speedup_wall_median']:.2f}×) at ε = "
          f"{rounds[0]['plain']['epsilon']:.3f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
