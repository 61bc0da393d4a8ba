"""The embedded default, end to end on CPU (``make demo``, about 3 minutes on 2 cores): pretrain, fine-tune
with and without DP, audit both.

1. A tiny Llama-shaped model is pretrained *without* DP on public text: Python's documentation
   (``pydoc_data``, shipped with CPython).
2. It is fine-tuned on the private records, CPython's standard-library source (code: another kind of text,
   so the fine-tuning visibly helps), twice: with DP at ε = 8 (δ = 1e-5, PRV accountant, full fine-tuning,
   ghost clipping) and without DP, the baseline a user would compare against.
3. Both are audited with the loss attack on their own members vs held-out records (``mia``).

The table at the end puts held-out perplexity, ε and the attack's AUC side by side.

    python recipes/demo.py [--output_dir runs/demo] [--quick]
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


def audit_auc(run_dir: Path, *, max_records: int, n_bootstrap: int) -> float:
    from dpllm.checkpoint import load_model
    from dpllm.data import load_split_texts
    """Loss-attack AUC of a run's own members vs its held-out records (0.5: no signal)."""
    from mia.audit import run_audit

    model, tok = load_model(run_dir)
    report, _ = run_audit(model, tok, load_split_texts(run_dir, "train"), load_split_texts(run_dir, "heldout"),
                          attacks=["loss"], max_length=128, max_records=max_records, n_bootstrap=n_bootstrap,
                          progress=False, blind=False)
    return report["attacks"]["loss"]["auc"]


def generations(run_dirs: dict[str, Path], prompts: tuple[str, ...] = ("def ", "class ", "import ")) -> dict:
    """A greedy continuation of each prompt by each model (``model.generate`` on the reloaded checkpoint)."""
    from dpllm.checkpoint import load_model

    out: dict[str, list[str]] = {}
    for name, run_dir in run_dirs.items():
        model, tok = load_model(run_dir, merge=True)
        out[name] = []
        for prompt in prompts:
            ids = tok(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
            new = model.generate(ids, max_new_tokens=40, do_sample=False, pad_token_id=tok.pad_token_id)
            out[name].append(prompt + tok.decode(new[0, ids.shape[1]:], skip_special_tokens=True))
    return out


def main(argv: list[str] | None = None, *, command: bool = False) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output_dir", default="runs/demo")
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
    quick = (["--max_steps", "4", "--eval_every", "2", "--eval_max_records", "32", "--logical_batch_size", "8",
              "--physical_batch_size", "8"] if args.quick else [])
    finetune_quick = quick + (["--max_records", "400"] if args.quick else [])
    start = time.time()

    print("== stage 1: public pretraining on Python's documentation, no DP")
    pre = train(parse_config(["--config", str(CONFIGS / "demo_pretrain.yaml"), "--output_dir", str(out / "pretrain"),
                              "--overwrite_output_dir", "true", *quick]))
    runs = {}
    for name, extra in (("dp", []), ("no_dp", ["--privacy.enabled", "false"])):
        print(f"== stage 2 ({'DP, ε = 8' if name == 'dp' else 'without DP, the baseline'}): fine-tuning on private "
              "records (CPython's standard-library source)")
        runs[name] = train(parse_config(["--config", str(CONFIGS / "demo_dp_full.yaml"), "--output_dir",
                                         str(out / name), "--model_name_or_path", str(out / "pretrain"),
                                         "--overwrite_output_dir", "true", *extra, *finetune_quick]))
    print("== audit: loss attack, members vs held-out records")
    aucs = {name: audit_auc(Path(r["run_dir"]), max_records=64 if args.quick else 400,
                            n_bootstrap=20 if args.quick else 200) for name, r in runs.items()}
    report = PrivacyReport.read(runs["dp"]["run_dir"])
    result = {
        "pretrain_only_private_heldout_ppl": _ppl(runs["dp"]["initial_eval_loss"]),
        "dp": {"heldout_ppl": runs["dp"]["final_eval_ppl"], "epsilon": report.epsilon, "delta": report.delta,
               "loss_attack_auc": aucs["dp"]},
        "no_dp": {"heldout_ppl": runs["no_dp"]["final_eval_ppl"], "epsilon": None,
                  "loss_attack_auc": aucs["no_dp"]},
        "pretrain_public_heldout_loss": pre["final_eval_loss"],
        "wall_time_s": round(time.time() - start, 1),
        "checkpoint": f"{runs['dp']['run_dir']}/checkpoint",
        "privacy_report": f"{runs['dp']['run_dir']}/privacy_report.json",
    }
    print("\n== dpllm demo: held-out perplexity on the private records (bytes; lower is better)")
    print(f"{'model':<34}{'perplexity':>11}{'ε (δ = 1e-5)':>14}{'loss-attack AUC':>17}")
    print(f"{'public pretraining only':<34}{result['pretrain_only_private_heldout_ppl']:>11.2f}{'-':>14}{'-':>17}")
    print(f"{'+ fine-tuning with DP':<34}{result['dp']['heldout_ppl']:>11.2f}{report.epsilon:>14.2f}"
          f"{aucs['dp']:>17.3f}")
    print(f"{'+ fine-tuning without DP':<34}{result['no_dp']['heldout_ppl']:>11.2f}{'∞':>14}{aucs['no_dp']:>17.3f}")
    samples = generations({"public pretraining only": out / "pretrain", "DP fine-tuned (ε = 8)": out / "dp"})
    result["generations"] = samples
    print("\n== greedy generations")
    for name, texts in samples.items():
        print(f"-- {name}")
        for text in texts:
            print("   " + repr(text))
    print(f"\nprivacy: {report.summary()}")
    print(f"checkpoint: {result['checkpoint']}\nreport:     {result['privacy_report']}")
    # export refuses a run whose membership audit is missing (issue 49): the audit above scored a subsample in
    # memory, so the release command audits the run directory first (26 s on 2 cores)
    print(f"release:    python -m mia audit --checkpoint {runs['dp']['run_dir']} --attacks loss && "
          f"dpllm export {runs['dp']['run_dir']} --out {out / 'release'}")
    print(f"wall time: {result['wall_time_s']} s")
    (out / "demo_result.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def _ppl(loss):
    import math

    return math.exp(min(loss, 50.0)) if loss is not None else float("nan")


if __name__ == "__main__":
    main(command=True)  # quiet_command: for this process only, never a caller's
