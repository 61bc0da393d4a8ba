"""DPTrainer reaches the recipe's units (issue 48): users (ULS / ELS, ``privacy_unit="user"``) and long records split
into windows (``long_records="split"``, with an optional overlap ``window_stride``). Each clipped sum is checked
against explicit per-record autograd, each ε against the recipe's own plan."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from datasets import Dataset
from transformers import TrainingArguments

from dpllm.config import ConfigError, parse_config
from dpllm.hf import DPTrainer, PrivacyArguments
from dpllm.sft import PadRecords
from dpllm.windows import WindowedRecords, cut
from tests.helpers import TEXTS, tiny_model

SAFE = dict(report_to="none", disable_tqdm=True, use_cpu=True, max_grad_norm=0)


def _args(out, **kw):
    return TrainingArguments(output_dir=str(out), **{**SAFE, **kw})


def _users_dataset(tok, users: dict[str, int], *, truncate: bool = False):
    """``users[name]`` records for each user, tokenized one record per row."""
    texts = [f"{u} wrote note {j}: {TEXTS[(len(u) + j) % len(TEXTS)]}" for u, n in users.items() for j in range(n)]
    who = [u for u, n in users.items() for _ in range(n)]
    ds = Dataset.from_dict({"text": texts, "user": who})
    return ds.map(lambda b: tok(b["text"], **({"truncation": True, "max_length": 24} if truncate else {})),
                  batched=True)


def _record_grad(model, row: dict) -> torch.Tensor:
    """One row's gradient of its own mean token loss (labels -100 kept out), alone in its backward pass."""
    from dpllm.train import forward_loss

    model.zero_grad()
    forward_loss(model, PadRecords(0)([row])).backward()
    g = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.requires_grad]).clone()
    model.zero_grad()
    return g


def _clipped_sum(units: list[torch.Tensor], C: float) -> torch.Tensor:
    return sum(min(1.0, C / (float(u.norm()) + 1e-6)) * u for u in units)


def _noise_free(monkeypatch):
    """No noise, so the step is the clipped sum divided by the expected batch (the noise is tested elsewhere)."""
    import opacus.optimizers.optimizer as opacus_opt

    from dpllm.privacy import clipping
    from dpllm.privacy.bk import optimizer as bk_opt

    def zeros(std, reference, generator=None, secure_mode=False):
        return torch.zeros_like(reference)

    for module in (opacus_opt, bk_opt, clipping):
        monkeypatch.setattr(module, "_generate_noise", zeros)


def _update(before, after) -> torch.Tensor:
    a = torch.cat([p.detach().reshape(-1) for p in before.parameters() if p.requires_grad])
    b = torch.cat([p.detach().reshape(-1) for p in after.parameters() if p.requires_grad])
    return a - b


def _one_step(tmp_path, model, tok, train, privacy: PrivacyArguments, physical: int):
    """One DPTrainer step at SGD lr 1, q = 1 (the logical batch holds every unit), no noise: θ − θ' = Σ clip / E."""
    trainer = DPTrainer(model=model, args=_args(tmp_path / "run", max_steps=1, optim="sgd", learning_rate=1.0,
                                                lr_scheduler_type="constant", per_device_train_batch_size=physical),
                        privacy_args=privacy, train_dataset=train, processing_class=tok)
    trainer.train()
    return trainer


# ---- the user unit -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["bk", "hooks"])
def test_user_unit_clips_each_users_mean_gradient_once_as_explicit_autograd(tmp_path, monkeypatch, mode):
    """Three users of 2, 1 and 3 records, all sampled (q = 1): the step is Σ_u clip_C(mean of u's record gradients)
    / U, against per-record autograd averaged by hand. A float64 model, but sequence_loss computes the loss in
    float32: the padded batch and the one-row passes agree to 3e-8 relative (seen), so 1e-6; a per-record clip (what
    record-level DP-SGD does) differs by 0.13 (seen), so > 1e-2."""
    _noise_free(monkeypatch)
    model, tok = tiny_model()
    model = model.double()
    before = copy.deepcopy(model)
    train = _users_dataset(tok, {"ann": 2, "bob": 1, "cyd": 3})
    rows = [{"input_ids": torch.tensor(r["input_ids"]), "labels": torch.tensor(r["input_ids"])} for r in train]
    grads = torch.stack([_record_grad(copy.deepcopy(before), r) for r in rows])
    means = [grads[0:2].mean(0), grads[2:3].mean(0), grads[3:6].mean(0)]
    C = float(torch.stack([m.norm() for m in means]).median())  # one user clipped, one not, one at C
    privacy = PrivacyArguments(privacy_unit="user", target_epsilon=None, noise_multiplier=1.0, logical_batch_size=6,
                               per_sample_max_grad_norm=C, grad_sample_mode=mode, target_delta=0.1,
                               reproducible_noise=True)
    trainer = _one_step(tmp_path, model, tok, train, privacy, physical=3)
    report = trainer.privacy_report
    assert report.privacy_unit == "user" and report.user_level["unit"] == "user"
    assert report.user_level["num_users"] == 3 and report.sample_rate == 1.0 and report.grad_sample_mode == mode
    got = _update(before, trainer.model) * 3  # Opacus divides by the expected users, q·U = 3
    want = _clipped_sum(means, C)
    assert (got - want).abs().max() <= 1e-6 * want.abs().max()
    per_record = _clipped_sum(list(grads), C) * 3 / 6  # record-level: N = 6 records, expected batch 6
    assert (got - per_record).abs().max() > 1e-2 * want.abs().max()


def test_one_users_contribution_is_at_most_C_whatever_its_records(tmp_path, monkeypatch):
    """One user of 4 records, C far below every gradient: the user's whole contribution to the step has norm C (not
    4·C, as a per-record clip of its records would allow)."""
    _noise_free(monkeypatch)
    model, tok = tiny_model(seed=1)
    before = copy.deepcopy(model)
    train = _users_dataset(tok, {"dee": 4})
    privacy = PrivacyArguments(privacy_unit="user", target_epsilon=None, noise_multiplier=1.0, logical_batch_size=4,
                               per_sample_max_grad_norm=1e-3, target_delta=0.5, reproducible_noise=True)
    trainer = _one_step(tmp_path, model, tok, train, privacy, physical=4)
    step = _update(before, trainer.model)  # expected users q·U = 1
    assert 0.99e-3 < float(step.norm()) <= 1e-3 * (1 + 1e-4)


