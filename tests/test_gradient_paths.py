"""No gradient reaches a trainable parameter around its clipping, on any step, in any mode ``auto`` can pick.

The attacker's toys (batch 1, σ = 0, C = 1e-3; figures are the norm of one step's update over C, bound 1):

- a view of a weight made before training and used by another layer (``Other(lin.weight.T)``);
- a copy made inside the owner's own call (a forward hook on ``lin`` computes ``W * 1.0``) used by another layer,
  alone and beside a layer bk has no rule for (GroupNorm) with hooks' per-sample gradients "too large", so that
  ``auto`` picks Opacus ghost;
- a tied use that first appears at step 2 (``F.linear(h, emb.weight)``), and the same with the weight reaching the
  other use through the autocast cast cached in its own layer's call.

On main at 888bb2b (owners.py watched the first forward pass only, by identity) ghost trained all of them:
95.0 × C (view), 95.0 × C (hook copy), 51.9 × C (hook copy, ``auto`` → ghost), step 1 1.00 then 58.2 × C (late
tie), step 1 1.00 then 57.8 × C (late use of the cached cast); hooks dropped each path silently (1.00).
Now hooks and ghost refuse at the backward pass where the path first carries a gradient
(:mod:`dpllm.privacy.paths`), before anything is applied; bk refuses them as before. Models that use each weight
only through its layer (with autocast, a layer called twice, LoRA, GPT-2's Conv1D, which Opacus runs through a
deep copy) train as before.
"""

import doctest

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpllm.config import PrivacyConfig
from dpllm.privacy.engine import PrivacyPlan, make_private

V, D, C = 13, 8, 1e-3
P = torch.randn(D, V, generator=torch.Generator().manual_seed(5))  # a fixed projection to the class scores


def big(ids):
    """A large input that carries no gradient, so a path through it reaches the weight at full strength."""
    return 50.0 * F.one_hot(ids % D, D).float()


class Other(nn.Module):
    """A parameter-free layer multiplying by a tensor it was given."""

    def __init__(self, w):
        super().__init__()
        self.w = w

    def forward(self, h):
        return h @ self.w


class ViewBeforeTraining(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.lin, self.head = nn.Embedding(V, D), nn.Linear(D, D), nn.Linear(D, V)
        self.other = Other(self.lin.weight.T)  # a view made at construction: never seen inside lin's own call

    def forward(self, ids):
        h = torch.tanh(self.lin(self.emb(ids)))
        return self.head(torch.tanh(self.other(h)).mean(1)) + self.other(big(ids)).mean(1) @ P


class HookCopy(nn.Module):
    def __init__(self, groupnorm=False):
        super().__init__()
        self.emb, self.lin, self.head = nn.Embedding(V, D), nn.Linear(D, D), nn.Linear(D, V)
        self.norm = nn.GroupNorm(2, D) if groupnorm else None  # bk has no rule for it: auto picks an Opacus mode
        self.lin.register_forward_hook(lambda m, i, o: setattr(m, "copy", m.weight * 1.0))  # inside lin's call

    def forward(self, ids):
        h = torch.tanh(self.lin(self.emb(ids)))
        extra = (big(ids) @ self.lin.copy.T).mean(1) @ P
        h = torch.tanh(h @ self.lin.copy.T)
        if self.norm is not None:
            h = self.norm(h.transpose(1, 2)).transpose(1, 2)
        return self.head(h.mean(1)) + extra


class LateTie(nn.Module):
    """From the second call on, the class scores also read a weight directly (``owner`` chooses which)."""

    def __init__(self, owner="emb"):
        super().__init__()
        self.emb, self.body, self.head = nn.Embedding(V, D), nn.Linear(D, D), nn.Linear(D, V)
        self.owner, self.calls = owner, 0

    def forward(self, ids):
        self.calls += torch.is_grad_enabled()  # training passes only (the independence check runs without)
        h = torch.tanh(self.body(self.emb(ids))).mean(1)
        out = self.head(h)
        if self.calls >= 2:
            w = self.emb.weight if self.owner == "emb" else self.head.weight  # head's: its cached autocast cast
            out = out + F.linear(big(ids).mean(1) @ P[:, :D], w)
        return out


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)  # the same initial weights on every run (and the figures in the docstring)


