"""Private instruction fine-tuning, measured on CPU (docs/results/sft/): base model, DP SFT at ε = 8, SFT without DP.

1. A tiny Llama is pretrained without DP on public text, Python's documentation (``demo_pretrain.yaml``).
2. It is fine-tuned on the built-in chat set ``stdlib_qa`` (a stdlib function's signature → its docstring,
   :mod:`dpllm.sft`), loss on the answers only, with DP at ε = 8 and without DP
   (``sft_stdlib_qa_dp.yaml``). Both runs share the split, so their step-0 evaluation is the base model's.
3. The held-out metric is the answers' perplexity given their prompts (bytes); the loss attack scores the
   answer tokens of members vs held-out records (``mia``); each run's greedy answers to four held-out
   prompts are printed and saved.

    python recipes/sft_study.py --output_dir runs/sft_study --results docs/results/sft   # ~4 min, 2 cores
    python recipes/sft_study.py --quick                                                    # tests
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

from dpllm.config import parse_config
from dpllm.logs import setup_logging

# torch, transformers and opacus load after the arguments are read (--help and typos answer at once)

CONFIGS = Path(__file__).parent / "configs" / "tiny"
COMMAND = "python recipes/sft_study.py --output_dir runs/sft_study --results docs/results/sft"


def answer_auc(run_dir: Path, *, max_records: int, n_bootstrap: int) -> dict:
    """Loss attack on the answers (given the prompts): members vs held-out records of the run."""
    from dpllm.checkpoint import load_model
    from dpllm.data import load_split_texts
    from mia.audit import run_audit

    model, tok = load_model(run_dir)
    report, _ = run_audit(model, tok, load_split_texts(run_dir, "train"), load_split_texts(run_dir, "heldout"),
                          attacks=["loss"], max_length=json.loads((run_dir / "splits.json").read_text())["max_length"],
                          max_records=max_records, n_bootstrap=n_bootstrap, progress=False, blind=False)
    loss = report["attacks"]["loss"]
    return {"auc": loss["auc"], "auc_ci": loss.get("ci", {}).get("auc"), "n_members": report["n_members"],
            "n_nonmembers": report["n_nonmembers"], "mean_answer_loss": report["mean_loss"]}


def main(argv: list[str] | None = None, *, command: bool = False) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output_dir", default="runs/sft_study")
    ap.add_argument("--results", default=None, help="write result.json and README.md here")
    ap.add_argument("--quick", action="store_true", help="a few steps per stage (tests)")
    args = ap.parse_args(argv)
    if command:  # a process of its own, and every model it trains or loads is a tiny one built from a config
        from dpllm.quantization import quiet_command

        quiet_command("tiny-llama")
    setup_logging()
    from dpllm.privacy.report import PrivacyReport
    from dpllm.train import train

    logging.getLogger("dpllm.privacy.plan").setLevel(logging.WARNING)
    out = Path(args.output_dir)
    quick = ["--max_steps", "2", "--eval_every", "2", "--eval_max_records", "16"] if args.quick else []
    # The study's protocol (docs/results/sft/): 6 passes at batch 64, to measure what DP costs a model trained to
    # convergence; the shipped config keeps to one pass (the compliance checklist's single-epoch item).
    protocol = ["--epochs", "6", "--logical_batch_size", "64", "--physical_batch_size", "32",
                      "--eval_every", "20", "--save_every", "0"]
    # epochs: 1 is ceil(N/20) = 2 steps for any N of 21..40 training records (33 of the 40 records); at batch 16
    # the boundary sat at N = 32, and one record more made it 3 steps
    sft_quick = (["--max_records", "40", "--epochs", "1", "--logical_batch_size", "20", "--physical_batch_size", "20",
                  "--num_generations", "1", "--accountant", "rdp"]
                 if args.quick else [])
    start = time.time()
    print("== stage 1: public pretraining on Python's documentation, no DP")
    train(parse_config(["--config", str(CONFIGS / "demo_pretrain.yaml"), "--output_dir", str(out / "pretrain"),
                        "--overwrite_output_dir", "true", "--progress", "false", *quick]))
    runs = {}
    for name, extra in (("dp", []), ("no_dp", ["--privacy.enabled", "false"])):
        print(f"== stage 2 ({'DP, ε = 8' if name == 'dp' else 'without DP'}): SFT on stdlib_qa, loss on the answers")
        runs[name] = train(parse_config([
            "--config", str(CONFIGS / "sft_stdlib_qa_dp.yaml"), "--output_dir", str(out / name),
            "--model_name_or_path", str(out / "pretrain"), "--overwrite_output_dir", "true", "--progress", "false",
            *protocol, *extra, *quick, *sft_quick]))
    audits = {name: answer_auc(out / name, max_records=32 if args.quick else 10_000,
                               n_bootstrap=10 if args.quick else 200) for name in runs}
    report = PrivacyReport.read(out / "dp")
    splits = json.loads((out / "dp" / "splits.json").read_text())
    result = {
        "command": COMMAND, "machine": "2-core CPU, this project's dev machine", "date": "2026-11-24",
        "dataset": "stdlib_qa", "train_records": len(splits["train"]), "heldout_records": len(splits["heldout"]),
        "dropped_no_answer": len(splits["sft"]["dropped_no_answer"]), "max_length": splits["max_length"],
        "metric": "held-out answer-only loss (nats per byte) and perplexity, given the prompt",
        "base": {"answer_loss": runs["dp"]["initial_eval_loss"], "answer_ppl": _ppl(runs["dp"]["initial_eval_loss"])},
        "dp": {"answer_loss": runs["dp"]["final_eval_loss"], "answer_ppl": runs["dp"]["final_eval_ppl"],
               "epsilon": report.epsilon, "delta": report.delta, "noise_multiplier": report.noise_multiplier,
               "sample_rate": report.sample_rate, "steps": report.steps, "accountant": report.accountant,
               "grad_sample_mode": report.grad_sample_mode, "loss_attack": audits["dp"]},
        "no_dp": {"answer_loss": runs["no_dp"]["final_eval_loss"], "answer_ppl": runs["no_dp"]["final_eval_ppl"],
                  "epsilon": None, "steps": runs["no_dp"]["steps"], "loss_attack": audits["no_dp"]},
        "generations": {name: [json.loads(x) for x in (out / name / "generations.jsonl").read_text().splitlines()]
                        for name in runs},
        "wall_time_s": round(time.time() - start, 1),
    }
    table = markdown(result)
    print("\n" + table)
    for name, rows in result["generations"].items():
        print(f"-- greedy answers, {name}")
        for r in rows:
            print(f"   {r['prompt'].splitlines()[1]!r}\n     reference: {r['reference'][:100]!r}\n"
                  f"     generated: {r['generated'][:100]!r}")
    if args.results:
        res = Path(args.results)
        res.mkdir(parents=True, exist_ok=True)
        (res / "result.json").write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
        (res / "README.md").write_text(readme(result, table))
    return result


def markdown(r: dict) -> str:
    rows = [("base (public pretraining only)", r["base"]["answer_ppl"], "-", "-"),
            ("+ SFT with DP", r["dp"]["answer_ppl"], f"{r['dp']['epsilon']:.2f}",
             f"{r['dp']['loss_attack']['auc']:.3f}"),
            ("+ SFT without DP", r["no_dp"]["answer_ppl"], "∞", f"{r['no_dp']['loss_attack']['auc']:.3f}")]
    lines = ["| model | held-out answer perplexity | ε (δ = 1e-5) | loss-attack AUC on answers |",
             "|---|---|---|---|"]
    return "\n".join(lines + [f"| {a} | {b:.2f} | {c} | {d} |" for a, b, c, d in rows]) + "\n"


def readme(r: dict, table: str) -> str:
    gens = "\n".join(f"- `{g['prompt'].splitlines()[1]}`\n  - reference: {g['reference'][:160]}\n"
                     f"  - DP: {g['generated'][:160]!r}\n  - no DP: {n['generated'][:160]!r}"
                     for g, n in zip(r["generations"]["dp"], r["generations"]["no_dp"]))
    return f"""# Private instruction fine-tuning (SFT) on the built-in chat set

