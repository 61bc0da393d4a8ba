"""Packed rows (data.packing: true): each record inside a packed row is computed, and clipped, as if alone.

Everything in float64 on CPU (packed_sequence_loss keeps float64 logits in float64) except Llama's RMSNorm,
which normalises in float32 whatever the input: a packed row and a row alone sum in different orders, and
the float32 rounding turns their 1e-16 differences into ~1e-8 relative ones. Hence 1e-6 of scale (as
test_bk_equivalence), while a record that saw another (no mask, shared positions) moves by 1e-3 or more. The
reference is explicit autograd on one record at a time, unpacked: its own row, no padding, no other record.
"""

import copy

import pytest
import torch

from dpllm.config import PrivacyConfig
from dpllm.packing import attention_of, block_causal_mask, collate_packed, packed_forward_loss, plan_batches
from dpllm.privacy import clipping
from tests.helpers import TEXTS, batch_of, tiny_model
from tests.test_bk_equivalence import f64_model, make_bk

CASES = [(kind, ft) for kind in ("tiny-gpt2", "tiny-llama") for ft in ("full", "lora")]


def pieces_of(tok, texts=TEXTS):
    return [torch.tensor(x) for x in tok(list(texts), truncation=True, max_length=48)["input_ids"]]


def alone_grads(model, tok):
    """Each record's own gradient of its mean next-token loss, by autograd on that record alone."""
    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    for x in pieces_of(tok):
        model.zero_grad()
        one = collate_packed([[x]], pad_token_id=tok.pad_token_id)
        packed_forward_loss(model, one).backward()
        out.append([p.grad.detach().clone() for p in params])
    return out


def close(got, expected, rel=1e-6):
    err = (got - expected).abs().max()
    assert err <= rel * expected.abs().max() + 1e-15, (err, expected.abs().max())


def packed_batch(tok, texts=TEXTS, row_length=96):
    """TEXTS as batch_of cuts them (48 tokens), packed into rows of ``row_length``."""
    pieces = pieces_of(tok, texts)
    (rows,) = plan_batches([len(x) for x in pieces], max_length=row_length, rows_per_batch=len(pieces))
    assert len(rows) < len(pieces)  # several records share a row
    order = [i for row in rows for i in row]  # the records in segment order
    return collate_packed([[pieces[i] for i in row] for row in rows], pad_token_id=tok.pad_token_id), order


@pytest.mark.parametrize("kind, attn", [("tiny-gpt2", "sdpa"), ("tiny-llama", "sdpa"), ("tiny-llama", "eager")])
def test_record_logits_inside_a_packed_row_equal_its_logits_alone(kind, attn):
    model, tok = f64_model(kind, "full", dp=False)
    model.set_attn_implementation(attn)
    model.eval()
    impl, mask_dtype = attention_of(model)
    assert impl == attn and mask_dtype == (torch.float64 if attn == "eager" else None)
    batch, order = packed_batch(tok)
    mask = block_causal_mask(batch["segments"], mask_dtype)
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=batch["position_ids"]).logits
        alone = batch_of(tok)
        ref = model(input_ids=alone["input_ids"], attention_mask=alone["attention_mask"]).logits
    seg = batch["segments"]
    for s, r in enumerate(order):
        n = int(alone["attention_mask"][r].sum())
        got = packed[seg == s]
        assert got.shape[0] == n
        torch.testing.assert_close(got, ref[r, :n], rtol=1e-6, atol=1e-9)
    # the mask matters: without it the later records of a row see the earlier ones
    with torch.no_grad():
        mixed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    assert (mixed[seg == 1] - ref[order[1], : int((seg == 1).sum())]).abs().max() > 1e-3


