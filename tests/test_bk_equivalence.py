"""Book-keeping clipping (grad_sample_mode: bk) gives exactly the explicit per-sample clipped sum.

float64 on CPU (the loss itself is float32: sequence_loss upcasts logits with .float(), hence 1e-6 of
scale), noise
0: the private sum must be Σᵢ w(‖gᵢ‖)·gᵢ, gᵢ record i's own gradient of its mean
next-token loss (its padding trimmed). Tiny GPT-2 (Conv1D, LayerNorm, learned positions) and tiny Llama
(RMSNorm, rotary), full fine-tuning and LoRA, every registered clipping function.
"""

import copy

import pytest
import torch

from dpllm.config import PrivacyConfig
from dpllm.privacy import clipping
from dpllm.privacy.engine import make_private
from dpllm.privacy.plan import PrivacyPlan
from dpllm.train import forward_loss
from tests.helpers import TEXTS, batch_of, tiny_model


def assert_close(got, expected):
    """Equal up to the float32 rounding of the loss, relative to the tensor's scale."""
    err = (got - expected).abs().max()
    assert err <= 1e-6 * expected.abs().max() + 1e-12, (err, expected.abs().max())


def f64_model(kind, finetuning, **kw):
    model, tok = tiny_model(kind, finetuning, **kw)
    return model.double(), tok


def explicit_per_sample_grads(model, batch):
    params = [p for p in model.parameters() if p.requires_grad]
    grads = []
    for i in range(batch["input_ids"].shape[0]):
        one = {k: v[i: i + 1] for k, v in batch.items()}
        n = int(one["attention_mask"].sum())  # trim this record's padding
        one = {k: v[:, :n] for k, v in one.items()}
        model.zero_grad()
        forward_loss(model, one).backward()
        grads.append([p.grad.detach().clone() for p in params])
    return grads


def make_bk(model, tok, cfg, logical=None):
    from dpllm.data import TokenizedRecords, make_collate

    dataset = TokenizedRecords(TEXTS, tok, 48)
    n = len(dataset)
    plan = PrivacyPlan(num_records=n, sample_rate=1.0, steps=1, noise_multiplier=0.0, delta=1e-5,
                       accountant="rdp", expected_batch_size=n)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    return make_private(model=model, optimizer=opt, dataset=dataset, collate_fn=make_collate(tok.pad_token_id),
                        cfg=cfg, plan=plan, logical_batch_size=logical or n), dataset


def expected_sum(model, batch, clip, quantile=0.5):
    per_sample = explicit_per_sample_grads(copy.deepcopy(model), batch)
    norms = torch.stack([torch.sqrt(sum((g ** 2).sum() for g in gs)) for gs in per_sample])
    cfg = PrivacyConfig(max_grad_norm=float(norms.quantile(quantile)), grad_sample_mode="bk", clipping=clip,
                        clipping_r=0.1, clipping_s=0.7)
    w = clipping.get(clip).weights(norms, cfg)
    return cfg, norms, [sum(wi * gs[j] for wi, gs in zip(w, per_sample)) for j in range(len(per_sample[0]))]


CASES = [(kind, ft) for kind in ("tiny-gpt2", "tiny-llama") for ft in ("full", "lora")]


@pytest.mark.parametrize("kind, finetuning", CASES)
@pytest.mark.parametrize("clip", clipping.names())
@pytest.mark.parametrize("policy", ["ghost", "explicit"])
def test_bk_sum_matches_explicit(kind, finetuning, clip, policy):
    model, tok = f64_model(kind, finetuning)
    batch = batch_of(tok)
    assert (batch["labels"] == -100).any()  # padding is present and must be masked
    cfg, norms, expected = expected_sum(model, batch, clip)
    pt, _ = make_bk(model, tok, cfg)
    assert pt.grad_sample_mode == "bk" and pt.criterion is None
    pt.model.set_policy(policy)
    pt.optimizer.zero_grad()
    forward_loss(pt.model, batch).backward()
    torch.testing.assert_close(pt.model.last_norms, norms, rtol=2e-6, atol=1e-9)
    pt.optimizer.pre_step()  # zero noise, divided by the expected batch size
    got = [p.grad * len(TEXTS) for p in pt.optimizer.params]
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert_close(g, e)


def test_every_trainable_layer_type_is_exercised():
    """Full GPT-2 covers Conv1D, LayerNorm, Embedding, Linear (the head); Llama RMSNorm."""
    from dpllm.privacy.bk import BookKeepingModule

    seen = set()
    for kind in ("tiny-gpt2", "tiny-llama"):
        model, tok = f64_model(kind, "full", dp=True)
        bk = BookKeepingModule(model, clip_weights=lambda n: torch.ones_like(n))
        forward_loss(bk, batch_of(tok)).backward()
        seen |= {type(r.module).__name__ for r in bk._records}
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    assert {"Conv1D", "LayerNorm", "Embedding", "Linear", "LlamaRMSNorm"} <= seen


