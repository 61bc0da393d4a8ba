"""DPTrainer and packed data (issue 49 item 1, issue 48's declared sequence unit): run_clm-style blocks are never
certified as records; declared as sequences they train, and the report says what one unit was."""

from __future__ import annotations

import json
from itertools import chain

import pytest
from datasets import Dataset
from transformers import TrainingArguments, default_data_collator

from dpllm.config import ConfigError
from dpllm.hf import DPTrainer, PrivacyArguments
from dpllm.hf.packed import crosses
from tests.helpers import tiny_model

SAFE = dict(report_to="none", disable_tqdm=True, use_cpu=True, max_grad_norm=0.0)
BLOCK = 32
# Forty short "notes", two patients' worth of text in many blocks once concatenated.
NOTES = [f"Patient {i}: seen on day {i % 7}, {'stable' if i % 3 else 'follow-up needed'}; dose {i * 5} mg."
         for i in range(40)]


def _args(out, **kw):
    return TrainingArguments(output_dir=str(out), **{**SAFE, **kw})


def group_texts(examples, *, keep_last: bool):
    """transformers' run_clm.py group_texts; keep_last keeps the short block at the end of each map batch."""
    joined = {k: list(chain(*examples[k])) for k in examples}
    total = len(joined["input_ids"])
    if not keep_last:
        total = total // BLOCK * BLOCK
    out = {k: [t[i: i + BLOCK] for i in range(0, total, BLOCK)] for k, t in joined.items()}
    out["labels"] = [list(x) for x in out["input_ids"]]
    return out


def run_clm_blocks(tok, *, keep_last: bool, specials: bool = True, decoded_text: bool = False):
    raw = Dataset.from_dict({"text": NOTES})
    ids = raw.map(lambda b: tok(b["text"], add_special_tokens=specials), batched=True, remove_columns=["text"])
    blocks = ids.map(lambda b: group_texts(b, keep_last=keep_last), batched=True, batch_size=10)
    if decoded_text:  # "keep its text in a 'text' column": the block decoded, not a record of the source
        blocks = blocks.map(lambda row: {"text": tok.decode(row["input_ids"], skip_special_tokens=True)})
    return blocks


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


@pytest.mark.parametrize("specials", [True, False], ids=["eos-in-rows", "no-edge-tokens"])
@pytest.mark.parametrize("variant", ["keep_last_block", "decoded_text_column"])
def test_run_clm_packing_variants_are_refused_as_records(tmp_path, tiny, variant, specials):
    """Both variants that passed the old all-rows-equal heuristic (the last short block of each map batch kept; a
    decoded 'text' column added), with the tokenizer's end token inside rows and without any edge token (GPT-2)."""
    model, tok = tiny
    blocks = run_clm_blocks(tok, keep_last=variant == "keep_last_block", specials=specials,
                            decoded_text=variant == "decoded_text_column")
    lengths = [len(r) for r in blocks["input_ids"]]
    if variant == "keep_last_block":
        assert len(set(lengths)) > 1  # not all rows alike: the old refusal did not fire
    trainer = DPTrainer(model=model, args=_args(tmp_path / "run", max_steps=1), train_dataset=blocks,
                        processing_class=tok, data_collator=default_data_collator)
    with pytest.raises(ConfigError, match="looks like packed data") as err:
        trainer.train()
    msg = str(err.value)
    assert "PrivacyArguments(privacy_unit='sequence')" in msg and f"one block of {BLOCK} tokens" in msg
    assert "own text, as it is in your source" in msg  # never "add a decoded text column"
    assert ("inside the row" in msg) == specials  # which evidence: the end token inside, or the block lengths
    assert not any((tmp_path / "run").iterdir())


