"""The embedded default, end to end on CPU (``make demo``): public pretraining, then DP fine-tuning.

1. A tiny Llama-shaped model is pretrained briefly *without* DP on the public half of the built-in
   corpus (Python's own documentation text, shipped with CPython).
2. It is DP fine-tuned with LoRA at ε = 8 (δ = 1e-5, PRV accountant) on the private half.
3. Both stages are evaluated on the private held-out records; the checkpoint and privacy report paths
   are printed.

    python recipes/demo.py [--output_dir runs/demo] [--quick]
"""

from __future__ import annotations

import argparse
import json
import logging
import warnings
import time
from pathlib import Path

from dpllm.checkpoint import format_report
from dpllm.config import parse_config
from dpllm.train import train

CONFIGS = Path(__file__).parent / "configs" / "tiny"


def quiet_known_warnings() -> None:
    """Hide warnings that are expected on every run and say nothing about this one."""
    # Opacus's ghost clipping backward on a model whose inputs need no grad (always true for LMs)
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    # transformers 5 renamed a property that peft still reads
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output_dir", default="runs/demo")
    ap.add_argument("--quick", action="store_true", help="a few steps per stage (tests)")
    args = ap.parse_args(argv)
    quiet_known_warnings()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    out = Path(args.output_dir)
    quick = ["--max_steps", "4", "--eval_every", "2", "--eval_max_records", "32"] if args.quick else []
    start = time.time()

    print("== stage 1: public pretraining, no DP")
    pre = train(parse_config(["--config", str(CONFIGS / "demo_pretrain.yaml"), "--output_dir", str(out / "pretrain"),
                              "--overwrite_output_dir", "true", *quick]))
    print("== stage 2: DP fine-tuning (LoRA, ε = 8) on private records")
    dp = train(parse_config(["--config", str(CONFIGS / "demo_dp_lora.yaml"), "--output_dir", str(out / "dp_lora"),
                             "--model_name_or_path", str(out / "pretrain"), "--overwrite_output_dir", "true", *quick]))
    report = json.loads((Path(dp["run_dir"]) / "privacy_report.json").read_text())
    result = {
        "pretrain_heldout_loss": pre["final_eval_loss"],
        "before_dp_private_heldout_loss": dp["initial_eval_loss"],
        "after_dp_private_heldout_loss": dp["final_eval_loss"],
        "after_dp_private_heldout_ppl": dp["final_eval_ppl"],
        "epsilon": report["epsilon"], "delta": report["delta"],
        "wall_time_s": round(time.time() - start, 1),
        "checkpoint": f"{dp['run_dir']}/checkpoint", "privacy_report": f"{dp['run_dir']}/privacy_report.json",
    }
    print("\n== dpllm demo")
    print(f"private held-out loss: {result['before_dp_private_heldout_loss']:.4f} after public pretraining -> "
          f"{result['after_dp_private_heldout_loss']:.4f} after DP fine-tuning "
          f"(perplexity {result['after_dp_private_heldout_ppl']:.2f})")
    print(f"privacy: {format_report(report)}")
    print(f"checkpoint: {result['checkpoint']}\nreport:     {result['privacy_report']}")
    print(f"wall time: {result['wall_time_s']} s")
    return result


if __name__ == "__main__":
    main()
