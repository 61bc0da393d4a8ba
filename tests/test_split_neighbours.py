"""The neighbouring relation holds on the user's file (issue 32, item 1): two files that differ in one record
(appended at the end, inserted in the middle, removed from the front) give training, held-out, public and canary
sets that differ in exactly that record, for every split option. No training: splits are built directly."""

from __future__ import annotations

import json
import logging
from collections import Counter

import pytest
import torch

from dpllm import data
from dpllm.config import ConfigError, DataConfig, parse_config
from dpllm.privacy import user_level

N = 240
NEW = "a record that was not in the file before, long enough to pass min_chars"


def _rows(n: int = N, users: int = 0) -> list[dict]:
    rows = [{"text": f"record {i}: " + "some words " * (i % 4) + "of the support ticket number " + str(i * 7919)}
            for i in range(n)]
    for i, r in enumerate(rows):
        if users:
            r["user"] = f"u{(i * 31) % users:03d}"
    return rows


def _neighbours(rows: list[dict], new: dict) -> list[tuple[str, list[dict], dict]]:
    """(how, the other file, the record the two files differ in)."""
    return [("appended", rows + [new], new), ("inserted", rows[: len(rows) // 2] + [new] + rows[len(rows) // 2:], new),
            ("removed from the front", rows[1:], rows[0])]


def _write(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _sets(cfg: DataConfig) -> dict[str, Counter]:
    loaded = data.load_records_counted(cfg)
    s = data.make_splits(loaded.records, cfg, loaded.users, loaded.public)
    out = {k: Counter(loaded.records[i] for i in getattr(s, k)) for k in ("train", "heldout", "public")}
    out["canaries"] = Counter(c["text"] for c in data.make_canaries(cfg) if c["included"])
    return out


def _differ_by(a: dict[str, Counter], b: dict[str, Counter], text: str, *, kept: bool = True) -> None:
    """``a`` and ``b`` differ in ``text`` alone: in exactly one set, or (``kept`` false: record_fraction left it
    out) in none."""
    moved = {k: (a[k] - b[k]) + (b[k] - a[k]) for k in a}
    assert all(set(m) <= {text} for m in moved.values()), {k: list(m)[:3] for k, m in moved.items() if m}
    assert sum(sum(m.values()) for m in moved.values()) == int(kept)  # exactly one record, in exactly one set


OPTIONS = {
    "held-out fraction": {"heldout_fraction": 0.3},
    "simulated public fraction": {"public_fraction": 0.2, "simulate_public_from_private": True},
    "dedup off": {"deduplicate": False},
    "canaries": {"num_canaries": 8, "canary_seed": 5},
    "another split key": {"split_seed": 11, "heldout_fraction": 0.5},
    "record fraction": {"record_fraction": 0.5},  # issue 46, item 6: part of the file, each record by itself
}


@pytest.mark.parametrize("option", list(OPTIONS))
def test_one_record_moves_only_itself(tmp_path, option):
    rows = _rows()
    cfg = DataConfig(dataset=_write(tmp_path / "a.jsonl", rows), **OPTIONS[option])
    before = _sets(cfg)
    assert before["train"] and before["heldout"]
    fraction = OPTIONS[option].get("record_fraction")
    for _how, other, changed in _neighbours(rows, {"text": NEW}):
        after = _sets(DataConfig(dataset=_write(tmp_path / "b.jsonl", other), **OPTIONS[option]))
        _differ_by(before, after, changed["text"], kept=fraction is None or data.keyed_draw(
            changed["text"], key=0, purpose="fraction") < fraction)


def test_the_issue_figure_moves_nothing_else(tmp_path):
    """The issue's measurement: 10,000 records plus one, public_fraction 0.1 (simulated) moved 767 records out of
    training and 768 in on main before this change; now only the new record enters."""
    rows = [{"text": f"record {i} " + "x" * (i % 9) + " with enough characters"} for i in range(10_000)]
    opts = {"public_fraction": 0.1, "simulate_public_from_private": True}
    before = _sets(DataConfig(dataset=_write(tmp_path / "a.jsonl", rows), **opts))
    after = _sets(DataConfig(dataset=_write(tmp_path / "b.jsonl", rows + [{"text": NEW}]), **opts))
    _differ_by(before, after, NEW)


def test_declared_public_dataset(tmp_path):
    rows = _rows()
    public = [{"text": f"public paragraph {i} that anyone may read, about the weather"} for i in range(30)]
    pub = _write(tmp_path / "public.jsonl", public + [rows[5]])  # a private record that is also declared public
    cfg = DataConfig(dataset=_write(tmp_path / "a.jsonl", rows), public_dataset=pub)
    before = _sets(cfg)
    assert set(before["public"]) == {r["text"] for r in public} | {rows[5]["text"]}
    assert rows[5]["text"] not in before["train"] and rows[5]["text"] not in before["heldout"]
    loaded = data.load_records_counted(cfg)
    assert loaded.same_as_public == 1 and loaded.public_read == 31
    for _how, other, changed in _neighbours(rows, {"text": NEW}):
        _differ_by(before, _sets(DataConfig(dataset=_write(tmp_path / "b.jsonl", other), public_dataset=pub)),
                   changed["text"])
    rule = data.make_splits(loaded.records, cfg, None, loaded.public).rule
    assert rule["public"].startswith("declared: every record of public_dataset=")


def test_user_level_splits_and_cap_move_only_that_user(tmp_path):
    rows = _rows(users=40)
    opts = {"privacy_unit": "user", "heldout_fraction": 0.25}
    cfg = DataConfig(dataset=_write(tmp_path / "a.jsonl", rows), **opts)
    before = _sets(cfg)
    for user in ("u007", "a new user"):
        new = {"text": NEW, "user": user}
        for _how, other, changed in _neighbours(rows, new):
            ocfg = DataConfig(dataset=_write(tmp_path / "b.jsonl", other), **opts)
            _differ_by(before, _sets(ocfg), changed["text"])

    # the cap (k records per user, one secret key): every user but the changed one keeps the same records
    def kept(cfg):
        loaded = data.load_records_counted(cfg)
        s = data.make_splits(loaded.records, cfg, loaded.users)
        cap = user_level.cap_users(s.train, loaded.users, 3, torch.Generator().manual_seed(0), texts=loaded.records)
        return {u: {loaded.records[i] for i in ids} for u, ids in cap["by_user"].items()}

    a = kept(cfg)
    assert any(len(v) == 3 for v in a.values())
    for how, other, changed in _neighbours(rows, {"text": NEW, "user": "u007"}):
        b = kept(DataConfig(dataset=_write(tmp_path / "b.jsonl", other), **opts))
        assert {u for u in a.keys() | b.keys() if a.get(u) != b.get(u)} <= {changed["user"]}, how


def test_sft_records(tmp_path):
    def chat(i):
        return {"messages": [{"role": "user", "content": f"what does function number {i} do?"},
                             {"role": "assistant", "content": f"it returns {i * 3} after checking its input"}]}

    rows = [chat(i) for i in range(N)]
    new = {"messages": [{"role": "user", "content": "a new question"}, {"role": "assistant", "content": "an answer"}]}
    cfg = DataConfig(dataset=_write(tmp_path / "a.jsonl", rows))
    before = _sets(cfg)
    assert all(t.startswith("{") for t in before["train"])  # canonical JSON records
    for _how, other, changed in _neighbours(rows, new):
        after = _sets(DataConfig(dataset=_write(tmp_path / "b.jsonl", other)))
        (text,) = [t for t in (Counter(after["train"] + after["heldout"])
                               - Counter(before["train"] + before["heldout"]))
                   + (Counter(before["train"] + before["heldout"]) - Counter(after["train"] + after["heldout"]))]
        assert json.loads(text)["messages"] == changed["messages"]
        _differ_by(before, after, text)


def test_duplicates_are_one_record_whichever_copy_comes_first(tmp_path):
    """With dedup on, a file's records are its distinct texts: adding a copy of a record, or removing the first of
    two copies, changes no set at all; adding a new text changes them by that text."""
    rows = _rows()
    rows.insert(7, dict(rows[100]))  # a second copy of record 100, before the first one
    cfg = DataConfig(dataset=_write(tmp_path / "a.jsonl", rows))
    before = _sets(cfg)
    for other in (rows + [dict(rows[3])], rows[:7] + rows[8:]):
        assert _sets(DataConfig(dataset=_write(tmp_path / "b.jsonl", other))) == before
    # dedup off: every copy is a record of its own, in the split of its text: one more copy moves only itself
    off = DataConfig(dataset=str(tmp_path / "a.jsonl"), deduplicate=False)
    before = _sets(off)
    assert before["train"][rows[7]["text"]] + before["heldout"][rows[7]["text"]] == 2  # both copies
    for other, changed in ((rows + [dict(rows[3])], rows[3]), (rows[:7] + rows[8:], rows[7])):
        _differ_by(before, _sets(DataConfig(dataset=_write(tmp_path / "b.jsonl", other), deduplicate=False)),
                   changed["text"])
    # at user level a text two users wrote is a record of each (dedup within one user), wherever the copies are
    urows = ([{"text": NEW, "user": "zed"}] + _rows(users=20) + [{"text": NEW, "user": "amy"}]
             + [{"text": NEW, "user": "zed"}])
    records, users = data.load_records_and_users(DataConfig(dataset=_write(tmp_path / "u.jsonl", urows),
                                                            privacy_unit="user"))
    assert sorted(u for r, u in zip(records, users) if r == NEW) == ["amy", "zed"]


def test_max_records_keeps_by_keyed_hash_not_file_order(tmp_path):
    rows = _rows()
    cfg = DataConfig(dataset=_write(tmp_path / "a.jsonl", rows), max_records=100)
    loaded = data.load_records_counted(cfg)
    assert len(loaded.records) == 100 and loaded.over_max_records == N - 100
    assert loaded.records != [r["text"] for r in rows[:100]]  # not the first 100 of the file
    assert any("max_records=100" in n for n in loaded.notes(cfg))
    before = set(loaded.records)
    for how, other, changed in _neighbours(rows, {"text": NEW}):
        after = set(data.load_records(DataConfig(dataset=_write(tmp_path / "b.jsonl", other), max_records=100)))
        moved = before ^ after
        # the changed record, and at most the one record it pushed past (or let back under) the cut
        assert len(moved - {changed["text"]}) <= 1 and len(moved) in (0, 2), how
        assert len(after) == 100


def test_max_records_keeps_the_smallest_draws_and_breaks_ties_by_text(tmp_path, monkeypatch):
    """The cap keeps the records of the smallest keyed draws; two equal draws (53-bit floats: about one capped load in
    10⁷ of a 50,000-record file) are ranked by text, so which one stays never depends on the file's order."""
    texts = [f"record number {i:02d} of the file, long enough to be kept" for i in range(12)]
    cfg = DataConfig(dataset=_write(tmp_path / "a.jsonl", [{"text": t} for t in texts]), max_records=5)
    draws = dict(zip(texts, data.keyed_draws(texts, key=cfg.split_seed, purpose="cap")))
    assert data.load_records(cfg) == [t for t in texts if draws[t] in sorted(draws.values())[:5]]
    # every record at one of three values: the cut falls inside a tie, which the texts decide
    tied = {t: [0.5, 0.25, 0.75][i % 3] for i, t in enumerate(texts)}
    monkeypatch.setattr(data, "keyed_draws", lambda contents, **_: [tied[t] for t in contents])
    ranked = sorted(texts, key=lambda t: (tied[t], t))[:5]
    assert data.load_records(cfg) == [t for t in texts if t in ranked]  # kept in file order
    cfg_reversed = DataConfig(dataset=_write(tmp_path / "b.jsonl", [{"text": t} for t in texts[::-1]]), max_records=5)
    assert sorted(data.load_records(cfg_reversed)) == sorted(ranked)


def test_public_fraction_of_the_private_file_is_refused_unless_simulated():
    with pytest.raises(ConfigError, match="put public records in public_dataset: FILE, or .a study only. set "
                                          "simulate_public_from_private: true"):
        parse_config(["--public_fraction", "0.1"])
    parse_config(["--public_fraction", "0.1", "--simulate_public_from_private", "true"])
    with pytest.raises(ConfigError, match="deduplicate=false needs privacy_unit=record"):
        parse_config(["--deduplicate", "false", "--privacy_unit", "user", "--max_records_per_user", "4"])


def test_same_file_same_split_and_a_rule_in_splits_json(tmp_path):
    rows = _rows()
    cfg = DataConfig(dataset=_write(tmp_path / "a.jsonl", rows))
    loaded = data.load_records_counted(cfg)
    a = data.make_splits(loaded.records, cfg)
    assert a == data.make_splits(list(loaded.records), cfg)
    out = a.to_json(loaded.records, cfg)
    assert out["split_rule"]["split_seed"] == 0 and out["split_rule"]["public"] == "none"
    assert "blake2b" in out["split_rule"]["draw"]


def test_the_console_says_where_every_record_went(tmp_path, caplog):
    """Issue 35, item 5: the training start prints how many records went where (private, console only)."""
    from dpllm.train import Trainer

    rows = _rows() + [dict(_rows()[4]), {"text": "short"}]
    cfg = parse_config(["--dataset", _write(tmp_path / "a.jsonl", rows), "--output_dir", str(tmp_path / "run"),
                        "--num_canaries", "4", "--heldout_fraction", "0.25", "--privacy.enabled", "false"])
    trainer = Trainer(cfg)
    trainer.setup_process()
    with caplog.at_level(logging.INFO, logger="dpllm.train"):
        trainer.setup_data()
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[private] data:")]
    s = trainer.data.splits
    trained = sum(c["included"] for c in trainer.data.canaries)
    assert line == (f"[private] data: {N + 2} records read; dropped 1 too short (min_chars=32), "
                    f"1 duplicate; {len(s.train)} train, {len(s.heldout)} held out (not trained on: eval and audits), "
                    f"0 public (none declared); 4 canaries ({trained} trained on)")
    assert len(s.train) + len(s.heldout) == N and 30 < len(s.heldout) < 90


def test_a_resumed_run_refuses_a_split_that_changed(tmp_path):
    path = tmp_path / "splits.json"
    path.write_text(json.dumps({"trained_sha256": sorted([data.sha256("a"), data.sha256("b")])}))
    with pytest.raises(data.DataError, match="predates dpllm's per-record split rule.*1 differ"):
        data.check_resumed_split(path, {data.sha256("a")})
    data.check_resumed_split(path, {data.sha256("a"), data.sha256("b")})  # the same members: resumes


# ---- issue 46: one record (or user) changes nothing about how the others are trained ---------------------------

def _examples(tmp_path, rows: list[dict], name: str, *extra: str) -> dict[str, tuple[list[int], list[int]]]:
    """Each trained record's text → the (token ids, labels) its training example holds (labels = ids where every
    token is in the loss, as the plain-text collator makes them)."""
    from dpllm.sft import load_tokenizer
    from dpllm.train import Trainer

    cfg = parse_config(["--dataset", _write(tmp_path / f"{name}.jsonl", rows), "--output_dir", str(tmp_path / name),
                        "--privacy.enabled", "false", "--max_length", "64", *extra])
    trainer = Trainer(cfg)
    trainer.setup_process()
    trainer.setup_data()
    train_ds, _, _ = trainer.data.datasets(load_tokenizer(cfg.model), cfg.data)
    out = {}
    for text, item in zip(trainer.data.train_texts, (train_ds[i] for i in range(len(train_ds)))):
        ids, labels = (item["input_ids"], item["labels"]) if isinstance(item, dict) else (item, item)
        out[text] = (ids.tolist(), labels.tolist())
    return out


def test_one_plain_record_does_not_flip_the_format_of_the_others(tmp_path):
    """Item 1: 200 records whose texts happen to be JSON prompt/completion strings, ± one plain-text record. The
    format is the file's schema (a text column: plain text), so every record trained in both runs has the same
    training example in both; on the old code the 200 were SFT records (loss on the answer) without the plain
    record and plain text with it."""
    rows = [{"text": json.dumps({"completion": f"the answer is {i * 7}", "prompt": f"what is {i} times seven?"},
                                sort_keys=True)} for i in range(200)]
    plain = {"text": "one plain record of the file, a support ticket about a printer"}
    a = _examples(tmp_path, rows, "a")
    b = _examples(tmp_path, rows + [plain], "b")
    both = a.keys() & b.keys()
    assert len(both) > 120 and set(b) - set(a) <= {plain["text"]}
    assert all(a[t] == b[t] for t in both), sum(a[t] != b[t] for t in both)
    t = next(iter(both))
    assert a[t][1] == a[t][0]  # plain text: every token is in the loss
    # data_format: text is honoured, and a declared shape the columns cannot hold is refused with what to change
    assert _examples(tmp_path, rows, "c", "--data_format", "text") == a
    with pytest.raises(data.DataError, match="data_format=prompt_completion needs the column"):
        _examples(tmp_path, rows, "d", "--data_format", "prompt_completion")


def _kept_by_user(cfg: DataConfig, k) -> tuple[dict[str, set], dict[str, set]]:
    """Each user's trained records after the cap (one fixed key) and each held-out user's records, as texts."""
    loaded = data.load_records_counted(cfg)
    s = data.make_splits(loaded.records, cfg, loaded.users)
    cap = user_level.cap_users(s.train, loaded.users, k, torch.Generator().manual_seed(0), texts=loaded.records)
    heldout: dict[str, set] = {}
    for i in s.heldout:
        heldout.setdefault(loaded.users[i], set()).add(loaded.records[i])
    return {u: {loaded.records[i] for i in ids} for u, ids in cap["by_user"].items()}, heldout


@pytest.mark.parametrize("k", [None, 3])
def test_a_new_user_who_shares_a_text_takes_no_record_from_another(tmp_path, k):
    """Item 2: a newcomer whose id sorts first writes a text an existing training user wrote (one the cap keeps).
    On the old code deduplication gave the text to the newcomer, so the existing user lost it (and with
    max_records_per_user the cap picked another record in its place); now every existing user keeps the same
    records, and the shared text is trained for both users."""
    rows = _rows(users=40)
    opts = {"privacy_unit": "user", "heldout_fraction": 0.25}
    before, _ = _kept_by_user(DataConfig(dataset=_write(tmp_path / "a.jsonl", rows), **opts), k)
    victim = next(u for u in sorted(before) if len(before[u]) == (k or 6))
    shared = sorted(before[victim])[0]
    for newcomer in ("a-newcomer", "zz-newcomer"):  # sorts before and after every existing user
        after, _ = _kept_by_user(DataConfig(dataset=_write(tmp_path / "b.jsonl", rows + [
            {"text": shared, "user": newcomer}, {"text": NEW, "user": newcomer}]), **opts), k)
        assert {u: after[u] for u in before} == before, newcomer
    # a held-out user's copy of a trained text is no non-member: it leaves the held-out split, never the training one
    heldout_user = next(u for u in sorted({r["user"] for r in rows}) if u not in before)
    text = next(r["text"] for r in rows if r["user"] == heldout_user)
    cfg = DataConfig(dataset=_write(tmp_path / "c.jsonl", rows + [{"text": text, "user": victim}]), **opts)
    trained, heldout = _kept_by_user(cfg, None)
    assert text in trained[victim] and text not in heldout[heldout_user]


def test_record_fraction_keeps_each_record_by_itself(tmp_path):
    """Item 6: with max_records one record added to a file pushed a kept record out (add/remove became replace),
    while the card said add/remove. record_fraction keeps a record iff its own keyed draw is under the fraction:
    about fraction·N records, and no record added or removed moves another (max_records on a file of one's own
    is refused under DP: the next test)."""
    rows = _rows()
    kept = set(data.load_records(DataConfig(dataset=_write(tmp_path / "a.jsonl", rows), record_fraction=0.5)))
    assert 90 < len(kept) < 150  # Binomial(240, 1/2): mean 120, sd 7.7
    for how, other, changed in _neighbours(rows, {"text": NEW}):
        after = set(data.load_records(DataConfig(dataset=_write(tmp_path / "b.jsonl", other), record_fraction=0.5)))
        assert after - {changed["text"]} == kept - {changed["text"]}, how
    assert len(kept) < len(set(data.load_records(DataConfig(dataset=str(tmp_path / "a.jsonl"),
                                                            record_fraction=0.75)))) < N
    with pytest.raises(ConfigError, match=r"record_fraction=1.5 must be in \(0, 1\]"):
        parse_config(["--record_fraction", "1.5"])


def test_max_records_is_refused_on_a_private_file_under_dp(tmp_path):
    """Item 6: on the old code a DP run on a file took max_records (and its card said add/remove one record)."""
    from dpllm.train import Trainer

    rows = _rows()

    def setup(dataset: str, *extra: str):
        trainer = Trainer(parse_config(["--dataset", dataset, "--output_dir", str(tmp_path / "run"),
                                        "--max_records", "100", *extra]))
        trainer.setup_process()
        trainer.setup_data()
        return trainer.data

    path = _write(tmp_path / "a.jsonl", rows)
    with pytest.raises(data.DataError, match="max_records=100 keeps a count.*Use record_fraction .each record kept "
                                             "by a keyed hash of its own text; e.g. record_fraction: 0.42"):
        setup(path)
    assert not (tmp_path / "run" / "splits.json").exists()
    assert len(setup(path, "--privacy.enabled", "false").records) == 100  # no DP: no relation to keep
    small = _write(tmp_path / "small.jsonl", rows[:99])  # 99 records, 100 with one more: no neighbour is cut
    assert len(setup(small).records) == 99
    assert len(setup("pydoc").records) == 100  # a built-in public corpus: nobody's file to hand a neighbour of


def test_a_count_kept_from_a_builtin_corpus_is_stated_in_the_released_relation():
    """Item 6, built-in corpora: max_records still ranks records there (a public corpus, the demo's), so the
    released relation says the ε is for a record of the kept set, not of the corpus; a file's run says add/remove."""
    from dpllm.export import neighbouring_relation
    from dpllm.privacy.report import PrivacyReport

    def report(dataset, cap):
        return PrivacyReport(enabled=True, num_records=100, steps=10, logical_batch_size=8, physical_batch_size=8,
                             stages=[{"name": "s", "enabled": True, "dataset": dataset, "max_records": cap}])

    ranked = neighbouring_relation(report("pystdlib", 2000))
    assert ranked.startswith("add or remove one record of the at most 2,000 that max_records kept")
    assert "built-in public corpus pystdlib" in ranked and "replaces a kept record" in ranked
    assert neighbouring_relation(report("pystdlib", None)) == "add or remove one record"
    # a file under DP reaches this point only when no neighbour is cut (run_data refuses the rest): add/remove holds
    assert neighbouring_relation(report("notes.jsonl", 100)) == "add or remove one record"
