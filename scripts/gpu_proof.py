"""GPU proof in one command (issue 47): the engine at 8B/1.5B, the shipped 8B recipe end to end, and a 5-size
scaling mini-sweep with a pre-registered prediction, in one 15-minute GPU window.

The one command on the GPU machine, from the repository root (the wheels it lacks travel in .whl/, made here
first by ``bash scripts/gpu_wheels.sh``; carry ``.whl``):

    bash scripts/gpu_proof.sh                 # installs .whl/ into a temp dir, runs this with --deadline-s 510

and on any CPU, the same phases on tiny shapes in well under a minute (tests/test_gpu_proof.py runs it):

    python scripts/gpu_proof.py --smoke --out runs/gpu_proof_smoke

Phases, in order, each under its own time limit and the global deadline (``--deadline-s``, checked between and
inside phases: a phase or part that would overrun is skipped and recorded as skipped, with why). Each writes
``OUT/<n>_<phase>.json`` (atomically) as soon as it ends, so an interrupted run keeps what finished:

1. ``engine``: scripts/bench_overhead.py's builders, on random-init shapes built on the GPU in bf16, T = 512:
   Llama-3-8B LoRA and Qwen2.5-1.5B full fine-tuning; modes nodp, bk (ghost if time allows). Per mode: step time,
   tokens/s and peak memory at the reference batch (the docs' 8 and 16), then the largest physical batch that
   fits (doubling until ``torch.cuda.OutOfMemoryError``).
2. ``recipe``: recipes/finetune_llm.py with recipes/configs/llama3_8b/lora_eps8.yaml on a random-init 8B model
   (``model.random_init``: config.json and a byte tokenizer, no weights) at its documented physical batch, a few
   steps; then the same in fp32 (bf16 under DP against fp32; on the 1B shape if fp32 8B does not fit).
3. ``scaling``: 5 Llama sizes (~5M to ~176M) DP-trained on the embedded corpus at ε = 8, 2 noise-batch settings
   (logical batch) each, the 4 smaller also at 2 step budgets (the noise-batch law has 9 parameters and needs 10
   configurations); the law is fitted on the 4 smaller and its prediction for the largest is written
   (``3_scaling_prediction.json``, timestamped) before the largest trains; then the error.
4. ``extras``: one FSDP2 bk step at world size 1 (scripts/bench_fsdp.py's setup), and one QLoRA nf4 8B step
   with and without DP if bitsandbytes is importable.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import resource
import signal
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts"), str(ROOT / "recipes")]

import bench_overhead as bo  # noqa: E402  (scripts/: the shapes, builders and steps this reuses)

# (phase, time limit in seconds on the GPU, in --smoke); the limits add up to the deadline's budget
# (--smoke's are wide: a loaded CI machine runs it several times slower; tests/test_gpu_proof.py checks the limits)
PHASES = (("engine", 175, 150), ("recipe", 120, 150), ("scaling", 200, 200), ("extras", 45, 150))
ENGINE_CASES = {  # (shape, finetuning, reference batch: the docs' figures are at these)
    "gpu": [("llama3-8b", "lora", 8), ("qwen2.5-1.5b", "full", 16)],
    "smoke": [("llama-tiny", "lora", 2), ("llama-tiny", "full", 2)],
}
# Llama shapes of recipes/configs/llama/scaling_sweep_gpu.yaml (sizes 0-3) and a fifth of ~176M parameters
SCALING_SIZES = {
    "gpu": [dict(tiny_hidden_size=256, tiny_num_layers=6, tiny_num_heads=4, tiny_intermediate_size=688),
            dict(tiny_hidden_size=384, tiny_num_layers=12, tiny_num_heads=6, tiny_intermediate_size=1024),
            dict(tiny_hidden_size=512, tiny_num_layers=16, tiny_num_heads=8, tiny_intermediate_size=1368),
            dict(tiny_hidden_size=768, tiny_num_layers=16, tiny_num_heads=12, tiny_intermediate_size=2048),
            dict(tiny_hidden_size=1024, tiny_num_layers=14, tiny_num_heads=16, tiny_intermediate_size=2736)],
    "smoke": [dict(tiny_hidden_size=h, tiny_num_layers=1, tiny_num_heads=2, tiny_intermediate_size=2 * h)
              for h in (16, 24, 32, 40, 64)],
}
SCALING = {  # steps budgets of the fitted sizes (the largest runs the last), logical batches, ε, LR per size
    "gpu": dict(steps=[40, 80], batches=[64, 256], epsilon=8.0, max_length=128, eval_records=256,
                lr=[2e-3, 1e-3, 6e-4, 4e-4, 3e-4], physical=[256, 256, 128, 64, 64], n_boot=200, records=None,
                largest_cost=4.0),
    "smoke": dict(steps=[2, 4], batches=[8, 16], epsilon=8.0, max_length=32, eval_records=16,
                  lr=[1e-2] * 5, physical=[16] * 5, n_boot=5, records=120, largest_cost=1.5),
}


class PhaseTimeout(Exception):
    """Raised by SIGALRM in the main thread when a phase reaches its time limit (between two Python calls)."""


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds")


def write_json(path: Path, doc: dict) -> None:
    """Write ``doc`` atomically: a reader (or an interrupted run) sees the old file or the new one, never half."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    os.replace(tmp, path)


