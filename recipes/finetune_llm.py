"""DP fine-tuning of a Hugging Face causal LM: one recipe, CPU to multi-GPU.

Launch commands (copy-paste):

    # tiny model on CPU, the embedded corpus (Python's own docs), LoRA at ε = 8
    accelerate launch recipes/finetune_llm.py --config recipes/configs/tiny/llama_lora_cpu.yaml \\
        --output_dir runs/x --max_steps 20

    # Llama-3-8B LoRA at ε = 8 on one 80 GB GPU
    accelerate launch --config_file recipes/accelerate/single_gpu.yaml recipes/finetune_llm.py \\
        --config recipes/configs/llama3_8b/lora_eps8.yaml --dataset my_records.jsonl --output_dir runs/llama8b

    # instruction / chat data (messages or prompt/completion columns; loss on the answers): the built-in set,
    # or your own chats.jsonl of {"messages": [{"role": ..., "content": ...}, ...]} (dpllm.sft)
    accelerate launch recipes/finetune_llm.py --config recipes/configs/tiny/sft_stdlib_qa_dp.yaml --output_dir runs/sft

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

import sys

from dpllm.config import parse_config
from dpllm.logs import setup_logging
from dpllm.privacy.report import PrivacyReport
from dpllm.train import TrainingError, train


def main(argv: list[str] | None = None) -> dict:
    """Train as configured; print the held-out loss and the privacy report. Returns the run summary."""
    setup_logging()
    summary = train(parse_config(argv))
    if summary:
        report = PrivacyReport.read(summary["run_dir"])
        print(f"\nheld-out loss {summary['final_eval_loss']:.4f} (perplexity {summary['final_eval_ppl']:.2f})")
        print(report.summary() if not report.enabled else f"privacy: {report.summary()}")
        print(f"checkpoint: {summary['run_dir']}/checkpoint   report: {summary['run_dir']}/privacy_report.json")
    return summary


def cli(argv: list[str] | None = None) -> int:
    """``main`` with the exit codes of a command: 0 done, 2 bad input (one line saying what to change), 1 failed."""
    try:
        main(argv)
    except ValueError as err:  # config, data, model and privacy-plan errors all say what to change
        print(f"error: {err}", file=sys.stderr)
        return 2
    except TrainingError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(cli())
