"""Synthetic text study (issue #25): what a synthetic copy of private data leaks and how useful it is, at
ε = 1, 4, 8 and without DP, on data that ships with Python.

1. Public pretraining, no DP: a tiny Llama on code from CPython's own test suite (``stdlib_files()["public"]``),
   so that the fine-tuned models start out writing Python.
2. Private data: short chunks of four standard-library modules (``calendar``, ``fractions``, ``heapq``,
   ``textwrap``), the module's name as the label (``data.label_column``, control codes as in Yue et al. 2023),
   plus planted canaries (``dpllm.canaries`` secret-sharer texts, each under a label) that land in the
   training or the held-out split by the split's own coin.
3. Fine-tuning from (1), full weights: without DP for many epochs, so that it memorises (as a tiny model on a
   small set does: tests/test_audit_pipeline.py), and with DP at ε = 1, 4, 8 (δ = 1e-5, PRV).
4. ``dpllm synthesize`` of each run (label-conditioned, in turn over the four labels), then its private
   report: verbatim / near-duplicate rates and nearest-neighbour distances against training vs held-out
   records, canaries found, n-gram JS divergence and Fréchet distance (mean-pooled hidden states of the
   public model from step 1) to held-out records, and a module classifier trained on the synthetic records
   and tested on the held-out real ones.

    python recipes/synthetic_study.py --out docs/results/synthetic          # ~15 min on 2 shared CPU cores
    python recipes/synthetic_study.py --out runs/synthetic_quick --quick    # seconds; tests

Writes ``results.json``, ``table.md`` and ``tradeoff.png`` in ``--out`` (the runs and the synthetic sets
under ``--work``, default ``runs/synthetic_study``).
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
import time
from pathlib import Path

MODULES = ("calendar", "fractions", "heapq", "textwrap")
EPSILONS = (8.0, 4.0, 1.0)
MAX_CHARS = 110  # a record plus its control code fits max_length = 128 bytes


def _chunks(path: Path) -> list[str]:
    from dpllm.scaling.corpora import chunk_lines

    return [c for c in chunk_lines(path.read_text(encoding="utf-8", errors="replace"), max_chars=MAX_CHARS)
            if len(c.strip()) >= 40]


def build_data(work: Path, *, per_module: int, canaries: int, public_records: int) -> dict:
    """Write ``private.jsonl`` (text, label) and ``public.jsonl`` (text) under ``work``; returns the canaries."""
    import sysconfig

    from dpllm import canaries as canary_designs
    from dpllm.scaling.corpora import stdlib_files

    rng = random.Random(0)
    rows = []
    for name in MODULES:
        chunks = _chunks(Path(sysconfig.get_paths()["stdlib"]) / f"{name}.py")
        rows += [{"text": t, "label": name} for t in rng.sample(chunks, min(per_module, len(chunks)))]
    planted = canary_designs.make(canaries, design="random", seed=7)
    rows += [{"text": c["text"], "label": MODULES[i % len(MODULES)]} for i, c in enumerate(planted)]
    rng.shuffle(rows)
    (work / "private.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    public = [t for path in stdlib_files()["public"] for t in _chunks(path)]
    public = random.Random(1).sample(public, min(public_records, len(public)))
    (work / "public.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in public))
    return {"canaries": planted, "records": len(rows), "public_records": len(public)}


def train_run(args: list[str]) -> dict:
    from dpllm.config import parse_config
    from dpllm.train import train

    return train(parse_config(args))


def planted_in_splits(run_dir: Path, planted: list[dict]) -> list[dict]:
    """The planted canaries with ``included`` = landed in the run's training split (held-out ones: the control)."""
    from dpllm.config import load_config_file
    from dpllm.data import load_records, split_control_code

    splits = json.loads((run_dir / "splits.json").read_text())
    records = load_records(load_config_file(run_dir / "config.yaml").data)
    where = {split_control_code(records[i])[1]: s for s in ("train", "heldout") for i in splits[s]}
    return [{**c, "included": where.get(c["text"]) == "train"} for c in planted if c["text"] in where]