class Clock:
    """The global deadline, and each phase's share of what is left of it."""

    def __init__(self, deadline_s: float):
        self.start = time.monotonic()
        self.deadline_s = deadline_s

    def left(self) -> float:
        return self.deadline_s - (time.monotonic() - self.start)

    def elapsed(self) -> float:
        return time.monotonic() - self.start


class Phase:
    """One phase's record, its own time limit, and the checks its parts make before they start."""

    def __init__(self, n: int, name: str, limit: float, clock: Clock, out: Path):
        self.n, self.name, self.clock, self.out = n, name, clock, out
        self.begin = time.monotonic()
        self.limit = min(limit, clock.left())
        self.rec = {"phase": name, "status": "running", "started_at": now(), "limit_s": round(self.limit, 1),
                    "parts": [], "skipped": []}

    def left(self) -> float:
        return min(self.limit - (time.monotonic() - self.begin), self.clock.left())

    def allows(self, what: str, need_s: float) -> bool:
        """Whether a part expected to take ``need_s`` fits in what is left; if not, record it as skipped."""
        if self.left() >= need_s:
            return True
        self.rec["skipped"].append({"what": what, "why": f"needs ~{need_s:.0f} s, {max(self.left(), 0):.0f} s left "
                                                         f"of the phase's limit and the deadline"})
        return False

    def path(self) -> Path:
        return self.out / f"{self.n}_{self.name}.json"

    def save(self) -> None:
        write_json(self.path(), self.rec)


def _on_alarm(signum, frame):
    raise PhaseTimeout()


def run_phase(n: int, name: str, limit: float, fn, ctx: dict) -> dict:
    """Run ``fn(phase, ctx)`` under ``limit`` seconds (SIGALRM) and the deadline; write its JSON whatever happens."""
    clock, out = ctx["clock"], ctx["out"]
    ph = Phase(n, name, limit, clock, out)
    cpu0 = time.process_time()
    if ph.limit < 5:
        ph.rec.update(status="skipped", why=f"{clock.left():.0f} s left before the deadline", ended_at=now())
        ph.save()
        return ph.rec
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, ph.limit)
    try:
        fn(ph, ctx)
        ph.rec["status"] = "ok"
    except PhaseTimeout:
        ph.rec["status"] = "stopped"
        ph.rec["why"] = f"reached its limit of {ph.limit:.0f} s; the parts above finished"
    except Exception as err:  # a phase that fails leaves the others their time
        ph.rec["status"] = "error"
        ph.rec["error"] = f"{type(err).__name__}: {err}"
        ph.rec["traceback"] = traceback.format_exc()[-4000:]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    ph.rec.update(ended_at=now(), wall_s=round(time.monotonic() - ph.begin, 2),
                  cpu_s=round(time.process_time() - cpu0, 2))
    ph.save()
    _free(ctx)
    print(f"[{clock.elapsed():6.1f} s] phase {n} {name}: {ph.rec['status']} in {ph.rec['wall_s']} s -> {ph.path()}",
          flush=True)
    return ph.rec


def _free(ctx) -> None:
    """Return a finished job's GPU memory to the next one. Not on CPU (--smoke): nothing waits for the memory, and
    a full collection there takes ~0.45 s with transformers and opacus loaded, 20 times a run."""
    if not ctx["cuda"]:
        return
    import torch

    gc.collect()
    torch.cuda.empty_cache()


def _peak_mib(ctx) -> tuple[float, str]:
    import torch

    if ctx["cuda"]:
        return torch.cuda.max_memory_allocated() / 2**20, "cuda_max_allocated_mib"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "process_peak_rss_mib (whole process)"


