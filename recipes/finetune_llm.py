"""DP fine-tuning of a Hugging Face causal LM: one recipe, CPU to multi-GPU.

Launch commands (copy-paste):

    # tiny model on CPU, the embedded corpus (Python's own docs), LoRA at ε = 8
    accelerate launch recipes/finetune_llm.py --config recipes/configs/tiny/llama_lora_cpu.yaml \\
        --output_dir runs/x --max_steps 20

    # Llama-3-8B LoRA at ε = 8 on one 80 GB GPU
    accelerate launch --config_file recipes/accelerate/single_gpu.yaml recipes/finetune_llm.py \\
        --config recipes/configs/llama3_8b/lora_eps8.yaml --dataset my_records.jsonl --output_dir runs/llama8b

    # GPT-2 full fine-tuning at ε = 3
    accelerate launch recipes/finetune_llm.py --config recipes/configs/gpt2/full_eps3.yaml --output_dir runs/gpt2

    # two processes (DDP; on a machine without GPUs they run on CPU): same batches, σ, q, steps and ε
    accelerate launch --multi_gpu --num_processes 2 recipes/finetune_llm.py \
        --config recipes/configs/tiny/llama_lora_cpu.yaml --output_dir runs/x2 --max_steps 20 --save_every 5

    # continue a killed run from its newest checkpoint (same command plus --resume_from latest)
    accelerate launch --multi_gpu --num_processes 2 recipes/finetune_llm.py \
        --config recipes/configs/tiny/llama_lora_cpu.yaml --output_dir runs/x2 --max_steps 20 --save_every 5 \
        --resume_from latest

    # check the run's ε ledger (hash chain, final ε against privacy_report.json, checkpoint hashes)
    dpllm ledger verify runs/x2

Any option can be overridden as ``--key value`` or ``--section.key value``; ``--help`` lists them all.
The run directory gets config.yaml, splits.json, metrics.jsonl, checkpoint/, privacy_report.json,
privacy_ledger.jsonl and, with save_every, checkpoints/ (see docs/operations.md).
"""

from __future__ import annotations

import logging
import warnings
import sys

from dpllm.checkpoint import format_report
from dpllm.config import parse_config
from dpllm.train import train


def quiet_known_warnings() -> None:
    """Hide warnings that are expected on every run and say nothing about this one."""
    # Opacus's ghost clipping backward on a model whose inputs need no grad (always true for LMs)
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    # transformers 5 renamed a property that peft still reads
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")


def main(argv: list[str] | None = None) -> dict:
    quiet_known_warnings()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = parse_config(argv)
    summary = train(cfg)
    if summary:
        import json
        from pathlib import Path

        report = json.loads((Path(summary["run_dir"]) / "privacy_report.json").read_text())
        print(f"\nheld-out loss {summary['final_eval_loss']:.4f} (perplexity {summary['final_eval_ppl']:.2f})")
        print(format_report(report) if not report.get("enabled", True) else f"privacy: {format_report(report)}")
        print(f"checkpoint: {summary['run_dir']}/checkpoint   report: {summary['run_dir']}/privacy_report.json")
    return summary


if __name__ == "__main__":
    try:
        main()
    except ValueError as err:  # config, data, model and privacy-plan errors all say what to change
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