@pytest.mark.parametrize("sampling", ["uls", "els"])
def test_user_unit_accounts_as_the_recipes_user_level_plan_and_verifies(tmp_path, sampling, capsys):
    """ε, q and σ of a DPTrainer user-level run are the recipe's plan (`dpllm plan --unit user`) for the same users,
    batch and steps; the report names the unit, `dpllm ledger verify` and `dpllm report` recompute it, and the
    user-level audit (mia.users) reads the run's users from records.jsonl."""
    from dpllm import ledger
    from dpllm.compliance import cli_main as report_main
    from dpllm.privacy.planning import user_plan_table
    from mia.users import load_run_users

    model, tok = tiny_model()
    sizes = {f"u{i:02d}": 1 + i % 4 for i in range(24)}  # 60 records; u03, u07... hold 4 > k = 3
    train = _users_dataset(tok, sizes)
    heldout = _users_dataset(tok, {f"h{i}": 2 for i in range(6)})
    out = tmp_path / sampling
    # ELS is given its σ: calibrating the mixture accounting at this small q·σ takes ~45 s (the recipe's path, the
    # same code); ULS calibrates with PRV in a fraction of a second
    noise = dict(target_epsilon=8.0) if sampling == "uls" else dict(target_epsilon=None, noise_multiplier=1.5)
    trainer = DPTrainer(model=model, args=_args(out, max_steps=3, per_device_train_batch_size=4),
                        privacy_args=PrivacyArguments(privacy_unit="user", user_sampling=sampling,
                                                      max_records_per_user=3, logical_batch_size=12,
                                                      target_delta=1e-2, reproducible_noise=True, **noise),
                        train_dataset=train, eval_dataset=heldout, processing_class=tok)
    metrics = trainer.train().metrics
    report, u = trainer.privacy_report, trainer.privacy_report.user_level
    assert report.privacy_unit == "user" and u["unit"] == "user" and u["sampling"] == sampling
    assert u["num_users"] == 24 and u["max_records_per_user"] == 3 and u["user_column"] == "user"
    assert u["users_trimmed"] == 6 and u["records_dropped"] == 6 and report.num_records == 54
    plan = user_plan_table(sampling=sampling, num_users=24, records_per_user=3, num_records=54,
                           users_per_batch=u["users_per_batch"], batch=12, steps=3, delta=1e-2,
                           noise_multiplier=report.noise_multiplier, epsilons=[])
    assert plan["given_noise"]["epsilon"] == pytest.approx(report.epsilon, rel=1e-6) == metrics["epsilon"]
    assert plan["sample_rate"] == pytest.approx(report.sample_rate)
    if sampling == "uls":  # users are sampled: q = B_u / U with B_u = round(12 · 24 / 54) = 5
        assert u["users_per_batch"] == 5 and report.sample_rate == pytest.approx(1 / 5) and report.epsilon <= 8.0
    else:  # records are sampled, the user-level ε by group privacy over k = 3 (more than the record level's)
        assert u["group_size"] == 3 and u["record_epsilon"] < report.epsilon
    assert ledger.verify(out).ok
    capsys.readouterr()
    assert report_main([str(out)]) == 0
    assert "user" in capsys.readouterr().out.lower()
    splits = json.loads((out / "splits.json").read_text())
    assert splits["privacy_unit"] == "user" and len(splits["users"]["train"]) == 24
    assert len(splits["train"]) == 54 and len(splits["users"]["dropped_records"]) == 6
    # the user-level audit's members and non-members: users, read back from records.jsonl and hash-checked
    members, nonmembers = load_run_users(out)
    assert sorted(members) == sorted(sizes) and sorted(nonmembers) == [f"h{i}" for i in range(6)]
    assert max(map(len, members.values())) == 3 and sum(map(len, members.values())) == 54


# ---- long records split into windows -----------------------------------------------------------------------

LONG = [TEXTS[0] + " " + TEXTS[1] + " " + TEXTS[3], TEXTS[4], TEXTS[3] + " " + TEXTS[5], TEXTS[2]]


def _long_dataset(tok, texts=LONG, **kw):
    return Dataset.from_dict({"text": list(texts)}).map(lambda b: tok(b["text"], **kw), batched=True)


@pytest.mark.parametrize("stride", [0, 8])
def test_split_clips_a_records_windows_once_as_explicit_autograd(tmp_path, monkeypatch, stride):
    """Records of 5, 1, 4 and 1 windows of 40 tokens (stride 8: 6, 1, 5, 1), all sampled: the step is Σ_r
    clip_C(Σ of r's window gradients) / N. The windows are cut here by hand from each record's ids (context tokens
    labelled -100), each window's gradient taken alone; 5e-8 relative seen, 1e-6 as above. Clipping each window
    instead differs by 0.29 (stride 0) and 0.52 (stride 8) (seen)."""
    _noise_free(monkeypatch)
    model, tok = tiny_model()
    model = model.double()
    before = copy.deepcopy(model)
    train = _long_dataset(tok)
    units = []
    for r in train:
        windows, dropped = cut(r["input_ids"], max_length=40, max_windows=8, stride=stride)
        assert dropped == 0
        rows = []
        for k, w in enumerate(windows):
            labels = torch.tensor(w)
            labels[: stride if k else 0] = -100
            rows.append({"input_ids": torch.tensor(w), "labels": labels})
        units.append(torch.stack([_record_grad(copy.deepcopy(before), x) for x in rows]))
    assert [len(u) for u in units] == ([5, 1, 4, 1] if stride == 0 else [6, 1, 5, 1])
    sums = [u.sum(0) for u in units]
    C = float(torch.stack([s.norm() for s in sums]).median())
    privacy = PrivacyArguments(long_records="split", window_length=40, max_windows=8, window_stride=stride,
                               target_epsilon=None, noise_multiplier=1.0, logical_batch_size=8,
                               per_sample_max_grad_norm=C, target_delta=0.1, reproducible_noise=True)
    trainer = _one_step(tmp_path, model, tok, train, privacy, physical=8)
    report = trainer.privacy_report
    assert report.privacy_unit == "record" and report.num_records == 4 and report.sample_rate == 1.0
    assert report.data["long_records"] == "split" and report.data["window_stride"] == stride
    got = _update(before, trainer.model) * report.expected_batch_size  # q·N = 4 records, not their windows
    want = _clipped_sum(sums, C)
    assert (got - want).abs().max() <= 1e-6 * want.abs().max()
    per_window = _clipped_sum([g for u in units for g in u], C)
    assert (got - per_window).abs().max() > 1e-2 * want.abs().max()


def test_split_accounts_as_the_record_level_and_says_what_it_split(tmp_path, caplog):
    """A split run and a truncated run over the same records: the same N, q, σ, steps and ε (the record level's);
    the split one trains more tokens, counts its windows in the report and says so on the console with DPTrainer's
    option names."""
    from dpllm import ledger
    from dpllm.privacy.accounting import compute_epsilon_history
    from dpllm.privacy.plan import sample_rate_for

    texts = [f"record {i}: " + " ".join(TEXTS[(i + j) % 6] for j in range(1 + i % 5)) for i in range(40)]
    reports = {}
    for how in ("split", "truncate"):
        model, tok = tiny_model()
        kw = {} if how == "split" else {"truncation": True, "max_length": 48}
        extra = dict(long_records="split", window_length=48, max_windows=3) if how == "split" else {}
        trainer = DPTrainer(model=model, args=_args(tmp_path / how, max_steps=3, per_device_train_batch_size=4),
                            privacy_args=PrivacyArguments(logical_batch_size=8, target_delta=1e-2,
                                                          reproducible_noise=True, **extra),
                            train_dataset=_long_dataset(tok, texts, **kw), processing_class=tok)
        caplog.clear()
        trainer.train()
        reports[how] = trainer.privacy_report
        assert ledger.verify(tmp_path / how).ok
        if how == "split":
            lines = [r.getMessage() for r in caplog.records if "[private] data:" in r.getMessage()]
    a, b = reports["split"], reports["truncate"]
    assert (a.num_records, a.sample_rate, a.noise_multiplier, a.steps, a.history) == (
        b.num_records, b.sample_rate, b.noise_multiplier, b.steps, b.history)
    assert a.sample_rate == sample_rate_for(40, 8)  # q over the 40 records, not their windows
    assert a.epsilon == b.epsilon == compute_epsilon_history(history=a.history, delta=1e-2, accountant="prv")
    d = a.data
    assert d["records"] == 40 and d["split_records"] > 10 and d["windows"] > 40 and d["capped_records"] > 0
    assert d["tokens_kept"] > b.data["tokens_kept"] and d["tokens_total"] == b.data["tokens_total"]
    assert b.data["truncated_records"] == d["split_records"]  # the truncated run counts its long records too
    assert len(lines) == 1 and f"{d['split_records']} of 40 training records are longer than window_length=48" in (
        lines[0]) and "raise max_windows (with per_device_train_batch_size) or window_length" in lines[0]
    splits = json.loads((tmp_path / "split" / "splits.json").read_text())
    assert splits["long_records"] == "split" and splits["max_windows"] == 3 and splits["max_length"] == 48


# ---- overlapping windows -----------------------------------------------------------------------------------

@pytest.mark.parametrize("T, s", [(8, 0), (8, 3), (8, 7), (5, 1)])
def test_window_stride_counts_every_token_once_with_the_overlap_asked(T, s):
    """Every token but a record's first is a target exactly once (position t ≥ 1 of a window with a label); each
    window after the first opens with the last s tokens of the one before, labelled -100."""
    ids = list(range(100, 137))  # 37 tokens
    ds = WindowedRecords.of_rows([ids], [ids], max_length=T, max_windows=100, stride=s)
    step, targets = T - s, []
    for k, row in enumerate(ds.rows):
        w, lab = row["input_ids"].tolist(), row["labels"].tolist()
        assert w == ids[k * step: k * step + T] and len(w) <= T
        if k:
            assert w[:s] == ds.rows[k - 1]["input_ids"].tolist()[-s:] if s else True  # the overlap asked
            assert lab[:s] == [-100] * s and all(x != -100 for x in lab[s:])
        targets += [x for t, x in enumerate(lab) if t >= 1 and x != -100]
    assert len(targets) == len(set(targets))  # no token's label counted twice (the ids are distinct)
    if s:  # every token after the record's first is a target
        assert sorted(targets) == ids[1:]
    else:  # without overlap a window's first token is never a target: ⌈L/T⌉ − 1 = 4 more are lost
        assert len(ds.rows) == 5 and sorted(targets) == [x for i, x in enumerate(ids) if i % T]
    assert ds.truncation["windows"] == len(ds.rows) and ds.truncation["window_stride"] == s


def test_window_stride_keeps_a_records_own_labels_and_the_cap():
    """A record's own -100 labels are cut with its ids; the cap keeps the first windows and the report counts the
    tokens it dropped with the overlap."""
    ids = list(range(20))
    labels = [-100] * 6 + ids[6:]  # a prompt kept out of the loss
    ds = WindowedRecords.of_rows([ids], [labels], max_length=6, max_windows=2, stride=2)
    assert [r["input_ids"].tolist() for r in ds.rows] == [ids[0:6], ids[4:10]]
    assert ds.rows[0]["labels"].tolist() == [-100] * 6
    assert ds.rows[1]["labels"].tolist() == [-100, -100, 6, 7, 8, 9]  # 2 context tokens, then its own labels
    s = ds.truncation
    assert s["windows"] == 2 and s["windows_dropped"] == 3 and s["tokens_kept"] == 10  # windows of 6, 4 new each


def test_the_audit_scores_each_token_of_an_overlapping_split_record_once():
    """mia's signals of a record split with window_stride 8 (windows of 32 from token 0, 24, 48, 72 of 101): each
    window scored alone by hand, its 7 repeated predictions dropped (the context tokens after its first), then
    concatenated: every token but the first scored once. 1e-5 as in tests/test_long_records.py (batched vs alone)."""
    import numpy as np

    from mia.signals import compute_signals

    model, tok = tiny_model()
    model.eval()
    full = tok("a" * 100)["input_ids"]
    sig = compute_signals(model, tok, ["a" * 100], max_length=32, max_windows=8, window_stride=8, progress=False)
    want = []
    with torch.no_grad():
        for k, start in enumerate((0, 24, 48, 72)):
            w = torch.tensor([full[start: start + 32]])
            logp = torch.log_softmax(model(input_ids=w).logits[0, :-1].float(), dim=-1)
            want.append(logp.gather(-1, w[0, 1:, None])[:, 0].double().numpy()[7 if k else 0:])
    want = np.concatenate(want)
    assert sig.num_tokens.tolist() == [100] == [len(full) - 1]
    np.testing.assert_allclose(sig.token_logprobs[0], want, rtol=1e-5, atol=1e-6)


def test_window_stride_in_the_recipe_is_recorded_and_refused_when_it_cannot_work():
    cfg = parse_config(["--long_records", "split", "--max_length", "64", "--window_stride", "16"])
    assert cfg.data.window_stride == 16
    with pytest.raises(ConfigError, match="window_stride=64 must be ≥ 0 and < max_length=64"):
        parse_config(["--long_records", "split", "--max_length", "64", "--window_stride", "64"])
    with pytest.raises(ConfigError, match="with long_records: truncate there are no windows"):
        parse_config(["--window_stride", "8"])


