"""Step time and memory of correlated noise (BandMF, BLT) against DP-SGD's independent noise, in the same run.

    OMP_NUM_THREADS=1 python scripts/bench_correlated_step.py \\
        --out docs/results/correlated_noise_speed/gpt2_small.json
    python scripts/bench_correlated_step.py --smoke --out /tmp/x.json     # tiny Llama, one round (the suite's)

The model: GPT-2 small's shape (124M parameters, random init from its config, no download), full fine-tuning under
bk on CPU, one thread, AdamW; a whole step is timed (forward, bk's backward and clipping, the noise, the update).

Same run, drift cancelled. Each correlated mode (banded b = 2, 4, 8; BLT d = 1 … 4 buffers, with and without
``reuse_draws``: x computed in the fresh draw's storage, or in a copy of it) gets one child
process that builds the model once and, round after round, takes one step with independent noise and one with the
mode's noise recurrence set on the bk optimizer (``LeanAccumulation.recurrence``, the hook every training run
uses), the order flipped each round. The ratio reported is the median over rounds of (mode step / independent
step of that round), in wall-clock and in process CPU time (one thread: CPU time is the work itself, whatever else
runs on the machine). Before timing, the recurrence is filled to its steady state (b−1 kept draws, or d buffers).

A whole step moves by ±10% from round to round, more than a recurrence costs; the only part of a step that differs
between the modes is the optimizer's noise call (the draw, and the recurrence), so each child then times that call
alone (``--noise-reps`` alternating rounds; ``noise_extra_cpu_s``, the median extra, and ``cpu_ratio_from_noise``, 1 +
that extra over the independent step's median CPU time).

Memory per process, measured two ways: ``VmHWM`` (peak resident set) from ``/proc/self/status`` of each child at
its end, beside that of a child that takes only independent steps (the difference is what the mode adds, malloc's
rounding included), and the exact bytes of the recurrence's state (the tensors its ``state_dict`` holds: b−1 or d
model-sized tensors of the trainable parameters, in the noise dtype).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_overhead import build_shape, options, random_batch, setup_mode  # noqa: E402

# the strategies are built for a run of this shape (what the coefficients are does not change the cost)
PLAN = dict(steps=1000, num_records=10_000, batch=100)  # ⌈N/B⌉ = 100 batches per epoch, 10 epochs


def recurrence_for(mode: str):
    """``independent`` → None; ``banded:b`` / ``blt:d`` → a fresh recurrence from the correlated-noise registry."""
    from dpllm.privacy import correlated

    if mode == "independent":
        return None
    kind, k = mode.split(":")
    if kind == "banded":
        noise = correlated.build("banded", int(k), noise_multiplier=1.0, **PLAN)
    elif kind in ("blt", "blt-reuse"):  # BLT's groups = one epoch's batches (its min-separation), d buffers
        noise = correlated.build("blt", PLAN["num_records"] // PLAN["batch"], buffers=int(k), **PLAN)
        # blt-reuse: x computed in the fresh draw's storage (BLTRecurrence(reuse_draws=True), what
        # CorrelatedNoise.recurrence() gives the optimizer); blt: the recurrence that copies each draw first
        return noise.strategy.recurrence(reuse_draws=kind == "blt-reuse")
    else:
        raise SystemExit(f"mode {mode!r}: use independent, banded:b, blt:d or blt-reuse:d")
    return noise.recurrence()


def state_bytes(rec) -> int:
    """Bytes of the tensors a recurrence keeps (its ``state_dict``: the past noise or the buffers)."""
    import torch

    def walk(x) -> int:
        if isinstance(x, torch.Tensor):
            return x.numel() * x.element_size()
        if isinstance(x, dict):
            return sum(walk(v) for v in x.values())
        if isinstance(x, (list, tuple)):
            return sum(walk(v) for v in x)
        return 0

    return 0 if rec is None else walk(rec.state_dict())


def peak_rss_mib() -> float:
    """This process's peak resident set (``VmHWM``, Linux), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def fill(opt, rec) -> None:
    """Run the recurrence on fresh draws until it holds its steady state (b−1 past draws, or d warm buffers)."""
    from opacus.optimizers.optimizer import _generate_noise

    for _ in range(max(1, rec.extra_tensors_per_parameter)):
        for i, p in enumerate(opt.params):
            rec.apply(i, _generate_noise(std=1.0, reference=p.detach(), generator=opt.generator))
        rec.end_step()