def _private(model, mode, physical_batch_size=None):
    torch.manual_seed(0)
    plan = PrivacyPlan(num_records=4, sample_rate=0.25, steps=3, noise_multiplier=0.0, delta=1e-5, accountant="rdp",
                       expected_batch_size=1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    data = [(torch.randint(0, V, (5,)), torch.tensor(i % V)) for i in range(4)]
    return make_private(model=model, optimizer=opt, dataset=data, collate_fn=lambda b: b,
                        cfg=PrivacyConfig(grad_sample_mode=mode, max_grad_norm=C), plan=plan, logical_batch_size=1,
                        physical_batch_size=physical_batch_size)


IDS, Y = torch.randint(0, V, (1, 5), generator=torch.Generator().manual_seed(1)), torch.tensor([3])


def _params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()]).clone()


def _step(pt, autocast=False):
    """One step on one record; returns ‖update‖ / C (lr 1, σ 0, expected batch 1: the update is the clipped sum)."""
    model = pt.model
    before = _params(model)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(IDS)
    loss = pt.criterion(out.float(), Y) if pt.criterion is not None else F.cross_entropy(out.float(), Y)
    loss.backward()
    pt.optimizer.step()
    pt.optimizer.zero_grad()
    return float((_params(model) - before).norm()) / C


REFUSED = r"(outside its own layer|through a path outside its own layer's forward call)"


@pytest.mark.parametrize("mode", ["auto", "bk", "hooks", "ghost"])
@pytest.mark.parametrize("make", [ViewBeforeTraining, HookCopy], ids=["view-before-training", "hook-copy"])
def test_a_path_around_the_layer_is_refused_before_anything_is_applied(mode, make):
    model = make()
    pt = _private(model, mode)
    before = _params(model)
    with pytest.raises(RuntimeError, match=REFUSED):
        _step(pt)
    assert torch.equal(_params(model), before)
    if mode in ("hooks", "ghost"):  # the guard stays refused: nothing more trains with this model
        with pytest.raises(RuntimeError, match="an earlier backward pass was refused"):
            _step(pt)


@pytest.mark.parametrize("mode", ["auto", "hooks", "ghost"])
def test_auto_picking_ghost_for_a_layer_bk_cannot_run_refuses_the_hook_copy(mode):
    model = HookCopy(groupnorm=True)
    # hooks' per-sample gradients "would not fit": auto picks ghost, as for a large model under full fine-tuning
    pt = _private(model, mode, physical_batch_size=10**15)
    assert pt.grad_sample_mode == ("ghost" if mode == "auto" else mode)
    before = _params(model)
    with pytest.raises(RuntimeError, match=r"lin\.weight got a gradient through a path outside"):
        _step(pt)
    assert torch.equal(_params(model), before)


@pytest.mark.parametrize("mode", ["auto", "bk", "hooks", "ghost"])
@pytest.mark.parametrize("owner, autocast", [("emb", False), ("head", True)], ids=["tied-emb", "cached-cast"])
def test_a_path_that_appears_at_step_two_is_refused_at_step_two(mode, owner, autocast):
    model = LateTie(owner)
    pt = _private(model, mode)
    # step 1: no extra path, one record moves the model by at most C (to float32 rounding; to bf16's 2⁻⁸ relative
    # rounding of the per-sample gradients under autocast)
    assert _step(pt, autocast) <= 1 + (1e-2 if autocast else 1e-5)
    before = _params(model)
    with pytest.raises(RuntimeError, match=rf"{owner}\.weight"):
        _step(pt, autocast)
    assert torch.equal(_params(model), before)  # step 2 applied nothing


