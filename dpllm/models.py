"""Load or build a causal LM and make it trainable under DP.

What Opacus 1.6 needs, and what this module does about it (each step is logged and recorded in the
privacy report under ``model_adjustments``):

- Ghost clipping refuses tied parameters (GPT-2 ties input and output embeddings). For full
  fine-tuning the output head is untied into its own copy of the weights (same function at step 0).
  Under LoRA the embeddings are frozen, so the tie is harmless and kept.
- Position ids that broadcast over the batch (batch dim 1, or built with ``expand``) break the
  embedding norm sampler (``view size is not compatible``) and hooks mode (``stack expects each tensor
  to be equal size``). The training loop always passes contiguous, per-row ``position_ids``
  (:func:`position_ids_for`).
- Layers without an Opacus norm sampler (GPT-2's ``Conv1D``, Llama's RMSNorm) fall back to per-sample
  gradients computed with functorch: correct, slower, more memory.
- QLoRA (``quantization: nf4 | fp4 | int8``): the base is loaded quantized by bitsandbytes through transformers'
  ``BitsAndBytesConfig`` (:func:`load_quantized`) and prepared with peft's ``prepare_model_for_kbit_training``
  before the adapters are attached. Every quantized layer is frozen, so the engines see only the adapters'
  ``nn.Linear`` layers as trainable: bk and Opacus clip exactly those, and the backward pass merely flows through
  the 4-bit base.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import re
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from dpllm.canaries import add_tokens as add_canary_tokens
from dpllm.canaries import added_tokens as canary_tokens
from dpllm.config import ConfigError, ModelConfig
from dpllm.errors import ModelError
from dpllm.io import looks_local
from dpllm.quantization import (  # noqa: F401 (re-exported)
    _UNQUANTIZED,
    _dtype,
    bnb_config,
    dequantize,
    load_quantized,
    one_cpu_path,
    quantization_of,
    quantize_in_memory,
    unquantized_base,
)

log = logging.getLogger(__name__)

TINY_MODELS = ("tiny-llama", "tiny-gpt2")
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "vocab.json", "tokenizer.model")


def byte_tokenizer():
    """Byte-level tokenizer with a fixed vocabulary: never trained on (private) data.

    Each call returns a tokenizer of its own (a run may add tokens to it: new-token canaries), unpickled from one
    built at the first call: building ``ByT5Tokenizer`` registers its 128 added tokens one by one (5.6 ms), the
    copy takes 0.7 ms, and every tiny run, reload and export asks for one.
    """
    import pickle

    if not _BYTE_TOKENIZER:
        from transformers import ByT5Tokenizer

        _BYTE_TOKENIZER.append(pickle.dumps(ByT5Tokenizer()))
    return pickle.loads(_BYTE_TOKENIZER[0])  # noqa: S301 (bytes this process pickled itself)


_BYTE_TOKENIZER: list[bytes] = []  # the pickled tokenizer that byte_tokenizer copies


def byte_ids(tokenizer, texts, *, truncation: bool = False, max_length: Optional[int] = None,
             add_special_tokens: bool = True) -> Optional[list]:
    """``tokenizer(texts, truncation=..., max_length=..., add_special_tokens=...)["input_ids"]`` for the byte tokenizer
    (transformers' ``ByT5Tokenizer`` as :func:`byte_tokenizer` builds it) without its Python tokenizer; None for any
    other tokenizer or setting, and the caller tokenizes as usual.

    ByT5 maps each UTF-8 byte b to id b + 3 (after ``<pad>``, ``</s>``, ``<unk>``) and appends ``</s>`` (id 1); with
    truncation the bytes are cut to ``max_length - 1`` before it. Its tokenizer gets there through a character trie
    over its 128 added tokens, ~2.6 µs per character (0.9 s per load of the pydoc corpus, every tiny run's data).
    The arithmetic applies only where no added token occurs: a text in which none of them is found (one regular
    expression over the added tokens, each of which must contain ``<``) is plain bytes; a text that holds one goes
    through the tokenizer, as does any text for a tokenizer with an added token without ``<``, a subclass, or
    left-side truncation. ``tests/test_data.py`` checks every case against the tokenizer itself.
    """
    from transformers import ByT5Tokenizer

    if type(tokenizer) is not ByT5Tokenizer or getattr(tokenizer, "offset", None) != 3 \
            or tokenizer.eos_token_id != 1 or tokenizer.truncation_side != "right" \
            or getattr(tokenizer, "split_special_tokens", False) or getattr(tokenizer, "do_lower_case", False) \
            or (truncation and (max_length is None or max_length < 2)) \
            or not all("<" in str(t) for t in tokenizer.added_tokens_encoder):
        return None
    texts = list(texts)
    added = _added_tokens_pattern(tuple(sorted(str(t) for t in tokenizer.added_tokens_encoder)))
    slow = [i for i, t in enumerate(texts) if "<" in t and added.search(t)]
    out: list = [None] * len(texts)
    if slow:
        for i, ids in zip(slow, tokenizer([texts[i] for i in slow], truncation=truncation, max_length=max_length,
                                          add_special_tokens=add_special_tokens)["input_ids"]):
            out[i] = ids
    keep = (max_length - 1 if add_special_tokens else max_length) if truncation else None
    fast = [i for i, ids in enumerate(out) if ids is None]
    if fast:  # all plain texts' bytes at once: one shift in numpy, then a slice per text (1.5× a per-byte loop)
        import numpy as np

        raws = [texts[i].encode("utf-8")[:keep] for i in fast]
        ids = (np.frombuffer(b"".join(raws), dtype=np.uint8).astype(np.int64) + 3).tolist()
        end = [1] if add_special_tokens else []
        at = 0
        for i, raw in zip(fast, raws):
            out[i] = ids[at: at + len(raw)] + end
            at += len(raw)
    return out


@functools.lru_cache(maxsize=16)
def _added_tokens_pattern(tokens: tuple[str, ...]) -> re.Pattern:
    """One regular expression that finds any of ``tokens`` in a text (compiled once per set of added tokens)."""
    return re.compile("|".join(re.escape(t) for t in tokens))


def resolve_checkpoint(path: str) -> Optional[Path]:
    """A dpllm run directory resolves to its ``checkpoint/``; a plain directory to itself."""
    p = Path(path)
    if (p / "checkpoint").is_dir() and (p / "splits.json").exists():
        return p / "checkpoint"
    return p if p.is_dir() else None


def build_tiny(cfg: ModelConfig, tokenizer, max_length: int) -> nn.Module:
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    positions = max(cfg.tiny_max_positions, max_length)
    common = dict(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if cfg.model_name_or_path == "tiny-llama":
        config = LlamaConfig(
            hidden_size=cfg.tiny_hidden_size,
            intermediate_size=cfg.tiny_intermediate_size,
            num_hidden_layers=cfg.tiny_num_layers,
            num_attention_heads=cfg.tiny_num_heads,
            num_key_value_heads=cfg.tiny_num_heads,
            max_position_embeddings=positions,
            tie_word_embeddings=False,
            **common,
        )
    else:
        config = GPT2Config(
            n_embd=cfg.tiny_hidden_size,
            n_inner=cfg.tiny_intermediate_size,
            n_layer=cfg.tiny_num_layers,
            n_head=cfg.tiny_num_heads,
            n_positions=positions,
            tie_word_embeddings=True,  # as GPT-2 itself: exercises the untying path
            # no dropout: short CPU runs gain nothing from it, and tests compare exact gradients
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            **common,
        )
    return AutoModelForCausalLM.from_config(config)


def source_of(cfg: ModelConfig) -> dict:
    """Where the model comes from, without loading it: a tiny config, an earlier dpllm run, or pretrained.

    Raises:
        ModelError: a local path that does not exist.
    """
    source = _source_of(cfg)
    if cfg.quantization != "none":  # how the base was loaded: the report, the export card and loaders say so
        source["quantization"] = cfg.quantization
    return source


def _source_of(cfg: ModelConfig) -> dict:
    name = cfg.model_name_or_path
    if name in TINY_MODELS:
        return {"kind": "tiny", "name": name}
    ckpt = resolve_checkpoint(name)
    if ckpt is None and looks_local(name):
        from dpllm.io import suggest_path

        near = suggest_path(name)
        raise ModelError(f"model_name_or_path={name}: no such local directory; "
                         + (f"did you mean {near}?" if near else "check the path (a Hub id looks like org/name)"))
    if ckpt is not None and (ckpt / "adapter_config.json").exists():
        return {"kind": "run_checkpoint", "path": str(ckpt.resolve()), "merged_lora": True}
    if ckpt is not None and (ckpt / "privacy_report.json").exists():
        return {"kind": "run_checkpoint", "path": str(ckpt.resolve())}
    return {"kind": "pretrained", "path": str(ckpt.resolve()) if ckpt is not None else name}


def load_base(cfg: ModelConfig, max_length: int, *, on_meta: bool = False) -> tuple[nn.Module, object, dict]:
    """Return ``(model, tokenizer, source)``: a tiny model, a Hub/local model, or an earlier run's checkpoint.

    An earlier run's LoRA checkpoint is merged into its base, so a later stage starts from the
    fine-tuned weights. ``on_meta``: a Hub/local model is built from its config on the meta device, without
    reading its weights (the FSDP processes that receive them from rank 0: :func:`dpllm.distributed.fill_from_rank0`).

    Raises:
        ModelError: a missing local path, a model directory without its tokenizer.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = source_of(cfg)
    q = cfg.quantization
    if source["kind"] == "tiny" or source.get("merged_lora"):
        if source["kind"] == "tiny":
            tok = byte_tokenizer()
            model = build_tiny(cfg, tok, max_length)
        else:
            from dpllm.checkpoint import load_model

            model, tok = load_model(source["path"], merge=True)  # a QLoRA run: merged into its dequantized base
        if q == "none":
            return model, tok, source
        quantized = quantize_in_memory(model, q, torch_dtype=cfg.torch_dtype)
        # the base a LoRA checkpoint saves (it has no path on disk): the weights before quantization, which a
        # loader quantizes again to the very same model (:func:`unquantized_base`)
        quantized.__dict__[_UNQUANTIZED] = model
        return quantized, tok, source
    where = source["path"]
    ckpt = Path(where) if Path(where).is_dir() else None
    if ckpt is not None and not any((ckpt / f).exists() for f in TOKENIZER_FILES):
        raise ModelError(f"{ckpt} has no tokenizer files ({', '.join(TOKENIZER_FILES)}); save the tokenizer "
                         "beside the model (tokenizer.save_pretrained)")
    try:
        tok = AutoTokenizer.from_pretrained(where, trust_remote_code=cfg.trust_remote_code)
    except Exception as err:
        raise ModelError(f"no tokenizer at {where}: {err}; a model directory must include its tokenizer") from err
    if q != "none":
        if cfg.random_init:
            raise ModelError(f"random_init with quantization={q}: random weights are built unquantized only; "
                             "set quantization: none")
        model = load_quantized(where, q, torch_dtype=cfg.torch_dtype, trust_remote_code=cfg.trust_remote_code)
    elif on_meta:
        model = _on_meta(where, cfg)
    elif cfg.random_init:
        model = _random_init(where, cfg)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            where, dtype=_dtype(cfg.torch_dtype), trust_remote_code=cfg.trust_remote_code
        )
    return model, tok, source


def _random_init(where: str, cfg: ModelConfig) -> nn.Module:
    """The model of ``where``'s config.json with random weights (``random_init``), built directly on this process's
    GPU where there is one: an 8B model takes about a second there, minutes on a CPU."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(where, trust_remote_code=cfg.trust_remote_code)
    dtype = _dtype(cfg.torch_dtype)
    dtype = torch.float32 if dtype == "auto" else dtype
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=cfg.trust_remote_code)
    log.warning("model: %s built from its config with RANDOM weights (random_init: benchmarks only)", where)
    return model


def _on_meta(where: str, cfg: ModelConfig) -> nn.Module:
    """The model ``from_pretrained`` would return, its parameters and buffers on the meta device (no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(where, trust_remote_code=cfg.trust_remote_code)
    dtype = _dtype(cfg.torch_dtype)
    if dtype == "auto":  # as from_pretrained resolves it: the checkpoint's own dtype
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=cfg.trust_remote_code)
    log.info("model: %s built from its config on the meta device; its weights come from rank 0", where)
    return model.eval()  # as from_pretrained returns it


def context_length(model: nn.Module) -> Optional[int]:
    c = model.config
    return getattr(c, "max_position_embeddings", None) or getattr(c, "n_positions", None)


def fit_to_run(model: nn.Module, tokenizer, *, max_length: int, canaries: list[dict]) -> None:
    """Ready a loaded model and tokenizer for a run: ``max_length`` within the model's context, a pad token (the
    end-of-sequence token where there is none), and the vocabulary entries the canaries need.

    Raises:
        ConfigError: ``max_length`` beyond the model's context.
    """
    ctx = context_length(model)
    if ctx is not None and max_length > ctx:
        raise ConfigError(f"max_length={max_length} exceeds the model's context of {ctx} tokens; lower max_length")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    added = add_canary_tokens(model, tokenizer, canary_tokens(canaries))
    if added:
        log.info("canaries: added %d new tokens to the vocabulary (%s)", added, canaries[0]["design"])


def base_to_keep(model: nn.Module, cfg: ModelConfig, source: dict) -> Optional[nn.Module]:
    """The base a LoRA run saves beside its adapters when the base has no path of its own (a tiny model, or one
    merged from an earlier run): QLoRA's the weights it was quantized from, else a copy. None otherwise."""
    if cfg.finetuning != "lora" or source["kind"] == "pretrained":
        return None
    unquantized = unquantized_base(model)
    return unquantized if unquantized is not None else copy.deepcopy(model)


def untie_output_embeddings(model: nn.Module, *, weight: bool = True) -> list[str]:
    """Give the output head its own copy of a tied input embedding; returns what was untied (for the report).

    ``weight=False`` keeps a tied weight (book-keeping clips it exactly, cross term included:
    :func:`dpllm.privacy.bk.layers.tied_cross`; Opacus refuses it). A bias tied to another module's parameter
    (BERT's prediction head: ``decoder.bias`` is ``predictions.bias``) is always given its own copy, and the
    other name, which the forward pass reaches only through the head, is frozen: Opacus (hooks and ghost)
    fails on the shared bias with a meta-device error and bk refuses a parameter of two layers. With
    ``tie_word_embeddings`` false a saved model loads both back as they are.
    """
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    if out is None:
        return []
    done = []
    bias = getattr(out, "bias", None)
    bias_tied = (isinstance(bias, nn.Parameter)
                 and sum(p is bias for _, p in model.named_parameters(remove_duplicate=False)) > 1)
    # a tied bias is untied, and then the weight too: transformers re-ties both or neither when loading
    if (weight or bias_tied) and out.weight is inp.weight:
        out.weight = nn.Parameter(inp.weight.detach().clone())
        done.append("untied output embedding from input embedding (Opacus refuses tied parameters)")
    if bias_tied:
        out.bias = nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad)
        bias.requires_grad_(False)
        done.append("untied the output head's bias from the parameter it shared (that one frozen; unused by the "
                    "forward pass)")
    if done:
        model.config.tie_word_embeddings = False
        if hasattr(model.config, "get_text_config"):
            model.config.get_text_config().tie_word_embeddings = False
    return done


