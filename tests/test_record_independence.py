"""One record's input may reach only its own output: models that mix records are refused before the first step.

Toys, and what main at 888bb2b did with them (σ = 0, C = 1e-3; the norm of a change in one step's update over C):

- ``h + h.mean(0)`` and a batch-statistics norm (``F.batch_norm`` in training mode): no trainable weight mixes
  anything, yet one record moves every other record's output and so their clipped gradients. Trained in every
  mode; add/remove sensitivity 1.069 and 1.054 (bound 1; the attacker's toys 1.30–1.41);
- a model that runs its layers sequence-first ``(T, B, d)``: every engine clips one gradient per position. One
  record alone (T = 5) moved the model by 1.86 (hooks) and 933.5 (ghost), bound 1; bk refuses T ≠ B, but fed a
  batch with T = B it trained (replace-one 1.68 here, bound 2; the attacker's toy 2.35);
- a model that pools over all positions, masked ones included: a longer record pads the others and moves their
  outputs (add/remove 1.028 in every mode).

Each is now refused in every mode (``auto``, ``bk``, ``hooks``, ``ghost``) at its first forward pass with
gradients, before anything is applied (:mod:`dpllm.privacy.independence`). Stock models pass, dropout included:
Llama, GPT-2, BERT as a decoder, LoRA; the suites that train them through ``make_private`` (recipes,
``DPTrainer``, SFT, user-level, MLP, FSDP) run the same check. Figures: ``python scripts/measure_guards.py toys``.
"""

import doctest

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import CausalLMOutput

from dpllm.config import PrivacyConfig
from dpllm.models import ModelError
from dpllm.privacy.engine import PrivacyPlan, make_private

V, D, C = 13, 8, 1e-3


class Mixing(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how
        self.emb, self.lin, self.head = nn.Embedding(V, D), nn.Linear(D, D), nn.Linear(D, V)

    def forward(self, ids):
        h = torch.tanh(self.lin(self.emb(ids)))
        if self.how == "mean":
            h = h + h.mean(0)
        else:  # statistics over the batch (and positions), as nn.BatchNorm1d in training mode
            h = F.batch_norm(h.transpose(1, 2), None, None, training=True).transpose(1, 2)
        return self.head(h)


class SequenceFirst(nn.Module):
    """Each record's output depends on that record alone, but its layers see (T, B, d): rows are positions."""

    def __init__(self):
        super().__init__()
        self.emb, self.lin, self.head = nn.Embedding(V, D), nn.Linear(D, D), nn.Linear(D, V)

    def forward(self, ids):
        h = self.emb(ids.t().contiguous())  # (T, B, d)
        return self.head(torch.tanh(self.lin(h))).transpose(0, 1)


class PaddingDependent(nn.Module):
    """An HF-style causal LM that adds the mean over all positions, padded ones included."""

    def __init__(self):
        super().__init__()
        self.emb, self.lin, self.head = nn.Embedding(V, D), nn.Linear(D, D), nn.Linear(D, V)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        h = torch.tanh(self.lin(self.emb(input_ids)))
        return CausalLMOutput(logits=self.head(h + h.mean(1, keepdim=True)))


def _lm_loss(logits, ids, criterion):
    B, T = ids.shape
    flat, labels = logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1)
    return criterion(flat, labels, shape=(B, T - 1, V)) if criterion is not None else F.cross_entropy(flat, labels)


def _private(model, mode, B):
    torch.manual_seed(0)
    plan = PrivacyPlan(num_records=8, sample_rate=B / 8, steps=1, noise_multiplier=0.0, delta=1e-5, accountant="rdp",
                       expected_batch_size=B)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    return make_private(model=model, optimizer=opt, dataset=list(range(8)), collate_fn=lambda b: b,
                        cfg=PrivacyConfig(grad_sample_mode=mode, max_grad_norm=C), plan=plan, logical_batch_size=B)


def _params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()]).clone()


MODES = ["auto", "bk", "hooks", "ghost"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("make, B, T, message", [
    (lambda: Mixing("mean"), 3, 5, "one record's input changes other records' outputs"),
    (lambda: Mixing("batchnorm"), 3, 5, "one record's input changes other records' outputs"),
    (SequenceFirst, 5, 5, (r"rows are not the batch's records: for a batch of 2 records emb \(5 rows\), "
                           r"lin \(5 rows\), head \(5 rows\) see another number of rows"
                           r".*per position, not per record")),
], ids=["mean-over-batch", "batch-statistics-norm", "sequence-first-T-equals-B"])
def test_a_model_whose_records_reach_each_other_is_refused_before_the_first_step(mode, make, B, T, message):
    torch.manual_seed(0)
    model = make()
    pt = _private(model, mode, B)
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))
    before = _params(model)
    with pytest.raises(RuntimeError, match=message):
        _lm_loss(pt.model(ids), ids, pt.criterion).backward()
        pt.optimizer.step()
    assert torch.equal(_params(model), before)


