"""Masking to the answer: token ids and labels of SFT records, -100 on every token the loss skips.

    encode                  segments → input_ids and labels: -100 on every prompt token (``loss_on: answer``),
                            or on none (``loss_on: all``); truncated to ``max_length`` on the right
    drop_cut_answers        before the privacy plan: a record whose answer ``max_length`` cuts off entirely is
                            reported and leaves the train and held-out splits (never trained on zero tokens)
    SFTRecords, PadRecords  the encoded records, and right-padded batches of them (-100 on padding)
    make_datasets           a run's training and held-out records and their collator
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch.utils.data import Dataset

from dpllm import truncation
from dpllm.config import DataConfig
from dpllm.errors import DataError
from dpllm.sft.records import format_of, needs_template, parse
from dpllm.sft.render import adds_bos, prepare_tokenizer, segments

log = logging.getLogger(__name__)


def encode(record: dict, tokenizer, *, max_length: int, loss_on: str = "answer") -> dict:
    """``{"input_ids", "labels", "answer_tokens", "full_length"}`` of one record, truncated to ``max_length`` on the
    right (``full_length``: its token count before the cut).

    Each piece is tokenized on its own (no special tokens added; a plain prompt/completion gets the
    tokenizer's BOS in front when it adds one), so no token straddles the prompt/answer boundary.
    ``answer_tokens`` counts the answer tokens that are predicted (position ≥ 1) after truncation.
    """
    pieces = segments(record, tokenizer)
    ids: list[int] = []
    answer: list[bool] = []
    if "messages" not in record and not isinstance(record.get("prompt"), list) and adds_bos(tokenizer):
        ids, answer = [tokenizer.bos_token_id], [False]
    for text, is_answer in pieces:
        t = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += t
        answer += [is_answer] * len(t)
    full = len(ids)
    ids, answer = ids[:max_length], answer[:max_length]
    input_ids = torch.tensor(ids, dtype=torch.long)
    mask = torch.tensor(answer, dtype=torch.bool)
    labels = input_ids.clone() if loss_on == "all" else input_ids.masked_fill(~mask, -100)
    return {"input_ids": input_ids, "labels": labels, "answer_tokens": int(mask[1:].sum()), "full_length": full}


def answer_fits(records: Sequence[str], tokenizer, *, max_length: int) -> list[bool]:
    """Whether each record keeps at least one predicted answer token within ``max_length``."""
    return [encode(parse(r), tokenizer, max_length=max_length)["answer_tokens"] > 0 for r in records]


def drop_cut_answers(records: Sequence[str], splits, tokenizer, *, max_length: int,
                     chat_template: Optional[str] = None, fmt: Optional[str] = None) -> list[int]:
    """Remove records whose answer ``max_length`` cuts off entirely from ``splits.train`` and ``.heldout``.

    They are reported (a warning, and ``splits.json``'s ``sft.dropped_no_answer``) and are neither members
    nor held out: training on them would train on zero tokens, and they have no answer to evaluate.

    Args:
        fmt: the data set's record shape (``Loaded.sft_format``); None guesses it from the records.

    Returns:
        The dropped record ids.

    Raises:
        DataError: conversations and no chat template (see :func:`prepare_tokenizer`), or no record left.
    """
    fmt = fmt or format_of(records)
    prepare_tokenizer(tokenizer, chat_template, needed=needs_template(records, fmt))
    ids = sorted(set(splits.train) | set(splits.heldout))
    fits = answer_fits([records[i] for i in ids], tokenizer, max_length=max_length)
    dropped = [i for i, ok in zip(ids, fits) if not ok]
    if dropped:
        gone = set(dropped)
        splits.train = [i for i in splits.train if i not in gone]
        splits.heldout = [i for i in splits.heldout if i not in gone]
        log.warning("sft: %d record(s) lose their whole answer to max_length=%d and are dropped before training "
                    "(e.g. record %d); raise max_length to keep them", len(dropped), max_length, dropped[0])
        if not splits.train:
            raise DataError(f"every training record loses its answer to max_length={max_length}; raise max_length")
    return dropped


class SFTRecords(Dataset):
    """Encoded SFT records: ``{"input_ids", "labels"}`` per item, as :class:`PadRecords` batches.

    Raises:
        DataError: a record with no answer token left (:func:`drop_cut_answers` should have removed it).
    """

    def __init__(self, records: Sequence[str], tokenizer, *, max_length: int, loss_on: str = "answer"):
        self.records = list(records)
        self.items = []
        full = []
        for i, r in enumerate(self.records):
            enc = encode(parse(r), tokenizer, max_length=max_length, loss_on=loss_on)
            if enc["answer_tokens"] == 0:
                raise DataError(f"record {i} has no answer token within max_length={max_length}; raise max_length")
            self.items.append({"input_ids": enc["input_ids"], "labels": enc["labels"]})
            full.append(enc["full_length"])
        self.truncation = truncation.summarize(full, max_length=max_length)  # what the cut removed (issue 49)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]

    @property
    def num_tokens(self) -> int:
        return sum(len(x["input_ids"]) for x in self.items)


@dataclass
class PadRecords:
    """Right-pad records into a batch; labels are -100 on padding, as :func:`dpllm.data.make_collate`."""

    pad_token_id: int

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        if not rows:
            return {}
        T = max(1, max(len(r["input_ids"]) for r in rows))
        ids = torch.full((len(rows), T), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), T), dtype=torch.long)
        labels = torch.full((len(rows), T), -100, dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            ids[i, :n], mask[i, :n], labels[i, :n] = r["input_ids"], 1, r["labels"]
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def make_datasets(train_texts, eval_texts, tokenizer, cfg: DataConfig, *, fmt: Optional[str] = None):
    """``(train_ds, eval_ds, collate)`` of a run: training labels as ``loss_on`` says; held-out ones
    always answer-only (the held-out metric is the answer's loss). ``fmt``: the data set's record shape
    (``Loaded.sft_format``); None guesses it from the records (callers with SFT records only)."""
    fmt = fmt or format_of(list(train_texts) + list(eval_texts))
    prepare_tokenizer(tokenizer, cfg.chat_template, needed=needs_template(train_texts, fmt))
    train = SFTRecords(train_texts, tokenizer, max_length=cfg.max_length, loss_on=cfg.loss_on)
    heldout = SFTRecords(eval_texts, tokenizer, max_length=cfg.max_length, loss_on="answer") if eval_texts else []
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return train, heldout, PadRecords(pad if pad is not None else 0)
