"""Long records split into windows, the record still the privacy unit (issue 48, ``data.long_records: split``)."""

import json

import numpy as np
import pytest
import torch

from dpllm import truncation
from dpllm.config import ConfigError, DataConfig, parse_config
from dpllm.windows import WindowedRecords, cut
from tests.helpers import TEXTS, explicit_grads, tiny_model

# record 0 is 3 windows of 40 byte tokens, record 2 is 4; the others fit in one
LONG = [TEXTS[0] + " " + TEXTS[1], TEXTS[4], TEXTS[3] + " " + TEXTS[5], TEXTS[2]]


def _explicit_window_grads(model, ds):
    """Each window's gradient of its own mean token loss, one backward pass per window."""
    from dpllm.data import make_collate

    collate = make_collate(0)
    return explicit_grads(model, (collate([item]) for item in ds.items))


def _engine_sum(model, tok, ds, C: float, mode: str):
    """The clipped sum (noise 0) the engine accumulates for every window of ``ds`` in one physical batch."""
    from dpllm.config import PrivacyConfig
    from dpllm.data import make_collate
    from dpllm.privacy.engine import make_private
    from dpllm.privacy.plan import PrivacyPlan
    from dpllm.train import forward_loss

    plan = PrivacyPlan(num_records=ds.num_records, sample_rate=0.5, steps=1, noise_multiplier=0.0, delta=1e-5,
                       accountant="rdp", expected_batch_size=1)
    collate = make_collate(tok.pad_token_id)
    private = make_private(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), dataset=ds,
                           collate_fn=collate, plan=plan, logical_batch_size=2,
                           cfg=PrivacyConfig(grad_sample_mode=mode, max_grad_norm=C), user_records=ds.units())
    assert private.grad_sample_mode == mode
    opt, batch = private.optimizer, collate(ds.items)
    opt.zero_grad()
    private.set_users(ds.record_of, reduction="sum")
    if mode == "bk":  # one backward pass leaves the clipped per-record sum in p.grad
        forward_loss(private.model, batch).backward()
        return torch.cat([p.grad.reshape(-1) for p in opt.params])
    opt.signal_skip_step(do_skip=True)  # accumulate only: summed_grad is the clipped sum
    forward_loss(private.model, batch).backward()
    opt.step()
    out = torch.cat([p.summed_grad.reshape(-1) for p in opt.params])
    private.model._close()
    return out


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_a_split_records_gradient_is_the_sum_over_its_windows_clipped_once(mode):
    """Against per-window autograd summed by hand. The batch (windows of several records, padded) and the one-window
    passes add the same terms in a different order, and sequence_loss computes the loss in float32 even for a float64
    model: they agree to ~6e-8 relative, so 1e-5; a missing cross term or a per-window clip moves it by > 1e-3."""
    model, tok = tiny_model()
    model = model.double()
    ds = WindowedRecords(LONG, tok, 40, 8)
    assert [len(r) for r in ds.units()] == [3, 1, 4, 1]
    g = _explicit_window_grads(model, ds).double()
    sums = torch.stack([g[rows].sum(0) for rows in ds.units()])  # one record's gradient: its windows' sum
    norms = sums.norm(dim=1)
    C = float(norms.median())  # some records clipped, some not
    want = sum(min(1.0, C / (float(n) + 1e-6)) * s for s, n in zip(sums, norms))
    got = _engine_sum(model, tok, ds, C, mode)
    err = (got - want).abs().max()
    assert err <= 1e-5 * want.abs().max(), err
    # clipping each window (or each record's mean of windows) is a different sum: the test can fail
    per_window = sum(min(1.0, C / (float(n) + 1e-6)) * r for r, n in zip(g, g.norm(dim=1)))
    means = torch.stack([g[rows].mean(0) for rows in ds.units()])
    per_mean = sum(min(1.0, C / (float(n) + 1e-6)) * m for m, n in zip(means, means.norm(dim=1)))
    assert (got - per_window).abs().max() > 1e-3 * want.abs().max()
    assert (got - per_mean).abs().max() > 1e-3 * want.abs().max()