def test_auto_policy_picks_the_cheaper_norm():
    """Ghost for a wide layer over few tokens, explicit for a rank-4 (LoRA-like) factor over many."""
    from dpllm.privacy.bk import BookKeepingModule

    wide, lora = torch.nn.Linear(256, 256), torch.nn.Linear(256, 4)
    bk = BookKeepingModule(torch.nn.Sequential(wide, lora), clip_weights=lambda n: torch.ones_like(n))
    kinds = {}
    for T in (8, 512):
        orig = bk._finish_backward
        bk._finish_backward = lambda T=T, orig=orig: kinds.update({(T, type(r.module), r.module.out_features):
                                                                   bool(r.ghost) for r in bk._records}) or orig()
        bk(torch.randn(2, T, 256)).sum().backward()
        bk._finish_backward = orig
    assert kinds[(8, torch.nn.Linear, 256)] and not kinds[(8, torch.nn.Linear, 4)]
    assert not kinds[(512, torch.nn.Linear, 256)]


def test_bk_refuses_what_it_cannot_do():
    from dpllm.privacy.bk import BookKeepingModule
    from dpllm.privacy.modes import resolve_mode

    model, _ = tiny_model("tiny-gpt2", "full", dp=False)  # a head tied to wte is supported (test_bk_vocab) ...
    model.transformer.h[0].mlp.c_proj.weight = model.transformer.h[1].mlp.c_proj.weight  # ... other sharing is not
    with pytest.raises(NotImplementedError, match="shared with"):
        BookKeepingModule(model, clip_weights=lambda n: n)
    assert resolve_mode("auto", model) == "hooks"  # the fastest Opacus mode (dpllm.privacy.modes)
    model.add_module("bn", torch.nn.BatchNorm1d(4))
    with pytest.raises(NotImplementedError, match="BatchNorm1d"):
        BookKeepingModule(model, clip_weights=lambda n: n)


def test_auto_resolves_to_bk_and_reports_it():
    model, tok = f64_model("tiny-llama", "lora")
    pt, _ = make_bk(model, tok, PrivacyConfig(grad_sample_mode="auto"))
    assert pt.grad_sample_mode == "bk"


@pytest.mark.parametrize("kind", ["tiny-llama", "tiny-gpt2"])
def test_virtual_batching_accumulates_the_one_pass_sum(kind):
    """Physical batches of 2 + 4 records, as the trainer runs them, give the one-pass clipped sum."""
    from dpllm.data import make_collate

    def run(split):
        model, tok = f64_model(kind, "full", dp=True)
        pt, dataset = make_bk(model, tok, PrivacyConfig(max_grad_norm=0.5, grad_sample_mode="bk"))
        collate = make_collate(tok.pad_token_id)
        n = len(dataset)
        parts = [list(range(0, split)), list(range(split, n))] if split else [list(range(n))]
        for i, part in enumerate(parts):
            pt.optimizer.signal_skip_step(do_skip=i < len(parts) - 1)
            pt.optimizer.zero_grad()
            forward_loss(pt.model, collate([dataset[j] for j in part])).backward()
            if i < len(parts) - 1:
                pt.optimizer.step()  # skipped: accumulates only
        pt.optimizer.pre_step()
        return [p.grad.detach().clone() for p in pt.optimizer.params]

    whole, split = run(None), run(2)
    for a, b in zip(whole, split):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-9)
    assert any(a.abs().sum() > 0 for a in whole)


def test_empty_share_runs_as_a_masked_record_and_adds_zero():
    model, tok = f64_model("tiny-llama", "full", dp=True)
    pt, _ = make_bk(model, tok, PrivacyConfig(grad_sample_mode="bk"))
    pt.optimizer.zero_grad()
    empty = {k: torch.zeros((0, 1), dtype=torch.long) for k in ("input_ids", "attention_mask", "labels")}
    forward_loss(pt.model, empty).backward()
    assert all(p.grad is not None and p.grad.abs().sum() == 0 for p in pt.optimizer.params)


class _Toy(torch.nn.Module):
    """Embedding with a padding row that real tokens use, a Linear called twice, a LayerNorm."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 6, padding_idx=0)
        self.lin = torch.nn.Linear(6, 6)
        self.norm = torch.nn.LayerNorm(6)
        self.head = torch.nn.Linear(6, 3)

    def forward(self, ids):
        h = self.lin(torch.tanh(self.lin(self.emb(ids))))
        return self.head(self.norm(h)).pow(2).mean((1, 2))  # one loss per sample


@pytest.mark.parametrize("policy", ["ghost", "explicit"])
def test_padding_row_and_repeated_layers_match_explicit(policy):
    from dpllm.privacy.bk import BookKeepingModule

    torch.manual_seed(0)
    toy = _Toy().double()
    ids = torch.randint(0, 11, (5, 7))
    ids[:, 0] = 0  # the padding id as a real input: its row gets no gradient
    per_sample = []
    for i in range(5):
        toy.zero_grad()
        toy(ids[i: i + 1]).sum().backward()
        per_sample.append([p.grad.clone() for p in toy.parameters()])
    norms = torch.stack([torch.sqrt(sum((g ** 2).sum() for g in gs)) for gs in per_sample])
    weights = 1.0 / (norms + 0.1)
    expected = [sum(w * gs[j] for w, gs in zip(weights, per_sample)) for j in range(len(per_sample[0]))]
    toy.zero_grad(set_to_none=True)
    bk = BookKeepingModule(toy, clip_weights=lambda n: 1.0 / (n + 0.1), loss_reduction="sum")
    bk.set_policy(policy)
    bk(ids).sum().backward()
    torch.testing.assert_close(bk.last_norms, norms)
    for p, e in zip(toy.parameters(), expected):
        torch.testing.assert_close(p.grad, e)
    assert toy.emb.weight.grad[0].abs().sum() == 0