@pytest.mark.parametrize("kind, finetuning", CASES)
@pytest.mark.parametrize("policy, width", [("ghost", None), ("explicit", None), ("ghost", 16), ("explicit", 16)])
def test_packed_clipped_sum_matches_explicit_per_record_clipping(kind, finetuning, policy, width, monkeypatch):
    """Width None: one sub-row per record here (the chosen width); 16: every record folded over several sub-rows."""
    from dpllm.privacy.bk.layers import Segments

    if width:
        monkeypatch.setattr(Segments, "choose_width", classmethod(lambda cls, lengths: width))
    model, tok = f64_model(kind, finetuning)
    per_record = alone_grads(copy.deepcopy(model), tok)  # one record at a time, unpacked
    norms = torch.stack([torch.sqrt(sum((g ** 2).sum() for g in gs)) for gs in per_record])
    cfg = PrivacyConfig(max_grad_norm=float(norms.median()), grad_sample_mode="bk")
    w = clipping.get("flat").weights(norms, cfg)  # C / (‖g‖ + 1e-6), at most 1
    expected = [sum(wi * gs[j] for wi, gs in zip(w, per_record)) for j in range(len(per_record[0]))]
    pt, _ = make_bk(model, tok, cfg)
    pt.model.set_policy(policy)
    batch, order = packed_batch(tok)
    pt.optimizer.zero_grad()
    pt.model.set_segments(batch["segments"])
    packed_forward_loss(pt.model, batch).backward()
    torch.testing.assert_close(pt.model.last_norms, norms[order], rtol=1e-6, atol=1e-12)
    assert int((w < 1).sum()) >= 2  # clipping bites for some records, not all
    pt.optimizer.pre_step()  # zero noise, divided by the expected batch size (records, not rows)
    got = [p.grad * len(TEXTS) for p in pt.optimizer.params]
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        close(g, e)


def test_plan_batches_keeps_records_whole_and_units_together():
    lengths = [30, 5, 64, 17, 40, 8, 8, 60, 12]
    units = [0, 1, 2, 2, 3, 4, 4, 5, 6]  # units 2 and 4 are the windows of one record each
    batches = plan_batches(lengths, max_length=64, rows_per_batch=2, units=units)
    placed = [i for b in batches for row in b for i in row]
    assert sorted(placed) == list(range(len(lengths)))  # every piece once, none cut
    assert all(len(b) <= 2 and all(sum(lengths[i] for i in row) <= 64 for row in b) for b in batches)
    where = {i: k for k, b in enumerate(batches) for row in b for i in row}
    assert where[2] == where[3] and where[5] == where[6]  # a unit's pieces in one backward pass
    assert sum(len(b) for b in batches) < len(lengths)  # records share rows
    with pytest.raises(ValueError, match="does not fit"):
        plan_batches([65], max_length=64, rows_per_batch=2)
    with pytest.raises(ValueError, match="cannot share one batch"):
        plan_batches([10, 10, 10], max_length=64, rows_per_batch=2, units=[0, 0, 0])


@pytest.mark.parametrize("width", [None, 16])
def test_split_windows_packed_are_clipped_once_per_record(width, monkeypatch):
    """long_records: split with packing: a record's windows are segments of the packed rows, one unit."""
    from dpllm.privacy.bk import BookKeepingModule
    from dpllm.privacy.bk.layers import Segments

    if width:  # each window folded over sub-rows of 16: sub-rows → window → record
        monkeypatch.setattr(Segments, "choose_width", classmethod(lambda cls, lengths: width))

    model, tok = f64_model("tiny-llama", "full")
    pieces = pieces_of(tok)
    long = torch.tensor(tok(TEXTS[1] + " " + TEXTS[3], truncation=False)["input_ids"])
    windows = [long[:40], long[40:]]  # one record of two windows
    items, unit = pieces[:3] + windows, [0, 1, 2, 3, 3]
    params = [p for p in model.parameters() if p.requires_grad]
    alone = []
    for x in items:
        model.zero_grad()
        packed_forward_loss(model, collate_packed([[x]], pad_token_id=tok.pad_token_id)).backward()
        alone.append([p.grad.detach().clone() for p in params])
    per_unit = [[sum(alone[i][j] for i in range(5) if unit[i] == u) for j in range(len(params))] for u in range(4)]
    norms = torch.stack([torch.sqrt(sum((g ** 2).sum() for g in gs)) for gs in per_unit])
    C = float(norms.median())
    weights = (C / norms).clamp(max=1.0)
    expected = [sum(w * gs[j] for w, gs in zip(weights, per_unit)) for j in range(len(params))]
    (rows,) = plan_batches([len(x) for x in items], max_length=96, rows_per_batch=5, units=unit)
    assert len(rows) < len(items)
    batch = collate_packed([[items[i] for i in row] for row in rows], pad_token_id=tok.pad_token_id)
    bk = BookKeepingModule(model, clip_weights=lambda n: (C / n).clamp(max=1.0), per_user=True)
    model.zero_grad()
    bk.set_segments(batch["segments"])
    bk.set_users([unit[i] for row in rows for i in row], reduction="sum")
    packed_forward_loss(bk, batch).backward()
    torch.testing.assert_close(bk.last_norms, norms, rtol=1e-6, atol=1e-12)
    for p, e in zip(params, expected):
        close(p.grad, e)


