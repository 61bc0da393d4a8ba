"""Is a pre-tokenized ``train_dataset`` one record per row? The packing recipes that are not are refused (issue 49).

At ``privacy_unit="record"`` one row must be one record: DP-SGD protects a row. A dataset packed the way
transformers' ``run_clm.py`` does it (records concatenated, then cut into blocks by ``group_texts``) mixes several
records in one row and cuts one record across rows, so a row-level guarantee says nothing about a record. Its
variants (the last short block kept, a ``text`` column decoded from each block) must not pass as records. The
evidence, any one of which refuses:

1. **A record boundary inside a row**: the token the tokenizer itself puts at the start of every text (Llama's
   BOS) after some text, or the one it puts at the end (ByT5's EOS) before more text. Rows whose labels mask
   tokens (-100, a prompt left out of the loss) are not read this way: chat templates may repeat those tokens
   between turns (Llama 2 puts BOS before every user turn), while ``group_texts`` copies the ids into the labels.
2. **Rows of exactly the block length that are not shown to be cut from a longer record**: at least 7 in 8 of the
   rows (:data:`FULL_SHARE`, and at least :data:`MIN_ROWS`) have the longest row's length, most of those have no
   record text that is longer than the row, and (where the tokenizer adds a start or end token) most of them do
   not begin and end with it, as every tokenized record does. One-record-per-row data reaches that length where
   ``truncation=True`` cut a longer record, which its text column shows (a text column decoded from the block is
   no longer than the block), or where its records share one template's length, which at 7 in 8 is rare.

Neither applies at ``privacy_unit="sequence"``, where the user declares the block to be the unit
(:mod:`dpllm.privacy.sequence_level`).
"""

from __future__ import annotations

from typing import Optional, Sequence

MIN_ROWS = 8  # fewer rows than this say nothing about block lengths
FULL_SHARE = 7 / 8  # packed blocks: all rows full but the last of each map() batch; honest records rarely so alike
SLACK = 1  # a text decoded from a row may re-tokenize to a token more (BPE merges at the cut): not a longer record


def edge_tokens(tokenizer) -> tuple[Optional[int], Optional[int]]:
    """The special tokens the tokenizer puts at the start and at the end of every text (None where it adds none)."""
    probe = "a b"
    with_sp = list(tokenizer(probe)["input_ids"])
    without = list(tokenizer(probe, add_special_tokens=False)["input_ids"])
    special = set(tokenizer.all_special_ids)
    if len(with_sp) <= len(without):
        return None, None
    start = with_sp[0] if with_sp[0] in special and with_sp[: 1] != without[: 1] else None
    end = with_sp[-1] if with_sp[-1] in special and with_sp[-1:] != without[-1:] else None
    return start, end


def crosses(ids: Sequence[int], *, start: Optional[int], end: Optional[int], special: set) -> bool:
    """A text starts or ends inside ``ids``: the start token after some text, or text after the end token."""
    content = ended = False
    for t in ids:
        if t in special:
            if t == start and content:
                return True
            if t == end and content:
                ended = True
        elif ended:
            return True
        else:
            content = True
    return False


def evidence(rows: Sequence[Sequence[int]], cut: Sequence[Optional[int]], tokenizer, *, text_column: str,
             masked: Optional[Sequence[bool]] = None) -> str:
    """Why ``rows`` look packed ('' when they do not).

    Args:
        rows: every row's token ids (padding removed).
        masked: per row, whether its labels leave some tokens out of the loss (-100); None: none do.
        cut: per row, how many tokens of its record's text lie past the row (None: the row has no text).
        tokenizer: the tokenizer the rows came from.
        text_column: the column the texts came from (named in the evidence).
    """
    start, end = edge_tokens(tokenizer)
    special = set(tokenizer.all_special_ids)
    n = len(rows)
    masked = masked if masked is not None else [False] * n
    crossing = sum(crosses(r, start=start, end=end, special=special) for r, m in zip(rows, masked) if not m) \
        if start or end else 0
    if crossing >= 2 or (crossing and crossing == n):
        names = " / ".join(repr(tokenizer.convert_ids_to_tokens(t)) for t in (start, end) if t is not None)
        return (f"{crossing:,} of {n:,} rows hold the end of one text and the start of another (the {names} token "
                "that the tokenizer puts at every text's edge sits inside the row)")
    longest = max((len(r) for r in rows), default=0)
    full = [i for i, r in enumerate(rows) if len(r) == longest]
    # group_texts leaves at most one short block per map() batch, so nearly every row is full; records of one
    # template can share a length too (22 of 32 in a test of ours), so a mere majority says nothing
    if n < MIN_ROWS or len(full) < FULL_SHARE * n:
        return ""
    if (start is not None or end is not None) and 2 * sum(_edged(rows[i], start, end) for i in full) > len(full):
        return ""  # most full rows begin and end as the tokenizer begins and ends a text: records, not blocks
    unexplained = [i for i in full if cut[i] is None or cut[i] <= SLACK]
    if 2 * len(unexplained) <= len(full):
        return ""
    why = (f"and no {text_column!r} column shows a longer record behind them" if all(cut[i] is None for i in full)
           else f"and for {len(unexplained):,} of them the {text_column!r} column is no longer than the row itself")
    return f"{len(full):,} of {n:,} rows have exactly {longest:,} tokens, the block length, {why}"


def _edged(ids: Sequence[int], start: Optional[int], end: Optional[int]) -> bool:
    """The row starts with the tokenizer's start token and ends with its end token (those it adds; truncation keeps
    them), as a tokenized record does and a block cut from the concatenation does only by chance."""
    return bool(ids) and (start is None or ids[0] == start) and (end is None or ids[-1] == end)


def refusal(name: str, found: str, *, text_column: str, string_columns: Sequence[str], has_text: bool,
            block: int) -> str:
    """The refusal for packed rows: the evidence, then the two honest ways on (never one that passes packed data)."""
    others = [c for c in string_columns if c != text_column]
    if not has_text and others:
        keep = (f"if {others[0]!r} holds each row's whole record, name it: "
                f"PrivacyArguments(record_text_column={others[0]!r}); otherwise ")
    else:
        keep = ""
    return (f"DPTrainer: {name} looks like packed data (texts concatenated and cut into blocks, as run_clm.py's "
            f"group_texts does): {found}. A row then mixes several records and one record is cut across rows, so "
            f"DP over rows would not protect a record. Either {keep}tokenize one record per row (tokenizer(text, "
            f"truncation=True, max_length=...), no group_texts) and keep each record's own text, as it is in your "
            f"source, in a {text_column!r} column (dpllm compares it with the row); or, if one block is what you mean "
            f"to protect, declare it: PrivacyArguments(privacy_unit='sequence'), and ε will protect one block of "
            f"{block:,} tokens, with the ε of a record cut across two blocks (a group of 2) reported beside it")
