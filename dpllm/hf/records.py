"""Rows of a Trainer dataset as dpllm records: one row is one record, the privacy unit (or, declared with
``privacy_unit="sequence"``, one packed block: :mod:`dpllm.hf.packed` refuses packed rows otherwise; with
``privacy_unit="user"`` a record of the user its ``user_column`` names; with ``long_records="split"`` a whole record
that :mod:`dpllm.windows` cuts into windows).

A row needs ``input_ids``; ``labels`` (with -100 on tokens kept out of the loss) and ``attention_mask``
(rows padded in advance are stripped back to their real tokens) are optional. Each record's text (the
``text_column`` if the row has it, else its decoded tokens) goes to ``OUTPUT_DIR/records.jsonl`` so that
``python -m mia audit`` can read members and non-members back as it does for any dpllm run.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch.utils.data import Dataset

from dpllm import truncation
from dpllm.config import ConfigError
from dpllm.hf import packed
from dpllm.sft import PadRecords, SFTArguments, canonical, encode, needs_template, parse, prepare_tokenizer

log = logging.getLogger(__name__)


class Rows(Dataset):
    """Records as ``{"input_ids", "labels"}`` 1-D LongTensors, their texts, the SFT record shape of the
    dataset's columns (``fmt``; None for token rows), ``truncation``: what ``max_length`` cut off them
    (:mod:`dpllm.truncation`; None where not counted), ``users``: each row's user (``privacy_unit="user"``; else
    None) and ``full_lengths``: each record's untruncated token count (None where unknown)."""

    def __init__(self, items: list[dict], texts: list[str], fmt=None, users: Optional[list[str]] = None):
        self.items, self.texts, self.fmt, self.users = items, texts, fmt, users
        self.truncation: Optional[dict] = None
        self.full_lengths: Optional[list[int]] = None

    def select(self, positions: list[int]) -> "Rows":
        """These rows only (in this order), their truncation counted again over them."""
        out = Rows([self.items[i] for i in positions], [self.texts[i] for i in positions], self.fmt,
                   None if self.users is None else [self.users[i] for i in positions])
        out.truncation = self.truncation
        if self.full_lengths is not None and positions:
            out.full_lengths = [self.full_lengths[i] for i in positions]
            out.truncation = truncation.summarize(out.full_lengths, max_length=self.max_length)
        return out

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]

    @property
    def max_length(self) -> int:
        return max((len(x["input_ids"]) for x in self.items), default=2)


def _tensor(value) -> torch.Tensor:
    return torch.as_tensor(value, dtype=torch.long).reshape(-1)


def rows_of(dataset, tokenizer, *, text_column: str, name: str, unit: str = "record",
            user_column: Optional[str] = None, whole: bool = False) -> Rows:
    """Read every row of ``dataset`` (a ``datasets.Dataset`` or any map-style dataset of dicts).

    At ``unit="record"`` or ``"user"`` the rows must be records (:mod:`dpllm.hf.packed` refuses packed blocks), and
    the rows' ``truncation`` (:mod:`dpllm.truncation`) says how many records their ``text_column`` shows were cut; at
    ``unit="sequence"`` a row is a declared block and its text is its decoded tokens.

    Args:
        user_column: each row's user is read from this column (``privacy_unit="user"``).
        whole: rows must hold whole records (``long_records="split"`` cuts them into windows itself).

    Raises:
        ConfigError: a row without ``input_ids`` (or without ``user_column``), rows that look packed, or (``whole``)
            a row its text shows was cut at tokenization.
    """
    items, texts, own, users = [], [], [], []
    for i in range(len(dataset)):
        row = dataset[i]
        if not isinstance(row, dict) or "input_ids" not in row:
            raise ConfigError(f"DPTrainer: {name} row {i} has no input_ids (got {type(row).__name__}"
                              f"{' with keys ' + str(sorted(row)) if isinstance(row, dict) else ''}); tokenize the "
                              "dataset first (dataset.map(tokenize))")
        if user_column is not None:
            if row.get(user_column) is None:
                raise ConfigError(f"DPTrainer: {name} row {i} has no user in column {user_column!r} "
                                  f"(privacy_unit='user' groups rows by user; columns: {sorted(row)}); add it, or "
                                  "name the column with PrivacyArguments(user_column=...)")
            users.append(str(row[user_column]))
        ids = _tensor(row["input_ids"])
        labels = _tensor(row["labels"]) if row.get("labels") is not None else ids.clone()
        if row.get("attention_mask") is not None:
            keep = _tensor(row["attention_mask"]).bool()
            ids, labels = ids[keep], labels[keep]
        items.append({"input_ids": ids, "labels": labels})
        text = row.get(text_column) if unit != "sequence" else None
        own.append(text if isinstance(text, str) else None)
        texts.append(text.strip() if isinstance(text, str) else tokenizer.decode(ids, skip_special_tokens=True).strip())
    rows = Rows(items, texts, users=users if user_column is not None else None)
    if unit == "sequence" or not items:
        return rows
    cut = _tokens_past_row(items, own, tokenizer)
    if whole:
        _check_whole(cut, name, text_column)
    ids = [x["input_ids"].tolist() for x in items]
    found = packed.evidence(ids, cut, tokenizer, text_column=text_column,
                            masked=[bool((x["labels"] == -100).any()) for x in items])
    if found:
        first = dataset[0]
        strings = [k for k, v in first.items() if isinstance(v, str)] if isinstance(first, dict) else []
        raise ConfigError(packed.refusal(name, found, text_column=text_column, string_columns=strings,
                                         has_text=any(t is not None for t in own), block=rows.max_length))
    if any(c is None for c in cut):
        rows.truncation = truncation.unknown(rows.max_length, f"{name} rows have no {text_column!r} column to compare "
                                             "with; keep each record's text in one (PrivacyArguments("
                                             "record_text_column=...)) and dpllm counts what tokenization cut off")
    else:
        rows.full_lengths = [len(x) + max(0, c) for x, c in zip(ids, cut)]
        rows.truncation = truncation.summarize(rows.full_lengths, max_length=rows.max_length)
    return rows


