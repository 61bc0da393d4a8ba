"""Book-keeping clipping under gradient checkpointing (reentrant or not); the chunked loss is in test_bk_vocab.py.

Layers run twice (forward, then recomputation in backward) but record once: activations are read from
the autograd function's saved tensors in backward, which checkpointing fills by recomputing them. The
clipped sum and the per-sample norms must equal those of the same step without checkpointing.

Reentrant checkpointing differentiates each segment in a backward pass of its own, nested in the outer
one; bk must still clip once, at the end of the outer pass (on 061ec7a a LoRA model's one record came out
at √2·C: each of its two segments was clipped to C), or refuse where it cannot.
"""

import pytest
import torch

from dpllm.models import activation_checkpointing
from dpllm.privacy.bk import BookKeepingModule
from dpllm.train import forward_loss
from tests.helpers import TEXTS, batch_of, tiny_model


def bk_step(kind, finetuning, checkpointing, *, reentrant=False, texts=TEXTS, clip_weights=None):
    model, tok = tiny_model(kind, finetuning)
    model = model.double()
    if checkpointing:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        assert base.is_gradient_checkpointing
        assert activation_checkpointing(model) == ("reentrant" if reentrant else "non-reentrant")
    model.train()
    bk = BookKeepingModule(model, clip_weights=clip_weights or (lambda n: 1.0 / (n + 0.1)))
    forward_loss(bk, batch_of(tok, texts)).backward()
    return bk.last_norms, [p.grad for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("kind, finetuning", [("tiny-llama", "full"), ("tiny-llama", "lora"), ("tiny-gpt2", "full")])
def test_checkpointing_records_once_and_matches(kind, finetuning, reentrant):
    norms, grads = bk_step(kind, finetuning, checkpointing=False)
    norms_ckpt, grads_ckpt = bk_step(kind, finetuning, checkpointing=True, reentrant=reentrant)
    torch.testing.assert_close(norms_ckpt, norms)  # recording twice would double explicit sums
    for a, b in zip(grads_ckpt, grads):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("reentrant", [None, False, True])
@pytest.mark.parametrize("finetuning", ["full", "lora"])
def test_one_record_is_clipped_to_exactly_C(finetuning, reentrant):
    """B = 1, no noise, C below the raw norm: the gradient bk leaves is the record's, scaled to norm C."""
    C = 1e-3
    flat = lambda n: (C / n).clamp(max=1.0)  # noqa: E731
    raw, _ = bk_step("tiny-llama", finetuning, checkpointing=False, texts=TEXTS[:1], clip_weights=flat)
    norms, grads = bk_step("tiny-llama", finetuning, checkpointing=reentrant is not None,
                           reentrant=bool(reentrant), texts=TEXTS[:1], clip_weights=flat)
    assert float(raw) > 100 * C  # the clipping is active
    torch.testing.assert_close(norms, raw)
    total = torch.sqrt(sum(g.pow(2).sum() for g in grads))
    assert float(total) == pytest.approx(C, rel=1e-6)


class _OwnBackward(torch.autograd.Function):
    """Runs ``inner`` on a graph of its own, built in forward, and differentiates it by a backward pass
    called from inside this node's backward: a nested pass whose graph was not built during a backward."""

    @staticmethod
    def forward(ctx, x, inner):
        with torch.enable_grad():
            xd = x.detach().requires_grad_()
            ctx.xd, ctx.out = xd, inner(xd)
        return ctx.out.detach()

    @staticmethod
    def backward(ctx, g):
        torch.autograd.backward(ctx.out, g)
        return ctx.xd.grad, None


class _Detour(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return _OwnBackward.apply(x, self.inner)


@pytest.mark.parametrize("head_trainable", [False, True])
def test_clipping_at_the_end_of_a_nested_pass_is_refused_or_deferred(head_trainable):
    """With a trainable layer in the outer pass, bk clips once at its end (norms equal the plain model's);
    with none, the only bk layer is differentiated by a nested pass and bk refuses, naming the fix."""
    torch.manual_seed(0)
    body, head = torch.nn.Linear(4, 4).double(), torch.nn.Linear(4, 1).double()
    head.requires_grad_(head_trainable)
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)  # a frozen head still passes gradients
    ref = BookKeepingModule(torch.nn.Sequential(body, head), clip_weights=lambda n: 1.0 / (n + 0.1))
    ref(x).pow(2).mean().backward()
    expected = (ref.last_norms.clone(), body.weight.grad.clone())
    ref.detach()
    body.zero_grad(set_to_none=True)
    head.zero_grad(set_to_none=True)
    bk = BookKeepingModule(torch.nn.Sequential(_Detour(body), head), clip_weights=lambda n: 1.0 / (n + 0.1))
    if head_trainable:
        bk(x).pow(2).mean().backward()
        torch.testing.assert_close(bk.last_norms, expected[0])
        torch.testing.assert_close(body.weight.grad, expected[1])
    else:
        with pytest.raises(RuntimeError, match="runs inside another one.*use_reentrant': False"):
            bk(x).pow(2).mean().backward()
        assert body.weight.grad is None  # nothing was clipped or written


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


def _dptrainer_step(out, *, checkpointing, grad_sample_mode="bk"):
    """One DPTrainer step (SGD, lr 1, reproducible batch and noise) of a LoRA model; the parameter change.

    The batch and noise derive from the seed and the run's config, which names the output directory's
    records file: runs to compare use the same directory.
    """
    from datasets import Dataset
    from transformers import TrainingArguments

    from dpllm.hf import DPTrainer, PrivacyArguments

    model, tok = tiny_model("tiny-llama", "lora")
    if checkpointing:  # the user's own call, as peft's prepare_model_for_kbit_training makes it
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        assert activation_checkpointing(model) == "reentrant"
    texts = [f"{t} (record {i})" for i in range(4) for t in TEXTS]
    ds = Dataset.from_dict({"text": texts}).map(lambda b: tok(b["text"], truncation=True, max_length=48), batched=True)
    args = TrainingArguments(output_dir=str(out), max_grad_norm=0.0, report_to="none", disable_tqdm=True,
                             use_cpu=True, max_steps=1, optim="sgd", learning_rate=1.0, lr_scheduler_type="constant",
                             per_device_train_batch_size=4, seed=3, gradient_checkpointing=False)
    privacy = PrivacyArguments(target_epsilon=None, noise_multiplier=0.7, per_sample_max_grad_norm=0.1,
                               logical_batch_size=8, reproducible_noise=True, grad_sample_mode=grad_sample_mode,
                               overwrite_output_dir=True)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    trainer = DPTrainer(model=model, args=args, privacy_args=privacy, train_dataset=ds, processing_class=tok)
    trainer.train()
    assert trainer.privacy_report.grad_sample_mode == grad_sample_mode
    return torch.cat([(p.detach() - before[n]).flatten() for n, p in model.named_parameters() if n in before])


def test_dptrainer_with_reentrant_checkpointing_turned_on_in_the_model(tmp_path):
    """The issue's path: the model's own reentrant checkpointing, TrainingArguments.gradient_checkpointing=False.

    Same batch and noise, C = 0.1 below every record's norm: the update equals the update without
    checkpointing (on 061ec7a each of the two segments was clipped to C separately: the updates differed).
    """
    plain = _dptrainer_step(tmp_path / "run", checkpointing=False)
    ckpt = _dptrainer_step(tmp_path / "run", checkpointing=True)
    assert plain.norm() > 1e-3
    torch.testing.assert_close(ckpt, plain, rtol=1e-5, atol=1e-6)


def test_dptrainer_refuses_model_checkpointing_under_opacus_modes(tmp_path):
    from dpllm.models import ModelError

    with pytest.raises(ModelError, match="reentrant gradient checkpointing enabled.*grad_sample_mode: bk"):
        _dptrainer_step(tmp_path / "ghost", checkpointing=True, grad_sample_mode="ghost")
    assert not any((tmp_path / "ghost").rglob("*"))  # refused before anything was written


@pytest.mark.parametrize("mode, reentrant", [("ghost", False), ("hooks", True), ("bk", True)])
def test_make_private_reads_checkpointing_from_the_model(mode, reentrant):
    """The library path: whoever turned checkpointing on, make_private refuses it outside bk."""
    from dpllm.config import PrivacyConfig
    from dpllm.data import TokenizedRecords, make_collate
    from dpllm.models import ModelError
    from dpllm.privacy.engine import make_private
    from dpllm.privacy.plan import plan_privacy

    model, tok = tiny_model("tiny-llama", "lora")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    cfg = PrivacyConfig(target_epsilon=None, noise_multiplier=1.0, grad_sample_mode=mode)
    plan = plan_privacy(num_records=len(TEXTS), logical_batch_size=2, steps=1, target_epsilon=None, delta=1e-5,
                        accountant="prv", noise_multiplier=1.0)
    kw = dict(model=model.train(), optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1),
              dataset=TokenizedRecords(TEXTS, tok, 48), collate_fn=make_collate(tok.pad_token_id), cfg=cfg, plan=plan,
              logical_batch_size=2)
    if mode != "bk":
        kind = "reentrant" if reentrant else "non-reentrant"
        with pytest.raises(ModelError, match=f"has {kind} gradient checkpointing enabled.*grad_sample_mode: {mode}"):
            make_private(**kw)
    else:
        assert make_private(**kw).grad_sample_mode == "bk"
