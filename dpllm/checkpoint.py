"""Checkpoints with their privacy report, written atomically; and loading them back.

A checkpoint directory holds the model (``save_pretrained``: full weights, or a LoRA adapter), the
tokenizer, ``privacy_report.json`` and ``dpllm_config.yaml``. A LoRA checkpoint over a tiny model built
from a config also carries that base under ``base_model/``, so it reloads without the original process.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from dpllm.io import atomic_directory, load_yaml, write_json_atomic

if TYPE_CHECKING:  # torch loads only where a model is handled
    from torch import nn


class CheckpointError(ValueError):
    pass


def library_versions() -> dict[str, str]:
    import accelerate
    import opacus
    import peft
    import torch
    import transformers

    import dpllm

    return {
        "python": platform.python_version(),
        "dpllm": dpllm.__version__,
        "torch": torch.__version__,
        "opacus": opacus.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "accelerate": accelerate.__version__,
    }


def unwrap(model: nn.Module) -> nn.Module:
    """Strip Opacus (GradSampleModule) and DDP wrappers."""
    while hasattr(model, "_module") or hasattr(model, "module"):
        model = getattr(model, "_module", None) or model.module
    return model


def save_checkpoint(
    path: str | Path,
    *,
    model: nn.Module,
    tokenizer,
    privacy_report: dict,
    config_yaml: str,
    base_model: Optional[nn.Module] = None,
    extra_files: Optional[dict[str, Any]] = None,
    state_dict: Optional[dict] = None,
    weights_dir: Optional[Path] = None,
) -> Path:
    """Write a checkpoint atomically: everything lands in a temp dir, then one rename.

    Args:
        path: target directory; an existing one is replaced only after the new one is complete.
        model: the trained model (Opacus/DDP wrappers are removed).
        tokenizer: saved beside the model so ``AutoTokenizer.from_pretrained(path)`` works.
        privacy_report: written as ``privacy_report.json``.
        config_yaml: the resolved run config, written as ``dpllm_config.yaml``.
        base_model: for LoRA over a base that has no path on disk, saved under ``base_model/``.
        extra_files: name → JSON-serialisable object, written beside the report.
        state_dict: the full weights when ``model`` is sharded (FSDP), gathered beforehand by every process.
        weights_dir: a directory where every process already wrote the weights (a sharded run,
            :func:`dpllm.sharded_checkpoint.write_weights`); its files are moved in and it is removed.
    """
    path = Path(path)
    model = unwrap(model)
    try:
        with atomic_directory(path) as tmp:
            if weights_dir is not None:
                for f in Path(weights_dir).iterdir():
                    os.replace(f, tmp / f.name)
                Path(weights_dir).rmdir()
            else:
                model.save_pretrained(tmp, **({"state_dict": state_dict} if state_dict is not None else {}))
            quantized = getattr(getattr(model, "config", None), "quantization_config", None)
            if quantized is not None and (tmp / "adapter_config.json").exists():  # QLoRA: how the base was quantized
                write_json_atomic(tmp / BASE_QUANTIZATION, _quantization_dict(quantized))
            tokenizer.save_pretrained(tmp)
            if base_model is not None:
                base_model.save_pretrained(tmp / "base_model")
                tokenizer.save_pretrained(tmp / "base_model")
            (tmp / "dpllm_config.yaml").write_text(config_yaml)
            write_json_atomic(tmp / "privacy_report.json", privacy_report)
            for name, obj in (extra_files or {}).items():
                write_json_atomic(tmp / name, obj)
    except Exception as err:  # OSError, or safetensors' SafetensorError wrapping one (disk full, quota)
        if isinstance(err, CheckpointError) or not (isinstance(err, OSError) or "Safetensor" in type(err).__name__):
            raise
        raise CheckpointError(f"could not write the checkpoint to {path} ({err}); nothing half-written was left "
                              "behind. Free disk space (or pick another output_dir) and run again") from err
    return path


#: Beside a QLoRA adapter: the base's ``BitsAndBytesConfig`` as a dict, so loaders quantize it exactly as in training.
BASE_QUANTIZATION = "base_quantization.json"


def _quantization_dict(q) -> dict:
    d = q.to_dict() if hasattr(q, "to_dict") else dict(q)
    return {k: (str(v).replace("torch.", "") if "dtype" in k and v is not None else v) for k, v in d.items()}


def base_quantization(path: str | Path):
    """The ``BitsAndBytesConfig`` a QLoRA checkpoint's base was quantized with (:data:`BASE_QUANTIZATION`), or None."""
    f = Path(path) / BASE_QUANTIZATION
    if not f.is_file():
        return None
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig.from_dict(json.loads(f.read_text()))


