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


def test_a_builtin_corpus_is_read_once_and_each_caller_gets_its_own_lists():
    """The built-in corpora come from this Python's installation: read once per process, the same records every
    time, and a caller that changes what it got changes nobody else's."""
    from dpllm.data import BUILTIN, BUILTIN_USERS, _builtin_corpus, _read_raw

    cfg = DataConfig(dataset="pydoc")
    first, users, _ = _read_raw(cfg)
    hits = _builtin_corpus.cache_info().hits
    first.append("changed by one caller")
    again, _, _ = _read_raw(cfg)
    assert _builtin_corpus.cache_info().hits == hits + 1  # not read again
    assert users is None and again == BUILTIN["pydoc"]() and again[-1] != "changed by one caller"
    texts, users, _ = _read_raw(DataConfig(dataset="pydoc", privacy_unit="user"))
    assert (texts, users) == tuple(BUILTIN_USERS["pydoc"]())


def test_local_formats(tmp_path):
    para = "A record long enough to pass the filter of thirty-two characters."
    (tmp_path / "a.jsonl").write_text(json.dumps({"body": para}) + "\n" + json.dumps({"body": para + " 2"}) + "\n")
    (tmp_path / "a.csv").write_text("id,body\n1," + para + "\n2," + para + " 3\n")
    (tmp_path / "a.txt").write_text(para + "\ncontinues here\n\n" + para + " 4\n\n\n")
    assert load_records(DataConfig(dataset=str(tmp_path / "a.jsonl"), text_column="body")) == [para, para + " 2"]
    assert load_records(DataConfig(dataset=str(tmp_path / "a.csv"), text_column="body"))[1] == para + " 3"
    # txt: one record per blank-line separated paragraph, whitespace folded
    assert load_records(DataConfig(dataset=str(tmp_path / "a.txt"))) == [para + " continues here", para + " 4"]


