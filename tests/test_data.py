import json

import pytest
import torch

from dpllm.config import DataConfig
from dpllm.data import DataError, TokenizedRecords, load_records, make_canaries, make_collate, make_splits
from dpllm.models import byte_tokenizer


def test_pydoc_corpus_ships_with_python():
    records = load_records(DataConfig())
    assert len(records) > 1000
    assert len(set(records)) == len(records)
    assert all(len(r) >= 32 for r in records)
    assert records == load_records(DataConfig())  # deterministic: splits.json ids index this list


def test_local_formats(tmp_path):
    para = "A record long enough to pass the filter of thirty-two characters."
    (tmp_path / "a.jsonl").write_text(json.dumps({"body": para}) + "\n" + json.dumps({"body": para + " 2"}) + "\n")
    (tmp_path / "a.csv").write_text("id,body\n1," + para + "\n2," + para + " 3\n")
    (tmp_path / "a.txt").write_text(para + "\ncontinues here\n\n" + para + " 4\n\n\n")
    assert load_records(DataConfig(dataset=str(tmp_path / "a.jsonl"), text_column="body")) == [para, para + " 2"]
    assert load_records(DataConfig(dataset=str(tmp_path / "a.csv"), text_column="body"))[1] == para + " 3"
    # txt: one record per blank-line separated paragraph, whitespace folded
    assert load_records(DataConfig(dataset=str(tmp_path / "a.txt"))) == [para + " continues here", para + " 4"]


def test_duplicates_dropped_so_no_record_is_both_member_and_not(tmp_path):
    para = "The same paragraph, twice, is one person's text counted twice."
    (tmp_path / "d.jsonl").write_text((json.dumps({"text": para}) + "\n") * 3)
    assert load_records(DataConfig(dataset=str(tmp_path / "d.jsonl"))) == [para]


def test_unsupported_file_type(tmp_path):
    (tmp_path / "x.parquet").write_text("")
    with pytest.raises(DataError, match="unsupported file type"):
        load_records(DataConfig(dataset=str(tmp_path / "x.parquet")))


def test_splits_are_disjoint_deterministic_and_cover():
    cfg = DataConfig(public_fraction=0.3, heldout_fraction=0.2, split_seed=7)
    a, b = make_splits(1000, cfg), make_splits(1000, cfg)
    assert a == b
    assert sorted(a.public + a.train + a.heldout) == list(range(1000))
    assert len(a.public) == 300 and len(a.heldout) == 140 and len(a.train) == 560
    assert make_splits(1000, DataConfig(split_seed=8)).train != make_splits(1000, DataConfig(split_seed=7)).train


def test_canaries_flip_a_fair_coin_each():
    canaries = make_canaries(DataConfig(num_canaries=2000, canary_seed=3))
    included = sum(c["included"] for c in canaries)
    assert 900 < included < 1100  # Binomial(2000, 1/2): ±4.5 standard deviations
    assert len({c["text"] for c in canaries}) == 2000


def test_truncation_and_padding_mask():
    tok = byte_tokenizer()
    ds = TokenizedRecords(["x" * 100, "short"], tok, max_length=16)
    assert len(ds[0]) == 16 and len(ds[1]) == 6  # 5 bytes + eos
    batch = make_collate(tok.pad_token_id)([ds[0], ds[1]])
    assert batch["input_ids"].shape == (2, 16)
    assert (batch["labels"][1, 6:] == -100).all() and (batch["attention_mask"][1, 6:] == 0).all()
    assert torch.equal(batch["labels"][0], batch["input_ids"][0])


def test_atomic_writes_have_normal_permissions_and_leave_nothing_on_error(tmp_path):
    import os

    from dpllm.io import atomic_directory, write_json_atomic

    write_json_atomic(tmp_path / "r.json", {"a": 1})
    assert (os.stat(tmp_path / "r.json").st_mode & 0o777) == 0o666 & ~_umask()
    with atomic_directory(tmp_path / "ckpt") as d:
        (d / "x").write_text("1")
    assert (tmp_path / "ckpt" / "x").read_text() == "1"
    with pytest.raises(RuntimeError):
        with atomic_directory(tmp_path / "ckpt") as d:
            (d / "x").write_text("2")
            raise RuntimeError("crash mid-write")
    assert (tmp_path / "ckpt" / "x").read_text() == "1"  # the old checkpoint survives
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "r.json"]  # no temp dir left


def _umask():
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask
