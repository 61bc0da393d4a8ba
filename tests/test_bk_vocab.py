"""bk's vocabulary-sized paths, each equal to the explicit per-sample computation (float64):

- an output head tied to the input embedding (GPT-2's default, kept under bk: no untied copy of the
  vocabulary matrix), record level and per user (ULS), ghost and explicit head norms, whole and chunked loss;
- the ghost clipped sum that scales the narrower side (an output layer's B×T×V gradient is never copied);
- Opacus's optimizer without its two gradient copies (:mod:`dpllm.privacy.bk.optimizer`), bitwise equal
  to Opacus's own over accumulated micro-batches.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpllm.config import PrivacyConfig
from dpllm.privacy.bk import BookKeepingModule, unsupported_layers
from tests.helpers import batch_of, tiny_model
from tests.test_bk_equivalence import assert_close, expected_sum, make_bk


class _TiedToy(nn.Module):
    """Embedding (with a padding row real tokens use) → Linear called twice → head sharing the embedding."""

    def __init__(self, V=13, d=5):
        super().__init__()
        self.emb = nn.Embedding(V, d, padding_idx=0)
        self.lin = nn.Linear(d, d)
        self.head = nn.Linear(d, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        h = self.lin(torch.tanh(self.lin(self.emb(ids))))
        logits = self.head(h)
        return nn.functional.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten(), reduction="none").view(
            ids.shape).sum(1)  # one loss per sample


def _per_sample(toy, ids):
    grads = []
    for i in range(ids.shape[0]):
        toy.zero_grad()
        toy(ids[i: i + 1]).sum().backward()
        grads.append([p.grad.clone() for p in toy.parameters()])
    return grads


@pytest.mark.parametrize("policy", ["ghost", "explicit"])
@pytest.mark.parametrize("users", [None, [0, 1, 0, 2, 1, 0]])
def test_tied_head_norms_and_sums_match_explicit(policy, users):
    torch.manual_seed(0)
    toy = _TiedToy().double()
    assert unsupported_layers(toy) == []  # the tie is supported, not refused
    ids = torch.randint(0, 13, (6, 7))
    ids[:, 0] = 0  # the padding id as a real input: its row gets no embedding gradient (the head's it does)
    per_sample = _per_sample(toy, ids)
    if users is None:
        units = [[i] for i in range(6)]
    else:
        units = [[i for i, u in enumerate(users) if u == v] for v in sorted(set(users))]
    unit_grads = [[sum(per_sample[i][j] for i in rows) / len(rows) if users else per_sample[rows[0]][j]
                   for j in range(len(per_sample[0]))] for rows in units]
    norms = torch.stack([torch.sqrt(sum((g ** 2).sum() for g in gs)) for gs in unit_grads])
    weights = 1.0 / (norms + 0.1)
    expected = [sum(w * gs[j] for w, gs in zip(weights, unit_grads)) for j in range(len(per_sample[0]))]
    toy.zero_grad(set_to_none=True)
    bk = BookKeepingModule(toy, clip_weights=lambda n: 1.0 / (n + 0.1), loss_reduction="sum",
                           per_user=users is not None)
    bk.set_policy(policy)
    if users is not None:
        bk.set_users(users)
    bk(ids).sum().backward()
    torch.testing.assert_close(bk.last_norms, norms)
    for p, e in zip(toy.parameters(), expected):
        torch.testing.assert_close(p.grad, e)
    assert toy.head.weight is toy.emb.weight


@pytest.mark.parametrize("policy", ["ghost", "explicit"])
def test_tied_gpt2_full_finetuning_matches_explicit(policy):
    """Tiny GPT-2 with its head still tied to wte (prepare_model(dp=False) keeps the tie)."""
    model, tok = tiny_model("tiny-gpt2", "full", dp=False)
    model = model.double()
    assert model.lm_head.weight is model.transformer.wte.weight
    batch = batch_of(tok)
    cfg, norms, expected = expected_sum(model, batch, "flat")
    pt, _ = make_bk(model, tok, cfg)
    assert pt.grad_sample_mode == "bk"
    pt.model.set_policy(policy)
    pt.optimizer.zero_grad()
    from dpllm.train import forward_loss

    forward_loss(pt.model, batch).backward()
    assert_close(pt.model.last_norms, norms)
    for p, e in zip([p for p in model.parameters() if p.requires_grad], expected):
        assert_close(p.grad, e)


@pytest.mark.parametrize("kind, finetuning, tied, clip", [
    ("tiny-llama", "full", False, lambda n: 1.0 / (n + 0.1)),
    ("tiny-gpt2", "lora", False, lambda n: 1.0 / (n + 0.1)),
    ("tiny-gpt2", "full", True, lambda n: (0.05 / n).clamp(max=1.0)),  # the head shares the embedding's weight
], ids=["llama-full", "gpt2-lora", "gpt2-full-tied"])
def test_chunked_loss_equals_sequence_loss_and_its_clipped_sum(kind, finetuning, tied, clip):
    """The head applied over several chunks (large-vocabulary loss) records several calls: the same loss, norms
    and clipped sums as the whole sequence loss."""
    from dpllm.models import position_ids_for
    from dpllm.privacy.bk.loss import causal_lm_chunked_loss
    from dpllm.train import forward_loss

    results = []
    for chunked in (False, True):
        model, tok = tiny_model(kind, finetuning, dp=not tied)  # dp=False keeps GPT-2's head tied
        bk = BookKeepingModule(model.double(), clip_weights=clip)
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


def test_other_shared_parameters_are_still_refused():
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    net[1].weight = net[0].weight
    assert "shared with" in unsupported_layers(net)[0]


def test_lean_optimizer_is_bitwise_opacus_over_accumulated_micro_batches():
    from opacus.optimizers import DPOptimizerFastGradientClipping

    from dpllm.privacy.bk.optimizer import LeanAccumulation

    def run(cls):
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(4))]
        opt = cls(torch.optim.SGD(params, lr=0.1), noise_multiplier=1.3, max_grad_norm=0.7, expected_batch_size=5,
                  loss_reduction="mean", generator=torch.Generator().manual_seed(42))
        grads = torch.Generator().manual_seed(7)
        for micro in range(3):
            opt.signal_skip_step(do_skip=micro < 2)
            opt.zero_grad()
            for p in params:  # what bk leaves: a fresh tensor in p.grad
                p.grad = torch.randn(p.shape, generator=grads)
            opt.step()
        return [p.detach().clone() for p in params]

    for a, b in zip(run(LeanAccumulation), run(DPOptimizerFastGradientClipping)):
        assert torch.equal(a, b)


def test_bk_uses_the_lean_optimizer():
    from dpllm.privacy.bk.optimizer import LeanAccumulation

    model, tok = tiny_model("tiny-llama", "lora")
    pt, _ = make_bk(model, tok, PrivacyConfig(grad_sample_mode="bk"))
    assert isinstance(pt.optimizer, LeanAccumulation)
