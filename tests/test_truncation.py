"""What max_length cuts off is said (issue 49 item 2): the console (one WARNING line), the privacy report's ``data``,
``dpllm report``; none cut says none. The counts are recomputed here from the trained texts alone."""

from __future__ import annotations

import doctest
import json
import logging

from dpllm import truncation
from dpllm.data import load_split_texts
from dpllm.models import byte_tokenizer
from dpllm.privacy import sequence_level
from tests.helpers import load_recipe

FAST = ["--max_steps", "1", "--logical_batch_size", "16", "--physical_batch_size", "16", "--max_length", "64",
        "--tiny_hidden_size", "32", "--tiny_num_heads", "2", "--eval_every", "0", "--eval_max_records", "8",
        "--progress", "false", "--min_chars", "0"]
recipe = load_recipe("finetune_llm")


def _run(tmp_path, texts, caplog):
    data = tmp_path / "notes.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="dpllm.train"):
        assert recipe.cli([*FAST, "--dataset", str(data), "--output_dir", str(out)]) == 0
    return out


def test_truncated_records_are_counted_in_the_console_report_and_dpllm_report(tmp_path, caplog, capsys):
    from dpllm.compliance import cli_main as report_main

    texts = [f"note {i}: " + ("long history of the patient, " * (2 + i % 4) if i % 3 == 0 else "fine")
             for i in range(48)]
    out = _run(tmp_path, texts, caplog)
    tok = byte_tokenizer()
    full = [len(tok(t)["input_ids"]) for t in load_split_texts(out, "train")]
    lost = sorted(n - 64 for n in full if n > 64)
    assert 0 < len(lost) < len(full)
    data = json.loads((out / "privacy_report.json").read_text())["data"]
    assert data == truncation.summarize(full, max_length=64)
    assert data["truncated_records"] == len(lost) and data["tokens_lost_max"] == lost[-1]
    assert data["tokens_total"] - data["tokens_kept"] == sum(lost)
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "max_length=64" in r.getMessage()]
    assert len(warned) == 1 and warned[0].getMessage().startswith("[private] data: ")
    line = warned[0].getMessage()
    assert f"{len(lost)} of {len(full)} training records" in line and f"max {lost[-1]})" in line
    assert f"max_length={max(full)} keeps every record whole" in line and "long_records: split" in line
    capsys.readouterr()
    assert report_main([str(out)]) == 0
    assert f"data: {len(lost)} of {len(full)} training records" in capsys.readouterr().out


def test_no_truncation_says_none():
    """Records that fit: the summary counts none cut, and the report's line for `dpllm report` says so."""
    from dpllm.data import TokenizedRecords
    from dpllm.privacy.report import PrivacyReport

    tok = byte_tokenizer()
    texts = [f"short note {i}" for i in range(12)]
    s = TokenizedRecords(texts, tok, 64).truncation
    assert s["truncated_records"] == 0 and s["tokens_total"] == s["tokens_kept"] == sum(len(t) + 1 for t in texts)
    report = PrivacyReport(enabled=False, num_records=12, steps=1, logical_batch_size=4, physical_batch_size=4, data=s)
    assert report.details() == [f"data: no training record was truncated: all 12 fit in max_length=64 tokens (the "
                                f"longest has {max(len(t) for t in texts) + 1})"]


def test_a_huge_record_is_counted_in_pieces():
    """Past the tokenizer shortcut's window a record's length is counted in pieces, never tokenized whole; the
    pieces' count is within a token per piece of the true one (bytes here: exact)."""
    from dpllm.data import TokenizedRecords

    tok = byte_tokenizer()
    big = "word ünïcödé " * 20_000
    s = TokenizedRecords([big, "short"], tok, 32).truncation
    assert s["estimated_records"] == 1 and s["truncated_records"] == 1
    assert s["max_length_for_all"] == len(tok(big)["input_ids"])


def test_doctests():
    assert doctest.testmod(truncation).failed == 0
    assert doctest.testmod(sequence_level).failed == 0


def test_sft_records_count_what_the_cut_removed():
    """Chat / instruction records: the answer's tail past max_length is counted as lost (bytes: one token each)."""
    from dpllm import sft

    tok = byte_tokenizer()
    long = sft.canonical({"prompt": "q", "completion": "y" * 90}, "prompt_completion", where="t")
    short = sft.canonical({"prompt": "q", "completion": "yes"}, "prompt_completion", where="t")
    s = sft.SFTRecords([long, short], tok, max_length=40).truncation
    full = [len(tok(p, add_special_tokens=False)["input_ids"]) for r in (long, short)
            for p in ["".join(text for text, _ in sft.segments(sft.parse(r), tok))]]
    assert s["truncated_records"] == 1 and s["tokens_total"] == sum(full)
    assert s["tokens_lost_max"] == full[0] - 40