def main(argv: list[str] | None = None, *, command: bool = False) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/synthetic_study/results", help="results.json, table.md, tradeoff.png")
    ap.add_argument("--work", default=None, help="runs and synthetic sets (default: runs/synthetic_study)")
    ap.add_argument("--quick", action="store_true", help="a few steps and samples per stage (tests)")
    args = ap.parse_args(argv)
    if command:  # a process of its own, and every model it trains or loads is a tiny one built from a config
        from dpllm.quantization import quiet_command

        quiet_command("tiny-llama")
    out = Path(args.out)
    work = Path(args.work or ("runs/synthetic_study_quick" if args.quick else "runs/synthetic_study"))
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    q = args.quick
    settings = {"modules": MODULES, "per_module": 12 if q else 80, "canaries": 8 if q else 40,
                "public_records": 200 if q else 4000, "hidden": 32 if q else 128, "layers": 2,
                "pretrain_steps": 4 if q else 300, "nodp_epochs": 2 if q else 40, "dp_epochs": 2 if q else 20,
                "dp_batch": 32 if q else 128, "nodp_batch": 16 if q else 32, "learning_rate": 0.003,
                "delta": 1e-5, "grad_sample_mode": "bk", "num_synthetic": 8 if q else 200,
                "max_new_tokens": 24 if q else 120, "temperature": 0.8, "top_p": 0.95, "heldout_fraction": 0.3}
    s = settings
    start = time.time()
    data = build_data(work, per_module=s["per_module"], canaries=s["canaries"], public_records=s["public_records"])
    model = ["--model_name_or_path", "tiny-llama", "--finetuning", "full", "--tiny_hidden_size", str(s["hidden"]),
             "--tiny_num_layers", str(s["layers"]), "--tiny_num_heads", "4",
             "--tiny_intermediate_size", str(4 * s["hidden"]), "--max_length", "128", "--eval_every", "0",
             "--progress", "false", "--overwrite_output_dir", "true", "--learning_rate", str(s["learning_rate"])]
    print("== public pretraining (no DP): CPython's test-suite code", flush=True)
    train_run([*model, "--dataset", str(work / "public.jsonl"), "--heldout_fraction", "0.05",
               "--privacy.enabled", "false", "--max_steps", str(s["pretrain_steps"]), "--logical_batch_size", "32",
               "--physical_batch_size", "32", "--lr_scheduler", "cosine", "--warmup_steps", "0" if q else "20",
               "--output_dir", str(work / "pretrain")])
    private = ["--model_name_or_path", str(work / "pretrain"), "--dataset", str(work / "private.jsonl"),
               "--label_column", "label", "--label_values", ",".join(MODULES),
               "--heldout_fraction", str(s["heldout_fraction"]), "--min_chars", "32"]
    arms = {"no_dp": ["--privacy.enabled", "false", "--epochs", str(s["nodp_epochs"]),
                      "--logical_batch_size", str(s["nodp_batch"]), "--physical_batch_size", str(s["nodp_batch"])]}
    for eps in EPSILONS[:1] if q else EPSILONS:
        arms[f"dp_eps{eps:g}"] = ["--target_epsilon", str(eps), "--target_delta", str(s["delta"]),
                                  "--accountant", "prv", "--epochs", str(s["dp_epochs"]),
                                  "--grad_sample_mode", s["grad_sample_mode"],
                                  "--logical_batch_size", str(s["dp_batch"]), "--physical_batch_size", "32"]
    rows = []
    for name, extra in arms.items():
        print(f"== fine-tuning {name}", flush=True)
        run_dir = work / name
        train_run([*model, *private, *extra, "--output_dir", str(run_dir)])
        rows.append(synthesize_and_measure(name, run_dir, work, data["canaries"], s))
    result = {"quick": q, "settings": settings, "data": {k: v for k, v in data.items() if k != "canaries"},
              "runs": rows, "wall_time_s": round(time.time() - start, 1),
              "command": "python recipes/synthetic_study.py "
                         + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))}
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "table.md").write_text(table(rows) + "\n")
    plot(rows, out / "tradeoff.png")
    print(table(rows))
    return result