def _is_oom(err: BaseException) -> bool:
    """A CUDA out-of-memory error, also where a hook re-raised it as a plain RuntimeError."""
    import torch

    return isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in str(err).lower()


# ---------------------------------------------------------------------------------------------- phase 1: engine
def engine(ph: Phase, ctx: dict) -> None:
    cases = ENGINE_CASES[ctx["profile"]]
    seq = 512 if not ctx["smoke"] else 32
    modes = ["nodp", "bk", "ghost"]
    ph.rec.update(seq=seq, dtype=ctx["dtype"], device=ctx["device"])
    jobs = [(c, m) for m in modes for c in cases]  # nodp and bk of both shapes first; ghost only if time allows
    jobs.sort(key=lambda j: (modes.index(j[1]) > 1, cases.index(j[0]), modes.index(j[1])))
    for k, ((shape, ft, ref), mode) in enumerate(jobs):
        share = ph.left() / (len(jobs) - k)  # an even share of what is left for each job still to run
        if not ph.allows(f"{shape} {ft} {mode}", min(share, 15 if not ctx["smoke"] else 1)):
            continue
        part = {"shape": shape, "finetuning": ft, "mode": mode, "ref_batch": ref, "seq": seq}
        ph.rec["parts"].append(part)
        try:
            _engine_job(part, ctx, seq, share)
        except Exception as err:  # one job's failure leaves the others their time
            what = "out of memory at setup or the reference batch" if _is_oom(err) else type(err).__name__
            part["error"] = f"{what}: {str(err)[:300]}"
        finally:
            _free(ctx)
        ph.save()
    base = {(p["shape"], p["finetuning"]): p for p in ph.rec["parts"] if p["mode"] == "nodp" and "step_s" in p}
    for p in ph.rec["parts"]:
        b = base.get((p["shape"], p["finetuning"]))
        if b and "step_s" in p and p["ref_batch"] == b["ref_batch"]:
            p["time_ratio_vs_nodp"] = p["step_s"] / b["step_s"]
            p["memory_ratio_vs_nodp"] = p["peak_memory_mib"] / b["peak_memory_mib"]
    ph.rec["per_layer_profile"] = ("not in this window; scripts/profile_bk.py gives bk's time per rule and phase "
                                   "(on CPU), the place to look where a ratio misses its target")


def _engine_job(part: dict, ctx: dict, seq: int, share: float) -> None:
    import torch

    device = torch.device(ctx["device"])
    dtype = getattr(torch, ctx["dtype"])
    t0 = time.monotonic()
    args = bo.options(shape=part["shape"], finetuning=part["finetuning"], device=ctx["device"], dtype=ctx["dtype"],
                      autocast="bf16" if ctx["cuda"] else "no", seq=seq, batch=part["ref_batch"])
    torch.manual_seed(0)
    model, mcfg = bo.build(args, device, dtype)
    vocab = model.get_input_embeddings().num_embeddings
    step, resolved = bo.make_step(args, model, mcfg, device, part["mode"])
    del model
    part["resolved_mode"] = resolved
    part["build_s"] = round(time.monotonic() - t0, 2)
    sync = torch.cuda.synchronize if ctx["cuda"] else (lambda: None)

    def timed(batch_size: int, n: int) -> list[float]:
        batch = bo.random_batch(args, batch_size, vocab, device)
        out = []
        for _ in range(n):
            sync()
            s = time.perf_counter()
            step(batch)
            sync()
            out.append(time.perf_counter() - s)
        return out

    if ctx["cuda"]:
        torch.cuda.reset_peak_memory_stats()
    times = timed(part["ref_batch"], 4)[1:]  # one warm-up step
    part["step_s"] = statistics.median(times)
    part["tokens_per_s"] = part["ref_batch"] * seq / part["step_s"]
    part["peak_memory_mib"], part["memory_kind"] = _peak_mib(ctx)
    # The largest batch that fits: doubling from the reference until out of memory (two steps each: the second
    # holds the optimizer's state), within this job's share of the phase and a cap.
    cap = 512 if not ctx["smoke"] else 2 * part["ref_batch"]
    b, fits, tried = 2 * part["ref_batch"], part["ref_batch"], []
    spent = time.monotonic() - t0
    while b <= cap:
        guess = max(times) * b / part["ref_batch"] * 3  # two steps at b, and margin
        if spent + guess > share:
            part["search_stopped"] = f"time: batch {b} would need ~{guess:.0f} s of this job's {share:.0f} s"
            break
        try:
            if ctx["cuda"]:
                torch.cuda.reset_peak_memory_stats()
            ts = timed(b, 2)
            fits = b
            tried.append({"batch": b, "step_s": ts[-1], "tokens_per_s": b * seq / ts[-1],
                          "peak_memory_mib": _peak_mib(ctx)[0]})
        except Exception as err:
            if not _is_oom(err):
                raise
            tried.append({"batch": b, "oom": str(err)[:160]})
            part["search_stopped"] = f"out of memory at batch {b}"
            break
        finally:
            _free(ctx)
        b *= 2
        spent = time.monotonic() - t0
    else:
        part["search_stopped"] = f"cap {cap}"
    part["max_batch_fits"] = fits
    part["max_batch_is_lower_bound"] = not part["search_stopped"].startswith("out of memory")
    part["batch_search"] = tried


