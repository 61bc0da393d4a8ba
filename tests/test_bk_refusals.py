"""Book-keeping refuses the parameter uses and layouts it cannot clip, instead of training with them.

Each custom model below is one that ``auto`` routes to bk (every trainable layer has a rule) but whose
gradient bk cannot clip per record. On 061ec7a each trained silently: a weight used outside its layer got
autograd's raw gradient with bk's clipped sum added to it (one record's contribution measured 75,223 × C
and 9,887 × C), and sequence-first or flattened layouts gave one norm per position (3.68 × C). The
batch-first control shows the refusals are not blanket ones: the same function, laid out batch-first,
trains with norms equal to a per-example autograd loop.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpllm.privacy.bk import BookKeepingModule
from dpllm.privacy.modes import resolve_mode

V, D, B, T = 13, 8, 3, 5


def _clip(n):
    return 1.0 / (n + 0.1)


class TiedHead(nn.Module):
    """Logits from the input embedding's weight, used directly: ``F.linear(h, emb.weight)``."""

    def __init__(self):
        super().__init__()
        self.emb, self.body = nn.Embedding(V, D), nn.Linear(D, D)

    def forward(self, ids):
        return F.linear(torch.tanh(self.body(self.emb(ids))), self.emb.weight)


class RawWeight(nn.Module):
    """A Linear called as a layer and its weight used again directly: ``h @ lin.weight.T``."""

    def __init__(self, also_called=True):
        super().__init__()
        self.also_called = also_called
        self.emb, self.lin, self.head = nn.Embedding(V, D), nn.Linear(D, D), nn.Linear(D, V)

    def forward(self, ids):
        h = self.emb(ids)
        if self.also_called:
            h = torch.tanh(self.lin(h))
        return self.head(torch.tanh(h @ self.lin.weight.T))


class MLP(nn.Module):
    """Two Linear layers over (B, T, D) features, laid out batch-first, sequence-first or flattened."""

    def __init__(self, layout):
        super().__init__()
        self.layout = layout
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, 2)

    def forward(self, x):
        f = lambda h: self.b(torch.tanh(self.a(h)))  # noqa: E731
        if self.layout == "sequence-first":  # (T, B, d), as nn.Transformer with batch_first=False
            return f(x.transpose(0, 1)).transpose(0, 1)
        if self.layout == "flattened":  # (B·T, d)
            return f(x.reshape(-1, D)).view(x.shape[0], x.shape[1], -1)
        return f(x)


def _record_losses(out):
    return out.float().pow(2).flatten(1).mean(1) if out.dim() > 2 else out.pow(2).mean(1)


def _lm_loss(logits, ids):
    return F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))


@pytest.mark.parametrize("make, name", [(TiedHead, "emb.weight"), (RawWeight, "lin.weight"),
                                        (lambda: RawWeight(also_called=False), "lin.weight")])
def test_a_weight_used_outside_its_layer_is_refused(make, name):
    torch.manual_seed(0)
    model = make().double()
    assert resolve_mode("auto", model) == "bk"  # every trainable layer has a rule: only the run can tell
    bk = BookKeepingModule(model, clip_weights=_clip)
    ids = torch.randint(0, V, (B, T))
    with pytest.raises(RuntimeError, match=rf"parameter {name} got a gradient from a use outside its own layer.*"
                                           r"Call the layer itself"):
        _lm_loss(bk(ids), ids).backward()
    assert dict(model.named_parameters())[name].grad is None  # the raw gradient never reached p.grad
    # once detached, the model is plain again: autograd's own gradient, no hook in the way
    bk.detach()
    _lm_loss(model(ids), ids).backward()
    assert dict(model.named_parameters())[name].grad is not None


@pytest.mark.parametrize("layout", ["sequence-first", "flattened"])
def test_layers_whose_rows_are_not_the_records_are_refused(layout):
    torch.manual_seed(0)
    model = MLP(layout).double()
    x = torch.randn(B, T, D, dtype=torch.float64)
    reference = MLP("batch-first").double()
    reference.load_state_dict(model.state_dict())
    torch.testing.assert_close(model(x), reference(x))  # the same function, laid out differently
    bk = BookKeepingModule(model, clip_weights=_clip)
    with pytest.raises(RuntimeError, match=rf"a batch of {B} records, but the trainable layers saw rows "
                                           r"\(Linear: \d+\).*one norm per position.*batch-first"):
        _record_losses(bk(x)).mean().backward()
    assert all(p.grad is None for p in model.parameters())  # nothing was written


def test_batch_first_control_norms_equal_a_per_example_loop():
    torch.manual_seed(0)
    model = MLP("batch-first").double()
    x = torch.randn(B, T, D, dtype=torch.float64)
    per_example = []
    for i in range(B):
        grads = torch.autograd.grad(_record_losses(model(x[i: i + 1])).sum(), list(model.parameters()))
        per_example.append(torch.sqrt(sum(g.pow(2).sum() for g in grads)))
    bk = BookKeepingModule(model, clip_weights=_clip)
    _record_losses(bk(x)).mean().backward()
    torch.testing.assert_close(bk.last_norms, torch.stack(per_example))


def test_chunked_loss_tells_bk_the_records_it_bypasses():
    """The chunked loss calls the decoder directly, so bk's forward never sees the batch: it names the rows."""
    from dpllm.models import position_ids_for
    from dpllm.privacy.bk.loss import causal_lm_chunked_loss
    from tests.helpers import batch_of, tiny_model

    model, tok = tiny_model("tiny-llama", "lora")
    bk = BookKeepingModule(model.double(), clip_weights=_clip)
    batch = batch_of(tok)
    bk.expect_rows(1)  # stale from elsewhere: the loss must replace it with the batch's own count
    causal_lm_chunked_loss(bk, batch, position_ids_for(batch["input_ids"]), chunk_tokens=7).backward()
    assert bk.last_norms.shape == (len(batch["input_ids"]),)



def test_a_gradient_left_from_before_wrapping_never_joins_the_clipped_sum(caplog):
    torch.manual_seed(0)
    model = MLP("batch-first").double()
    x = torch.randn(B, T, D, dtype=torch.float64)
    _record_losses(model(x)).mean().backward()  # a plain backward pass: raw, unclipped gradients
    bk = BookKeepingModule(model, clip_weights=lambda n: torch.zeros_like(n))  # clip everything to zero
    assert "dropped the gradients that 4 trainable parameters (a.weight, a.bias, b.weight...)" in caplog.text
    _record_losses(bk(x)).mean().backward()
    assert all(float(p.grad.abs().max()) == 0.0 for p in model.parameters())  # only the (zero) clipped sum
