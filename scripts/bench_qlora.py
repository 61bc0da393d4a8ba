"""CPU figures for QLoRA: step time and peak memory of a tiny Llama with its base quantized (NF4) or not, LoRA,
with and without DP (bk). Figures, not a goal: bitsandbytes' CPU path dequantizes every 4-bit weight at every call.

    OMP_NUM_THREADS=1 python scripts/bench_qlora.py                       # 4 layers × 1024 wide, T 128, B 4
    OMP_NUM_THREADS=1 python scripts/bench_qlora.py --hidden 256 --seq 256 --batch 8

Each (quantization, mode) runs in its own process (scripts/bench_overhead.py), so the peak resident memory is its
own; ``weights MiB`` is the model's own footprint (transformers' ``get_memory_footprint``: 4-bit linear layers,
float32 embeddings, norms, head and adapters), the part quantization changes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def weights_mib(hidden: int, layers: int, heads: int, quantization: str, seq: int) -> float:
    from dpllm.config import ModelConfig
    from dpllm.models import load_base, prepare_model

    cfg = ModelConfig(finetuning="lora", tiny_hidden_size=hidden, tiny_num_layers=layers, tiny_num_heads=heads,
                      tiny_intermediate_size=4 * hidden, tiny_max_positions=max(256, seq), lora_r=16,
                      quantization=quantization)
    model, _, _ = load_base(cfg, seq)
    model, _ = prepare_model(model, cfg, dp=True)
    return model.get_memory_footprint() / 2**20


def main(argv=None) -> dict:
    from bench_overhead import main as bench

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default="runs/bench/qlora_cpu.json")
    args = ap.parse_args(argv)
    common = ["--finetuning", "lora", "--hidden", str(args.hidden), "--layers", str(args.layers), "--heads",
              str(args.heads), "--seq", str(args.seq), "--batch", str(args.batch), "--steps", str(args.steps),
              "--warmup", "2", "--modes", "nodp,bk"]
    out = {"setup": vars(args), "runs": {}}
    for q in ("none", "nf4"):
        res = bench([*common, "--quantization", q, "--out", str(Path(args.out).with_suffix(f".{q}.json"))])
        out["runs"][q] = {"weights_mib": weights_mib(args.hidden, args.layers, args.heads, q, args.seq),
                          "results": res["results"]}
    print(f"\ntiny Llama {args.layers} × {args.hidden}, LoRA r 16, T {args.seq}, B {args.batch}, CPU "
          f"(median of {args.steps} steps)")
    print(f"{'base':<6}{'mode':<6}{'step (s)':>10}{'peak RSS MiB':>14}{'weights MiB':>13}{'× DP/noDP':>11}")
    for q, run in out["runs"].items():
        for r in run["results"]:
            if "error" in r:
                print(f"{q:<6}{r['mode']:<6} failed: {r['error'][:80]}")
                continue
            print(f"{q:<6}{r['mode']:<6}{r['median_step_s']:>10.3f}{r['peak_memory_mib']:>14.0f}{run['weights_mib']:>13.1f}"
                  f"{r.get('time_ratio_vs_nodp') or 0:>11.2f}")
    rows = {(q, r["mode"]): r for q, run in out["runs"].items() for r in run["results"] if "error" not in r}
    if ("none", "bk") in rows and ("nf4", "bk") in rows:
        a, b = rows[("none", "bk")], rows[("nf4", "bk")]
        print(f"nf4 / unquantized, DP (bk): step time {b['median_step_s'] / a['median_step_s']:.2f}×, peak RSS "
              f"{b['peak_memory_mib'] / a['peak_memory_mib']:.2f}×, weights "
              f"{out['runs']['nf4']['weights_mib'] / out['runs']['none']['weights_mib']:.2f}×")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")
    return out


if __name__ == "__main__":
    main()