# ---------------------------------------------------------------------------------------------- phase 2: recipe
def recipe(ph: Phase, ctx: dict) -> None:
    import yaml

    conf = ROOT / "recipes/configs/llama3_8b/lora_eps8.yaml"
    doc = yaml.safe_load(conf.read_text())
    physical = doc["train"]["physical_batch_size"]
    shapes = ["llama3-8b", "llama3.2-1b"] if not ctx["smoke"] else ["llama-tiny", "llama-tiny"]
    ph.rec.update(config=str(conf.relative_to(ROOT)), documented_physical_batch=physical,
                  max_length=doc["data"]["max_length"])
    runs = [(shapes[0], "bfloat16")]
    runs.append((shapes[0], "float32"))
    i = 0
    while i < len(runs):
        shape, dtype = runs[i]
        i += 1
        need = 45 if not ctx["smoke"] else 3
        if not ph.allows(f"{shape} {dtype}", need):
            continue
        part = _recipe_run(ctx, conf, shape, dtype, physical, ph.left() - 2)
        ph.rec["parts"].append(part)
        ph.save()
        if shape == shapes[0] and dtype == "float32" and part["returncode"] != 0:
            part["note"] = "fp32 at the 8B shape did not run (above); bf16 and fp32 are compared on the 1B shape"
            runs += [(shapes[1], "bfloat16"), (shapes[1], "float32")]
    by = {(p["shape"], p["dtype"]): p for p in ph.rec["parts"] if p["returncode"] == 0 and p.get("step_s")}
    for shape in shapes:
        if (shape, "bfloat16") in by and (shape, "float32") in by:
            ph.rec["bf16_vs_fp32"] = {"shape": shape, "step_time_ratio_bf16_over_fp32":
                                      by[(shape, "bfloat16")]["step_s"] / by[(shape, "float32")]["step_s"]}
            break


