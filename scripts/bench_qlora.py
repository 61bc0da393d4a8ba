"""CPU figures for QLoRA: step time and peak memory of a tiny Llama with its base quantized (NF4) or not, LoRA,
with and without DP (bk). Figures, not a goal: bitsandbytes' CPU path dequantizes every 4-bit weight at every call.

    OMP_NUM_THREADS=1 python scripts/bench_qlora.py                       # 4 layers × 1024 wide, T 128, B 4
    OMP_NUM_THREADS=1 python scripts/bench_qlora.py --hidden 256 --seq 256 --batch 8

Each (quantization, mode) runs in its own process (scripts/bench_overhead.py), so the peak resident memory is its
own (both bases load from a saved tiny Llama, as a pretrained model loads: the 4-bit one is quantized while
loading); step times from separate processes follow the machine's load, so the
step-time figure to quote is the interleaved one (both bases in one process, alternating, ``--interleave R``).
``weights MiB`` is the model's own footprint (transformers' ``get_memory_footprint``: 4-bit linear layers,
float32 embeddings, norms, head and adapters), the part quantization changes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def save_tiny(path: Path, hidden: int, layers: int, heads: int, seq: int) -> None:
    """The tiny Llama and its tokenizer saved to ``path``: both bases load from disk, as a pretrained model does
    (bitsandbytes quantizes while loading; no full-precision copy of the model is held)."""
    import torch

    from dpllm.config import ModelConfig
    from dpllm.models import build_tiny, byte_tokenizer

    torch.manual_seed(0)
    tok = byte_tokenizer()
    cfg = ModelConfig(tiny_hidden_size=hidden, tiny_num_layers=layers, tiny_num_heads=heads,
                      tiny_intermediate_size=4 * hidden, tiny_max_positions=max(256, seq))
    build_tiny(cfg, tok, seq).save_pretrained(path)
    tok.save_pretrained(path)


def weights_mib(path: Path, quantization: str, seq: int) -> float:
    from dpllm.config import ModelConfig
    from dpllm.models import load_base, prepare_model

    cfg = ModelConfig(model_name_or_path=str(path), finetuning="lora", lora_r=16, quantization=quantization)
    model, _, _ = load_base(cfg, seq)
    model, _ = prepare_model(model, cfg, dp=True)
    return model.get_memory_footprint() / 2**20


def interleaved(args, saved: Path) -> dict:
    """Both bases in this one process, one DP (bk) step of each per round in turn: the per-round ratio of process
    CPU time (one thread: the work itself, whatever else the machine runs) is the steady figure on a shared machine;
    separate processes minutes apart mostly measure the load."""
    import statistics
    import time

    import torch
    from bench_overhead import setup_mode

    from dpllm.config import ModelConfig
    from dpllm.models import load_base
    from dpllm.train import forward_loss

    steps = {}
    for q in ("none", "nf4"):
        torch.manual_seed(0)
        cfg = ModelConfig(model_name_or_path=str(saved), finetuning="lora", lora_r=16, quantization=q)
        model, _, _ = load_base(cfg, args.seq)
        m, opt, crit, _ = setup_mode(model, cfg, "bk", args.batch, torch.device("cpu"))

        def step(batch, m=m, opt=opt, crit=crit):
            opt.zero_grad()
            forward_loss(m, batch, crit).backward()
            opt.step()

        steps[q] = step
    ids = torch.randint(3, 380, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    wall, cpu = {q: [] for q in steps}, {q: [] for q in steps}
    for r in range(2 + args.interleave):
        for q, f in steps.items():
            t0, c0 = time.perf_counter(), time.process_time()
            f(batch)
            if r >= 2:
                wall[q].append(time.perf_counter() - t0)
                cpu[q].append(time.process_time() - c0)
    out = {q: {"median_wall_s": statistics.median(wall[q]), "median_cpu_s": statistics.median(cpu[q])} for q in steps}
    out["nf4_cpu_ratio"] = statistics.median(a / b for a, b in zip(cpu["nf4"], cpu["none"]))
    print(f"interleaved, DP (bk), median of {args.interleave} rounds: unquantized {out['none']['median_cpu_s']:.3f} s "
          f"CPU ({out['none']['median_wall_s']:.3f} s wall), nf4 {out['nf4']['median_cpu_s']:.3f} s CPU "
          f"({out['nf4']['median_wall_s']:.3f} s wall); nf4 / unquantized CPU time per round "
          f"{out['nf4_cpu_ratio']:.3f}×")
    return out


def main(argv=None) -> dict:
    from bench_overhead import main as bench

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--modes", default="nodp,bk", help="of scripts/bench_overhead.py's modes, nodp first")
    ap.add_argument("--out", default="runs/bench/qlora_cpu.json")
    ap.add_argument("--interleave", type=int, default=5, help="rounds of the one-process step-time comparison")
    args = ap.parse_args(argv)
    import tempfile

    tmp = tempfile.TemporaryDirectory(prefix="bench-qlora-")
    saved = Path(tmp.name)
    save_tiny(saved, args.hidden, args.layers, args.heads, args.seq)
    common = ["--model", str(saved), "--finetuning", "lora", "--seq", str(args.seq), "--batch", str(args.batch),
              "--steps", str(args.steps), "--warmup", "2", "--modes", args.modes]
    out = {"setup": vars(args), "runs": {}}
    for q in ("none", "nf4"):
        res = bench([*common, "--quantization", q, "--out", str(Path(args.out).with_suffix(f".{q}.json"))])
        out["runs"][q] = {"weights_mib": weights_mib(saved, q, args.seq), "results": res["results"]}
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
    if args.interleave:
        out["interleaved"] = interleaved(args, saved)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")
    return out


if __name__ == "__main__":
    main()
