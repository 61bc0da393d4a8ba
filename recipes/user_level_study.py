"""User-level DP study (issue #13): the same data and budget trained three ways, plus step-time benchmark.

Data: the built-in pydoc corpus with its documented user grouping (each documentation topic cut into runs of
at most 16 consecutive paragraphs: 192 users, 1 to 16 records each), split by user (20% of users held
out). Model: a tiny Llama trained from scratch (full fine-tuning), the same seed, steps and logical batch of
records for every arm. Budget: user-level (ε = 8, δ = 1e-4 < 1/U).

- ``record``: record-level DP-SGD on all records at record-level ε = 8 (what a record-level run would print),
  reported honestly at the user level (``user_sampling: record``): group privacy over the declared cap
  k = 16 (pydoc's largest user, so nothing is trimmed; without a cap the user-level ε is unbounded).
- ``els``: at most k = 4 records per user, record-level DP-SGD, σ calibrated so the *user-level* ε by
  group privacy is 8.
- ``uls``: at most k = 4 records per user, users Poisson-sampled, one clipped mean gradient per user,
  σ calibrated on the user count for ε = 8 (hooks).
- ``none``: no DP (reference).

For each: held-out perplexity (held-out users) and a user-level loss MIA (members = training users, score =
mean loss over the user's records; :mod:`mia.users`). The benchmark times ULS against record-level DP
(hooks, ghost and bk) at the same logical batch of records on a wider model.

    python recipes/user_level_study.py --out docs/results/user_level            # ~15 min on 2 CPU cores
    python recipes/user_level_study.py --out runs/user_level_quick --quick
    python recipes/user_level_study.py --out docs/results/user_level --bench-only   # redo only the benchmark

Writes ``results.json`` and ``summary.md``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
import warnings
from pathlib import Path

import torch

EPSILON, DELTA, K = 8.0, 1e-4, 4


def base_args(out: Path, name: str, *, steps: int, batch: int, hidden: int = 64, layers: int = 2,
              physical: int = 16, seed: int = 0) -> list[str]:
    return ["--model_name_or_path", "tiny-llama", "--finetuning", "full", "--tiny_hidden_size", str(hidden),
            "--tiny_num_layers", str(layers), "--tiny_num_heads", "4", "--tiny_intermediate_size", str(4 * hidden),
            "--max_length", "64", "--privacy_unit", "user", "--max_steps", str(steps),
            "--logical_batch_size", str(batch), "--physical_batch_size", str(physical), "--learning_rate", "3e-3",
            "--eval_every", "0", "--eval_max_records", "100000", "--log_every", "1000", "--target_delta", str(DELTA),
            "--output_dir", str(out / name), "--overwrite_output_dir", "true", "--progress", "false",
            "--seed", str(seed), "--reproducible_noise", "true"]


def run(args_list: list[str]) -> dict:
    from dpllm.config import parse_config
    from dpllm.train import train

    return train(parse_config(args_list))


def audit(run_dir: Path) -> dict:
    from dpllm.checkpoint import load_model
    from mia.users import load_run_users, user_audit

    members, nonmembers = load_run_users(run_dir, seed=0)
    model, tok = load_model(run_dir / "checkpoint")
    rep, _ = user_audit(model.eval(), tok, members, nonmembers, attacks=("loss",), max_length=64, batch_size=16,
                        n_bootstrap=200, seed=0)
    a = rep["attacks"]["loss"]
    return {"auc": a["auc"], "auc_ci": a["ci"]["auc"], "tpr@10%fpr": a["tpr@fpr=0.1"],
            "member_users": rep["n_members"], "nonmember_users": rep["n_nonmembers"]}


def study(out: Path, *, steps: int, batch: int, seeds=(0,)) -> list[dict]:
    arms = {
        # k = 16 is pydoc's documented largest user (PYDOC_USER_PARAGRAPHS): it trims nothing, and it is what the
        # user-level ε is computed for (a declared cap; without one the user-level ε is unbounded)
        "record": ["--user_sampling", "record", "--grad_sample_mode", "hooks", "--max_records_per_user", "16",
                   "--target_epsilon", str(EPSILON)],
        "els": ["--user_sampling", "els", "--grad_sample_mode", "hooks", "--max_records_per_user", str(K),
                "--target_epsilon", str(EPSILON)],
        "uls": ["--user_sampling", "uls", "--grad_sample_mode", "hooks", "--max_records_per_user", str(K),
                "--target_epsilon", str(EPSILON)],
        "none": ["--enabled", "false", "--max_records_per_user", str(K)],
    }
    rows = []
    for seed, (name, extra) in ((s, a) for s in seeds for a in arms.items()):
        t0 = time.time()
        run_name = f"{name}_s{seed}"
        summary = run(base_args(out, run_name, steps=steps, batch=batch, seed=seed) + extra)
        report = json.loads((out / run_name / "privacy_report.json").read_text())
        u = report.get("user_level") or {}
        record_run = u.get("sampling") == "record"
        row = {"arm": name, "seed": seed, "command_args": extra, "privacy_unit": report.get("privacy_unit"),
               "user_epsilon": u.get("user_epsilon") if record_run else report.get("epsilon"),
               "user_delta": report.get("delta"),
               "record_epsilon": report.get("epsilon") if record_run else u.get("record_epsilon"),
               "group_size": u.get("group_size"), "noise_multiplier": report.get("noise_multiplier"),
               "sample_rate": report.get("sample_rate"), "num_users": u.get("num_users"),
               "num_records": report["num_records"], "users_trimmed": u.get("users_trimmed"),
               "records_dropped": u.get("records_dropped"), "steps": report["steps"],
               "tokens_seen": summary["tokens_seen"], "heldout_ppl": summary["final_eval_ppl"],
               "heldout_loss": summary["final_eval_loss"], "wall_s": round(time.time() - t0, 1)}
        row["mia_users"] = audit(out / run_name)
        rows.append(row)
        print(json.dumps({k: row[k] for k in ("arm", "seed", "user_epsilon", "heldout_ppl", "wall_s")}), flush=True)
    return rows


def benchmark(out: Path, *, steps: int, batch: int) -> list[dict]:
    """Seconds per step and per record at the same logical batch of records (wider model; hooks, ghost, bk)."""
    # the same k-capped records; record-level DP-SGD (Poisson over records, per-record clipping) vs ULS
    capped = ["--max_records_per_user", str(K)]
    arms = {"record hooks": ["--user_sampling", "els", "--grad_sample_mode", "hooks"] + capped,
            "record ghost": ["--user_sampling", "els", "--grad_sample_mode", "ghost"] + capped,
            "record bk": ["--user_sampling", "els", "--grad_sample_mode", "bk"] + capped,
            "uls hooks": ["--user_sampling", "uls", "--grad_sample_mode", "hooks"] + capped,
            "uls bk": ["--user_sampling", "uls", "--grad_sample_mode", "bk"] + capped}
    rows = []
    for rep in range(2):  # interleaved repeats: the machine is shared
        for name, extra in arms.items():
            args = base_args(out, "bench_" + name.replace(" ", "_"), steps=steps, batch=batch, hidden=128, layers=4,
                             physical=32) + ["--target_epsilon", str(EPSILON)] + extra
            summary = run(args)
            rows.append({"arm": name, "repeat": rep, "steps": summary["steps"], "wall_s": summary["wall_time_s"],
                         "s_per_step": summary["wall_time_s"] / summary["steps"],
                         "tokens_per_step": summary["tokens_seen"] / summary["steps"],
                         "ms_per_1k_tokens": 1e6 * summary["wall_time_s"] / max(summary["tokens_seen"], 1)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def summarize(res: dict) -> str:
    lines = ["# User-level DP: record-level (group privacy) vs ELS vs ULS", "",
             f"Command: `{res['command']}`", "",
             f"pydoc with its topic-chunk users, split by user; tiny Llama ({res['settings']['model']}), "
             f"{res['settings']['steps']} steps, logical batch {res['settings']['batch']} records, "
             f"user-level budget (ε = {EPSILON:g}, δ = {DELTA:g}), k = {K}. Held-out perplexity on held-out users; "
             "user-level loss MIA (mean loss over a user's records; AUC with 95% bootstrap CI).", "",
             "| arm | user-level ε (δ = 1e-4) | record-level ε | k | σ | q | users | records | held-out ppl "
             "(mean ± sd over seeds) | user MIA AUC (mean over seeds) |", "|---|---|---|---|---|---|---|---|---|---|"]
    import statistics

    def spread(xs):
        return f"{statistics.mean(xs):.2f} ± {statistics.stdev(xs):.2f}" if len(xs) > 1 else f"{xs[0]:.2f}"

    for r in res["runs"]:
        if r["seed"] != res["runs"][0]["seed"]:
            continue
        same = [x for x in res["runs"] if x["arm"] == r["arm"]]
        eps = ("∞ (no DP)" if r["arm"] == "none" else "unbounded" if r["user_epsilon"] is None
               else f"{r['user_epsilon']:.3g}")
        rec = "" if r["record_epsilon"] is None else f"{r['record_epsilon']:.3g}"
        lines.append(f"| {r['arm']} | {eps} | {rec} | {r['group_size'] or ''} | "
                     f"{'' if r['noise_multiplier'] is None else format(r['noise_multiplier'], '.3g')} | "
                     f"{'' if r['sample_rate'] is None else format(r['sample_rate'], '.3g')} | "
                     f"{r['num_users'] or ''} | "
                     f"{r['num_records']} | {spread([x['heldout_ppl'] for x in same])} | "
                     f"{spread([x['mia_users']['auc'] for x in same])} |")
    lines += ["", "Per seed (held-out ppl; user MIA AUC [95% bootstrap CI]):", "",
              "| arm | seed | held-out ppl | user MIA AUC [CI] | TPR@10% FPR |", "|---|---|---|---|---|"]
    for r in res["runs"]:
        m = r["mia_users"]
        lines.append(f"| {r['arm']} | {r['seed']} | {r['heldout_ppl']:.2f} | {m['auc']:.3f} [{m['auc_ci'][0]:.2f}, "
                     f"{m['auc_ci'][1]:.2f}] | {m['tpr@10%fpr']:.3f} |")
    bench: dict = {}
    for b in res["benchmark"]:
        bench.setdefault(b["arm"], []).append(b)
    def best(name):
        return min(bench[name], key=lambda x: x["s_per_step"])

    lines += ["", "## Step time at the same logical batch of records (Llama 4×128, CPU, best of 2)", "",
              "Same k-capped data, expected 64 records per step; record-level DP-SGD samples records, ULS samples "
              "users (B_u chosen so a step holds 64 records in expectation). Poisson batches differ in size, so "
              "time per 1,000 tokens is shown too. ULS is compared with record-level DP in the same engine mode."
              + (f" Rerun with `{res['benchmark_command']}`." if res.get("benchmark_command") else ""), "",
              "| arm | s/step | tokens/step | ms per 1k tokens | × record hooks (per step) | "
              "× record, same mode (per step) | × record, same mode (per token) |", "|---|---|---|---|---|---|---|"]
    for name in bench:
        b, hooks = best(name), best("record hooks")
        same = best("record " + name.split()[-1]) if "record " + name.split()[-1] in bench else b
        lines.append(f"| {name} | {b['s_per_step']:.3f} | {b['tokens_per_step']:.0f} | "
                     f"{b['ms_per_1k_tokens']:.1f} | {b['s_per_step'] / hooks['s_per_step']:.2f} | "
                     f"{b['s_per_step'] / same['s_per_step']:.2f} | "
                     f"{b['ms_per_1k_tokens'] / same['ms_per_1k_tokens']:.2f} |")
    reading = Path(res["out"]) / "reading.md"  # written by a person after looking at the numbers
    lines += ["", "## Reading", "", reading.read_text() if reading.is_file() else "(no reading.md yet)"]
    return "\n".join(lines) + "\n"


def resummarize(out: Path) -> None:
    """Rewrite summary.md from results.json (e.g. after adding reading.md)."""
    res = json.loads((out / "results.json").read_text())
    res["out"] = str(out)
    (out / "summary.md").write_text(summarize(res))


def main(argv: list[str] | None = None, *, command: bool = False) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/user_level")
    ap.add_argument("--quick", action="store_true", help="few steps: a smoke test of the recipe")
    ap.add_argument("--seeds", default="0,1,2",
                    help="comma-separated training seeds (model init and the seeded noise; the user split is fixed)")
    ap.add_argument("--summary-only", action="store_true", help="rewrite summary.md from results.json and reading.md")
    ap.add_argument("--bench-only", action="store_true",
                    help="rerun only the step-time benchmark and replace it in an existing results.json")
    args = ap.parse_args(argv)
    if command:  # a process of its own, and every model it trains or loads is a tiny one built from a config
        from dpllm.quantization import quiet_command

        quiet_command("tiny-llama")
    if args.summary_only:
        resummarize(Path(args.out))
        return {}
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    out = Path(args.out)
    command = "python recipes/user_level_study.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    if args.bench_only:
        res = json.loads((out / "results.json").read_text())
        res["benchmark"] = benchmark(out / "runs", steps=20, batch=64)
        res["benchmark_command"] = command
        (out / "results.json").write_text(json.dumps(res, indent=2, default=str))
        resummarize(out)
        return res
    runs_dir = out / "runs" if not args.quick else out
    steps, batch = (5, 32) if args.quick else (300, 32)
    res = {"command": command, "quick": args.quick, "out": str(out),
           "settings": {"steps": steps, "batch": batch, "epsilon": EPSILON, "delta": DELTA, "k": K,
                        "model": "2 layers × 64 wide", "dataset": "pydoc (privacy_unit: user)"}}
    seeds = (0,) if args.quick else tuple(int(x) for x in args.seeds.split(","))
    res["settings"]["seeds"] = list(seeds)
    res["runs"] = study(runs_dir, steps=steps, batch=batch, seeds=seeds)
    res["benchmark"] = benchmark(runs_dir, steps=3 if args.quick else 20, batch=64)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=2, default=str))
    (out / "summary.md").write_text(summarize(res))
    return res


if __name__ == "__main__":
    main(command=True)  # quiet_command: for this process only, never a caller's