def test_windows_and_split_of_a_record_never_depend_on_other_records():
    from dpllm.data import make_splits
    from dpllm.models import byte_tokenizer

    tok = byte_tokenizer()
    base = [t * 3 for t in TEXTS]  # 130-220 bytes: 2 to 4 windows of 64
    longer = base[:3] + ["x" * 999] + base[3:]  # one long record more, in the middle
    a, b = WindowedRecords(base, tok, 64, 3), WindowedRecords(longer, tok, 64, 3)
    win_a = [[a.items[i].tolist() for i in rows] for rows in a.units()]
    win_b = [[b.items[i].tolist() for i in rows] for rows in b.units()]
    assert win_b[:3] + win_b[4:] == win_a and len(win_b[3]) == 3  # the newcomer is capped, no one else moves
    assert sum(len(w) > 1 for w in win_a) >= 4
    cfg = DataConfig(heldout_fraction=0.5)
    sa, sb = make_splits(base, cfg), make_splits(longer, cfg)
    moved = {i: (i if i < 3 else i + 1) for i in range(len(base))}
    assert {moved[i] for i in sa.train} == set(sb.train) - {3} and {moved[i] for i in sa.heldout} == set(
        sb.heldout) - {3}


def test_the_window_cap_keeps_each_records_first_windows_and_is_reported():
    from dpllm.models import byte_tokenizer

    assert cut(list(range(10)), max_length=4, max_windows=2) == ([[0, 1, 2, 3], [4, 5, 6, 7]], 1)
    tok = byte_tokenizer()
    texts = ["a" * 100, "b" * 30, "c" * 50]  # byte tokens (+1 BOS): 101, 31, 51 → 7, 3, 4 windows of 16
    ds = WindowedRecords(texts, tok, 16, 4)
    full = [tok(t)["input_ids"] for t in texts]
    got = [[ds.items[i].tolist() for i in rows] for rows in ds.units()]
    assert got[0] == [full[0][k: k + 16] for k in (0, 16, 32, 48)]  # the first 4 of 7, in order
    assert got[1] == [full[1][k: k + 16] for k in (0, 16)] and sum(map(len, got[2])) == 51  # whole
    s = ds.truncation
    assert (s["split_records"], s["windows"], s["windows_dropped"], s["capped_records"]) == (3, 2 + 4 + 4, 3, 1)
    assert s["truncated_records"] == 1 and s["tokens_total"] - s["tokens_kept"] == 101 - 64
    line = truncation.describe(s)
    assert "3 of 3 training records are longer than max_length=16" in line
    assert "max_windows=4 dropped 3 windows of 1 records: 37 of 183 tokens" in line


@pytest.mark.parametrize("extra, words", [
    (["--privacy_unit", "user"], "privacy_unit=user it is planned"),
    (["--data_format", "messages"], "data_format=messages records"),
    (["--grad_sample_mode", "ghost"], "not ghost"),
    (["--max_windows", "32"], "max_windows=32 > physical_batch_size=16"),
])
def test_split_refuses_what_it_cannot_do_yet_in_one_line(extra, words):
    with pytest.raises(ConfigError, match=words):
        parse_config(["--long_records", "split", *extra])


def _run(tmp_path, long_records):
    from dpllm.train import train

    out = tmp_path / long_records
    train(parse_config([
        "--model_name_or_path", "tiny-llama", "--finetuning", "full", "--tiny_hidden_size", "32",
        "--tiny_num_layers", "1", "--max_records", "120", "--max_length", "32", "--long_records", long_records,
        "--max_windows", "4", "--grad_sample_mode", "bk", "--max_steps", "3", "--logical_batch_size", "8",
        "--physical_batch_size", "8", "--eval_every", "0", "--eval_max_records", "8", "--target_delta", "1e-3",
        "--output_dir", str(out), "--progress", "false", "--reproducible_noise", "true"]))
    return out