def _recipe_run(ctx: dict, conf: Path, shape: str, dtype: str, physical: int, timeout: float) -> dict:
    """One run of the recipe in its own process (its own GPU memory, a hard timeout): the shipped config, a
    random-init model of ``shape``, the embedded corpus, 3 optimizer steps of two physical batches each."""
    from transformers import AutoConfig

    from dpllm.models import byte_tokenizer

    model_dir = ctx["out"] / "recipe" / f"{shape}_config"
    if not (model_dir / "config.json").exists():
        spec = dict(bo.SHAPES[shape])
        arch = spec.pop("arch")
        AutoConfig.for_model(arch, max_position_embeddings=8192, **spec).save_pretrained(model_dir)
        byte_tokenizer().save_pretrained(model_dir)
    import yaml

    run_dir = ctx["out"] / "recipe" / f"{shape}_{dtype}"
    phys = physical if not ctx["smoke"] else 4
    # The shipped config with its one epoch replaced by 3 steps (an option the command line cannot unset); every
    # other change is an override below, recorded with the run
    doc = yaml.safe_load(conf.read_text())
    doc["train"].update(epochs=None, max_steps=3)
    derived = ctx["out"] / "recipe" / f"{conf.stem}_3steps.yaml"
    derived.write_text(yaml.safe_dump(doc, sort_keys=False))
    argv = ["--config", str(derived), "--model_name_or_path", str(model_dir), "--random_init", "true",
            "--torch_dtype", dtype, "--mixed_precision", "bf16" if dtype == "bfloat16" else "no",
            "--dataset", "pydoc", "--output_dir", str(run_dir), "--overwrite_output_dir", "true",
            "--logical_batch_size", str(2 * phys), "--physical_batch_size", str(phys),
            "--eval_every", "0", "--eval_max_records", str(phys), "--save_every", "0", "--log_every", "1",
            "--warmup_steps", "0", "--progress", "false"]
    if ctx["smoke"]:  # 100 of pydoc's 1,748 records: tokenizing them all was a third of this phase on CPU
        argv += ["--max_length", "32", "--max_records", "100"]
    res_file = run_dir.with_suffix(".child.json")
    cmd = [sys.executable, __file__, "--recipe-child", str(res_file), "--", *argv]
    t0 = time.monotonic()
    part = {"shape": shape, "dtype": dtype, "physical_batch_size": phys, "config": f"{conf.relative_to(ROOT)} with "
            "train.epochs: null, train.max_steps: 3", "command": "python recipes/finetune_llm.py "
            + " ".join(argv), "process": "own" if not ctx["smoke"] else "this one (--smoke: no second start-up)"}
    if ctx["smoke"]:  # the same call as the child's, in this process: a second interpreter's imports are most of it
        part["returncode"] = recipe_child(str(res_file), argv)
    else:
        try:
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(timeout, 1))
            part["returncode"] = proc.returncode
            if proc.returncode != 0:
                part["stderr_tail"] = proc.stderr[-2500:]
        except subprocess.TimeoutExpired:
            part.update(returncode=-9, error=f"killed at the phase's limit ({timeout:.0f} s)")
    part["wall_s"] = round(time.monotonic() - t0, 2)
    if res_file.exists():
        part.update(json.loads(res_file.read_text()))
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        train = [r for r in rows if r.get("split") == "train" and "elapsed_s" in r]
        gaps = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(train, train[1:])]
        part["steps"] = len(train)
        if gaps:  # the first step carries the warm-up (kernels, allocator): the later ones are the step time
            part["step_s"] = statistics.median(gaps)
            part["tokens_per_step_max"] = 2 * phys * (32 if ctx["smoke"] else 512)
        part["epsilon_at_end"] = train[-1].get("epsilon") if train else None
    return part