def one_mode(args) -> dict:
    """This child's mode beside independent noise, alternating steps (see the module docstring)."""
    import torch

    from dpllm.config import ModelConfig
    from dpllm.train import forward_loss

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_shape(args.shape, torch.device("cpu"), torch.float32, args.seq)
    vocab = model.get_input_embeddings().num_embeddings
    model, opt, criterion, _ = setup_mode(model, ModelConfig(finetuning="full"), "bk", args.batch,
                                          torch.device("cpu"))
    trainable = sum(p.numel() for p in opt.params)
    batch = random_batch(options(seq=args.seq), args.batch, vocab, torch.device("cpu"))
    rec = recurrence_for(args.mode)
    if rec is not None:
        fill(opt, rec)

    def step(r):
        opt.recurrence = r
        opt.zero_grad()
        forward_loss(model, batch, criterion).backward()
        opt.step()

    pairs = [rec] if args.mode == "independent" else [None, rec]
    wall = {i: [] for i in range(len(pairs))}
    cpu = {i: [] for i in range(len(pairs))}
    for r in range(args.warmup + args.rounds):
        order = range(len(pairs)) if r % 2 == 0 else reversed(range(len(pairs)))
        for i in order:
            t0, c0 = time.perf_counter(), time.process_time()
            step(pairs[i])
            if r >= args.warmup:
                wall[i].append(time.perf_counter() - t0)
                cpu[i].append(time.process_time() - c0)
        print(f"{args.mode}: round {r + 1}/{args.warmup + args.rounds}", file=sys.stderr, flush=True)
    noise = noise_only(opt, pairs, args.noise_reps) if rec is not None and args.noise_reps else None
    peak = peak_rss_mib()  # before state_bytes: BLT's state_dict clones its buffers
    row = {"mode": args.mode, "trainable_parameters": trainable, "rounds": args.rounds,
           "extra_tensors_per_parameter": 0 if rec is None else rec.extra_tensors_per_parameter,
           "state_bytes": state_bytes(rec), "peak_rss_mib": peak,
           "median_step_s": statistics.median(wall[len(pairs) - 1]),
           "median_cpu_s": statistics.median(cpu[len(pairs) - 1])}
    if rec is not None:
        row.update(independent_median_step_s=statistics.median(wall[0]),
                   independent_median_cpu_s=statistics.median(cpu[0]),
                   wall_ratio=statistics.median(m / i for m, i in zip(wall[1], wall[0])),
                   cpu_ratio=statistics.median(m / i for m, i in zip(cpu[1], cpu[0])),
                   wall_s=wall[1], cpu_s=cpu[1], independent_wall_s=wall[0], independent_cpu_s=cpu[0])
    if noise is not None:  # the only part of a step that differs, timed alone against the whole step's median
        extra = statistics.median(m - i for m, i in zip(noise[1], noise[0]))
        row.update(noise_cpu_s=noise[1], independent_noise_cpu_s=noise[0], noise_extra_cpu_s=extra,
                   cpu_ratio_from_noise=1 + extra / statistics.median(cpu[0]))
    return row


def noise_only(opt, pairs, reps: int) -> dict:
    """CPU seconds of the optimizer's noise alone (``add_noise``: the draw, and the recurrence for the mode) over
    ``reps`` alternating rounds, for independent noise and the mode. A whole step's time moves by ±10% from round
    to round on a shared machine, more than the recurrence costs; its difference from independent noise is in this
    call only, so timing the call alone resolves it."""
    import torch

    for p in opt.params:
        p.summed_grad = torch.zeros_like(p)
    times = {i: [] for i in range(len(pairs))}
    for r in range(reps + 1):
        for i in (range(len(pairs)) if r % 2 == 0 else reversed(range(len(pairs)))):
            opt.recurrence = pairs[i]
            for p in opt.params:  # a cleared sum, as zero_grad and a backward pass leave it
                p.summed_grad.zero_()
                if hasattr(p.summed_grad, "_processed"):
                    del p.summed_grad._processed
            c0 = time.process_time()
            opt.add_noise()
            if r:  # the first round warms the allocator
                times[i].append(time.process_time() - c0)
    for p in opt.params:
        p.summed_grad, p.grad = None, None
    return times


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="gpt2-small", help="a shape of scripts/bench_overhead.py's SHAPES")
    ap.add_argument("--seq", type=int, default=64, help="tokens per record (short: the noise's share is largest)")
    ap.add_argument("--batch", type=int, default=2, help="physical batch (records per step)")
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds per mode (one step of each per round)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    ap.add_argument("--bands", type=int, nargs="*", default=[2, 4, 8], help="banded modes: b")
    ap.add_argument("--buffers", type=int, nargs="*", default=[1, 2, 3, 4], help="BLT modes: d")
    ap.add_argument("--reuse-buffers", type=int, nargs="*", default=[1, 2, 3, 4],
                    help="BLT modes whose recurrence computes x in the draw's storage (reuse_draws): d")
    ap.add_argument("--no-independent", action="store_true",
                    help="skip the independent-only process (its peak RSS is the reference of '+ MiB')")
    ap.add_argument("--noise-reps", type=int, default=7,
                    help="rounds of the noise call alone per correlated mode (0: skip; see noise_only)")
    ap.add_argument("--smoke", action="store_true", help="tiny Llama, one round, b = 2 and d = 1, in this process")
    ap.add_argument("--out", default="runs/bench/correlated_step.json")
    ap.add_argument("--mode", default=None, help=argparse.SUPPRESS)  # internal: one child
    return ap


