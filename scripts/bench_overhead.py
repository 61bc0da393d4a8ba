"""Step time, throughput and peak memory of DP training versus the same step without DP, per mode.

Same model, same physical batch; modes: ``nodp``, Opacus ``ghost`` and ``hooks``, dpllm ``bk``
(book-keeping, :mod:`dpllm.privacy.bk`). Each mode runs in its own process so peak memory is its own,
through the trainer's own loss (:func:`dpllm.train.forward_loss`) and Opacus's DP optimizer step.
Prints a table and writes JSON (figures, not a timed test).

    python scripts/bench_overhead.py                                  # tiny Llama 4×256, T=256, B=8, CPU
    python scripts/bench_overhead.py --finetuning lora
    python scripts/bench_overhead.py --model tiny-gpt2 --seq 256 --batch 8
    # GPU, random-init shapes built on the device in bf16 (no download), bf16 autocast, batch search:
    python scripts/bench_overhead.py --shape llama3-8b --finetuning lora --device cuda --dtype bfloat16 \\
        --autocast bf16 --seq 512 --batch 8 --search-batch --out runs/bench/llama3_8b_lora.json
    python scripts/bench_overhead.py --shape qwen2.5-1.5b --finetuning full --device cuda --dtype bfloat16 \\
        --autocast bf16 --seq 512 --batch 16 --search-batch --out runs/bench/qwen_1p5b_full.json

User-level sampling (ULS) at the same physical batch of records: modes ``uls_bk`` and ``uls_hooks`` clip one
mean gradient per user, the batch's rows grouped ``--records-per-user`` at a time:

    python scripts/bench_overhead.py --hidden 128 --layers 4 --seq 64 --batch 32 --steps 20 \
        --modes bk,uls_bk,hooks,uls_hooks --records-per-user 4

Side by side in one process, alternating steps (``--interleave R``: median of R per-round ratios to nodp, the
way to compare on a machine shared with other jobs; memory still from one process per mode):

    OMP_NUM_THREADS=1 python scripts/bench_overhead.py --shape gpt2-small --seq 128 --batch 4 --modes nodp,bk \
        --interleave 7 --out docs/results/bench_cpu/gpt2_small_full.json

QLoRA (``--quantization nf4|fp4``, LoRA only): the base's linear layers quantized by bitsandbytes and frozen, the
adapters trained (the issue-34 goal: Llama-3-8B QLoRA DP at T = 512 under 24 GB, within 1.15× of no DP on an H100):

    python scripts/bench_overhead.py --shape llama3-8b --finetuning lora --quantization nf4 --device cuda \
        --dtype bfloat16 --autocast bf16 --seq 512 --batch 8 --modes nodp,bk --steps 10 \
        --out runs/bench/llama3_8b_qlora.json
    python scripts/bench_overhead.py --finetuning lora --quantization nf4 --modes nodp,bk   # tiny Llama, CPU

``--chunked-loss N`` computes the per-record loss N positions at a time (no float32 B×T×V logits);
``--gradient-checkpointing`` recomputes activations in backward (non-reentrant; bk and nodp only).
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

MODES = ("nodp", "ghost", "hooks", "bk")
USER_MODES = ("uls_bk", "uls_hooks")  # opt-in through --modes
# Random-init shapes of public models (sizes from their configs); vocabularies as the real ones.
SHAPES = {
    "llama3-8b": dict(arch="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
    "llama3.2-1b": dict(arch="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                        tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(arch="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    # CPU-sized real vocabularies (issue #26): GPT-2 small itself, and Llama 3's 128k vocabulary at width 256
    "gpt2-small": dict(arch="gpt2", n_embd=768, n_layer=12, n_head=12, n_positions=1024, vocab_size=50257,
                       tie_word_embeddings=True, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    # smoke tests (tests/test_scripts_smoke.py, scripts/gpu_proof.py --smoke): seconds on a CPU
    "llama-tiny": dict(arch="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=2, vocab_size=512),
    "llama-128k": dict(arch="llama", hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=4, vocab_size=128256, rope_theta=500000.0),
}


def build_shape(name: str, device, dtype, seq: int):
    """A random-init model of shape ``name`` (SHAPES), built directly on ``device``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(SHAPES[name])
    arch = spec.pop("arch")
    if "n_positions" not in spec:
        spec["max_position_embeddings"] = max(8192, seq)
    cfg = AutoConfig.for_model(arch, **spec)
    with torch.device(device):  # built where it runs: an 8B model takes about a second on a GPU
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype)