def test_a_jsonl_file_is_parsed_once_whatever_its_records_hold(tmp_path, monkeypatch):
    """The SFT reader (chat and instruction tables) and the plain-text reader share one parse of a .jsonl file:
    a million-record file is not read twice to find that it holds plain text."""
    import dpllm.io

    para = "A record long enough to pass the filter of thirty-two characters."
    plain, chat = tmp_path / "plain.jsonl", tmp_path / "chat.jsonl"
    plain.write_text("".join(json.dumps({"text": f"{para} {i}", "user": f"u{i % 3}"}) + "\n" for i in range(5)))
    chat.write_text("".join(json.dumps({"prompt": f"{para} {i}?", "completion": f"{para} {i}."}) + "\n"
                            for i in range(5)))
    parsed, real = [], dpllm.io.read_jsonl
    monkeypatch.setattr(dpllm.io, "read_jsonl", lambda path, **kw: parsed.append(str(path)) or real(path, **kw))
    assert load_records(DataConfig(dataset=str(plain))) == [f"{para} {i}" for i in range(5)]
    assert parsed == [str(plain)]
    from dpllm.data import load_records_and_users

    texts, users = load_records_and_users(DataConfig(dataset=str(plain), privacy_unit="user"))
    assert users == [f"u{i % 3}" for i in range(5)] and len(texts) == 5 and parsed == [str(plain)] * 2
    assert len(load_records(DataConfig(dataset=str(chat)))) == 5 and parsed[2:] == [str(chat)]
    # a bad line is still reported with its file and line, from the one parse
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": para}) + "\n{oops\n")
    with pytest.raises(DataError, match=r"bad.jsonl:2: not valid JSON"):
        load_records(DataConfig(dataset=str(tmp_path / "bad.jsonl")))
    assert parsed[3:] == [str(tmp_path / "bad.jsonl")]


def test_duplicates_dropped_so_no_record_is_both_member_and_not(tmp_path):
    para = "The same paragraph, twice, is one person's text counted twice."
    (tmp_path / "d.jsonl").write_text((json.dumps({"text": para}) + "\n") * 3)
    assert load_records(DataConfig(dataset=str(tmp_path / "d.jsonl"))) == [para]


def test_unsupported_file_type(tmp_path):
    (tmp_path / "x.xlsx").write_text("")
    with pytest.raises(DataError, match="unsupported file type"):
        load_records(DataConfig(dataset=str(tmp_path / "x.xlsx")))


def test_splits_are_disjoint_deterministic_and_cover():
    records = [f"record {i}" for i in range(1000)]
    cfg = DataConfig(public_fraction=0.3, heldout_fraction=0.2, split_seed=7, simulate_public_from_private=True)
    a, b = make_splits(records, cfg), make_splits(list(records), cfg)
    assert a == b
    assert sorted(a.public + a.train + a.heldout) == list(range(1000))
    # each record by its own keyed hash: Binomial counts around 300 / 140 / 560 (within ±4.5 standard deviations)
    assert abs(len(a.public) - 300) < 65 and abs(len(a.heldout) - 140) < 50 and len(a.train) == 1000 - len(
        a.public) - len(a.heldout)
    assert a.rule["split_seed"] == 7 and a.rule["public"].startswith("SIMULATED")
    assert make_splits(records, DataConfig(split_seed=8)).train != make_splits(records, DataConfig(split_seed=7)).train


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


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_new_token_canaries_grow_the_vocabulary_for_every_canary_alike(tmp_path, name):
    from dpllm.canaries import add_tokens, added_tokens
    from dpllm.config import ModelConfig
    from dpllm.models import build_tiny

    canaries = make_canaries(DataConfig(num_canaries=50, canary_design="new_token", canary_seed=5))
    new = added_tokens(canaries)
    # members and non-members both: a vocabulary holding only the members' tokens would publish the coins
    assert len(new) == 50 and 10 < sum(c["included"] for c in canaries) < 40
    tok = byte_tokenizer()
    model = build_tiny(ModelConfig(model_name_or_path=name), tok, 32)
    old = len(tok)
    tables = (model.get_input_embeddings, model.get_output_embeddings)
    before = [get().weight.detach().clone() for get in tables]
    assert add_tokens(model, tok, new) == 50 and len(tok) == old + 50
    for get, was in zip(tables, before):
        w = get().weight
        assert w.shape[0] == old + 50 and torch.equal(w[:old], was)
        # every new row starts at the mean of the old ones: no canary starts ahead of another
        assert torch.allclose(w[old:], w[:old].mean(0).expand(50, -1), atol=0, rtol=0)
    ids = tok(canaries[7]["text"])["input_ids"]
    assert ids[:-1] == tok("§", add_special_tokens=False)["input_ids"] + [old + 7] and ids[-1] == tok.eos_token_id
    # a later stage from a saved checkpoint already has them: nothing is added, trained rows are kept
    tok.save_pretrained(tmp_path)
    again = type(tok).from_pretrained(tmp_path)
    assert again(canaries[7]["text"])["input_ids"] == ids
    w = model.get_output_embeddings().weight
    with torch.no_grad():
        w[old + 7] += 1.0
    assert add_tokens(model, again, new) == 0 and w[old + 7].sub(w[old]).abs().max() == 1.0


def test_new_token_canaries_need_full_finetuning():
    from dpllm.config import ConfigError, RunConfig, validate

    cfg = RunConfig()
    cfg.data.num_canaries, cfg.data.canary_design, cfg.model.finetuning = 10, "new_token", "lora"
    with pytest.raises(ConfigError, match="finetuning: full"):
        validate(cfg)
    cfg.model.finetuning = "full"
    validate(cfg)


def _byte_cases():
    import random

    rng = random.Random(0)
    alphabet = "ab c\n\té€😀中\x00>/s"
    texts = ["", " ", "plain ascii", "héllo wörld 😀 中文", "a < b and c > d", "<pad> x </s>", "x<extra_id_3>y",
             "ends with </s>", "<unk>", "tab\tand\nnewline  ", "\x00\x01 control",
             # near misses: "<" and ">" around what is not an added token (plain bytes)
             "<pad", "pad>", "<PAD>", "< /s>", "<extra_id_>", "<extra_id_999>", "<<unk>>", "<</s", "if a<b: <div>"]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 90))) for _ in range(200)]
    texts += [t[:5] + "<" + t[5:] for t in texts[-20:]] + [t + " </s> " + t for t in texts[-10:]]
    return texts