def main(argv=None) -> dict:
    args = parser().parse_args(argv)
    if args.smoke:
        args.shape, args.seq, args.batch, args.rounds, args.warmup = "llama-tiny", 16, 2, 1, 0
        args.bands, args.buffers, args.reuse_buffers = [2], [1], [1]
    if args.mode:
        print(json.dumps(one_mode(args)))
        return {}
    modes = ([] if args.no_independent else ["independent"]) + [f"banded:{b}" for b in args.bands] \
        + [f"blt:{d}" for d in args.buffers] + [f"blt-reuse:{d}" for d in args.reuse_buffers]
    base = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--smoke"]
    if args.smoke:
        base += ["--shape", args.shape, "--seq", "16", "--batch", "2", "--rounds", "1", "--warmup", "0"]
    rows = []
    for mode in modes:
        t0 = time.time()
        if args.smoke:  # one process: the memory figures are then not per mode (the suite only checks it runs)
            rows.append(one_mode(argparse.Namespace(**{**vars(args), "mode": mode})))
        else:
            res = subprocess.run([sys.executable, __file__, *base, "--mode", mode], capture_output=True, text=True,
                                 env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
            if res.returncode != 0:
                print(res.stderr[-3000:], file=sys.stderr)
                rows.append({"mode": mode, "error": (res.stderr.strip().splitlines() or ["?"])[-1]})
                continue
            rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
        print(f"{mode}: done in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    ind = next((r for r in rows if r["mode"] == "independent" and "error" not in r), None)
    for r in rows:
        if "error" not in r and ind is not None:
            r["peak_rss_over_independent_mib"] = r["peak_rss_mib"] - ind["peak_rss_mib"]
    import torch

    result = {"command": "OMP_NUM_THREADS=1 python scripts/bench_correlated_step.py " + " ".join(base),
              "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "machine": {"cpu": _cpu_name(), "cores": os.cpu_count(), "platform": platform.platform(),
                          "load_average_end": os.getloadavg(), "torch": torch.__version__, "threads": 1},
              "setup": {"shape": args.shape, "seq": args.seq, "batch": args.batch, "rounds": args.rounds,
                        "warmup": args.warmup, "engine": "bk", "finetuning": "full", "optimizer": "AdamW",
                        "dtype": "float32", "strategy_plan": PLAN,
                        "memory": "peak_rss_mib: VmHWM of the mode's own process (independent steps and the mode's "
                                  "steps); state_bytes: the recurrence's tensors exactly" if not args.smoke else
                                  "smoke: all modes in one process, peak_rss_mib is not per mode"},
              "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"{args.shape}, T={args.seq}, batch {args.batch}, bk, one thread; median of {args.rounds} rounds, each "
          "mode beside independent noise in its own process")
    print(f"{'mode':<13}{'step (s)':>9}{'× indep.':>9}{'cpu ×':>8}{'state GiB':>11}{'peak RSS MiB':>14}{'+ MiB':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['mode']:<13}failed: {r['error'][:90]}")
            continue
        print(f"{r['mode']:<13}{r['median_step_s']:>9.3f}{r.get('wall_ratio', 1.0):>9.3f}"
              f"{r.get('cpu_ratio', 1.0):>8.3f}"
              f"{r['state_bytes'] / 2**30:>11.3f}{r['peak_rss_mib']:>14.0f}"
              f"{r.get('peak_rss_over_independent_mib', 0.0):>8.0f}")
    print(f"wrote {args.out}")
    return result


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


if __name__ == "__main__":
    main()