Command: `{r['command']}`; {r['machine']}, {r['date']}; wall time {r['wall_time_s']} s.

Data: `stdlib_qa` (dpllm.sft): "What does `module.name(signature)` do?" → the first paragraph of its
docstring, one conversation per record, {r['train_records']} trained and {r['heldout_records']} held out
({r['dropped_no_answer']} dropped before training: max_length = {r['max_length']} bytes cut off their whole
answer). Model: tiny Llama (2 × 96) pretrained without DP on Python's documentation, then fully fine-tuned on
the answers only (prompt tokens never in the loss), with DP (σ = {r['dp']['noise_multiplier']:.3f},
q = {r['dp']['sample_rate']:.4f}, {r['dp']['steps']} steps, {r['dp']['accountant']} accountant,
{r['dp']['grad_sample_mode']}) and without.

{table}
Reading: DP SFT at ε = {r['dp']['epsilon']:.0f} closes {_gain(r):.0%} of the perplexity gap between the base \
model and SFT
without DP; the loss attack on answers is near chance under DP and clearly above it without. The greedy
answers of a 2-layer, 96-wide byte-level model are repetitive either way: they show the answer format
learnt (the non-private model starts like stdlib docstrings, "Return a ..."), not quality.

Perplexity is per byte of the held-out answers given their prompts. The loss attack scores each record's
answer tokens given its prompt (a deployed assistant's threat model) on all members vs all held-out
records; AUC 95% CIs: DP {_ci(r['dp'])}, no DP {_ci(r['no_dp'])}.

Greedy answers to held-out prompts (the runs' `generations.jsonl`):

{gens}

Raw numbers: `result.json`.
"""


def _gain(r: dict) -> float:
    base, dp, no_dp = r["base"]["answer_ppl"], r["dp"]["answer_ppl"], r["no_dp"]["answer_ppl"]
    return (base - dp) / (base - no_dp) if base != no_dp else float("nan")


def _ci(run: dict) -> str:
    ci = run["loss_attack"].get("auc_ci")
    return f"[{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "n/a"


def _ppl(loss):
    import math

    return math.exp(min(loss, 50.0)) if loss is not None else float("nan")


if __name__ == "__main__":
    main(command=True)  # quiet_command: for this process only, never a caller's
