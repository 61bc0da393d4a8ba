"""Step time and peak memory of private steps under FSDP2, against the same sharded step without DP (CPU, gloo).

Modes, each sharded as the trainer shards it (:func:`dpllm.distributed.wrap_model`): ``nodp`` and ``bk``
(one shard group per transformer block, :func:`dpllm.distributed.shard_model`), ``ghost_fsdp`` (Opacus's
``FSDP2Wrapper``, one group per layer, as its norm samplers need). Same model, same per-process batch, every
process its own records. Figures, not a timed test:

    OMP_NUM_THREADS=1 python scripts/bench_fsdp.py --interleave 7 --out docs/results/bench_cpu/fsdp_llama_full.json

launches ``torch.distributed.run --nproc_per_node 2`` twice over: once with every mode in the same pair of
processes, one step of each per round in turn (``time.process_time`` per step on each process: the work
itself, steadier than wall time on a shared machine; ratios to ``nodp`` per round, median over rounds), then
once per mode for its peak resident memory per process (``ru_maxrss``: everything the process holds,
Python and torch included).

On GPUs (nccl; random-init shapes of bench_overhead.py built on each GPU, fp32 shards, bf16 compute; wall time
per step and ``torch.cuda.max_memory_allocated`` per process). NOT YET RUN: no GPU was lent to the session
that wrote it; expected memory per GPU: ``python scripts/fsdp_memory.py``:

    python scripts/bench_fsdp.py --device cuda --processes 8 --shape llama3-8b --mixed-precision bf16 \
        --seq 512 --batch 8 --interleave 5 --modes nodp,bk --out runs/bench/fsdp_llama3_8b_full.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
MODES = ("nodp", "bk", "ghost_fsdp")


def setup(args, mode: str, rank: int, world: int):
    """``step(batch)`` for one mode on this process, the model prepared and sharded as the trainer does."""
    import torch
    from bench_overhead import build, options

    from dpllm.config import PrivacyConfig
    from dpllm.data import make_collate
    from dpllm.distributed import World, wrap_model
    from dpllm.models import prepare_model
    from dpllm.privacy.engine import make_private
    from dpllm.privacy.plan import PrivacyPlan
    from dpllm.train import forward_loss

    torch.manual_seed(0)  # the same initial weights on every process and in every mode
    dp = mode != "nodp"
    # fp32 shards: the optimizer's and the noise's dtype
    model, mcfg = build(options(args), _device(args), torch.float32)
    model, _ = prepare_model(model, mcfg, dp=dp, keep_tie=mode == "bk")
    model = wrap_model(model.train(), dp=dp, world=World(rank=rank, size=world, kind="fsdp"), accelerator=None,
                       mixed_precision=args.mixed_precision, grad_sample_mode=mode if dp else None)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    criterion = None
    if dp:
        n = args.batch * world  # q = 1: every step sees the shapes of the no-DP step
        plan = PrivacyPlan(num_records=n, sample_rate=1.0, steps=1, noise_multiplier=1.0, delta=1e-5,
                           accountant="rdp", expected_batch_size=n)
        pt = make_private(model=model, optimizer=opt, dataset=[torch.full((8,), 3)] * n, collate_fn=make_collate(0),
                          cfg=PrivacyConfig(grad_sample_mode=mode), plan=plan, logical_batch_size=n,
                          noise_generator=torch.Generator(_device(args)).manual_seed(1000 + rank),
                          sampling_generator=torch.Generator().manual_seed(0), rank=rank, world_size=world)
        model, opt, criterion = pt.model, pt.optimizer, pt.criterion

    def step(batch):
        opt.zero_grad()
        forward_loss(model, batch, criterion).backward()
        opt.step()

    return step, model


def _device(args):
    import torch

    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if args.device == "cuda" else torch.device("cpu")


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from bench_overhead import random_batch

    from dpllm.checkpoint import unwrap
    from dpllm.distributed import finish_process

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(_device(args))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    modes = [args.mode] if args.mode else args.modes.split(",")
    steps = {}
    for mode in modes:
        steps[mode], model = setup(args, mode, rank, world)
    vocab = unwrap(model).get_input_embeddings().num_embeddings
    batch = random_batch(args, args.batch + rank, vocab, _device(args))  # other records on each process
    batch = {k: v[: args.batch] for k, v in batch.items()}
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda and args.mixed_precision == "bf16")
    cpu = {m: [] for m in modes}
    wall = {m: [] for m in modes}
    rounds = args.warmup + (args.interleave if not args.mode else args.memory_steps)
    for r in range(rounds):
        for mode in modes:
            dist.barrier()  # every process starts the step together: a wait is not counted as the step's work
            sync()
            t0, c0 = time.perf_counter(), time.process_time()
            with autocast:
                steps[mode](batch)
            sync()
            if r >= args.warmup:
                wall[mode].append(time.perf_counter() - t0)
                cpu[mode].append(time.process_time() - c0)
    peak = (torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    found = {"rank": rank, "cpu_s": cpu, "wall_s": wall, "peak_mib": peak / 2**20,
             "memory_kind": "cuda_max_allocated" if cuda else "process_peak_rss"}
    rows = [None] * world
    dist.all_gather_object(rows, found)
    if rank == 0:
        Path(args.worker_out).write_text(json.dumps(rows))
    finish_process(0)


def _launch(args, out: Path, mode: str | None = None) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.processes), "--master_port",
           str(port), __file__, "--worker-out", str(out), *_shape_args(args)]
    if mode:
        cmd += ["--mode", mode]
    subprocess.run(cmd, check=True, cwd=HERE.parent, env={**os.environ, "PYTHONPATH": str(HERE.parent)})
    return json.loads(out.read_text())


def _shape_args(args) -> list[str]:
    return ["--hidden", str(args.hidden), "--layers", str(args.layers), "--heads", str(args.heads), "--vocab",
            str(args.vocab), "--seq", str(args.seq), "--batch", str(args.batch), "--interleave",
            str(args.interleave), "--warmup", str(args.warmup), "--memory-steps", str(args.memory_steps),
            "--finetuning", args.finetuning, "--device", args.device, "--mixed-precision", args.mixed_precision,
            "--modes", args.modes, *(["--shape", args.shape] if args.shape else [])]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-llama", help=argparse.SUPPRESS)
    ap.add_argument("--shape", default=None, help="a random-init shape of scripts/bench_overhead.py (e.g. llama3-8b); "
                                                  "default: a Llama of --hidden/--layers/--heads/--vocab")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--mixed-precision", default="no", choices=("no", "bf16"), help="bf16 compute, fp32 shards")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, nodp first, of {', '.join(MODES)}")
    ap.add_argument("--finetuning", default="full", choices=("full", "lora"))
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192, help="vocabulary of the random-init Llama")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4, help="records per process per step")
    ap.add_argument("--interleave", type=int, default=7, help="timed rounds (one step of every mode each)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--memory-steps", type=int, default=2, help="steps of each per-mode memory launch (0: no "
                                                                "memory launches; the peak of the shared launch)")
    ap.add_argument("--out", default="runs/bench/fsdp.json")
    ap.add_argument("--mode", default=None, help=argparse.SUPPRESS)  # internal: one mode (memory)
    ap.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)  # internal: run as a worker
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    if modes[0] != "nodp" or not set(modes) <= set(MODES):
        raise SystemExit(f"--modes {args.modes}: nodp first (the reference of every ratio), then any of {MODES[1:]}")
    if args.worker_out:
        if not args.shape:  # the tiny builder sizes the vocabulary from the byte tokenizer; use a Llama shape
            _use_vocab(args)
        return worker(args)
    tmp = Path(args.out).with_suffix(".tmp.json")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    timing = _launch(args, tmp)
    # --memory-steps 0 (the smoke test): one launch; every mode's peak is then the shared process's
    memory = {m: _launch(args, tmp, m) if args.memory_steps else timing for m in modes}
    tmp.unlink()
    rows = []
    for mode in modes:
        per_rank = [{"rank": r["rank"],
                     "cpu_ratio_vs_nodp": statistics.median(c / b for c, b in zip(r["cpu_s"][mode],
                                                                                  r["cpu_s"]["nodp"])),
                     "wall_ratio_vs_nodp": statistics.median(w / b for w, b in zip(r["wall_s"][mode],
                                                                                   r["wall_s"]["nodp"])),
                     "median_cpu_s": statistics.median(r["cpu_s"][mode]),
                     "median_wall_s": statistics.median(r["wall_s"][mode]),
                     "peak_mib": next(x for x in memory[mode] if x["rank"] == r["rank"])["peak_mib"]}
                    for r in timing]
        rows.append({"mode": mode, "per_rank": per_rank})
    result = {"command": "OMP_NUM_THREADS=1 python scripts/bench_fsdp.py " + " ".join(sys.argv[1:] if argv is None
                                                                                     else argv),
              "shape": {"name": args.shape or "llama", "hidden": args.hidden, "layers": args.layers,
                        "heads": args.heads, "vocab": args.vocab, "seq": args.seq, "batch_per_process": args.batch,
                        "processes": args.processes, "finetuning": args.finetuning, "device": args.device,
                        "mixed_precision": args.mixed_precision},
              "memory_kind": timing[0]["memory_kind"] + ("" if args.memory_steps else ", all modes in one process"),
              "rounds": args.interleave, "load_average": os.getloadavg(), "rows": rows, "timing_raw": timing}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"{'mode':12s} {'rank':>4s} {'cpu×':>6s} {'wall×':>6s} {'cpu s':>7s} {'peak MiB':>9s}")
    for row in rows:
        for r in row["per_rank"]:
            print(f"{row['mode']:12s} {r['rank']:4d} {r['cpu_ratio_vs_nodp']:6.2f} {r['wall_ratio_vs_nodp']:6.2f} "
                  f"{r['median_cpu_s']:7.3f} {r['peak_mib']:9.0f}")
    return result


def _use_vocab(args) -> None:
    """Build a random-init Llama of the requested shape (bench_overhead's SHAPES registry, one entry added)."""
    import bench_overhead

    bench_overhead.SHAPES["bench-fsdp"] = dict(
        arch="llama", hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.heads, vocab_size=args.vocab)
    args.shape = "bench-fsdp"


if __name__ == "__main__":
    main()