def synthesize_and_measure(name: str, run_dir: Path, work: Path, planted: list[dict], s: dict) -> dict:
    from dpllm.privacy.report import PrivacyReport
    from dpllm.synthetic import evaluate, synthesize, write_report

    synth = work / "synthetic" / f"{name}.jsonl"
    synth.parent.mkdir(exist_ok=True)
    synth.unlink(missing_ok=True)
    card = synthesize(run_dir, num=s["num_synthetic"], out=synth, temperature=s["temperature"], top_p=s["top_p"],
                      max_new_tokens=s["max_new_tokens"], batch_size=50, seed=0, allow_non_private=name == "no_dp",
                      progress=False)
    rep = evaluate(synth, run_dir, embedder=str(work / "pretrain"), canaries=planted_in_splits(run_dir, planted))
    write_report(rep, synth)
    report = PrivacyReport.read(run_dir)
    lk, fd = rep["leakage"], rep["fidelity"]
    return {"run": name, "epsilon": report.epsilon if report.enabled else None, "delta": report.delta,
            "noise_multiplier": report.noise_multiplier, "sample_rate": report.sample_rate, "steps": report.steps,
            "accountant": report.accountant, "card_statement": card["statement"],
            "verbatim_train_all": lk["verbatim"]["train_all"], "verbatim_train": lk["verbatim"]["train"],
            "verbatim_heldout": lk["verbatim"]["heldout"],
            "distinct_train_records_copied": lk["verbatim"]["distinct_train_records_copied"],
            "near_train": lk["near"]["train"], "near_heldout": lk["near"]["heldout"],
            "nn_median_train": lk["nn_distance"]["train"]["median"],
            "nn_median_heldout": lk["nn_distance"]["heldout"]["median"], "closer_to_train": lk["closer_to_train"],
            "canaries": {k: v for k, v in lk.get("canaries", {}).items() if k != "extracted_ids"},
            "ngram_js_1": fd["synthetic"]["ngram_js_1"], "ngram_js_2": fd["synthetic"]["ngram_js_2"],
            "frechet": fd["synthetic"]["frechet"], "downstream_accuracy": fd["synthetic"].get("downstream_accuracy"),
            "real": {"ngram_js_1": fd["real_reference"]["ngram_js_1"], "ngram_js_2": fd["real_reference"]["ngram_js_2"],
                     "frechet": fd["real_reference"]["frechet"],
                     "downstream_accuracy": fd["real_reference"].get("downstream_accuracy"),
                     "downstream_accuracy_all_train": fd.get("real_train_all_accuracy")},
            "majority_accuracy": fd.get("majority_accuracy"), "examples": lk["examples"][:2]}


def _f(x, fmt="{:.3f}"):
    return "–" if x is None else fmt.format(x)


def table(rows: list[dict]) -> str:
    pct = "{:.1%}".format
    head = ("| synthetic from | ε (δ = 1e-5) | verbatim copies: train / held-out | near dup.: train / held-out | "
            "closer to train | canaries found: trained / not | word-bigram JS ↓ | Fréchet ↓ | classifier acc. ↑ |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        c = r["canaries"]
        lines.append(f"| {r['run']} | {_f(r['epsilon'], '{:.2f}') if r['epsilon'] is not None else '∞ (no DP)'} | "
                     f"{pct(r['verbatim_train'])} / {pct(r['verbatim_heldout'])} | {pct(r['near_train'])} / "
                     f"{pct(r['near_heldout'])} | {pct(r['closer_to_train'])} | "
                     f"{c.get('extracted_included', 0)}/{c.get('included', 0)} / {c.get('extracted_excluded', 0)}/"
                     f"{c.get('excluded', 0)} | {_f(r['ngram_js_2'])} | {_f(r['frechet'])} | "
                     f"{_f(r['downstream_accuracy'], '{:.1%}')} |")
    real = rows[0]["real"]
    lines.append(f"| *real training records* | – | – | – | – | – | {_f(real['ngram_js_2'])} | {_f(real['frechet'])} | "
                 f"{_f(real['downstream_accuracy'], '{:.1%}')} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["run"] for r in rows]
    x = range(len(rows))
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    ax = axes[0]
    ax.bar([i - 0.2 for i in x], [r["near_train"] for r in rows], 0.4, label="vs training", color="tab:red")
    ax.bar([i + 0.2 for i in x], [r["near_heldout"] for r in rows], 0.4, label="vs held-out", color="tab:blue")
    ax.set(title="leakage: near duplicates", ylabel="fraction of synthetic records")
    ax.legend()
    ax = axes[1]
    ax.bar(x, [r["frechet"] for r in rows], color="tab:gray")
    ax.axhline(rows[0]["real"]["frechet"], color="k", ls="--", lw=1, label="real records")
    ax.set(title="fidelity: Fréchet distance ↓")
    ax.legend()
    ax = axes[2]
    ax.bar(x, [r["downstream_accuracy"] or 0 for r in rows], color="tab:green")
    ax.axhline(rows[0]["real"]["downstream_accuracy"] or 0, color="k", ls="--", lw=1, label="trained on real")
    ax.axhline(rows[0]["majority_accuracy"] or 0, color="k", ls=":", lw=1, label="majority class")
    ax.set(title="utility: module classifier acc. ↑", ylim=(0, 1))
    ax.legend()
    for ax in axes:
        ax.set_xticks(list(x), names, rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main(command=True)  # quiet_command: for this process only, never a caller's