def prepare_model(model: nn.Module, cfg: ModelConfig, *, dp: bool, keep_tie: bool = False
                  ) -> tuple[nn.Module, list[str]]:
    """Apply full fine-tuning or LoRA and the DP fixes; return the model and what was adjusted.

    ``keep_tie``: leave an output head tied to the input embedding (for bk, which clips it exactly).
    """
    adjustments: list[str] = []
    quantized = quantization_of(model)
    if quantized != "none" and cfg.finetuning != "lora":
        raise ModelError(f"the base is quantized ({quantized}) and cannot be fine-tuned in full: use finetuning: lora "
                         "(QLoRA), or load it unquantized")
    if quantized != "none":
        from peft import prepare_model_for_kbit_training

        # peft's preparation as QLoRA users know it: every base parameter frozen, the non-quantized ones (norms,
        # embeddings, head) cast to float32. Checkpointing stays the trainer's choice (train.gradient_checkpointing,
        # non-reentrant): peft's default would turn on reentrant checkpointing, which Opacus's modes cannot run.
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        adjustments.append(f"base quantized by bitsandbytes ({quantized}), frozen, prepared with peft's "
                           "prepare_model_for_kbit_training (norms, embeddings and head in float32)")
    if cfg.finetuning == "full":
        for p in model.parameters():
            p.requires_grad_(True)
        if dp:  # after requires_grad: it freezes a tied bias's other name
            adjustments += untie_output_embeddings(model, weight=not keep_tie)
    else:
        from peft import LoraConfig, get_peft_model

        targets = cfg.lora_target_modules
        target_modules = targets if targets == "all-linear" else [t.strip() for t in targets.split(",") if t.strip()]
        fan_in_fan_out = type(model).__name__.startswith("GPT2")  # GPT-2's Conv1D stores weights transposed
        lora = LoraConfig(
            r=cfg.lora_r,
            lora_alpha=cfg.lora_alpha,
            lora_dropout=cfg.lora_dropout,
            target_modules=target_modules,
            fan_in_fan_out=fan_in_fan_out,
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, lora)
        adjustments.append(f"LoRA r={cfg.lora_r} on {targets}; base weights (embeddings included) frozen")
    if dp:
        adjustments.append("position_ids passed per row and contiguous (Opacus embedding norm sampler)")
    for a in adjustments:
        log.info("model: %s", a)
    return model, adjustments