@pytest.mark.parametrize("mode", MODES)
def test_outputs_that_move_with_the_batchs_padding_are_refused(mode):
    from dpllm.train import forward_loss

    torch.manual_seed(0)
    model = PaddingDependent()
    pt = _private(model, mode, 3)
    ids = torch.randint(1, V, (3, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, 4:] = 0  # a shorter record, padded
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    with pytest.raises(RuntimeError, match="change with the batch's padded length"):
        forward_loss(pt.model, batch, pt.criterion).backward()


def _gpt2_with_dropout():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=300, n_positions=64, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.1,
                     embd_pdrop=0.1, attn_pdrop=0.1)
    return GPT2LMHeadModel(cfg)


def _bert_decoder():
    from transformers import BertConfig, BertLMHeadModel

    cfg = BertConfig(vocab_size=300, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                     max_position_embeddings=64, is_decoder=True)  # dropout 0.1 by default
    return BertLMHeadModel(cfg)


@pytest.mark.parametrize("build", ["tiny-llama full", "tiny-llama lora", "gpt2 dropout", "bert decoder"])
def test_stock_models_pass_on_a_padded_batch_and_leave_the_random_state_alone(build):
    from helpers import TEXTS, batch_of, tiny_model

    from dpllm.models import byte_tokenizer, position_ids_for
    from dpllm.privacy.independence import check_record_independence

    torch.manual_seed(0)
    if build.startswith("tiny-llama"):
        model, tok = tiny_model("tiny-llama", build.split()[1])
    else:
        model, tok = (_gpt2_with_dropout() if build.startswith("gpt2") else _bert_decoder()), byte_tokenizer()
    model.train()
    batch = batch_of(tok, TEXTS[:4], max_length=32)
    assert (batch["attention_mask"] == 0).any()  # records of different lengths: padded positions
    ids = batch["input_ids"]
    state = torch.get_rng_state()
    # max_length 64: step 4 adds a record of 64 tokens (the context of GPT-2 and BERT here) to records cut to 8
    check_record_independence(model, (), {"input_ids": ids, "attention_mask": batch["attention_mask"],
                                          "position_ids": position_ids_for(ids)}, max_length=64)
    assert torch.equal(torch.get_rng_state(), state)  # training's dropout and noise draws are untouched


def test_the_check_runs_once_before_the_first_pass_with_gradients(monkeypatch):
    from dpllm.privacy import independence

    calls = []
    monkeypatch.setattr(independence, "check_record_independence", lambda *a, **k: calls.append(a))
    model = Mixing("mean")
    independence.guard_record_independence(model)
    ids = torch.randint(0, V, (3, 5))
    with torch.no_grad():
        model(ids)  # evaluation: not the batch that is checked
    model(ids)
    model(ids)
    assert len(calls) == 1 and torch.equal(calls[0][1][0], ids)


def test_doctests():
    from dpllm.privacy import independence

    assert doctest.testmod(independence, optionflags=doctest.ELLIPSIS).failed == 0


@pytest.mark.parametrize("mode", ["auto", "hooks"])
def test_dptrainer_refuses_a_stock_model_made_to_mix_records(tmp_path, mode):
    """The same check on the path a user's own Trainer script takes (``DPTrainer`` runs dpllm's Trainer stages):
    a tiny Llama whose final norm's output gets the batch mean added."""
    from datasets import Dataset
    from helpers import TEXTS, tiny_model
    from transformers import TrainingArguments

    from dpllm.hf import DPTrainer, PrivacyArguments

    model, tok = tiny_model("tiny-llama", "lora")
    model.get_base_model().model.norm.register_forward_hook(lambda m, i, o: o + o.mean(0, keepdim=True))
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    data = Dataset.from_dict({"text": [f"{t} ({i})" for i in range(4) for t in TEXTS]})
    data = data.map(lambda b: tok(b["text"], truncation=True, max_length=32), batched=True)
    trainer = DPTrainer(model=model, args=TrainingArguments(str(tmp_path / "run"), max_steps=2, report_to="none",
                                                            disable_tqdm=True, use_cpu=True,
                                                            per_device_train_batch_size=4),
                        privacy_args=PrivacyArguments(target_epsilon=8.0, logical_batch_size=8,
                                                      grad_sample_mode=mode),
                        train_dataset=data, processing_class=tok)
    # a ModelError (ValueError): bad input, which the commands print as one line saying what to change
    with pytest.raises(ModelError, match="one record's input changes other records' outputs"):
        trainer.train()
    assert all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters() if p.requires_grad)
