"""Opacus-clipped (ghost and hooks) summed gradients equal the explicit per-sample computation.

Noise is 0, so the private sum must be exactly Σᵢ w(‖gᵢ‖)·gᵢ where gᵢ is record i's own gradient of
its mean next-token loss. Covers tiny GPT-2 (tied embeddings, Conv1D) and tiny Llama (RMSNorm,
rotary), full fine-tuning and LoRA, and every registered clipping function.
"""

import copy

import pytest
import torch

from dpllm.config import PrivacyConfig
from dpllm.privacy import clipping
from dpllm.privacy.engine import PrivacyPlan, make_private
from dpllm.train import forward_loss
from tests.helpers import TEXTS, batch_of, tiny_model


def explicit_per_sample_grads(model, batch):
    params = [p for p in model.parameters() if p.requires_grad]
    grads = []
    for i in range(batch["input_ids"].shape[0]):
        one = {k: v[i: i + 1] for k, v in batch.items()}
        # trim this record's padding: its gradient must not depend on the batch it sits in
        n = int(one["attention_mask"].sum())
        one = {k: v[:, :n] for k, v in one.items()}
        model.zero_grad()
        forward_loss(model, one).backward()
        grads.append([p.grad.detach().clone() for p in params])
    return grads


def private_sum(model, tok, batch, cfg: PrivacyConfig):
    from dpllm.data import TokenizedRecords, make_collate

    dataset = TokenizedRecords(TEXTS, tok, 48)
    n = len(dataset)
    plan = PrivacyPlan(num_records=n, sample_rate=1.0, steps=1, noise_multiplier=0.0, delta=1e-5,
                       accountant="rdp", expected_batch_size=n)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    pt = make_private(model=model, optimizer=opt, dataset=dataset, collate_fn=make_collate(tok.pad_token_id),
                      cfg=cfg, plan=plan, logical_batch_size=n)
    pt.optimizer.zero_grad()
    forward_loss(pt.model, batch, pt.criterion).backward()
    pt.optimizer.pre_step()  # clip (or weight), add zero noise, divide by the expected batch size
    return [p.grad.detach().clone() * n for p in pt.optimizer.params]


CASES = [(kind, ft, mode) for kind in ("tiny-gpt2", "tiny-llama") for ft in ("full", "lora")
         for mode in ("ghost", "hooks")]


@pytest.mark.parametrize("kind, finetuning, mode", CASES)
@pytest.mark.parametrize("clip", ["flat", "psasc"])
def test_private_sum_matches_explicit(kind, finetuning, mode, clip):
    model, tok = tiny_model(kind, finetuning)
    batch = batch_of(tok)
    reference = copy.deepcopy(model)
    per_sample = explicit_per_sample_grads(reference, batch)
    norms = torch.stack([torch.sqrt(sum((g ** 2).sum() for g in gs)) for gs in per_sample])
    # C at the median norm: some records are clipped, some are not
    cfg = PrivacyConfig(max_grad_norm=float(norms.median()), grad_sample_mode=mode, clipping=clip,
                        clipping_r=0.1, clipping_s=0.7)
    weights = clipping.get(clip).weights(norms, cfg)
    if clip == "flat":
        assert (weights < 1).any() and (weights >= 1 - 1e-6).any()
    expected = [sum(w * gs[j] for w, gs in zip(weights, per_sample)) for j in range(len(per_sample[0]))]

    got = private_sum(model, tok, batch, cfg)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert torch.allclose(g, e, rtol=1e-4, atol=1e-6), (g - e).abs().max()


@pytest.mark.parametrize("name", ["flat", "automatic", "psac", "psasc"])
@pytest.mark.parametrize("s", [0.3, 1.0, 2.0])
def test_weighted_norm_never_exceeds_sensitivity(name, s):
    cfg = PrivacyConfig(max_grad_norm=0.7, clipping_r=0.05, clipping_s=s)
    fn = clipping.get(name)
    n = torch.logspace(-6, 6, 2001, dtype=torch.float64)
    weighted = fn.weights(n, cfg) * n
    assert (weighted <= fn.sensitivity(cfg) * (1 + 1e-9)).all()
    # the bound is tight: large gradients approach it
    assert weighted.max() > 0.99 * fn.sensitivity(cfg)


def test_psasc_noise_is_calibrated_to_its_sensitivity():
    fn = clipping.get("psasc")
    assert fn.sensitivity(PrivacyConfig(max_grad_norm=1.0, clipping_s=0.5)) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="clipping_s"):
        fn.sensitivity(PrivacyConfig(clipping_s=0.0))
    with pytest.raises(ValueError, match="not known"):
        clipping.get("nope")


@pytest.mark.parametrize("mode", ["ghost", "hooks"])
def test_virtual_batching_accumulates_the_same_clipped_sum(mode):
    """A logical batch split into physical batches (as the trainer does) gives the one-pass private sum."""
    from dpllm.data import TokenizedRecords, make_collate

    def run(split):
        model, tok = tiny_model("tiny-llama", "lora")
        dataset = TokenizedRecords(TEXTS, tok, 48)
        n = len(dataset)
        plan = PrivacyPlan(num_records=n, sample_rate=1.0, steps=1, noise_multiplier=0.0, delta=1e-5,
                           accountant="rdp", expected_batch_size=n)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        collate = make_collate(tok.pad_token_id)
        pt = make_private(model=model, optimizer=opt, dataset=dataset, collate_fn=collate,
                          cfg=PrivacyConfig(max_grad_norm=0.5, grad_sample_mode=mode), plan=plan,
                          logical_batch_size=n)
        parts = [list(range(0, split)), list(range(split, n))] if split else [list(range(n))]
        for i, part in enumerate(parts):
            pt.optimizer.signal_skip_step(do_skip=i < len(parts) - 1)
            pt.optimizer.zero_grad()
            forward_loss(pt.model, collate([dataset[j] for j in part]), pt.criterion).backward()
            if i < len(parts) - 1:
                pt.optimizer.step()  # skipped: clips and accumulates only
        pt.optimizer.pre_step()
        return [p.grad.detach().clone() for p in pt.optimizer.params]

    whole, split = run(None), run(2)
    for a, b in zip(whole, split):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
    assert any(a.abs().sum() > 0 for a in whole)