def quantize_shape(model, kind: str, compute_dtype):
    """Replace every linear layer but the output head by a frozen bitsandbytes 4-bit layer, in place on the model's
    device (what ``from_pretrained(quantization_config=BitsAndBytesConfig(...))`` builds, without a checkpoint on
    disk), and mark the model quantized so ``prepare_model`` prepares it as QLoRA."""
    import bitsandbytes as bnb
    from torch import nn

    from dpllm.models import bnb_config

    if kind not in ("nf4", "fp4"):
        raise SystemExit(f"--quantization {kind} with --shape: only nf4 and fp4 are built on the device here")
    head = model.get_output_embeddings()
    for name, m in list(model.named_modules()):
        if isinstance(m, nn.Linear) and m is not head:
            q = bnb.nn.Linear4bit(m.in_features, m.out_features, bias=m.bias is not None, compute_dtype=compute_dtype,
                                  quant_type=kind, compress_statistics=True, device="meta")
            q.weight = bnb.nn.Params4bit(m.weight.data, requires_grad=False, quant_type=kind,
                                         compress_statistics=True).to(m.weight.device)  # quantized by .to()
            if m.bias is not None:
                q.bias = nn.Parameter(m.bias.data, requires_grad=False)
            model.set_submodule(name, q)
            del m
    model.config.quantization_config = bnb_config(kind, torch_dtype_name(compute_dtype))
    model.is_loaded_in_4bit = True
    return model


def torch_dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def build(args, device, dtype):
    from dpllm.config import ModelConfig
    from dpllm.models import load_base

    mcfg = ModelConfig(model_name_or_path=args.model, finetuning=args.finetuning, tiny_hidden_size=args.hidden,
                       tiny_num_layers=args.layers, tiny_num_heads=args.heads, tiny_intermediate_size=4 * args.hidden,
                       tiny_max_positions=max(256, args.seq), torch_dtype=args.dtype, lora_r=args.lora_r,
                       quantization=args.quantization)
    if args.shape:
        model = build_shape(args.shape, device, dtype, args.seq)
        if args.quantization != "none":
            model = quantize_shape(model, args.quantization, dtype)
    else:
        model, _, _ = load_base(mcfg, args.seq)
    return model, mcfg


def setup_mode(model, mcfg, mode: str, batch_size: int, device, *, gradient_checkpointing: bool = False,
               users: list[int] | None = None):
    """``(model, optimizer, criterion, private)`` for one benchmarked engine, prepared as the trainer does
    (bk keeps a tied head). ``mode`` is ``nodp`` or a ``grad_sample_mode``; ``users`` names each row's user
    (user-level sampling). ``private`` (Opacus's ``PrivateTraining``) and ``criterion`` are None without DP."""
    import torch

    from dpllm.config import PrivacyConfig
    from dpllm.data import make_collate
    from dpllm.models import prepare_model
    from dpllm.privacy.engine import make_private
    from dpllm.privacy.plan import PrivacyPlan

    dp = mode != "nodp"
    model, _ = prepare_model(model, mcfg, dp=dp, keep_tie=mode == "bk")  # as the trainer: bk keeps a tie
    if gradient_checkpointing:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.to(device).train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    if not dp:
        return model, opt, None, None
    # A dataset of exactly one physical batch: q = 1, so every step sees the same shapes as no-DP.
    records = [torch.full((8,), 3, dtype=torch.long) for _ in range(batch_size)]
    plan = PrivacyPlan(num_records=batch_size, sample_rate=1.0, steps=1, noise_multiplier=1.0, delta=1e-5,
                       accountant="rdp", expected_batch_size=batch_size)
    user_records = [[i for i, u in enumerate(users) if u == v] for v in sorted(set(users))] if users else None
    pt = make_private(model=model, optimizer=opt, dataset=records, collate_fn=make_collate(0),
                      cfg=PrivacyConfig(grad_sample_mode=mode), plan=plan, logical_batch_size=batch_size,
                      user_records=user_records)
    return pt.model, pt.optimizer, pt.criterion, pt