def _short_records(tmp_path):
    """120 text records: most short (13–31 byte tokens, several to a row of 64), every fifth ~100 tokens."""
    import json

    path = tmp_path / "short.jsonl"
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    texts = [f"record {i}: " + " ".join(words[(i * k) % 8] for k in range(1 + i % 4)) for i in range(120)]
    texts = [t + (" and then" + t) * 3 if i % 5 == 0 else t for i, t in enumerate(texts)]  # some of ~100 tokens
    lines = [json.dumps({"text": t}) for t in texts]
    path.write_text("\n".join(lines) + "\n")
    return path


def _run(tmp_path, name, *extra):
    from dpllm.config import parse_config
    from dpllm.train import train

    out = tmp_path / name
    summary = train(parse_config([
        "--model_name_or_path", "tiny-llama", "--finetuning", "full", "--tiny_hidden_size", "32",
        "--tiny_num_layers", "1", "--dataset", str(_short_records(tmp_path)), "--min_chars", "8",
        "--max_length", "64", "--grad_sample_mode", "bk",
        "--max_steps", "3", "--logical_batch_size", "16", "--physical_batch_size", "4", "--eval_every", "0",
        "--eval_max_records", "8", "--target_delta", "1e-3", "--output_dir", str(out), "--progress", "false",
        "--reproducible_noise", "true", *extra]))
    return out, summary


def _weights(run):
    from safetensors.torch import load_file

    (path,) = (run / "checkpoint").glob("*.safetensors")
    return load_file(path)


def test_packed_run_trains_the_same_model_as_unpacked_at_the_same_epsilon_and_says_so(tmp_path, monkeypatch):
    """Same records sampled, same noise: the packed run's update is the unpacked run's, up to float rounding."""
    import dataclasses

    from dpllm import resume
    from dpllm.privacy.report import PrivacyReport

    # the stage key seeds the (reproducible) sampling and noise: give both runs the unpacked run's key, with the
    # data file's (tmp_path) name fixed, so that the records sampled are the same on every machine and every run
    key = resume.config_key
    monkeypatch.setattr(resume, "config_key", lambda cfg: key(dataclasses.replace(
        cfg, data=dataclasses.replace(cfg.data, packing=False, dataset="short.jsonl"))))
    (plain, s0), (packed, s1) = _run(tmp_path, "plain"), _run(tmp_path, "packed", "--packing", "true")
    a, b = PrivacyReport.read(plain), PrivacyReport.read(packed)
    assert (a.num_records, a.sample_rate, a.noise_multiplier, a.steps, a.history, a.epsilon, a.privacy_unit) == (
        b.num_records, b.sample_rate, b.noise_multiplier, b.steps, b.history, b.epsilon, b.privacy_unit)
    assert a.packing is None and b.packing["tokens_per_row"] == 64
    k = b.packing
    assert k["records"] > k["rows"] and k["real_tokens"] == s1["tokens_seen"] == s0["tokens_seen"]
    assert "packed into" in " ".join(b.details()) and "clipped alone" in " ".join(b.details())
    wa, wb = _weights(plain), _weights(packed)
    moved = max(float((wa[n] - wb[n]).abs().max()) for n in wa)
    assert moved < 1e-4, moved  # float32 rounding of two batchings of one sum; a wrong clip moves them ~1e-2


@pytest.mark.parametrize("extra, words", [
    (["--privacy_unit", "user"], "privacy_unit=user it is not built"),
    (["--grad_sample_mode", "hooks"], "not hooks"),
    (["--grad_sample_mode", "ghost"], "not ghost"),
    (["--clipping", "quantile"], "clipping: quantile is not built"),
    (["--noise", "banded", "--bands", "2"], "noise: banded is not built"),
])
def test_packing_refuses_what_it_cannot_do_in_one_line(extra, words):
    from dpllm.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match=words):
        parse_config(["--packing", "true", *extra])


