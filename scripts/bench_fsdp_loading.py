"""Host memory of loading a model under FSDP: every process reading the weights, or rank 0 alone
(``fsdp_cpu_ram_efficient_loading``: the others build on the meta device and receive their shards).

Saves a random-init Llama of the given shape to a temporary directory, then runs two gloo processes per way
through dpllm's own calls (``load_base``, ``shard_model``, ``fill_from_rank0``), and prints each process's peak
resident memory while loading (Linux: the peak is reset once dpllm and torch are imported) and whether both ways
give every process the same shard.

    OMP_NUM_THREADS=1 python scripts/bench_fsdp_loading.py        # 12 × 1024, 267M parameters, fp32, 4 processes
    python scripts/bench_fsdp_loading.py --layers 4 --hidden 512 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile


def _worker(rank: int, world: int, port: int, path: str, from_rank0: bool, queue) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from dpllm.config import ModelConfig
    from dpllm.distributed import World, fill_from_rank0, full_state, shard_model
    from dpllm.models import load_base

    me = World(rank=rank, size=world, kind="fsdp")
    before = _reset_peak()
    model, _, _ = load_base(ModelConfig(model_name_or_path=path), 64, on_meta=from_rank0 and rank > 0)
    full = full_state(model) if from_rank0 and rank == 0 else None
    model = shard_model(model)
    if from_rank0:
        fill_from_rank0(model, full, me, torch.device("cpu"))
    del full
    peak = _status("VmHWM")
    digest = float(sum(p.detach().to_local().double().sum() for p in model.parameters()))
    queue.put({"rank": rank, "from_rank0": from_rank0, "peak_rss_mib": peak,
               "after_imports_mib": before, "shard_sum": digest})
    dist.destroy_process_group()


def _status(key: str) -> float:
    """A /proc/self/status memory figure in MiB (Linux)."""
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(key + ":")) / 1024


def _reset_peak() -> float:
    """Reset this process's peak resident memory to its current one (Linux: clear_refs 5); return it in MiB."""
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    return _status("VmRSS")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32_000)
    ap.add_argument("--processes", type=int, default=4, help="gloo processes (CPU; more than the cores is fine)")
    ap.add_argument("--saved-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="the checkpoint's dtype (Hub checkpoints are mostly bf16); dpllm trains in float32")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)

    import torch
    import torch.multiprocessing as mp
    from transformers import LlamaConfig, LlamaForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        from dpllm.models import byte_tokenizer

        cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                          num_attention_heads=max(1, args.hidden // 64), vocab_size=args.vocab,
                          max_position_embeddings=128)
        model = LlamaForCausalLM(cfg)
        n = sum(p.numel() for p in model.parameters())
        model.to(getattr(torch, args.saved_dtype)).save_pretrained(tmp)
        byte_tokenizer().save_pretrained(tmp)
        del model
        print(f"Llama {args.layers} × {args.hidden}, vocab {args.vocab}: {n / 1e6:.0f}M parameters, "
              f"{4 * n / 2**20:.0f} MiB in fp32 (saved in {args.saved_dtype}); {args.processes} gloo processes",
              flush=True)
        rows = []
        ctx = mp.get_context("spawn")
        for from_rank0 in (False, True):
            queue = ctx.Queue()
            port = _port()
            procs = [ctx.Process(target=_worker, args=(r, args.processes, port, tmp, from_rank0, queue))
                     for r in range(args.processes)]
            for p in procs:
                p.start()
            got = sorted((queue.get(timeout=600) for _ in procs), key=lambda r: r["rank"])
            for p in procs:
                p.join()
            rows += got
            way = "rank 0 reads, others on meta" if from_rank0 else "every process reads"
            grown = [r["peak_rss_mib"] - r["after_imports_mib"] for r in got]
            print(f"{way:29s} peak RSS growth while loading: rank 0 {grown[0]:6.0f} MiB, others "
                  f"{min(grown[1:]):6.0f}–{max(grown[1:]):.0f} MiB; all processes {sum(grown):6.0f} MiB", flush=True)
        w = args.processes
        same = all(abs(a["shard_sum"] - b["shard_sum"]) <= 1e-6 * max(1.0, abs(a["shard_sum"]))
                   for a, b in zip(rows[:w], rows[w:]))
        print(f"every process holds the same shard either way: {same}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"layers": args.layers, "hidden": args.hidden, "vocab": args.vocab, "parameters": n,
                       "processes": args.processes, "saved_dtype": args.saved_dtype,
                       "rows": rows, "same_shards": same}, fh, indent=1)


if __name__ == "__main__":
    main()
