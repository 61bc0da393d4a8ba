"""Where a book-keeping (bk) step spends its time, per layer type, beside a non-private step of the same model.

torch.profiler over a few steps of each; bk's work is labelled per rule and phase
(``bk.<Rule>.record`` in backward, ``bk.<Rule>.norm2`` and ``bk.<Rule>.clipped`` once the backward ends),
the loss as ``loss`` and the optimizer as ``optimizer``. Prints one table per mode and writes JSON.

    OMP_NUM_THREADS=1 python scripts/profile_bk.py --shape gpt2-small --out runs/profile/gpt2_small.json
    OMP_NUM_THREADS=1 python scripts/profile_bk.py --shape llama-128k --out runs/profile/llama_128k.json
    # process CPU time per phase, nodp and bk interleaved (robust to other jobs on a shared machine)
    OMP_NUM_THREADS=1 python scripts/profile_bk.py --shape gpt2-small --phases 5 --out runs/profile/phases.json
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_overhead import SHAPES, build_shape, setup_mode  # noqa: E402


def label_rules():
    """Wrap every bk rule's record / norm2 / clipped in a profiler label (this process only)."""
    import torch

    from dpllm.privacy.bk import layers

    for rule in layers.RULES:
        cls = type(rule)
        for phase in ("record", "norm2", "clipped"):
            fn = cls.__dict__.get(phase) or getattr(cls, phase, None)
            if fn is None or getattr(fn, "_labelled", False):
                continue

            def wrapped(self, *a, _fn=fn, _name=f"bk.{cls.__name__}.{phase}", **kw):
                with torch.profiler.record_function(_name):
                    return _fn(self, *a, **kw)

            wrapped._labelled = True
            setattr(cls, phase, functools.wraps(fn)(wrapped))
    # the embedding records in its autograd function, not through rule.record
    bw = layers._EmbeddingFn.backward

    def emb_backward(ctx, g):
        with torch.profiler.record_function("bk.EmbeddingRule.record"):
            return bw(ctx, g)

    layers._EmbeddingFn.backward = staticmethod(emb_backward)


def _setup(args, mode: str):
    """``(model, optimizer, criterion)`` for ``mode`` (nodp or a grad_sample_mode) on the chosen shape, on CPU."""
    import torch

    from dpllm.config import ModelConfig

    torch.manual_seed(0)
    model = build_shape(args.shape, torch.device("cpu"), torch.float32, args.seq)
    return setup_mode(model, ModelConfig(finetuning=args.finetuning, lora_r=16), mode, args.batch,
                      torch.device("cpu"))[:3]


def profile(args, mode: str) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, record_function

    from dpllm.train import forward_loss

    model, opt, criterion = _setup(args, mode)
    vocab = (model._module if hasattr(model, "_module") else model).get_input_embeddings().num_embeddings
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (args.batch, args.seq), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}

    def step():
        opt.zero_grad()
        with record_function("forward+loss"):
            loss = forward_loss(model, batch, criterion)
        with record_function("backward"):
            loss.backward()
        with record_function("optimizer"):
            opt.step()

    step()  # warm-up
    with torch.profiler.profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            step()
    rows = []
    for e in prof.key_averages():
        if e.key.startswith("bk.") or e.key in ("forward+loss", "backward", "optimizer"):
            rows.append({"label": e.key, "cpu_total_s": e.cpu_time_total / 1e6 / args.steps, "calls": e.count})
    top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]
    ops = [{"op": e.key, "self_cpu_s": e.self_cpu_time_total / 1e6 / args.steps, "calls": e.count // args.steps}
           for e in top]
    return {"mode": mode, "labels": sorted(rows, key=lambda r: -r["cpu_total_s"]), "top_ops": ops}


def phases(args, rounds: int) -> dict:
    """Process CPU time per phase (forward+loss, backward, bk's end-of-backward work, optimizer step) of nodp
    and bk, interleaved for ``rounds`` rounds in this process; medians, and the median per-round ratio."""
    import statistics
    import time

    import torch

    from dpllm.privacy import bk
    from dpllm.train import forward_loss

    finish = {"s": 0.0}
    original = bk.BookKeepingModule._finish_backward

    def timed(self):
        c = time.process_time()
        original(self)
        finish["s"] += time.process_time() - c

    bk.BookKeepingModule._finish_backward = timed
    runs = {}
    for mode in ("nodp", "bk"):
        runs[mode] = _setup(args, mode)[:2]
    vocab = runs["nodp"][0].get_input_embeddings().num_embeddings
    ids = torch.randint(3, vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    split = {m: [] for m in runs}
    for r in range(rounds + 1):  # the first round warms up
        for mode, (model, opt) in runs.items():
            finish["s"] = 0.0
            c0 = time.process_time()
            opt.zero_grad()
            loss = forward_loss(model, batch)
            c1 = time.process_time()
            loss.backward()
            c2 = time.process_time()
            opt.step()
            c3 = time.process_time()
            if r:
                split[mode].append({"forward_loss": c1 - c0, "backward": c2 - c1 - finish["s"],
                                    "bk_end_of_backward": finish["s"], "optimizer": c3 - c2, "total": c3 - c0})
    out = {m: {k: statistics.median(x[k] for x in rows) for k in rows[0]} for m, rows in split.items()}
    out["cpu_ratio"] = statistics.median(b["total"] / a["total"] for a, b in zip(split["nodp"], split["bk"]))
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="gpt2-small", choices=sorted(SHAPES))
    ap.add_argument("--finetuning", default="full", choices=("full", "lora"))
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--modes", default="nodp,bk")
    ap.add_argument("--out", default="runs/profile/bk.json")
    ap.add_argument("--phases", type=int, default=0, help="R > 0: instead, CPU time per phase over R interleaved "
                                                          "rounds (nodp vs bk)")
    args = ap.parse_args(argv)
    if args.phases:
        res = {"setup": vars(args), "phases": phases(args, args.phases)}
        for mode in ("nodp", "bk"):
            print(mode, "  ".join(f"{k} {v:.3f}" for k, v in res["phases"][mode].items()))
        print(f"median per-round CPU-time ratio bk / nodp: {res['phases']['cpu_ratio']:.3f}")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=2))
        return res
    label_rules()
    result = {"setup": vars(args), "modes": [profile(args, m) for m in args.modes.split(",")]}
    for r in result["modes"]:
        print(f"== {r['mode']} ({args.shape}, {args.finetuning}, T={args.seq}, B={args.batch}; s per step)")
        for row in r["labels"]:
            print(f"  {row['label']:<32}{row['cpu_total_s']:>9.3f}")
        print("  top ops (self time):")
        for o in r["top_ops"]:
            print(f"    {o['op']:<40}{o['self_cpu_s']:>9.3f}  ×{o['calls']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