def test_refusal_names_record_text_column_when_another_text_column_is_there(tmp_path, tiny):
    model, tok = tiny
    blocks = run_clm_blocks(tok, keep_last=True, specials=False)
    blocks = blocks.map(lambda row: {"note": "a whole note"})
    with pytest.raises(ConfigError, match=r"PrivacyArguments\(record_text_column='note'\)"):
        DPTrainer(model=model, args=_args(tmp_path / "run", max_steps=1), train_dataset=blocks,
                  processing_class=tok).train()


def test_a_start_token_after_text_is_a_record_boundary():
    special = {1, 2}
    assert crosses([1, 5, 6, 1, 7], start=1, end=None, special=special)  # Llama: BOS after text
    assert not crosses([1, 1, 5, 6, 7], start=1, end=None, special=special)  # a doubled BOS at the start
    assert crosses([5, 6, 2, 7], start=None, end=2, special=special)  # ByT5: text after EOS
    assert not crosses([5, 6, 7, 2, 0], start=None, end=2, special={0, 1, 2})  # EOS, then padding


def test_turns_of_one_chat_with_masked_prompts_are_not_a_boundary(tiny):
    """A pre-tokenized conversation whose template repeats the edge token between turns (Llama 2: BOS before every
    user turn; here ByT5's EOS after every turn) is one record when its labels mask the prompts; the same ids with
    every token in the loss, as group_texts leaves them, are read as two texts in one row."""
    from dpllm.hf.packed import evidence

    _, tok = tiny
    rows = [tok(f"question {i}?")["input_ids"] + tok("answer " * (1 + i % 3))["input_ids"] for i in range(10)]
    cut = [None] * len(rows)
    assert evidence(rows, cut, tok, text_column="text", masked=[True] * len(rows)) == ""
    assert "10 of 10 rows hold the end of one text" in evidence(rows, cut, tok, text_column="text")


def test_one_record_per_row_with_long_records_trains_and_reports_truncation(tmp_path, tiny):
    """Rows cut by truncation=True fill max_length like blocks do, but their text shows the longer record behind
    them: they train, and the report counts what the cut removed (computed here from the texts alone)."""
    from dpllm.export import export

    model, tok = tiny
    texts = [n[:30] for n in NOTES[:6]] + [n * 3 for n in NOTES[6:16]]  # 10 of 16 records longer than 48 tokens
    ds = Dataset.from_dict({"text": texts}).map(lambda b: tok(b["text"], truncation=True, max_length=48), batched=True)
    assert sum(len(r) == 48 for r in ds["input_ids"]) >= 8
    trainer = DPTrainer(model=model, args=_args(tmp_path / "run", max_steps=1, per_device_train_batch_size=8),
                        privacy_args=PrivacyArguments(target_epsilon=8, logical_batch_size=8), train_dataset=ds,
                        processing_class=tok)
    trainer.train()
    full = [len(tok(t)["input_ids"]) for t in texts]
    lost = sorted(n - 48 for n in full if n > 48)
    data = json.loads((tmp_path / "run" / "privacy_report.json").read_text())["data"]
    assert data["truncated_records"] == len(lost) == 10 and data["records"] == 16
    assert data["tokens_total"] == sum(full) and data["tokens_kept"] == sum(min(n, 48) for n in full)
    assert data["tokens_lost_max"] == lost[-1] and data["tokens_lost_median"] == (lost[4] + lost[5]) / 2
    assert data["max_length_for_all"] == max(full)
    bundle = export(tmp_path / "run", tmp_path / "bundle", declare_public=["truncation"])
    card = (bundle / "README.md").read_text()
    assert "10 of 16 training records" in card
    assert f"{sum(full) - data['tokens_kept']:,} of {sum(full):,} tokens" in card
    assert f"max_length={max(full):,} keeps every record whole" in card
    withheld = (export(tmp_path / "run", tmp_path / "bundle2") / "README.md").read_text()
    assert "10 of 16" not in withheld and "--declare-public truncation" in withheld