class Layers(nn.Module):
    """Each weight used through its own layer only; ``twice``: one layer called twice (hooks sums both calls;
    Opacus's ghost refuses a layer called twice as parameter tying)."""

    def __init__(self, twice=False):
        super().__init__()
        self.emb, self.lin, self.head = nn.Embedding(V, D), nn.Linear(D, D), nn.Linear(D, V)
        self.twice = twice

    def forward(self, ids):
        h = torch.tanh(self.lin(self.emb(ids)))
        return self.head(torch.tanh(self.lin(h) if self.twice else h).mean(1))


@pytest.mark.parametrize("mode, twice", [("hooks", True), ("hooks", False), ("ghost", False)])
@pytest.mark.parametrize("autocast", [False, True])
def test_models_that_use_weights_only_through_their_layers_train_every_step(mode, twice, autocast):
    pt = _private(Layers(twice), mode)
    for _ in range(3):
        assert 0 < _step(pt, autocast) <= 1 + (1e-2 if autocast else 1e-5)  # as at step 1 above


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
@pytest.mark.parametrize("kind, finetuning", [("tiny-gpt2", "full"), ("tiny-llama", "lora")])
def test_stock_causal_lms_train_under_autocast(mode, kind, finetuning):
    """GPT-2's Conv1D runs through Opacus's functorch copy; LoRA's layers sit inside peft's; casts are cached."""
    from helpers import batch_of, tiny_model

    from dpllm.data import make_collate
    from dpllm.train import forward_loss

    model, tok = tiny_model(kind, finetuning)
    batch = batch_of(tok)
    n = batch["input_ids"].shape[0]
    plan = PrivacyPlan(num_records=n, sample_rate=1.0, steps=2, noise_multiplier=0.0, delta=1e-5, accountant="rdp",
                       expected_batch_size=n)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    pt = make_private(model=model, optimizer=opt, dataset=list(range(n)), collate_fn=make_collate(tok.pad_token_id),
                      cfg=PrivacyConfig(grad_sample_mode=mode), plan=plan, logical_batch_size=n)
    for _ in range(2):
        before = _params(model)
        loss = forward_loss(pt.model, batch, pt.criterion, lambda: torch.autocast("cpu", dtype=torch.bfloat16))
        loss.backward()
        pt.optimizer.step()
        pt.optimizer.zero_grad()
        assert not torch.equal(_params(model), before)


def test_a_zero_contribution_is_not_a_path_and_removing_the_guard_frees_the_model():
    from dpllm.privacy.paths import guard_gradient_paths

    model = ViewBeforeTraining()
    guard = guard_gradient_paths(model, "ghost")
    (model(IDS) * 0).sum().backward()  # every path carries exactly zero: nothing escapes clipping
    model.zero_grad()
    with pytest.raises(RuntimeError, match=r"lin\.weight"):
        model(IDS).sum().backward()
    assert all(p.grad is None for p in model.parameters())  # what this pass had accumulated was dropped
    guard.remove()
    model(IDS).sum().backward()  # a plain model again
    assert model.lin.weight.grad is not None


def test_doctests():
    from dpllm.privacy import paths

    assert doctest.testmod(paths, optionflags=doctest.ELLIPSIS).failed == 0


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_the_model_handed_back_after_private_training_is_plain_again(mode):
    """``DPTrainer`` hands ``trainer.model`` back through ``release``: the guard leaves with Opacus's hooks, so a
    later non-private use of the model (a tied head, say) is the user's business again."""
    from dpllm.hf.trainer import release

    model = LateTie("emb")
    pt = _private(model, mode)
    _step(pt)
    assert release(pt.model) is model
    assert not any(p._backward_hooks for p in model.parameters())
    model.calls = 5  # the tied use now runs, without DP
    F.cross_entropy(model(IDS), Y).backward()
    assert model.emb.weight.grad is not None