def test_packing_refuses_a_model_bk_cannot_clip_naming_the_layer():
    from dpllm.config import ConfigError, parse_config
    from dpllm.privacy.modes import prepare_engine

    model, _ = tiny_model("tiny-llama", "full", dp=True)
    model.model.add_module("extra", torch.nn.BatchNorm1d(4))  # a trainable layer without a bk rule
    cfg = parse_config(["--packing", "true", "--grad_sample_mode", "auto"])
    with pytest.raises(ConfigError, match="BatchNorm1d.*data.packing: false"):
        prepare_engine(model, cfg, sharded=False, keep_tie=False)


def test_packing_refuses_attention_that_ignores_our_mask_and_models_that_mix_records():
    from dpllm.packing import check_records_apart
    from dpllm.privacy.paths import UnclippableModel

    model, tok = tiny_model("tiny-llama", "full", dp=False)
    batch, _ = packed_batch(tok)
    check_records_apart(model, batch)  # the block-diagonal mask keeps them apart: no error
    assert model.training  # modes restored

    class NoMask(torch.nn.Module):  # an attention path that does not read the 4-D mask
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask, position_ids):
            return self.inner(input_ids=input_ids, position_ids=position_ids)

    with pytest.raises(UnclippableModel, match="does not keep the records of a row apart"):
        check_records_apart(NoMask(model), batch)
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="attn_implementation='flash_attention_2'.*packing: false"):
        attention_of(model)


@pytest.mark.parametrize("extra", [
    ["--long_records", "split", "--max_windows", "3", "--max_length", "48"],  # windows are the pieces packed
    ["--dataset", "stdlib_qa", "--max_records", "120", "--max_length", "256"],  # chat records: loss on answers
    ["--enabled", "false"],  # packing without DP: the same loss, rows filled
])
def test_packed_runs_with_split_windows_chat_records_and_without_dp(tmp_path, extra):
    from dpllm.privacy.report import PrivacyReport

    out, summary = _run(tmp_path, "run", "--packing", "true", *extra)
    rep = PrivacyReport.read(out)
    k = rep.packing
    assert k["records"] > k["rows"] > 0 and k["real_tokens"] == summary["tokens_seen"]
    assert k["real_tokens"] > 0.5 * k["row_tokens"]
    if "split" in extra:
        assert rep.data["long_records"] == "split" and rep.data["windows"] > rep.num_records
        assert rep.privacy_unit == "record"


def test_sub_row_width_wastes_few_positions():
    from dpllm.privacy.bk.layers import Segments

    assert Segments.choose_width([40, 41, 39]) == 41  # alike: one row each
    w = Segments.choose_width([500] + [60] * 30)  # one long record among short ones: fold it, not pad them to it
    assert w < 500 and 31 * w < 0.5 * 31 * 500
    seg = Segments(torch.tensor([[0] * 5 + [1] * 2 + [-1]]), width=2)
    assert seg.owner.tolist() == [0, 0, 0, 1] and seg.most == 3 and seg.count == 2


def test_doctests():
    import doctest

    from dpllm import packing
    from dpllm.privacy.bk import layers

    assert doctest.testmod(packing).failed == 0 and doctest.testmod(layers).failed == 0


def test_bk_refuses_a_trainable_layer_that_does_not_see_each_token_of_the_packed_rows():
    """A head over a pooled input (one vector per row) cannot be split by record: refused, not clipped per row."""
    from dpllm.privacy.bk import BookKeepingModule

    class Pooled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = torch.nn.Embedding(11, 4), torch.nn.Linear(4, 1)

        def forward(self, ids):
            return self.head(self.emb(ids).mean(1)).sum()

    bk = BookKeepingModule(Pooled(), clip_weights=lambda n: torch.ones_like(n))
    bk.set_segments(torch.tensor([[0, 0, 1, 1, -1]]))
    with pytest.raises(RuntimeError, match=r"saw \(1, 1\).*packed batch is \(1, 5\).*packing: false"):
        bk(torch.randint(0, 11, (1, 5))).backward()