def test_declared_sequence_unit_trains_a_run_clm_script_end_to_end(tmp_path, tiny, capsys):
    """run_clm.py's data path unchanged (tokenize, group_texts, default_data_collator), the DPTrainer swap and
    privacy_unit='sequence': N counts blocks, the report, `dpllm report` and the card say one unit is one block,
    with the ε of a record cut across two blocks beside it, and the run directory verifies."""
    from dpllm import ledger
    from dpllm.cli import main as dpllm_main
    from dpllm.export import export

    model, tok = tiny
    blocks = run_clm_blocks(tok, keep_last=False)
    trainer = DPTrainer(model=model, args=_args(tmp_path / "run", max_steps=2, per_device_train_batch_size=8),
                        privacy_args=PrivacyArguments(target_epsilon=8, logical_batch_size=8, privacy_unit="sequence"),
                        train_dataset=blocks, processing_class=tok, data_collator=default_data_collator)
    trainer.train()
    out = tmp_path / "run"
    report = json.loads((out / "privacy_report.json").read_text())
    seq = report["sequence_level"]
    assert report["privacy_unit"] == "sequence" and report["num_records"] == len(blocks)
    assert seq["tokens_per_sequence"] == BLOCK and seq["group_size"] == 2
    assert seq["group_epsilon"] > report["epsilon"] > 0 and "data" not in report
    assert ledger.verify(out).ok, ledger.verify(out).message
    capsys.readouterr()
    assert dpllm_main(["report", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"one protected unit is one sequence of {BLOCK} consecutive tokens" in printed
    assert f"protected as a group of 2 (ε = {seq['group_epsilon']:.3f}" in printed
    assert f"N = {len(blocks):,} sequences (unit: sequence)" in printed
    card = (export(out, tmp_path / "bundle") / "README.md").read_text()
    assert f"one sequence of {BLOCK} consecutive tokens" in card and "at the level of one **sequence**" in card
    assert f"**add or remove one sequence (a block of {BLOCK} tokens of the concatenated training texts)**" in card
    assert f"tokens_per_sequence: {BLOCK}" in card  # the Hub metadata block
    assert "Long records" not in card and "which sequences the model was trained on" in card


def test_the_recipe_refuses_the_sequence_unit_before_writing(tmp_path, capsys):
    """privacy_unit: sequence is a DPTrainer declaration over its blocks; the recipe trains one record per row."""
    from tests.helpers import load_recipe

    data = tmp_path / "notes.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in NOTES))
    out = tmp_path / "run"
    assert load_recipe("finetune_llm").cli(["--dataset", str(data), "--output_dir", str(out), "--privacy_unit",
                                            "sequence", "--max_steps", "1", "--progress", "false"]) == 2
    assert "privacy_unit=sequence" in capsys.readouterr().err and not out.exists()


def test_records_of_one_template_are_not_taken_for_blocks(tiny):
    """Honest rows whose records share a length (a template: 22 of 32 at the longest in test_qlora_runs) were refused
    as packed by a majority-length rule. Rows that begin and end as the tokenizer begins and ends a text are records;
    without edge tokens, fewer than 7 in 8 rows at the longest length say nothing."""
    from dpllm.hf.packed import evidence

    _, tok = tiny
    texts = [f"Record {i}: the quick brown fox number {i}." for i in range(40)]
    rows = [tok(t)["input_ids"] for t in texts]  # ByT5 ends every text with its end token
    assert evidence(rows, [0] * len(rows), tok, text_column="text") == ""
    bare = [tok(t, add_special_tokens=False)["input_ids"] for t in texts[:32]]  # 22 of 32 at the longest length
    assert sum(len(r) == max(map(len, bare)) for r in bare) == 22
    assert evidence(bare, [0] * len(bare), tok, text_column="text") == ""
    # the same length rule still refuses blocks: nearly every row full, not shown to be cut from a longer record
    blocks = [r[:8] for r in bare] + [bare[0][:5]]
    assert "rows have exactly 8 tokens, the block length" in evidence(blocks, [0] * len(blocks), tok,
                                                                      text_column="text")