def test_split_run_trains_every_window_reports_the_counts_and_accounts_as_record_level(tmp_path, caplog):
    from dpllm.privacy.accounting import compute_epsilon_history
    from dpllm.privacy.plan import sample_rate_for
    from dpllm.privacy.report import PrivacyReport

    split, cut_run = _run(tmp_path, "split"), _run(tmp_path, "truncate")
    a, b = PrivacyReport.read(split), PrivacyReport.read(cut_run)
    # the same N source records, q, σ, steps and ε: the record-level accounting, nothing for the windows
    assert a.privacy_unit == b.privacy_unit == "record" and a.user_level is None
    assert (a.num_records, a.sample_rate, a.noise_multiplier, a.steps, a.history) == (
        b.num_records, b.sample_rate, b.noise_multiplier, b.steps, b.history)
    assert a.epsilon == b.epsilon == compute_epsilon_history(history=a.history, delta=1e-3, accountant="prv")
    assert a.sample_rate == sample_rate_for(a.num_records, 8)  # q over the source records, not the windows
    d = a.data
    assert d["long_records"] == "split" and d["records"] == a.num_records and d["split_records"] > 10
    assert d["windows"] > a.num_records and d["windows_dropped"] > 0 and d["capped_records"] > 0
    assert d["tokens_kept"] > b.data["tokens_kept"]  # more of the text is trained on than truncation keeps
    assert d["tokens_total"] == b.data["tokens_total"]
    splits_a, splits_b = (json.loads((r / "splits.json").read_text()) for r in (split, cut_run))
    assert splits_a["train"] == splits_b["train"]  # splits describe source records, decided as ever
    assert f"{d['split_records']:,} of {d['records']:,} training records are longer than max_length=32" in caplog.text
    assert splits_a["long_records"] == "split" and splits_a["max_windows"] == 4 and "max_windows" not in splits_b
    from mia.__main__ import main as mia_main

    assert mia_main(["audit", "--checkpoint", str(split), "--attacks", "loss", "--n-bootstrap", "20",
                     "--no-progress"]) == 0
    rep = json.loads((split / "audit" / "mia_report.json").read_text())
    assert rep["max_windows"] == 4 and rep["n_members"] == a.num_records  # members are the source records


def test_mia_scores_a_split_record_over_all_its_windows_as_one_unit():
    """Each window scored alone by hand, concatenated per record: the audit's per-token signals of the record. The
    audit batches windows of several records (right-padded): the same arithmetic in another order, so 1e-5."""
    from mia.signals import compute_signals

    model, tok = tiny_model()
    model.eval()
    texts = ["a" * 100, "short text here"]  # 101 byte tokens: windows of 32, 32, 32, 5 (3 kept); 16 tokens
    sig = compute_signals(model, tok, texts, max_length=32, max_windows=3, progress=False)
    full = tok(texts[0])["input_ids"]
    want = []
    with torch.no_grad():
        for k in (0, 32, 64):
            w = torch.tensor([full[k: k + 32]])
            logp = torch.log_softmax(model(input_ids=w).logits[0, :-1].float(), dim=-1)
            want.append(logp.gather(-1, w[0, 1:, None])[:, 0].double().numpy())
    want = np.concatenate(want)
    assert sig.num_tokens.tolist() == [3 * 31, 15]
    np.testing.assert_allclose(sig.token_logprobs[0], want, rtol=1e-5, atol=1e-6)
    assert sig.loss[0] == pytest.approx(-want.mean(), rel=1e-5)
    one_row = compute_signals(model, tok, texts, max_length=32, progress=False)  # the truncated record: 31 tokens
    assert one_row.num_tokens.tolist() == [31, 15] and one_row.loss[1] == pytest.approx(sig.loss[1], rel=1e-5)


def test_split_of_chat_records_found_in_the_file_is_refused_before_anything_is_written(tmp_path):
    from dpllm.train import train

    with pytest.raises(ConfigError, match="long_records=split of messages records .* is planned"):
        train(parse_config(["--model_name_or_path", "tiny-llama", "--dataset", "stdlib_qa", "--max_records", "40",
                            "--long_records", "split", "--output_dir", str(tmp_path / "run"), "--progress", "false"]))
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_split_sigkill_then_resume_equals_uninterrupted(tmp_path):
    """The resumed run cuts the same windows and draws the same record batches (the unit sampler's generator is
    restored): its report and weights are the uninterrupted run's."""
    from safetensors.torch import load_file

    from dpllm import ledger
    from tests.test_resume import kill_mid_run, run

    SPLIT = ["--long_records", "split", "--max_windows", "4", "--grad_sample_mode", "bk", "--target_delta", "1e-3"]
    killed = tmp_path / "killed"
    kill_mid_run(killed, *SPLIT)
    run(killed, "--resume_from", "latest", *SPLIT)
    run(tmp_path / "whole", *SPLIT)
    r1, r2 = (json.loads((d / "privacy_report.json").read_text()) for d in (killed, tmp_path / "whole"))
    for key in ("steps", "epsilon", "history", "num_records", "data"):
        assert r1[key] == r2[key], key
    assert r1["data"]["windows"] > r1["num_records"]
    a, b = (load_file(str(d / "checkpoint" / "model.safetensors")) for d in (killed, tmp_path / "whole"))
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert ledger.verify(killed).ok
