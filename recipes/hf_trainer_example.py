"""A standard Hugging Face causal-LM fine-tuning script, made differentially private by three lines (``# DP``).

The three lines: import ``DPTrainer`` and ``PrivacyArguments`` from ``dpllm.hf``; parse ``PrivacyArguments``
beside the usual argument dataclasses; build ``DPTrainer`` instead of ``Trainer``. Everything else is the
usual Trainer script: datasets in, ``trainer.train()``, ``model.generate()`` on the result. The output
directory is a dpllm run directory (privacy_report.json, privacy_ledger.jsonl, splits.json, checkpoint/).

Launch commands (copy-paste):

    # tiny Llama built from a config, LoRA, ε = 8 on Python's own documentation (offline, CPU, ~1 min)
    python recipes/hf_trainer_example.py --output_dir runs/hf --max_steps 20 \\
        --per_device_train_batch_size 16 --logical_batch_size 64 --learning_rate 5e-3 --target_epsilon 8

    # your own model and files (one record per row; the "text" column is kept for audits)
    accelerate launch --config_file recipes/accelerate/single_gpu.yaml recipes/hf_trainer_example.py \\
        --model_name_or_path Qwen/Qwen2.5-0.5B \\
        --train_file train.jsonl --validation_file heldout.jsonl --output_dir runs/qwen --num_train_epochs 2 \\
        --per_device_train_batch_size 8 --logical_batch_size 256 --target_epsilon 8 --bf16

    # then, as for any dpllm run
    dpllm report runs/hf && dpllm ledger verify runs/hf && dpllm export runs/hf --out release/hf
    python -m mia audit --checkpoint runs/hf

DP-SGD clips each record's gradient (``--per_sample_max_grad_norm``, 1.0); the Trainer's ``--max_grad_norm``
(a clip of the whole batch's gradient, 1.0 by default) is ignored with one warning. The per-sample engine is
chosen for the model (``--grad_sample_mode auto``: book-keeping where it applies) and named in the report.
"""

import sys
from dataclasses import dataclass, field
from typing import Optional

import torch
from datasets import Dataset, DatasetDict, load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser, TrainingArguments

from dpllm.distributed import finish_process
from dpllm.hf import DPTrainer, PrivacyArguments  # DP

PROMPTS = ["The for statement", "A class definition", "Exceptions are"]


@dataclass
class ModelArguments:
    model_name_or_path: str = field(default="tiny-llama", metadata={
        "help": "Hub id or local directory; 'tiny-llama' builds a tiny model from a config (offline)."})
    use_lora: bool = field(default=True, metadata={"help": "Train LoRA adapters (peft) instead of all weights."})
    lora_r: int = field(default=8, metadata={"help": "LoRA rank."})


@dataclass
class DataArguments:
    dataset_name: str = field(default="pydoc", metadata={
        "help": "Hub dataset id, or 'pydoc' (Python's documentation, offline) split as dpllm splits it."})
    train_file: Optional[str] = field(default=None, metadata={"help": "Local .jsonl/.json/.csv training records."})
    validation_file: Optional[str] = field(default=None, metadata={"help": "Local held-out records."})
    text_column: str = field(default="text", metadata={"help": "Column holding each record's text."})
    max_length: int = field(default=128, metadata={"help": "Tokens per record (truncated, never packed)."})
    max_records: Optional[int] = field(default=None, metadata={"help": "pydoc only: use this many records."})


def load_model(args: ModelArguments):
    if args.model_name_or_path.startswith("tiny-"):  # offline: a tiny model from a config, byte tokenizer
        from dpllm.config import ModelConfig
        from dpllm.models import build_tiny, byte_tokenizer

        tokenizer = byte_tokenizer()
        model = build_tiny(ModelConfig(model_name_or_path=args.model_name_or_path), tokenizer, 128)
    else:
        tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
        model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if args.use_lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r,
                                                 target_modules="all-linear", task_type="CAUSAL_LM"))
    return model, tokenizer


def load_raw(args: DataArguments) -> DatasetDict:
    if args.train_file:
        files = {"train": args.train_file, **({"validation": args.validation_file} if args.validation_file else {})}
        kind = args.train_file.rsplit(".", 1)[-1].replace("jsonl", "json")
        return load_dataset(kind, data_files=files)
    if args.dataset_name == "pydoc":
        from dpllm.config import DataConfig
        from dpllm.data import load_records, make_splits

        cfg = DataConfig(dataset="pydoc", max_records=args.max_records)
        records = load_records(cfg)
        splits = make_splits(records, cfg)
        return DatasetDict({"train": Dataset.from_dict({"text": [records[i] for i in splits.train]}),
                            "validation": Dataset.from_dict({"text": [records[i] for i in splits.heldout]})})
    return load_dataset(args.dataset_name)


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], max_new_tokens: int = 24) -> list[str]:
    model.eval()
    out = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids.to(model.device)
        gen = model.generate(input_ids=ids, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
        out.append(tokenizer.decode(gen[0, ids.shape[1]:], skip_special_tokens=True))
    model.train()
    return out


def main(argv: Optional[list[str]] = None) -> dict:
    parser = HfArgumentParser((ModelArguments, DataArguments, TrainingArguments, PrivacyArguments))  # DP
    model_args, data_args, training_args, privacy_args = parser.parse_args_into_dataclasses(args=argv)
    model, tokenizer = load_model(model_args)
    raw = load_raw(data_args)

    def tokenize(batch):
        return tokenizer(batch[data_args.text_column], truncation=True, max_length=data_args.max_length)

    data = raw.map(tokenize, batched=True)
    before = generate(model, tokenizer, PROMPTS)

    trainer = DPTrainer(model=model, args=training_args, privacy_args=privacy_args,  # DP
                        train_dataset=data["train"], eval_dataset=data.get("validation"), processing_class=tokenizer)
    result = trainer.train()

    after = generate(trainer.model, tokenizer, PROMPTS)
    for prompt, b, a in zip(PROMPTS, before, after):
        print(f"{prompt!r}\n  base: {b!r}\n  DP:   {a!r}")
    if trainer.is_world_process_zero():
        print(f"privacy: {trainer.privacy_report.summary()}")
        print(f"run directory: {training_args.output_dir} (dpllm report / export / python -m mia audit read it)")
    return {"metrics": result.metrics, "base": before, "dp": after}


if __name__ == "__main__":
    code = 0
    try:
        main()
    except ValueError as err:  # dpllm's refusals say what to change
        print(f"error: {err}", file=sys.stderr)
        code = 2
    sys.exit(finish_process(code))  # under accelerate launch: no interpreter teardown to abort a finished run in
