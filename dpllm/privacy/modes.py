"""``grad_sample_mode: auto`` (the default): which per-sample engine runs a model, and why.

Each mode, when ``auto`` chooses it, and why:

- bk: every trainable layer has a book-keeping rule (sharded or not). One backward pass, no per-sample tensors;
  fastest (README Benchmarks).
- hooks: some layer has no bk rule, and the per-sample gradients fit, or user-level sampling (ghost cannot sum a
  user's records). Faster than ghost: 1.5× vs 2.3× (CPU), 1.36× vs 2.26× (H100, LoRA).
- ghost: some layer has no bk rule, and hooks' per-sample gradients would not fit. No per-sample gradient tensors.

Opacus's hooks mode keeps one gradient per record for every trainable parameter: physical batch ×
trainable parameters × bytes. That is small under LoRA (8 × 20M × 2 B = 320 MB for Llama-3-8B) and
prohibitive for full fine-tuning of a large model (16 × 1.5B × 2 B = 48 GB), where ghost clipping pays a
second backward pass instead of the memory. "Fits" means at most a quarter of the device's memory (the
rest is weights, optimizer state and activations).

Under FSDP2 ``auto`` is bk or nothing: Opacus's ``hooks`` and ``ghost`` cannot see sharded parameters, and
its ``ghost_fsdp`` (two backward passes) runs only when asked for by name; a model with a layer bk cannot
handle is refused with that choice in the message. :func:`prepare_engine` is the training run's call: the
engine, decided before anything is written, with the model made ready for it (output head, checkpointing).

Example:
    >>> from torch import nn
    >>> choose_mode("auto", nn.Sequential(nn.Linear(3, 4))).mode
    'bk'
    >>> choose_mode("hooks", nn.Sequential(nn.Linear(3, 4))).reason
    'set by grad_sample_mode: hooks'
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from dpllm.checkpoint import unwrap
from dpllm.config import ConfigError, RunConfig
from dpllm.models import check_checkpointing, untie_output_embeddings

#: Share of the device's memory that hooks' per-sample gradients may take before auto picks ghost.
HOOKS_MEMORY_SHARE = 0.25


@dataclass(frozen=True)
class ModeChoice:
    """The engine that runs (``mode``, never ``auto``) and a one-line ``reason`` for the log and report."""

    mode: str
    reason: str


def device_memory(device: torch.device) -> Optional[int]:
    """Total memory in bytes of ``device`` (a CUDA GPU, or the machine's RAM for the CPU); None if unknown."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type == "cpu" and hasattr(os, "sysconf"):
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            return None
    return None


def choose_mode(requested: str, model: nn.Module, *, physical_batch_size: Optional[int] = None,
                per_user: bool = False, sharded: Optional[bool] = None) -> ModeChoice:
    """Resolve ``grad_sample_mode`` for ``model`` (already prepared: trainable parameters final).

    Args:
        requested: the configured mode; anything but ``auto`` is returned as is.
        model: the model to train (possibly DDP- or FSDP-wrapped).
        physical_batch_size: records per backward pass (None: assume hooks fits).
        per_user: user-level sampling (ULS): Opacus ghost cannot clip a user's summed records.
        sharded: the model is (or will be) FSDP-sharded; None: read it from ``model``.

    Returns:
        A :class:`ModeChoice`.

    Raises:
        ConfigError: ``auto`` under FSDP for a model with a layer bk cannot handle.
    """
    if requested != "auto":
        return ModeChoice(requested, f"set by grad_sample_mode: {requested}")
    from torch.distributed.fsdp import FSDPModule

    from dpllm.privacy.bk import unsupported_layers

    if sharded is None:
        sharded = any(isinstance(m, FSDPModule) for m in model.modules())
    bad = unsupported_layers(model)
    if not bad:
        return ModeChoice("bk", "auto: every trainable layer has a book-keeping rule (one backward pass)"
                                + ("; FSDP-sharded" if sharded else ""))
    if sharded:
        from dpllm.config import ConfigError

        raise ConfigError(f"grad_sample_mode=auto under FSDP: no book-keeping rule for {', '.join(bad[:3])}; freeze "
                          "or untie those layers, or set grad_sample_mode: ghost_fsdp (Opacus ghost clipping per "
                          "shard, two backward passes)")
    without = f"auto: no book-keeping rule for {bad[0]}" + (f" and {len(bad) - 1} more" if len(bad) > 1 else "")
    if per_user:
        return ModeChoice("hooks", f"{without}; user-level sampling (or a long record split into windows) needs "
                                   "per-sample gradients (Opacus ghost cannot sum a unit's rows before clipping)")
    params = [p for p in model.parameters() if p.requires_grad]
    if physical_batch_size is None or not params:
        return ModeChoice("hooks", f"{without}; Opacus hooks (faster than ghost)")
    need = physical_batch_size * sum(p.numel() * p.element_size() for p in params)
    total = device_memory(params[0].device)
    if total is not None and need > HOOKS_MEMORY_SHARE * total:
        return ModeChoice("ghost", f"{without}; hooks' per-sample gradients would take {need / 2**30:.1f} GiB "
                                   f"(> {HOOKS_MEMORY_SHARE:.0%} of the device's {total / 2**30:.0f} GiB), so Opacus "
                                   "ghost clipping")
    return ModeChoice("hooks", f"{without}; Opacus hooks (faster than ghost; per-sample gradients take "
                               f"{need / 2**30:.2g} GiB)")


def resolve_mode(requested: str, model: nn.Module, *, sharded: Optional[bool] = None) -> str:
    """``auto`` → the engine :func:`choose_mode` picks (bk where every layer has a rule).

    A weight used outside its layer or a layer fed sequence-first rows shows only when the model runs; bk
    then refuses at the first backward pass (Opacus's ghost would not help: its norms miss such a use too,
    while its second backward pass includes it unclipped; ``hooks`` handles it).
    """
    return choose_mode(requested, model, sharded=sharded).mode


def prepare_engine(model: nn.Module, cfg: RunConfig, *, sharded: bool,
                   keep_tie: bool) -> tuple[Optional[str], list[str]]:
    """The per-sample engine of a training run (None without DP), decided before anything is written, and the
    model made ready for it: the output head untied where the engine needs it, (non-reentrant) gradient
    checkpointing turned on where asked and allowed.

    Args:
        sharded: FSDP (``auto`` is then bk or a refusal).
        keep_tie: the head was left tied to the input embedding for bk (:func:`dpllm.models.prepare_model`).

    Returns:
        ``(mode, adjustments)``: the engine, and what was changed in the model (for the privacy report).

    Raises:
        ConfigError: gradient checkpointing under DP, or packing, with an engine other than bk (the layer named).
    """
    p, dp, adjustments = cfg.privacy, cfg.privacy.enabled, []
    mode = resolve_mode(p.grad_sample_mode, model, sharded=sharded) if dp else None
    if dp and cfg.data.packing and mode != "bk":  # only bk clips a record's segment of a packed row alone
        from dpllm.privacy.bk import unsupported_layers

        bad = unsupported_layers(model)
        raise ConfigError(f"data.packing needs grad_sample_mode bk, which cannot clip this model's trainable "
                          f"{', '.join(bad[:3]) or 'layers'} per record of a packed row; freeze or untie them, or "
                          "set data.packing: false")
    if keep_tie and cfg.model.finetuning == "full" and mode != "bk":
        adjustments += untie_output_embeddings(model)
    if cfg.train.gradient_checkpointing:
        if dp and mode != "bk":
            raise ConfigError(
                f"gradient_checkpointing=true under DP needs grad_sample_mode: bk (or auto on a model bk fully "
                f"supports), not {p.grad_sample_mode}: recomputed activations re-run Opacus's forward hooks "
                "and corrupt per-sample norms; switch the mode, or turn checkpointing off")
        # non-reentrant: book-keeping reads activations from autograd's saved tensors, recorded once
        unwrap(model).gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if dp:  # however checkpointing got turned on (a model's own code may): only bk clips under it
        check_checkpointing(model, mode)
    return mode, adjustments