def run_quantization(path: str | Path) -> tuple[str, str]:
    """``(quantization, torch_dtype)`` of the run that wrote checkpoint ``path`` (its ``dpllm_config.yaml``);
    ``("none", "float32")`` for a checkpoint without one (any HF model directory)."""
    f = Path(path) / "dpllm_config.yaml"
    model = ((load_yaml(f.read_text()) or {}).get("model") or {}) if f.is_file() else {}
    return str(model.get("quantization") or "none"), str(model.get("torch_dtype") or "float32")


def load_model(path: str | Path, *, merge: bool = False, device: str = "cpu", dtype=None):
    """Load ``(model, tokenizer)`` from a dpllm checkpoint or run directory, full or LoRA.

    A QLoRA run's base (``model.quantization`` in its ``dpllm_config.yaml``) is loaded quantized the same way as
    in training, so audits score the model that was trained.

    Args:
        path: a checkpoint directory, a run directory (its ``checkpoint/`` is used), or any HF model dir.
        merge: for LoRA, merge the adapter into the base and return a plain transformers model (a QLoRA run's
            base is dequantized first: the merged model is the trained function in full precision).

    Raises:
        CheckpointError: no model or no tokenizer at ``path``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if (path / "checkpoint").is_dir():
        path = path / "checkpoint"
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as err:
        raise CheckpointError(f"{path} has no loadable tokenizer ({err}); save the tokenizer with the model") from err
    kw = {} if dtype is None else {"dtype": dtype}
    if (path / "adapter_config.json").exists():
        from peft import PeftModel

        base_dir = path / "base_model"
        if base_dir.is_dir():
            base_name = base_dir
        else:
            base_name = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
            if not base_name:
                raise CheckpointError(f"{path} is a LoRA adapter that names no base model and has no base_model/ "
                                      "beside it; load it from the run directory that wrote it")
        quantization, torch_dtype = run_quantization(path)
        if quantization != "none":  # QLoRA: the base quantized as in training (dpllm.quantization.load_quantized)
            import torch

            from dpllm.errors import ModelError
            from dpllm.quantization import dequantize, load_quantized

            try:
                base = load_quantized(base_name, quantization, torch_dtype=torch_dtype, config=base_quantization(path))
            except ModelError as err:
                raise CheckpointError(f"{path}: {err}") from err
            if merge:  # merged into the dequantized weights: the trained function, in full precision
                base = dequantize(base, dtype or torch.float32)
        else:
            base = AutoModelForCausalLM.from_pretrained(base_name, **kw)
        model = PeftModel.from_pretrained(base, path)
        if merge:
            model = model.merge_and_unload()
    elif (path / "config.json").exists():
        model = AutoModelForCausalLM.from_pretrained(path, **kw)
    else:
        raise CheckpointError(f"{path} holds neither a model (config.json) nor an adapter (adapter_config.json)")
    if getattr(model, "hf_device_map", None) is not None or getattr(model, "is_loaded_in_8bit", False):
        return model.eval(), tokenizer  # placed while loading (bitsandbytes); int8 models refuse .to()
    return model.to(device).eval(), tokenizer