def check_dp_layers(model: nn.Module) -> None:
    """Refuse trainable layers Opacus cannot give per-sample gradients for (e.g. BatchNorm)."""
    from opacus.validators import ModuleValidator

    errors = ModuleValidator.validate(model, strict=False)
    if errors:
        raise ModelError(
            "layers unsupported under DP: "
            + "; ".join(str(e) for e in errors[:5])
            + ". Freeze them, use LoRA, or replace them (opacus.validators.ModuleValidator.fix)"
        )


def activation_checkpointing(model: nn.Module) -> Optional[str]:
    """How the model's own layers recompute activations in backward, read from the model itself.

    transformers' ``gradient_checkpointing_enable`` (and peft's ``prepare_model_for_kbit_training``) mark
    each checkpointed module with ``gradient_checkpointing = True`` and a ``_gradient_checkpointing_func``
    that is ``torch.utils.checkpoint.checkpoint`` with the caller's keyword arguments; torch's default is
    reentrant when ``use_reentrant`` is not given.

    Returns:
        None (no checkpointing), ``"non-reentrant"``, or ``"reentrant"`` (if any module is).
    """
    found = None
    for m in model.modules():
        if getattr(m, "gradient_checkpointing", False) is True:
            keywords = getattr(getattr(m, "_gradient_checkpointing_func", None), "keywords", None) or {}
            if keywords.get("use_reentrant", True) is not False:
                return "reentrant"
            found = "non-reentrant"
    return found