def test_recipe_split_run_with_stride_trains_the_overlapping_windows(tmp_path):
    """The recipe's split run with window_stride: splits.json and the report record it; ε is the record level's."""
    from dpllm.privacy.accounting import compute_epsilon_history
    from dpllm.privacy.report import PrivacyReport
    from dpllm.train import train

    out = tmp_path / "run"
    train(parse_config([
        "--model_name_or_path", "tiny-llama", "--finetuning", "full", "--tiny_hidden_size", "32",
        "--tiny_num_layers", "1", "--max_records", "60", "--max_length", "32", "--long_records", "split",
        "--max_windows", "4", "--window_stride", "8", "--max_steps", "2", "--logical_batch_size", "8",
        "--physical_batch_size", "8", "--eval_every", "0", "--eval_max_records", "8", "--target_delta", "1e-3",
        "--output_dir", str(out), "--progress", "false", "--reproducible_noise", "true"]))
    report = PrivacyReport.read(out)
    assert report.data["window_stride"] == 8 and report.data["windows"] > report.num_records
    assert report.epsilon == compute_epsilon_history(history=report.history, delta=1e-3, accountant="prv")
    assert json.loads((out / "splits.json").read_text())["window_stride"] == 8
    from mia.audit import run_window_stride

    assert run_window_stride(out) == 8  # mia audit scores the run's windows with its overlap


# ---- refusals ----------------------------------------------------------------------------------------------

REFUSED = [
    (dict(privacy_unit="user", grad_sample_mode="ghost"), "user_sampling=uls needs grad_sample_mode"),
    (dict(privacy_unit="user", user_sampling="els"), "set max_records_per_user"),
    (dict(privacy_unit="user", user_sampling="els", max_records_per_user=2, noise_schedule="linear"),
     "noise_schedule with user_sampling=els"),
    (dict(privacy_unit="group"), "privacy_unit='group'"),
    (dict(long_records="split"), "needs window_length=N"),
    (dict(long_records="split", window_length=32, window_stride=32), "window_stride=32 must be ≥ 0 and < "
                                                                     "window_length=32"),
    (dict(long_records="split", window_length=32, max_windows=16), "max_windows=16 > "
                                                                   "per_device_train_batch_size=8"),
    (dict(long_records="split", window_length=32, grad_sample_mode="ghost"), "long_records=split needs "
                                                                             "grad_sample_mode"),
    (dict(long_records="split", window_length=32, privacy_unit="user"), "with privacy_unit=user"),
    (dict(long_records="split", window_length=32, privacy_unit="sequence"), "with privacy_unit=sequence"),
    (dict(window_stride=4), "with long_records: truncate there are no windows"),
]


@pytest.mark.parametrize("kw, words", REFUSED, ids=[w for _, w in REFUSED])
def test_what_the_recipe_refuses_dptrainer_refuses_when_built(tmp_path, kw, words):
    model, tok = tiny_model()
    with pytest.raises(ConfigError, match=words):
        DPTrainer(model=model, args=_args(tmp_path / "run", max_steps=1, per_device_train_batch_size=8),
                  privacy_args=PrivacyArguments(logical_batch_size=8, **kw),
                  train_dataset=_users_dataset(tok, {"a": 2, "b": 2}), processing_class=tok)
    assert not (tmp_path / "run").exists()