def make_step(args, model, mcfg, device, mode):
    import torch

    from dpllm.models import position_ids_for
    from dpllm.train import forward_loss

    uls = mode.startswith("uls_")
    users = [i // args.records_per_user for i in range(args.batch)]
    model, opt, criterion, pt = setup_mode(model, mcfg, mode.removeprefix("uls_"), args.batch, device,
                                           gradient_checkpointing=args.gradient_checkpointing,
                                           users=users if uls else None)
    resolved = pt.grad_sample_mode if pt is not None else mode
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if args.autocast == "bf16" else None

    def loss_of(batch):
        if args.chunked_loss:
            from dpllm.privacy.bk.loss import causal_lm_chunked_loss

            with autocast() if autocast else torch.autocast(device.type, enabled=False):
                return causal_lm_chunked_loss(model, batch, position_ids_for(batch["input_ids"]),
                                              chunk_tokens=args.chunked_loss)
        return forward_loss(model, batch, criterion, autocast)

    def step(batch):
        opt.zero_grad()
        if uls:
            pt.set_users(users[: batch["input_ids"].shape[0]])
        loss = loss_of(batch)
        loss.backward()
        opt.step()

    return step, resolved


def random_batch(args, batch_size, vocab, device):
    import torch

    g = torch.Generator().manual_seed(batch_size)
    ids = torch.randint(3, vocab, (batch_size, args.seq), generator=g).to(device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def one_mode(args) -> dict:
    import torch

    torch.manual_seed(0)
    device = torch.device(args.device)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model, mcfg = build(args, device, dtype)
    vocab = model.get_input_embeddings().num_embeddings
    step, resolved = make_step(args, model, mcfg, device, args.mode)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    batch = random_batch(args, args.batch, vocab, device)
    times = []
    for i in range(args.warmup + args.steps):
        sync()
        t0 = time.perf_counter()
        step(batch)
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    if cuda:
        peak, kind = torch.cuda.max_memory_allocated() / 2**20, "cuda_max_allocated_mib"
    else:
        peak, kind = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "process_peak_rss_mib"
    med = statistics.median(times)
    row = {"mode": args.mode, "resolved_mode": resolved, "median_step_s": med, "min_step_s": min(times),
           "tokens_per_s": args.batch * args.seq / med, "steps": args.steps, "peak_memory_mib": peak,
           "memory_kind": kind, "max_batch_fits": None}
    if args.search_batch:
        row["max_batch_fits"] = search_batch(args, step, vocab, device)
    return row


def interleaved(args) -> dict:
    """All modes in this one process, one step of each per round in turn; per-round ratios to ``nodp``.

    On a machine shared with other jobs, a slow spell hits every mode of a round alike, so the median of the
    per-round ratios is steadier than ratios of medians taken minutes apart. Wall-clock and process CPU time
    (``time.process_time``, one thread: the work itself, whatever the load) are both recorded.
    """
    import torch

    device = torch.device(args.device)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    modes = args.modes.split(",")
    if modes[0] != "nodp":
        raise SystemExit("--interleave needs nodp first in --modes (the reference of every ratio)")
    steps, resolved = {}, {}
    for mode in modes:
        torch.manual_seed(0)
        model, mcfg = build(args, device, dtype)
        vocab = model.get_input_embeddings().num_embeddings
        steps[mode], resolved[mode] = make_step(args, model, mcfg, device, mode)
    batch = random_batch(args, args.batch, vocab, device)
    wall = {m: [] for m in modes}
    cpu = {m: [] for m in modes}
    for r in range(args.warmup + args.interleave):
        for mode in modes:
            t0, c0 = time.perf_counter(), time.process_time()
            steps[mode](batch)
            if r >= args.warmup:
                wall[mode].append(time.perf_counter() - t0)
                cpu[mode].append(time.process_time() - c0)
    rows = []
    for mode in modes:
        rows.append({"mode": mode, "resolved_mode": resolved[mode], "rounds": args.interleave,
                     "median_step_s": statistics.median(wall[mode]), "median_cpu_s": statistics.median(cpu[mode]),
                     "wall_ratio_vs_nodp": statistics.median(w / b for w, b in zip(wall[mode], wall["nodp"])),
                     "cpu_ratio_vs_nodp": statistics.median(c / b for c, b in zip(cpu[mode], cpu["nodp"])),
                     "wall_s": wall[mode], "cpu_s": cpu[mode]})
    return {"interleaved": rows, "load_average": os.getloadavg()}


def search_batch(args, step, vocab, device) -> int:
    """Largest physical batch for which two steps run: doubling from --batch, then bisection (GPU OOM)."""
    import torch

    def fits(b: int) -> bool:
        try:
            for _ in range(2):
                step(random_batch(args, b, vocab, device))
            return True
        except torch.cuda.OutOfMemoryError:
            return False
        finally:
            torch.cuda.empty_cache() if device.type == "cuda" else None

    lo, hi = 0, None
    b = args.batch
    while b <= args.search_max:
        if fits(b):
            lo, b = b, 2 * b
        else:
            hi = b
            break
    if hi is None:
        return lo  # capped by --search-max
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def parser() -> argparse.ArgumentParser:
    """The command line; :func:`options` gives its defaults to scripts that call :func:`build` and
    :func:`make_step` directly, so an option added here reaches them too."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-llama", help="tiny-llama, tiny-gpt2 or a local HF model directory")
    ap.add_argument("--shape", default=None, choices=sorted(SHAPES), help="random-init shape built on --device")
    ap.add_argument("--finetuning", default="full", choices=("full", "lora"))
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--quantization", default="none", choices=("none", "nf4", "fp4", "int8"),
                    help="QLoRA: the frozen base quantized by bitsandbytes (with --finetuning lora)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="weights dtype")
    ap.add_argument("--autocast", default="no", choices=("no", "bf16"))
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--chunked-loss", type=int, default=0, help="positions per loss chunk (0: whole logits)")
    ap.add_argument("--search-batch", action="store_true", help="also find the largest physical batch that fits")
    ap.add_argument("--search-max", type=int, default=1024)
    ap.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES + USER_MODES)}")
    ap.add_argument("--records-per-user", type=int, default=4, help="uls_* modes: rows per user")
    ap.add_argument("--out", default="runs/bench/overhead.json")
    ap.add_argument("--interleave", type=int, default=0,
                    help="R > 0: time the modes in one process, alternating for R rounds (median per-round ratio "
                         "to nodp); peak memory still comes from one process per mode")
    ap.add_argument("--memory-steps", type=int, default=2, help="--interleave: steps of each memory process")
    ap.add_argument("--mode", default=None, help=argparse.SUPPRESS)  # internal: run one mode
    return ap


def options(base=None, **overrides) -> argparse.Namespace:
    """This script's options as :func:`build`, :func:`make_step` and :func:`random_batch` read them: the command
    line's defaults, then the attributes of ``base`` (another script's namespace), then ``overrides``.

    Other scripts build their namespace here rather than by hand: a hand-built one broke when ``--quantization``
    was added (issue 49.9)."""
    return argparse.Namespace(**{**vars(parser().parse_args([])), **vars(base or argparse.Namespace()), **overrides})


def main(argv=None) -> dict:
    ap = parser()
    args = ap.parse_args(argv)
    if args.quantization != "none" and args.finetuning != "lora":
        ap.error(f"--quantization {args.quantization} needs --finetuning lora (a quantized base cannot be trained)")
    if args.mode == "interleaved":
        print(json.dumps(interleaved(args)))
        return {}
    if args.mode:
        print(json.dumps(one_mode(args)))
        return {}
    rows = []
    base_argv = list(argv if argv is not None else sys.argv[1:])
    child = base_argv + (["--steps", str(args.memory_steps), "--warmup", "1"] if args.interleave else [])
    for mode in args.modes.split(","):
        res = subprocess.run([sys.executable, __file__, *child, "--mode", mode], capture_output=True, text=True,
                             env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        if res.returncode != 0:
            print(res.stderr[-3000:], file=sys.stderr)
            rows.append({"mode": mode, "error": res.stderr.strip().splitlines()[-1] if res.stderr.strip() else "?"})
            continue
        rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
    base = next((r for r in rows if r["mode"] == "nodp" and "error" not in r), None)
    for r in rows:
        if "error" in r:
            continue
        r["time_ratio_vs_nodp"] = r["median_step_s"] / base["median_step_s"] if base else None
        r["memory_ratio_vs_nodp"] = r["peak_memory_mib"] / base["peak_memory_mib"] if base else None
    inter = None
    if args.interleave:
        res = subprocess.run([sys.executable, __file__, *base_argv, "--mode", "interleaved"], capture_output=True,
                             text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        if res.returncode != 0:
            print(res.stderr[-3000:], file=sys.stderr)
            raise SystemExit("the interleaved run failed")
        inter = json.loads(res.stdout.strip().splitlines()[-1])
    import torch

    setup = {k: v for k, v in vars(args).items() if k not in ("mode", "out")}
    setup.update(torch=torch.__version__, threads=torch.get_num_threads(),
                 omp_num_threads=os.environ.get("OMP_NUM_THREADS"))
    result = {"setup": setup, "results": rows, **(inter or {})}
    print(f"model={args.shape or args.model} finetuning={args.finetuning} seq={args.seq} batch={args.batch} "
          f"device={args.device} autocast={args.autocast} (median of {args.steps} steps after {args.warmup} warm-up)")
    print(f"{'mode':<10}{'ran':<10}{'step (s)':>10}{'tok/s':>10}{'× no-DP':>9}"
          f"{'peak MiB':>10}{'× no-DP':>9}{'max B':>7}")
    for r in rows:
        if "error" in r:
            print(f"{r['mode']:<10}failed: {r['error'][:90]}")
            continue
        print(f"{r['mode']:<10}{r['resolved_mode']:<10}{r['median_step_s']:>10.4f}{r['tokens_per_s']:>10.0f}"
              f"{r['time_ratio_vs_nodp'] or 0:>9.2f}{r['peak_memory_mib']:>10.0f}{r['memory_ratio_vs_nodp'] or 0:>9.2f}"
              f"{r['max_batch_fits'] if r['max_batch_fits'] is not None else '-':>7}")
    if inter:
        print(f"interleaved, one process, median of {args.interleave} per-round ratios to nodp "
              f"(load average {inter['load_average'][0]:.1f}):")
        print(f"{'mode':<10}{'ran':<10}{'wall (s)':>10}{'× no-DP':>9}{'cpu (s)':>10}{'× no-DP':>9}")
        for r in inter["interleaved"]:
            print(f"{r['mode']:<10}{r['resolved_mode']:<10}{r['median_step_s']:>10.3f}{r['wall_ratio_vs_nodp']:>9.3f}"
                  f"{r['median_cpu_s']:>10.3f}{r['cpu_ratio_vs_nodp']:>9.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
