"""Step time and peak memory of DP training versus the same step without DP.

Same model, same physical batch, three modes: no DP, Opacus ghost clipping, Opacus hooks (materialised
per-sample gradients). Each mode runs in its own process so peak memory is its own. Prints a table and
writes JSON.

    python scripts/bench_overhead.py                                  # tiny Llama on CPU
    python scripts/bench_overhead.py --model tiny-gpt2 --finetuning full --seq 256 --batch 8
    python scripts/bench_overhead.py --model meta-llama/Meta-Llama-3-8B --finetuning lora --device cuda \\
        --dtype bfloat16 --seq 512 --batch 8 --out runs/bench/llama8b.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODES = ("nodp", "ghost", "hooks")


def one_mode(args) -> dict:
    import torch

    from dpllm.config import ModelConfig, PrivacyConfig
    from dpllm.data import TokenizedRecords, make_collate
    from dpllm.models import load_base, prepare_model
    from dpllm.privacy.engine import PrivacyPlan, make_private
    from dpllm.train import forward_loss

    torch.manual_seed(0)
    device = torch.device(args.device)
    mcfg = ModelConfig(model_name_or_path=args.model, finetuning=args.finetuning, tiny_hidden_size=args.hidden,
                       tiny_num_layers=args.layers, tiny_num_heads=args.heads, tiny_intermediate_size=4 * args.hidden,
                       tiny_max_positions=max(256, args.seq), torch_dtype=args.dtype)
    model, tok, _ = load_base(mcfg, args.seq)
    dp = args.mode != "nodp"
    model, _ = prepare_model(model, mcfg, dp=dp)
    model.to(device).train()
    vocab = model.get_input_embeddings().num_embeddings
    batch = {"input_ids": torch.randint(3, vocab, (args.batch, args.seq), device=device)}
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    batch["labels"] = batch["input_ids"].clone()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    criterion = None
    if dp:
        # A dataset of exactly one physical batch: q = 1, so every step sees the same shapes as no-DP.
        texts = ["x" * 8] * args.batch
        ds = TokenizedRecords(texts, tok, 8)
        plan = PrivacyPlan(num_records=args.batch, sample_rate=1.0, steps=1, noise_multiplier=1.0, delta=1e-5,
                           accountant="rdp", expected_batch_size=args.batch)
        pt = make_private(model=model, optimizer=opt, dataset=ds, collate_fn=make_collate(tok.pad_token_id),
                          cfg=PrivacyConfig(grad_sample_mode=args.mode), plan=plan, logical_batch_size=args.batch)
        model, opt, criterion = pt.model, pt.optimizer, pt.criterion
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(args.warmup + args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = forward_loss(model, batch, criterion)
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2**20
        kind = "cuda_max_allocated_mib"
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        kind = "process_peak_rss_mib"
    return {"mode": args.mode, "median_step_s": statistics.median(times), "min_step_s": min(times),
            "steps": args.steps, "peak_memory_mib": peak, "memory_kind": kind}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--finetuning", default="full", choices=("full", "lora"))
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--out", default="runs/bench/overhead.json")
    ap.add_argument("--mode", default=None, help=argparse.SUPPRESS)  # internal: run one mode
    args = ap.parse_args(argv)
    if args.mode:
        print(json.dumps(one_mode(args)))
        return {}
    rows = []
    base_argv = [a for a in (argv if argv is not None else sys.argv[1:])]
    for mode in args.modes.split(","):
        res = subprocess.run([sys.executable, __file__, *base_argv, "--mode", mode], capture_output=True, text=True,
                             env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        if res.returncode != 0:
            print(res.stderr[-2000:], file=sys.stderr)
            raise SystemExit(f"mode {mode} failed")
        rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
    base = next((r for r in rows if r["mode"] == "nodp"), None)
    for r in rows:
        r["time_ratio_vs_nodp"] = r["median_step_s"] / base["median_step_s"] if base else None
        r["memory_ratio_vs_nodp"] = r["peak_memory_mib"] / base["peak_memory_mib"] if base else None
    setup = {k: v for k, v in vars(args).items() if k not in ("mode", "out")}
    result = {"setup": setup, "results": rows}
    print(f"model={args.model} finetuning={args.finetuning} seq={args.seq} batch={args.batch} device={args.device} "
          f"(median of {args.steps} steps after {args.warmup} warm-up)")
    print(f"{'mode':<8}{'step (s)':>10}{'× no-DP':>9}{'peak MiB':>10}{'× no-DP':>9}")
    for r in rows:
        print(f"{r['mode']:<8}{r['median_step_s']:>10.4f}{r['time_ratio_vs_nodp'] or 0:>9.2f}"
              f"{r['peak_memory_mib']:>10.0f}{r['memory_ratio_vs_nodp'] or 0:>9.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