def recipe_child(res_file: str, argv: list[str]) -> int:
    """The recipe's own ``cli`` in this process, then its wall time and peak memory into ``res_file``."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("finetune_llm", ROOT / "recipes" / "finetune_llm.py")
    ft = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ft)
    t0 = time.monotonic()
    code = ft.cli(argv)
    cuda = torch.cuda.is_available()
    peak = (torch.cuda.max_memory_allocated() / 2**20 if cuda
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    write_json(Path(res_file), {"recipe_rc": code, "recipe_wall_s": round(time.monotonic() - t0, 2),
                                "peak_memory_mib": peak,
                                "memory_kind": "cuda_max_allocated_mib" if cuda else "process_peak_rss_mib"})
    return code


# --------------------------------------------------------------------------------------------- phase 3: scaling
def scaling(ph: Phase, ctx: dict) -> None:
    import scaling_sweep  # recipes/: the sweep's run configuration, reused

    from dpllm.config import DataConfig, config_from_dict
    from dpllm.data import load_records
    from dpllm.scaling.fit import fit_form
    from dpllm.scaling.runs import load_runs

    sizes, s = SCALING_SIZES[ctx["profile"]], SCALING[ctx["profile"]]
    out = ctx["out"] / "scaling"
    out.mkdir(parents=True, exist_ok=True)
    runs_file = out / "runs.jsonl"
    runs_file.unlink(missing_ok=True)
    # The corpus once, as a file: every run reads the same records (the first ``records`` of it with --smoke, where
    # the byte tokenizer's Python loop over all of pydoc would be most of a tiny run's time)
    corpus = out / "corpus.jsonl"
    texts = load_records(DataConfig(dataset="pydoc", min_chars=32))[: s["records"]]
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    base = {"model": {"model_name_or_path": "tiny-llama", "finetuning": "full", "tiny_max_positions": 256},
            "data": {"dataset": str(corpus), "max_length": s["max_length"], "heldout_fraction": 0.05,
                     "min_chars": 32},
            "train": {"physical_batch_size": 64, "lr_scheduler": "constant", "warmup_steps": 0, "eval_every": 0,
                      "eval_max_records": s["eval_records"], "log_every": 1000, "progress": False,
                      "mixed_precision": "bf16" if ctx["cuda"] else "no"},
            "privacy": {"target_delta": 1e-5, "accountant": "prv", "grad_sample_mode": "auto", "max_grad_norm": 1.0}}
    ph.rec.update(protocol={
        "corpus": f"pydoc (the embedded corpus: Python's own documentation, byte tokenizer), {len(texts)} records",
        "epsilon": s["epsilon"], "delta": 1e-5, "logical_batches": s["batches"], "steps_fitted_sizes": s["steps"],
        "steps_largest": s["steps"][-1], "learning_rates": s["lr"], "max_length": s["max_length"],
        "training": "DP full training from random init (no pretraining: no time for it in this window)",
        "law": "noise_batch: L = E + A/N^alpha + B/S^beta + C·sigma_bar^gamma·N^kappa/S^eta (9 parameters, so the "
               "4 fitted sizes run 2 batches × 2 step budgets: 16 configurations)"},
        sizes=sizes)

    def run(i: int, steps: int, batch: int) -> dict | None:
        name = f"size{i}_steps{steps}_b{batch}"
        size = {**sizes[i], "train": {"physical_batch_size": min(s["physical"][i], batch)}}
        cfg = scaling_sweep._run_cfg(base, size, steps=steps, eps=s["epsilon"], seed=0, batch=batch, lr=s["lr"][i])
        cfg["train"].update(output_dir=str(out / name), runs_file=str(runs_file), overwrite_output_dir=True)
        from dpllm.train import train

        t0, started = time.monotonic(), now()
        train(config_from_dict(cfg))
        row = next(r for r in reversed(load_runs(runs_file)) if Path(r["run_dir"]).name == name)
        part = {"name": name, "size": i, "steps": steps, "logical_batch": batch, "started_at": started,
                "ended_at": now(), "wall_s": round(time.monotonic() - t0, 2), "N": row["params_trainable"],
                "noise_multiplier": row["noise_multiplier"], "sigma_bar": row["noise_multiplier"] / batch,
                "final_eval_loss": row["final_eval_loss"], "epsilon": row.get("epsilon")}
        ph.rec["parts"].append(part)
        ph.save()
        return part

    fitted = [(i, steps, b) for i in range(len(sizes) - 1) for steps in s["steps"] for b in s["batches"]]
    last = [(len(sizes) - 1, s["steps"][-1], b) for b in s["batches"]]
    per_run = []
    for i, steps, b in fitted:
        # leave the largest size its time: about as long as the slowest fitted run so far, times its size ratio
        reserve = (max(per_run) if per_run else 1.0) * s["largest_cost"] * len(last)
        if not ph.allows(f"size{i} steps{steps} b{b}", reserve + (per_run[-1] if per_run else 1.0)):
            continue
        t0 = time.monotonic()
        run(i, steps, b)
        per_run.append(time.monotonic() - t0)
    rows = [p for p in ph.rec["parts"] if p["size"] < len(sizes) - 1]
    fit = fit_form("noise_batch", loss=[p["final_eval_loss"] for p in rows], N=[p["N"] for p in rows],
                   S=[p["steps"] for p in rows], sigma_bar=[p["sigma_bar"] for p in rows], n_boot=s["n_boot"],
                   seed=0, label="sizes 0-3")
    n_last = _params_of(sizes[-1], s["max_length"])
    sigma_bar = {b: next(p["sigma_bar"] for p in rows if p["logical_batch"] == b and p["steps"] == s["steps"][-1])
                 for b in s["batches"]}  # σ depends on the records, batch, steps and ε: not on the model
    preds = []
    for i, steps, b in last:
        x = {"N": n_last, "S": steps, "sigma_bar": sigma_bar[b]}
        lo, hi = fit.prediction_interval(0.95, **x)
        preds.append({"size": i, "steps": steps, "logical_batch": b, **x,
                      "predicted_loss": float(fit.predict(**x)), "interval_95": [float(lo), float(hi)]})
    prediction = {"written_at": now(), "fit": {"params": fit.params, "r2": fit.r2, "n_points": fit.n_points,
                                               "n_boot": s["n_boot"], "at_bound": fit.at_bound},
                  "predictions": preds, "note": "written before any run of the largest size started"}
    write_json(ctx["out"] / f"{ph.n}_scaling_prediction.json", prediction)  # the pre-registration, never rewritten
    ph.rec["prediction"] = prediction
    ph.save()
    for pred, (i, steps, b) in zip(preds, last):
        if not ph.allows(f"size{i} steps{steps} b{b} (the largest)", (max(per_run) if per_run else 1.0)
                         * s["largest_cost"] * 0.75):
            continue
        got = run(i, steps, b)
        got["predicted_loss"] = pred["predicted_loss"]
        got["error_pct"] = 100 * (got["final_eval_loss"] - pred["predicted_loss"]) / got["final_eval_loss"]
        got["inside_interval_95"] = pred["interval_95"][0] <= got["final_eval_loss"] <= pred["interval_95"][1]
        got["same_inputs_as_predicted"] = got["N"] == pred["N"] and abs(got["sigma_bar"] - pred["sigma_bar"]) < 1e-12
        ph.save()


def _params_of(size: dict, max_length: int) -> int:
    """Trainable parameters of a tiny Llama of ``size`` (full fine-tuning: all), built on the meta device."""
    import torch

    from dpllm.config import ModelConfig
    from dpllm.models import build_tiny, byte_tokenizer, count_parameters

    cfg = ModelConfig(model_name_or_path="tiny-llama", finetuning="full", tiny_max_positions=256, **size)
    with torch.device("meta"):
        model = build_tiny(cfg, byte_tokenizer(), max_length)
    return int(count_parameters(model)[1])


# ---------------------------------------------------------------------------------------------- phase 4: extras
def extras(ph: Phase, ctx: dict) -> None:
    if ph.allows("FSDP2 bk step at world size 1", 20 if not ctx["smoke"] else 3):
        part = {"what": "fsdp2_world1"}
        ph.rec["parts"].append(part)
        try:
            _fsdp_world1(part, ctx)
        finally:
            _free(ctx)
        ph.save()
    try:
        import bitsandbytes  # noqa: F401
    except Exception as err:
        ph.rec["skipped"].append({"what": "QLoRA nf4 8B step", "why": f"bitsandbytes not importable: {err}"})
        return
    if ph.allows("QLoRA nf4 step, nodp and bk", 20 if not ctx["smoke"] else 3):
        for mode in ("nodp", "bk"):
            part = {"what": "qlora_nf4", "mode": mode}
            ph.rec["parts"].append(part)
            try:
                _qlora(part, ctx, mode)
            except Exception as err:
                part["error"] = f"{type(err).__name__}: {str(err)[:300]}"
            finally:
                _free(ctx)
            ph.save()
        got = [p for p in ph.rec["parts"] if p.get("what") == "qlora_nf4" and "step_s" in p]
        if len(got) == 2:
            ph.rec["qlora_time_ratio_bk_vs_nodp"] = got[1]["step_s"] / got[0]["step_s"]


def _fsdp_world1(part: dict, ctx: dict) -> None:
    """nodp and bk steps of a model sharded by FSDP2 in a process group of one (bench_fsdp.py's setup)."""
    import socket

    import bench_fsdp
    import torch
    import torch.distributed as dist

    from dpllm.checkpoint import unwrap

    shape = "qwen2.5-1.5b" if not ctx["smoke"] else "llama-tiny"
    seq, batch = (512, 4) if not ctx["smoke"] else (16, 2)
    args = bo.options(shape=shape, finetuning="full", device="cuda" if ctx["cuda"] else "cpu", seq=seq, batch=batch,
                      mixed_precision="bf16" if ctx["cuda"] else "no")
    part.update(shape=shape, seq=seq, batch=batch, mixed_precision=args.mixed_precision)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("LOCAL_RANK", "0")
    dist.init_process_group("nccl" if ctx["cuda"] else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    try:
        sync = torch.cuda.synchronize if ctx["cuda"] else (lambda: None)
        for mode in ("nodp", "bk"):
            if ctx["cuda"]:
                torch.cuda.reset_peak_memory_stats()
            step, model = bench_fsdp.setup(args, mode, 0, 1)
            vocab = unwrap(model).get_input_embeddings().num_embeddings
            b = bo.random_batch(args, batch, vocab, torch.device(args.device))
            autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=ctx["cuda"])
            times = []
            for _ in range(3):
                sync()
                t0 = time.perf_counter()
                with autocast:
                    step(b)
                sync()
                times.append(time.perf_counter() - t0)
            part[mode] = {"step_s": statistics.median(times[1:]), "peak_memory_mib": _peak_mib(ctx)[0]}
            del step, model
            _free(ctx)
        part["time_ratio_bk_vs_nodp"] = part["bk"]["step_s"] / part["nodp"]["step_s"]
    finally:
        dist.destroy_process_group()


def _qlora(part: dict, ctx: dict, mode: str) -> None:
    import torch

    shape, seq, batch = ("llama3-8b", 512, 8) if not ctx["smoke"] else ("llama-tiny", 16, 2)
    args = bo.options(shape=shape, finetuning="lora", quantization="nf4", device=ctx["device"], dtype=ctx["dtype"],
                      autocast="bf16" if ctx["cuda"] else "no", seq=seq, batch=batch)
    device = torch.device(ctx["device"])
    if ctx["cuda"]:
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    model, mcfg = bo.build(args, device, getattr(torch, ctx["dtype"]))
    vocab = model.get_input_embeddings().num_embeddings
    step, resolved = bo.make_step(args, model, mcfg, device, mode)
    del model
    b = bo.random_batch(args, batch, vocab, device)
    sync = torch.cuda.synchronize if ctx["cuda"] else (lambda: None)
    times = []
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        step(b)
        sync()
        times.append(time.perf_counter() - t0)
    part.update(shape=shape, seq=seq, batch=batch, resolved_mode=resolved, step_s=statistics.median(times[1:]),
                peak_memory_mib=_peak_mib(ctx)[0])


# ------------------------------------------------------------------------------------------------------- main
def environment(ctx: dict) -> dict:
    import torch

    env = {"date": now(), "python": platform.python_version(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "device": ctx["device"], "smoke": ctx["smoke"],
           "deadline_s": ctx["clock"].deadline_s, "hostname": platform.node(), "versions": {}}
    if ctx["cuda"]:
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    from importlib.metadata import PackageNotFoundError, version

    for name in ("transformers", "peft", "accelerate", "opacus", "datasets", "dp-accounting", "bitsandbytes"):
        try:  # installed versions (the metadata: importing bitsandbytes or datasets takes seconds)
            env["versions"][name] = version(name)
        except PackageNotFoundError:  # recorded, not fatal: the phase that needs it says so
            env["versions"][name] = None
    try:
        env["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                           timeout=5).stdout.strip() or None
    except Exception:
        env["git_commit"] = None
    return env


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="output folder (default docs/results/gpu/<date>, or "
                                                "runs/gpu_proof_smoke with --smoke)")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="stop cleanly before this many seconds in all (default 510; 900 with --smoke)")
    ap.add_argument("--smoke", action="store_true", help="every phase on CPU with tiny shapes (well under a minute)")
    ap.add_argument("--phases", default=",".join(p[0] for p in PHASES), help="comma-separated subset, in order")
    ap.add_argument("--recipe-child", default=None, help=argparse.SUPPRESS)  # internal: phase 2's process
    if argv is None:
        argv = sys.argv[1:]
    if "--recipe-child" in argv:
        k = argv.index("--recipe-child")
        return sys.exit(recipe_child(argv[k + 1], argv[argv.index("--") + 1:]))
    args = ap.parse_args(argv)
    if args.deadline_s is None:
        args.deadline_s = 900.0 if args.smoke else 510.0
    import torch

    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        raise SystemExit("no GPU here: run with --smoke for the CPU check of every phase")
    out = Path(args.out or ("runs/gpu_proof_smoke" if args.smoke else f"docs/results/gpu/{dt.date.today()}"))
    out.mkdir(parents=True, exist_ok=True)
    ctx = {"clock": Clock(args.deadline_s), "out": out.resolve(), "smoke": args.smoke, "cuda": cuda,
           "device": "cuda" if cuda else "cpu", "dtype": "bfloat16" if cuda else "float32",
           "profile": "smoke" if args.smoke else "gpu"}
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    env = environment(ctx)
    write_json(out / "0_environment.json", env)
    print(f"gpu proof: {env.get('gpu', 'CPU (smoke)')}, torch {env['torch']}, deadline {args.deadline_s:.0f} s -> "
          f"{out}", flush=True)
    wanted = args.phases.split(",")
    fns = {"engine": engine, "recipe": recipe, "scaling": scaling, "extras": extras}
    done = {}
    for n, (name, limit, smoke_limit) in enumerate(PHASES, start=1):
        if name in wanted:
            done[name] = run_phase(n, name, smoke_limit if args.smoke else limit, fns[name], ctx)
    summary = {"ended_at": now(), "wall_s": round(ctx["clock"].elapsed(), 2), "cpu_s": round(time.process_time(), 2),
               "phases": {k: v["status"] for k, v in done.items()}}
    write_json(out / "9_summary.json", summary)
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