@pytest.mark.parametrize("kwargs", [{}, {"truncation": True, "max_length": 2}, {"truncation": True, "max_length": 7},
                                    {"truncation": True, "max_length": 64}, {"add_special_tokens": False},
                                    {"add_special_tokens": False, "truncation": True, "max_length": 5}],
                         ids=["whole", "cut2", "cut7", "cut64", "nospecial", "nospecial_cut5"])
def test_byte_ids_are_the_byte_tokenizers_own(kwargs, monkeypatch):
    """The byte tokenizer's ids by arithmetic equal what the tokenizer returns, for unicode, control characters,
    the empty text, and texts that hold (or nearly hold) its added tokens (those that hold one go through it)."""
    from dpllm.models import byte_ids, byte_tokenizer

    tok = byte_tokenizer()
    texts = _byte_cases()
    expected = tok(texts, **kwargs)["input_ids"]
    asked, real_call = [], type(tok).__call__
    monkeypatch.setattr(type(tok), "__call__", lambda self, batch, **kw: asked.extend(batch) or real_call(self, batch,
                                                                                                          **kw))
    fast = byte_ids(tok, texts, **kwargs)
    assert fast is not None and fast == expected
    # only the texts that hold an added token went through the tokenizer; the others (near misses too) by arithmetic
    holding = [t for t in texts if any(a in t for a in tok.added_tokens_encoder)]
    assert asked == holding and len(holding) >= 15 and len(texts) - len(holding) > 150
    assert "<extra_id_999>" not in asked and "<extra_id_3>" in "".join(asked)


def test_byte_ids_leave_other_tokenizers_and_settings_to_the_tokenizer():
    from transformers import ByT5Tokenizer

    from dpllm.models import byte_ids, byte_tokenizer

    class Custom(ByT5Tokenizer):
        pass

    assert byte_ids(Custom(), ["x"]) is None  # a subclass may tokenize otherwise
    left = byte_tokenizer()
    left.truncation_side = "left"
    assert byte_ids(left, ["xyz"], truncation=True, max_length=2) is None
    grown = byte_tokenizer()
    grown.add_tokens(["canary"])  # an added token without "<" can hide in any text
    assert byte_ids(grown, ["a canary"]) is None
    assert byte_ids(byte_tokenizer(), ["x"], truncation=True, max_length=1) is None


def test_each_byte_tokenizer_is_a_fresh_byt5_tokenizer_of_its_own():
    from transformers import ByT5Tokenizer

    from dpllm.models import byte_tokenizer

    built, copied = ByT5Tokenizer(), byte_tokenizer()
    texts = _byte_cases()
    assert type(copied) is ByT5Tokenizer and copied(texts)["input_ids"] == built(texts)["input_ids"]
    assert copied.get_vocab() == built.get_vocab() and copied.special_tokens_map == built.special_tokens_map
    assert copied.decode(copied("é <extra_id_3>")["input_ids"]) == built.decode(built("é <extra_id_3>")["input_ids"])
    copied.add_tokens(["canary"])
    copied.pad_token = "<unk>"
    again = byte_tokenizer()  # what one caller changed is not the next caller's
    assert len(copied) == len(built) + 1 and len(again) == len(built) and again.pad_token == built.pad_token


def test_cut_with_the_arithmetic_equals_cut_through_the_tokenizer(monkeypatch):
    """TokenizedRecords' ids and token counts (truncation report) are the same with the byte tokenizer's arithmetic
    as through the tokenizer, on the pydoc corpus, one record long enough for the windowed count, and a few with
    added-token text."""
    import dpllm.models
    from dpllm.data import _cut, load_records
    from dpllm.models import byte_tokenizer

    tok = byte_tokenizer()
    texts = load_records(DataConfig(dataset="pydoc"))[:300] + ["x" * 9000 + " é" * 500, "a <pad> b", "<extra_id_1>"]
    fast = _cut(texts, tok, 48)
    monkeypatch.setattr(dpllm.models, "byte_ids", lambda *a, **k: None)
    assert fast == _cut(texts, tok, 48) and fast[2] == 1  # the long record counted in windows, as before