def check_checkpointing(model: nn.Module, grad_sample_mode: str) -> None:
    """Refuse activation checkpointing (however it was turned on) under a mode whose norms it corrupts.

    Opacus's ghost and hooks modes capture activations with forward hooks, which recomputation runs again.
    Book-keeping reads activations from autograd's saved tensors and clips once at the end of the outermost
    backward pass, under either kind of checkpointing (:mod:`dpllm.privacy.bk`).

    Raises:
        ModelError: checkpointing on, under a mode other than ``bk``.
    """
    kind = activation_checkpointing(model)
    if kind is not None and grad_sample_mode != "bk":
        raise ModelError(
            f"the model has {kind} gradient checkpointing enabled, which corrupts Opacus's per-sample norms under "
            f"grad_sample_mode: {grad_sample_mode} (recomputed activations re-run its forward hooks); use "
            "grad_sample_mode: bk (or auto on a model bk fully supports), or turn it off "
            "(model.gradient_checkpointing_disable())")


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(total, trainable) parameter counts."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return total, trainable


def position_ids_for(input_ids: torch.Tensor) -> torch.Tensor:
    """Per-row, contiguous position ids (never a broadcast view: see the module docstring)."""
    B, T = input_ids.shape
    return torch.arange(T, device=input_ids.device).unsqueeze(0).repeat(B, 1)
