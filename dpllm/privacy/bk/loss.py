"""Per-record loss for large vocabularies without a float32 B×T×V logits tensor.

:func:`chunked_sequence_loss` equals :func:`dpllm.privacy.engine.sequence_loss` applied to
``head(hidden)``: each record's mean next-token loss over its real tokens (label -100 never counts), then
the mean over records. It runs the head and the float32 cross-entropy over chunks of ``chunk_tokens``
positions, each under activation checkpointing, so at most one chunk's logits exist at a time (forward
and backward). With a frozen head (LoRA) nothing vocabulary-sized is kept; with a trainable head under
``bk`` the head's output gradients are recorded per chunk in the model's dtype (bf16 under autocast).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def _chunk_nll(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = head(hidden)
    nll = nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="none",
                                      ignore_index=-100)
    return nll.view(labels.shape).sum(1)  # (B,) summed over this chunk's positions


def chunked_sequence_loss(hidden: torch.Tensor, head: nn.Module, labels: torch.Tensor, *,
                          chunk_tokens: int = 1024) -> torch.Tensor:
    """Mean over records of each record's mean next-token loss, the head applied ``chunk_tokens`` positions at a time.

    Args:
        hidden: the last hidden states (B, T, d), before the output head.
        head: the output projection (e.g. ``model.get_output_embeddings()``).
        labels: (B, T) token ids with -100 where the loss must not count (padding).
        chunk_tokens: positions per chunk; memory for logits is B·chunk_tokens·V.

    Returns:
        A scalar, equal to ``sequence_loss(head(hidden), labels)``.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be positive")
    h, y = hidden[:, :-1], labels[:, 1:]
    total = torch.zeros(h.shape[0], dtype=torch.float32, device=h.device)
    for t0 in range(0, h.shape[1], chunk_tokens):
        hc, yc = h[:, t0: t0 + chunk_tokens], y[:, t0: t0 + chunk_tokens]
        if hc.requires_grad or torch.is_grad_enabled():
            total = total + checkpoint(_chunk_nll, head, hc, yc, use_reentrant=False)
        else:
            total = total + _chunk_nll(head, hc, yc)
    counts = (y != -100).sum(1).clamp(min=1)
    return (total / counts).mean()


def causal_lm_chunked_loss(model: nn.Module, batch: dict, position_ids: torch.Tensor, *,
                           chunk_tokens: int = 1024) -> torch.Tensor:
    """:func:`chunked_sequence_loss` for an HF causal LM (PEFT-wrapped or not, BK-wrapped or not)."""
    inner = model
    while hasattr(inner, "_module"):
        if hasattr(inner, "expect_rows"):  # bk: its forward is bypassed, so tell it the batch's records
            inner.expect_rows(batch["input_ids"].shape[0])
        inner = inner._module
    base = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
    out = base.get_decoder()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                             position_ids=position_ids)
    return chunked_sequence_loss(out.last_hidden_state, base.get_output_embeddings(), batch["labels"],
                                 chunk_tokens=chunk_tokens)