def test_dptrainer_refuses_data_the_unit_cannot_use_before_writing(tmp_path):
    model, tok = tiny_model()

    def train(privacy, train_ds, eval_ds=None):
        DPTrainer(model=model, args=_args(tmp_path / "run", max_steps=1, per_device_train_batch_size=4),
                  privacy_args=PrivacyArguments(logical_batch_size=4, target_delta=0.1, **privacy),
                  train_dataset=train_ds, eval_dataset=eval_ds, processing_class=tok).train()

    with pytest.raises(ConfigError, match="no user in column 'author'"):
        train(dict(privacy_unit="user", user_column="author"), _users_dataset(tok, {"a": 2, "b": 2}))
    with pytest.raises(ConfigError, match="1 user\\(s\\) of eval_dataset also have rows in train_dataset"):
        train(dict(privacy_unit="user"), _users_dataset(tok, {"a": 2, "b": 2}), _users_dataset(tok, {"b": 1}))
    with pytest.raises(ConfigError, match="a user keeps 3 records > per_device_train_batch_size=2"):
        DPTrainer(model=model, args=_args(tmp_path / "run", max_steps=1, per_device_train_batch_size=2),
                  privacy_args=PrivacyArguments(privacy_unit="user", logical_batch_size=4, target_delta=0.1),
                  train_dataset=_users_dataset(tok, {"a": 3, "b": 1}), processing_class=tok).train()
    with pytest.raises(ConfigError, match="were cut at tokenization; tokenize without truncation"):
        train(dict(long_records="split", window_length=16, max_windows=4),
              _long_dataset(tok, truncation=True, max_length=24))
    chats = Dataset.from_dict({"messages": [[{"role": "user", "content": "hi"}, {"role": "assistant",
                                                                                "content": "hello"}]] * 4,
                               "user": ["a", "a", "b", "b"]})
    with pytest.raises(ConfigError, match="privacy_unit='user' and long_records='split' with them are not yet"):
        train(dict(privacy_unit="user"), chats)
    assert not any((tmp_path / "run").iterdir())  # the Trainer's constructor makes output_dir; nothing is in it


# ---- resume ------------------------------------------------------------------------------------------------

# ~11 s each (three runs and their checkpoints): the split one, whose windows are a function of the data alone, is in
# the slow set (its sampler's restore is the recipe's, tests/test_long_records.py's slow kill-and-resume test)
@pytest.mark.parametrize("unit", ["user", pytest.param("split", marks=pytest.mark.slow)])
def test_an_interrupted_run_resumes_to_the_uninterrupted_one(tmp_path, unit):
    """Ctrl-C after step 3 of 4, resumed from step 2: the same users kept (the cap's choice is read back from
    splits.json, not drawn again), the same unit batches and noise, so the same weights and history."""
    from tests.test_hf_trainer import StopAt

    def run(out, *, callbacks=(), resume=None):
        model, tok = tiny_model()
        if unit == "user":
            data = _users_dataset(tok, {f"u{i}": 1 + i % 3 for i in range(12)})
            kw = dict(privacy_unit="user", max_records_per_user=2)
        else:
            data = _long_dataset(tok, [f"{i}: " + " ".join(TEXTS[(i + j) % 6] for j in range(1 + i % 3))
                                       for i in range(12)])
            kw = dict(long_records="split", window_length=40, max_windows=4, window_stride=4)
        trainer = DPTrainer(model=model, args=_args(out, max_steps=4, save_steps=2, per_device_train_batch_size=4,
                                                    seed=3),
                            privacy_args=PrivacyArguments(target_epsilon=None, noise_multiplier=0.8, accountant="rdp",
                                                          logical_batch_size=6, target_delta=1e-2,
                                                          reproducible_noise=True, **kw),
                            train_dataset=data, processing_class=tok, callbacks=list(callbacks))
        return trainer, trainer.train(resume_from_checkpoint=resume)

    out_dir = tmp_path / "run"
    whole, _ = run(out_dir)
    out_dir.rename(tmp_path / "whole")
    with pytest.raises(KeyboardInterrupt):
        run(out_dir, callbacks=[StopAt(3)])
    resumed, out = run(out_dir, resume=True)
    assert out.global_step == 4 and resumed.dp_run.start_step == 2
    mine, theirs = dict(resumed.model.named_parameters()), dict(whole.model.named_parameters())
    for name, p in theirs.items():
        torch.testing.assert_close(mine[name].detach(), p.detach())
    a, b = resumed.privacy_report, whole.privacy_report
    assert (a.history, a.epsilon, a.user_level, a.data) == (b.history, b.epsilon, b.user_level, b.data)
    assert json.loads((out_dir / "splits.json").read_text())["train"] == json.loads(
        (tmp_path / "whole" / "splits.json").read_text())["train"]
