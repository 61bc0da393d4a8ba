"""DP fine-tuning of a Hugging Face causal LM: one recipe, CPU to multi-GPU.

Launch commands (copy-paste):

    # tiny model on CPU, the embedded corpus (Python's own docs), LoRA at ε = 8
    accelerate launch --config_file recipes/accelerate/single_gpu.yaml recipes/finetune_llm.py \\
        --config recipes/configs/tiny/llama_lora_cpu.yaml --output_dir runs/x --max_steps 20

    # Llama-3-8B LoRA at ε = 8 on one 80 GB GPU
    accelerate launch --config_file recipes/accelerate/single_gpu.yaml recipes/finetune_llm.py \\
        --config recipes/configs/llama3_8b/lora_eps8.yaml --dataset my_records.jsonl --output_dir runs/llama8b

    # instruction / chat data (messages or prompt/completion columns; loss on the answers): the built-in set,
    # or your own chats.jsonl of {"messages": [{"role": ..., "content": ...}, ...]} (dpllm.sft)
    accelerate launch --config_file recipes/accelerate/single_gpu.yaml recipes/finetune_llm.py \\
        --config recipes/configs/tiny/sft_stdlib_qa_dp.yaml --output_dir runs/sft

    # GPT-2 full fine-tuning at ε = 3
    accelerate launch --config_file recipes/accelerate/single_gpu.yaml recipes/finetune_llm.py \\
        --config recipes/configs/gpt2/full_eps3.yaml --output_dir runs/gpt2

    # two processes (DDP; on a machine without GPUs they run on CPU): same batches, σ, q, steps and ε
    accelerate launch --config_file recipes/accelerate/multi_gpu.yaml --num_processes 2 recipes/finetune_llm.py \\
        --config recipes/configs/tiny/llama_lora_cpu.yaml --output_dir runs/x2 --max_steps 20 --save_every 5

    # continue a killed run from its newest checkpoint (same command plus --resume_from latest)
    accelerate launch --config_file recipes/accelerate/multi_gpu.yaml --num_processes 2 recipes/finetune_llm.py \\
        --config recipes/configs/tiny/llama_lora_cpu.yaml --output_dir runs/x2 --max_steps 20 --save_every 5 \\
        --resume_from latest

    # check the run's ε ledger (hash chain, final ε against privacy_report.json, checkpoint hashes)
    dpllm ledger verify runs/x2

Any option can be overridden as ``--key value`` or ``--section.key value``; ``--help`` lists them all.
The run directory gets config.yaml, splits.json, metrics.jsonl, checkpoint/, privacy_report.json,
privacy_ledger.jsonl and, with save_every, checkpoints/ (see docs/operations.md).
"""

from __future__ import annotations

import os
import sys

# Only light modules at the top: --help, a mistyped option or path is answered before torch is imported.
from dpllm.config import check_paths, parse_config
from dpllm.logs import setup_logging
from dpllm.stopping import EXIT_CODES, finish_process, follow_launcher, program_of, release_process_group


def main(argv: list[str] | None = None, *, command: bool = False) -> dict:
    """Train as configured; print the privacy report and where the (private) held-out loss is. Returns the run
    summary. ``command``: run as ``python recipes/finetune_llm.py`` (a process of its own, so process-wide settings
    such as :func:`dpllm.quantization.quiet_command` are safe; never in a caller's process)."""
    setup_logging()
    cfg = parse_config(argv)  # options and config file checked ...
    check_paths(cfg)  # ... and data / model paths and output_dir: all before torch is imported
    if command:  # this process runs one configuration: bitsandbytes' import-time log is noise when it is unused
        from dpllm.quantization import quiet_command

        quiet_command(cfg.model.model_name_or_path, quantization=cfg.model.quantization)
    from dpllm.privacy.report import PrivacyReport
    from dpllm.train import train

    summary = train(cfg)
    if summary:
        report = PrivacyReport.read(summary["run_dir"])
        # un-noised losses on private held-out records stay in the run directory, not in what a job prints
        print(f"\nheld-out loss and perplexity: {summary['run_dir']}/run_summary.json (private)")
        print(report.summary() if not report.enabled else f"privacy: {report.summary()}")
        for warning in report.warnings:  # logged when planned; repeated where the run ends, where people look
            print(f"warning: {warning}")
        print(f"checkpoint: {summary['run_dir']}/checkpoint   report: {summary['run_dir']}/privacy_report.json")
    return summary


def interrupted(err: KeyboardInterrupt, argv: list[str], program: str) -> None:
    """After Ctrl-C or SIGTERM, one line (from the first process only): where to resume from, and the command
    (``program``, how the script was started)."""
    from dpllm.resume import Interrupted, interrupted_message

    main_process = err.main if isinstance(err, Interrupted) else int(os.environ.get("RANK", "0")) == 0
    if not main_process:
        return
    if not isinstance(err, Interrupted):
        print("error: interrupted outside training (nothing of a run was lost)", file=sys.stderr)
        return
    print(f"error: {interrupted_message(err, program=program, argv=argv)}", file=sys.stderr)


def cli(argv: list[str] | None = None, *, command: bool = False) -> int:
    """``main`` with the exit codes of a command: 0 done, 2 bad input (one line saying what to change), 1 failed,
    130 interrupted by Ctrl-C, 143 stopped by SIGTERM (a scheduler's preemption: a resumable checkpoint is written
    at the end of the current step); both print one line saying where to resume from."""
    program = program_of(sys.argv[0])  # now: a launcher that is signalled ends before its worker (dpllm.stopping)
    try:
        main(argv, command=command)
    except KeyboardInterrupt as err:
        interrupted(err, list(sys.argv[1:] if argv is None else argv), program)
        return EXIT_CODES.get(getattr(err, "signal", None), 130)
    except ValueError as err:  # config, data, model and privacy-plan errors all say what to change
        if int(os.environ.get("RANK", "0")) == 0:  # every process read the same input: one line, not one each
            print(f"error: {err}", file=sys.stderr)
        return 2
    except Exception as err:
        from dpllm.train import TrainingError

        if not isinstance(err, TrainingError):
            raise
        rank = int(os.environ.get("RANK", "0"))  # a failure may be one process's own: each says which it is
        print(f"error: {err}" if rank == 0 else f"error (process {rank}): {err}", file=sys.stderr)
        return 1
    finally:
        release_process_group()  # a process group exists only once training code was imported
    return 0


if __name__ == "__main__":
    follow_launcher()  # one process under `accelerate launch`: stop when the launcher ends (dpllm.stopping)
    sys.exit(finish_process(cli(command=True)))  # a launched worker leaves without interpreter teardown
