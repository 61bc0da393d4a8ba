"""Book-keeping clipping under gradient checkpointing (use_reentrant=False) and with a chunked loss.

Layers run twice (forward, then recomputation in backward) but record once: activations are read from
the autograd function's saved tensors in backward, which checkpointing fills by recomputing them. The
clipped sum and the per-sample norms must equal those of the same step without checkpointing.
"""

import pytest
import torch

from dpllm.privacy.bk import BookKeepingModule
from dpllm.train import forward_loss
from tests.helpers import batch_of, tiny_model


def bk_step(kind, finetuning, checkpointing):
    model, tok = tiny_model(kind, finetuning)
    model = model.double()
    if checkpointing:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        assert base.is_gradient_checkpointing
    model.train()
    bk = BookKeepingModule(model, clip_weights=lambda n: 1.0 / (n + 0.1))
    forward_loss(bk, batch_of(tok)).backward()
    return bk.last_norms, [p.grad for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("kind, finetuning", [("tiny-llama", "full"), ("tiny-llama", "lora"), ("tiny-gpt2", "full")])
def test_checkpointing_records_once_and_matches(kind, finetuning):
    norms, grads = bk_step(kind, finetuning, checkpointing=False)
    norms_ckpt, grads_ckpt = bk_step(kind, finetuning, checkpointing=True)
    torch.testing.assert_close(norms_ckpt, norms)  # recording twice would double explicit sums
    for a, b in zip(grads_ckpt, grads):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("kind, finetuning", [("tiny-llama", "full"), ("tiny-gpt2", "lora")])
def test_chunked_loss_equals_sequence_loss_and_its_clipped_sum(kind, finetuning):
    from dpllm.models import position_ids_for
    from dpllm.privacy.bk.loss import causal_lm_chunked_loss

    results = []
    for chunked in (False, True):
        model, tok = tiny_model(kind, finetuning)
        bk = BookKeepingModule(model.double(), clip_weights=lambda n: 1.0 / (n + 0.1))
        batch = batch_of(tok)
        if chunked:  # 7 positions per chunk: several chunks and a ragged last one
            loss = causal_lm_chunked_loss(bk, batch, position_ids_for(batch["input_ids"]), chunk_tokens=7)
        else:
            loss = forward_loss(bk, batch)
        loss.backward()
        results.append((loss.detach(), bk.last_norms, [p.grad for p in model.parameters() if p.requires_grad]))
    (loss, norms, grads), (loss_c, norms_c, grads_c) = results
    torch.testing.assert_close(loss_c, loss)
    torch.testing.assert_close(norms_c, norms)
    for a, b in zip(grads_c, grads):
        torch.testing.assert_close(a, b)


def test_bf16_autocast_runs_and_stays_close_to_fp32():
    """Under bf16 autocast layers save bf16 activations; norms and clipped sums stay within bf16 rounding."""
    out = []
    for ac in (False, True):
        model, tok = tiny_model("tiny-llama", "lora")
        bk = BookKeepingModule(model, clip_weights=lambda n: 1.0 / (n + 0.1))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=ac):
            loss = forward_loss(bk, batch_of(tok))
        loss.backward()
        out.append((bk.last_norms, [p.grad for p in model.parameters() if p.requires_grad]))
    (n32, g32), (n16, g16) = out
    assert all(g.dtype == torch.float32 for g in g16)
    assert ((n16 - n32).abs() / n32).max() < 0.05
    for a, b in zip(g16, g32):
        assert (a - b).norm() <= 0.05 * b.norm() + 1e-6
