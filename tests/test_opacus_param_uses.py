"""Opacus modes refuse a trainable weight used outside its own layer, at the first forward pass with gradients.

Opacus computes per-record gradients (hooks) or norms (ghost) from each layer's own forward call; a weight
also used elsewhere gets that use's gradient from plain autograd. Under ghost it is scaled by a coefficient
that never saw it, so one record moves the model by more than C (1.03 × C on the toy below with
C = 1e-3, σ = 0; 5.13 × C on the attacker's read's toy); under hooks it is dropped. On 6150ffb both trained
silently; bk refuses the same models at its first backward pass (tests/test_bk_refusals.py).
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpllm.config import PrivacyConfig
from dpllm.privacy.engine import PrivacyPlan, make_private
from dpllm.privacy.owners import guard_parameter_uses

V, D = 13, 8


class TiedClassifier(nn.Module):
    """Class scores from the embedding's own weight: ``F.linear(h, emb.weight)``."""

    def __init__(self):
        super().__init__()
        self.emb, self.body = nn.Embedding(V, D), nn.Linear(D, D)

    def forward(self, ids):
        return F.linear(torch.tanh(self.body(self.emb(ids))).mean(1), self.emb.weight)


class Transposed(nn.Module):
    """A Linear called as a layer, and its weight read again through ``.T`` in the parent."""

    def __init__(self):
        super().__init__()
        self.emb, self.lin, self.head = nn.Embedding(V, D), nn.Linear(D, D), nn.Linear(D, V)

    def forward(self, ids):
        h = torch.tanh(self.lin(self.emb(ids)))
        return self.head(torch.tanh(h @ self.lin.weight.T).mean(1))


class Clean(nn.Module):
    """Every weight used only by its own layer; the parent reads weights' metadata and a detached copy."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)

    def forward(self, ids):
        h = self.emb(ids).to(self.head.weight.dtype)  # p.dtype: metadata, no gradient
        scale = self.head.weight.detach().abs().mean()  # a detached read carries no gradient back
        return self.head(torch.tanh(h).mean(1)) * (1.0 + 0 * scale)


def _private(model, mode):
    torch.manual_seed(0)
    plan = PrivacyPlan(num_records=4, sample_rate=0.5, steps=2, noise_multiplier=1.0, delta=1e-5, accountant="rdp",
                       expected_batch_size=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [(torch.randint(0, V, (5,)), torch.tensor(i % V)) for i in range(4)]
    return make_private(model=model, optimizer=opt, dataset=data, collate_fn=lambda b: b,
                        cfg=PrivacyConfig(grad_sample_mode=mode), plan=plan, logical_batch_size=2)


def _step(pt, ids, y):
    out = pt.model(ids)
    loss = pt.criterion(out, y) if pt.criterion is not None else F.cross_entropy(out, y)
    loss.backward()
    pt.optimizer.step()
    pt.optimizer.zero_grad()


IDS, Y = torch.randint(0, V, (3, 5), generator=torch.Generator().manual_seed(1)), torch.tensor([1, 2, 3])


@pytest.mark.parametrize("mode", ["ghost", "hooks"])
@pytest.mark.parametrize("make, name, where", [(TiedClassifier, "emb.weight", "TiedClassifier"),
                                               (Transposed, "lin.weight", "Transposed")])
def test_a_weight_used_outside_its_layer_is_refused_before_any_step(mode, make, name, where):
    model = make()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    pt = _private(model, mode)
    with pytest.raises(RuntimeError, match=rf"used outside its own layer: {name} \(in {where}\)\. Opacus's "
                                           rf"grad_sample_mode {mode}.*call the layer that owns it"):
        _step(pt, IDS, Y)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing was trained


@pytest.mark.parametrize("mode", ["ghost", "hooks"])
def test_a_clean_model_trains_and_the_guard_leaves_after_one_pass(mode):
    model = Clean()
    def count():  # this guard's hooks (the per-step guard of dpllm.privacy.paths stays: it checks every step)
        hooks = [h for m in model.modules() for h in (*m._forward_pre_hooks.values(), *m._forward_hooks.values())]
        return sum("guard_parameter_uses" in getattr(h, "__qualname__", "") for h in hooks)

    pt = _private(model, mode)
    assert count() == 2 * len(list(model.modules()))  # two per module
    with torch.no_grad():
        pt.model(IDS)  # an evaluation first: not the pass that is checked
    assert count() == 2 * len(list(model.modules()))
    _step(pt, IDS, Y)
    _step(pt, IDS, Y)
    assert count() == 0  # the guard left after its one check
    assert pt.engine.accountant.history[-1][2] == 2  # both steps were taken


def test_a_forward_pass_without_gradients_is_not_checked_and_the_next_one_is():
    model = TiedClassifier()
    guard_parameter_uses(model, "hooks")
    with torch.no_grad():
        model(IDS)  # no gradient can flow: nothing to refuse yet
    with pytest.raises(RuntimeError, match="emb.weight"):
        model(IDS)
    model(IDS)  # the guard removed itself with its one check