def _check_whole(cut: list, name: str, text_column: str) -> None:
    """``long_records="split"``: a row shorter than its record's text was cut at tokenization, and the windows
    would miss the rest; refuse it (rows without a text to compare with are taken as whole)."""
    short = [i for i, c in enumerate(cut) if c is not None and c > 0]
    if short:
        raise ConfigError(f"DPTrainer: long_records='split' cuts whole records into windows, but {len(short)} row(s) "
                          f"of {name} (first: row {short[0]}, {cut[short[0]]} tokens short of its {text_column!r} "
                          "text) were cut at tokenization; tokenize without truncation=True / max_length")
    if any(c is None for c in cut):
        log.warning("DPTrainer: long_records='split': %s rows have no %r column, so whether tokenization cut them is "
                    "unknown; they are split as they are", name, text_column)


def _tokens_past_row(items: list[dict], texts: list, tokenizer) -> list:
    """Per row, how many more text tokens its record's text has than the row (None: no text); special tokens the
    tokenizer adds are left out on both sides, so a row cut by ``truncation=True`` counts what the cut removed."""
    special = set(tokenizer.all_special_ids)
    with_text = [i for i, t in enumerate(texts) if t is not None]
    out: list = [None] * len(items)
    if with_text:
        enc = tokenizer([texts[i] for i in with_text], add_special_tokens=False)["input_ids"]
        for i, t in zip(with_text, enc):
            row = sum(int(x) not in special for x in items[i]["input_ids"].tolist())
            out[i] = sum(x not in special for x in t) - row
    return out


def trainer_rows(dataset, tokenizer, args: SFTArguments, *, name: str, loss_on: str):
    """The rows of an untokenized SFT dataset as :class:`Rows` (texts: canonical records).

    Records whose answer ``max_length`` cuts off entirely are reported and dropped here, before the plan.
    """
    if args.loss_on not in ("answer", "all"):
        raise ConfigError(f"SFTArguments.loss_on={args.loss_on!r}; choose answer or all")
    cols = list(dataset[0])
    fmt = "messages" if "messages" in cols else "prompt_completion"
    texts = [canonical(dataset[i], fmt, where=f"DPTrainer: {name} row {i}") for i in range(len(dataset))]
    prepare_tokenizer(tokenizer, args.chat_template, needed=needs_template(texts, fmt))
    items, kept, full, dropped = [], [], [], 0
    for t in texts:
        enc = encode(parse(t), tokenizer, max_length=args.max_length, loss_on=loss_on)
        if enc["answer_tokens"] == 0:
            dropped += 1
            continue
        items.append({"input_ids": enc["input_ids"], "labels": enc["labels"]})
        kept.append(t)
        full.append(enc["full_length"])
    if dropped:
        log.warning("sft: %d row(s) of %s lose their whole answer to max_length=%d and are dropped before training",
                    dropped, name, args.max_length)
    if not items and name == "train_dataset":
        raise ConfigError(f"DPTrainer: every row of {name} loses its answer to max_length={args.max_length}; raise it")
    rows = Rows(items, kept, fmt)
    rows.truncation = truncation.summarize(full, max_length=args.max_length) if items else None
    return rows


__all__ = ["PadRecords", "Rows", "rows_of", "trainer_rows"]
