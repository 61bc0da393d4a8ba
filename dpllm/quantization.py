"""Loading a frozen base quantized by bitsandbytes (QLoRA): the ``BitsAndBytesConfig`` for each
``model.quantization``, loading and re-quantizing in memory, and dequantizing to merge adapters.

Used by :mod:`dpllm.models` (training) and :mod:`dpllm.checkpoint` (reloading a run as it was trained); below
both in the layers, so neither has to import the other for it.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from dpllm.errors import QLORA_EXTRA, ModelError


def known_unquantized(where: str) -> bool:
    """Whether the model ``where`` names is known to load without bitsandbytes: a tiny model; a local directory
    (a run, its checkpoint, a model) whose ``dpllm_config.yaml`` and ``config.json`` say no quantization; a Hub id
    whose cached ``config.json`` has no ``quantization_config``. Unknown (a Hub id not cached yet, a file that
    cannot be read) is False."""
    import json
    from pathlib import Path

    import yaml

    from dpllm.io import load_yaml

    if where in ("tiny-llama", "tiny-gpt2"):  # dpllm.models.TINY_MODELS, built from a config (a layer above)
        return True
    path = Path(str(where)).expanduser()
    try:
        if path.is_dir():
            dirs = [d for d in (path, path / "checkpoint", path / "base_model", path / "checkpoint" / "base_model")
                    if d.is_dir()]
            runs = [d / "dpllm_config.yaml" for d in dirs if (d / "dpllm_config.yaml").is_file()]
            models = [d / "config.json" for d in dirs if (d / "config.json").is_file()]
            if not runs and not models:
                return False
            if any(((load_yaml(f.read_text()) or {}).get("model") or {}).get("quantization") not in (None, "none")
                   for f in runs):
                return False  # a QLoRA run: its base is loaded quantized again (dpllm.checkpoint.load_model)
            return not any("quantization_config" in json.loads(f.read_text()) for f in models)
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(str(where), "config.json")
        return isinstance(cached, str) and "quantization_config" not in json.loads(Path(cached).read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return False


def hide_unused_bitsandbytes(quantization: str, *models: str) -> bool:
    """Make bitsandbytes unimportable in this process when the run will not use it; True when hidden.

    peft and transformers import bitsandbytes whenever it is installed, and it logs about its optional GPU kernels
    on import: noise in every non-quantized run. A ``None`` entry in ``sys.modules`` makes ``import`` fail and
    ``find_spec`` answer None, so they take their path for an environment without it. For a command's process
    only (a recipe that runs one configuration), never a library call: it lasts as long as the process.

    Args:
        quantization: the run's ``model.quantization``.
        models: every model the process will load (``model_name_or_path``, a run or checkpoint directory); hidden
            only when each is known to load without bitsandbytes (:func:`known_unquantized`: not a QLoRA run's
            checkpoint, not a pre-quantized model), and never when none is named.
    """
    import sys

    if quantization not in (None, "none") or "bitsandbytes" in sys.modules or not models:
        return False
    if not all(known_unquantized(str(m)) for m in models):
        return False
    sys.modules["bitsandbytes"] = None  # type: ignore[assignment]
    return True


def quiet_command(*models: str, quantization: str = "none", progress: bool = True) -> bool:
    """What a command's entry point sets for its own process before it imports the training stack: bitsandbytes
    hidden when every model it will load is known to load without it (:func:`hide_unused_bitsandbytes`), the
    third-party deprecations a user cannot act on silenced (:func:`dpllm.logs.silence_known_deprecations`), and,
    with ``progress=False`` (a command's ``--no-progress``), transformers' bars (loading weights) turned off. Never a
    library call: all of it lasts as long as the process. True when bitsandbytes was hidden."""
    from dpllm.logs import silence_known_deprecations

    silence_known_deprecations()
    if not progress:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    return hide_unused_bitsandbytes(quantization, *models)


def _dtype(name: str):
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}[name]


def bnb_config(quantization: str, torch_dtype: str = "float32"):
    """transformers' ``BitsAndBytesConfig`` for ``quantization`` (None for ``none``).

    4-bit: NF4 or FP4 with double quantization (the quantization constants quantized too, ~0.4 bits per weight
    saved, as in QLoRA) and computation in the adapters' dtype (float32 unless torch_dtype is bfloat16/float16).
    int8: bitsandbytes' int8 weights, with LLM.int8's outlier decomposition off (``llm_int8_threshold=0``): on a
    GPU it picks the activation columns to keep in float16 from the whole batch, so one record would change how
    the others are computed, and per-record clipping would no longer bound what a record changes."""
    if quantization in (None, "none"):
        return None
    from transformers import BitsAndBytesConfig

    if quantization == "int8":
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=0.0)
    compute = _dtype(torch_dtype) if torch_dtype in ("bfloat16", "float16") else torch.float32
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quantization, bnb_4bit_compute_dtype=compute,
                              bnb_4bit_use_double_quant=True)


def quantization_of(model: nn.Module) -> str:
    """The ``quantization`` option a loaded model corresponds to: nf4, fp4, int8 or none (read from its config)."""
    q = getattr(getattr(model, "config", None), "quantization_config", None)
    if q is None:
        return "none"
    q = q.to_dict() if hasattr(q, "to_dict") else dict(q)
    if q.get("load_in_4bit"):
        return str(q.get("bnb_4bit_quant_type", "fp4"))
    return "int8" if q.get("load_in_8bit") else "none"


def _load_device_map():
    """Where bitsandbytes quantizes while loading: this process's GPU (never the whole model in full precision
    on the CPU first), else the CPU."""
    return {"": torch.cuda.current_device()} if torch.cuda.is_available() else "cpu"


def load_quantized(where, quantization: str, *, torch_dtype: str = "float32", trust_remote_code: bool = False,
                   config=None):
    """``AutoModelForCausalLM.from_pretrained(where)`` with the base quantized (:func:`bnb_config`, or ``config``:
    the ``BitsAndBytesConfig`` a checkpoint recorded).

    Raises:
        ModelError: bitsandbytes is not installed (names the extra).
    """
    from transformers import AutoModelForCausalLM

    try:
        import bitsandbytes  # noqa: F401
    except ImportError as err:
        raise ModelError(f"quantization={quantization} needs bitsandbytes: {QLORA_EXTRA}") from err
    dtype = _dtype(torch_dtype)
    model = AutoModelForCausalLM.from_pretrained(
        where, quantization_config=config if config is not None else bnb_config(quantization, torch_dtype),
        device_map=_load_device_map(),
        dtype=torch.float32 if dtype == "auto" else dtype, trust_remote_code=trust_remote_code)
    return one_cpu_path(model)


def one_cpu_path(model: nn.Module) -> nn.Module:
    """Keep bitsandbytes' 4-bit layers on one computation on the CPU.

    On a CPU with AVX512-BF16, bitsandbytes 0.50 repacks a 4-bit weight *in place* the first time the layer runs
    in eval mode without gradients (an evaluation) and from then on multiplies in bfloat16: the same model would
    give other numbers after an evaluation than before (a 1% difference measured on a tiny Llama). Turned off,
    every call dequantizes to the compute dtype, as in training. No effect on a GPU."""
    for m in model.modules():
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False
    return model


def quantize_in_memory(model: nn.Module, quantization: str, *, torch_dtype: str = "float32") -> nn.Module:
    """A quantized copy of a model built or merged in memory (a tiny model; an earlier run's merged LoRA): saved
    to a temporary directory and loaded back through :func:`load_quantized` (bitsandbytes quantizes while
    loading). Quantization is deterministic: the same weights give the same quantized model every time."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="dpllm-quantize-") as tmp:
        model.save_pretrained(tmp)
        quantized = load_quantized(tmp, quantization, torch_dtype=torch_dtype)
    name = getattr(model, "name_or_path", "") or ""  # not the temporary directory, gone now
    quantized.name_or_path = quantized.config._name_or_path = name
    return quantized


_UNQUANTIZED = "_dpllm_unquantized_base"


def unquantized_base(model: nn.Module) -> Optional[nn.Module]:
    """The full-precision weights a model built in memory was quantized from (:func:`load_base`), handed over
    once (None for any other model)."""
    return model.__dict__.pop(_UNQUANTIZED, None)


def dequantize(model: nn.Module, dtype=torch.float32) -> nn.Module:
    """The model with every bitsandbytes layer replaced by an ``nn.Linear`` holding its dequantized weight (what the
    layer multiplies by in training; transformers' ``dequantize``): a LoRA adapter merged into it gives the trained
    function in full precision, where merging into the 4-bit weights would round the adapters' small update away.
    Call it on a freshly loaded model (:func:`load_quantized`)."""
    out = model.dequantize(dtype=dtype)
    return out if out is not None else model
