"""Small builders shared by tests: tiny models and tokenized batches, no downloads."""

from __future__ import annotations

import torch

from dpllm.config import ModelConfig
from dpllm.data import make_collate
from dpllm.models import build_tiny, byte_tokenizer, prepare_model

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Differential privacy bounds what one record can change.",
    "def f(x):\n    return x + 1",
    "Ghost clipping computes per-sample norms without materialising gradients.",
    "short one",
    "Poisson sampling includes each record independently with probability q.",
]


def tiny_model(kind: str = "tiny-llama", finetuning: str = "full", *, dp: bool = True, seed: int = 0, hidden: int = 32):
    torch.manual_seed(seed)
    cfg = ModelConfig(model_name_or_path=kind, finetuning=finetuning, tiny_hidden_size=hidden, tiny_num_layers=2,
                      tiny_num_heads=2, tiny_intermediate_size=64, tiny_max_positions=128, lora_r=4)
    tok = byte_tokenizer()
    model = build_tiny(cfg, tok, 64)
    if finetuning == "lora":
        # LoRA B starts at zero, which makes A's gradient zero: perturb so every parameter gets signal.
        model, _ = prepare_model(model, cfg, dp=dp)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05)
    else:
        model, _ = prepare_model(model, cfg, dp=dp)
    return model, tok


def batch_of(tok, texts=TEXTS, max_length: int = 48) -> dict:
    items = [torch.tensor(x) for x in tok(list(texts), truncation=True, max_length=max_length)["input_ids"]]
    return make_collate(tok.pad_token_id)(items)


def load_recipe(name: str):
    """Import ``recipes/<name>.py`` as a module (recipes are scripts, not a package)."""
    import importlib.util
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location(name, os.path.join(root, "recipes", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
