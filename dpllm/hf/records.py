"""Rows of a Trainer dataset as dpllm records: one row is one record, the privacy unit.

A row needs ``input_ids``; ``labels`` (with -100 on tokens kept out of the loss) and ``attention_mask``
(rows padded in advance are stripped back to their real tokens) are optional. Each record's text (the
``text_column`` if the row has it, else its decoded tokens) goes to ``OUTPUT_DIR/records.jsonl`` so that
``python -m mia audit`` can read members and non-members back as it does for any dpllm run.
"""

from __future__ import annotations

import logging

import torch
from torch.utils.data import Dataset

from dpllm.config import ConfigError
from dpllm.sft import PadRecords, SFTArguments, canonical, encode, needs_template, parse, prepare_tokenizer

log = logging.getLogger(__name__)

# Rows that all have exactly this many tokens or more, none padded and with no text of their own, are almost
# certainly blocks cut from concatenated records (run_clm's group_texts), where one row mixes records.
_PACKED_MIN_ROWS = 8


class Rows(Dataset):
    """Records as ``{"input_ids", "labels"}`` 1-D LongTensors, their texts, and the SFT record shape of the
    dataset's columns (``fmt``; None for token rows)."""

    def __init__(self, items: list[dict], texts: list[str], fmt=None):
        self.items, self.texts, self.fmt = items, texts, fmt

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]

    @property
    def max_length(self) -> int:
        return max((len(x["input_ids"]) for x in self.items), default=2)


def _tensor(value) -> torch.Tensor:
    return torch.as_tensor(value, dtype=torch.long).reshape(-1)


def rows_of(dataset, tokenizer, *, text_column: str, name: str) -> Rows:
    """Read every row of ``dataset`` (a ``datasets.Dataset`` or any map-style dataset of dicts).

    Raises:
        ConfigError: a row without ``input_ids``, or rows that look packed (see ``_PACKED_MIN_ROWS``).
    """
    items, texts, padded, has_text = [], [], False, False
    for i in range(len(dataset)):
        row = dataset[i]
        if not isinstance(row, dict) or "input_ids" not in row:
            raise ConfigError(f"DPTrainer: {name} row {i} has no input_ids (got {type(row).__name__}"
                              f"{' with keys ' + str(sorted(row)) if isinstance(row, dict) else ''}); tokenize the "
                              "dataset first (dataset.map(tokenize))")
        ids = _tensor(row["input_ids"])
        labels = _tensor(row["labels"]) if row.get("labels") is not None else ids.clone()
        if row.get("attention_mask") is not None:
            keep = _tensor(row["attention_mask"]).bool()
            padded |= bool((~keep).any())
            ids, labels = ids[keep], labels[keep]
        items.append({"input_ids": ids, "labels": labels})
        text = row.get(text_column)
        has_text |= isinstance(text, str)
        texts.append(text.strip() if isinstance(text, str) else tokenizer.decode(ids, skip_special_tokens=True).strip())
    lengths = {len(x["input_ids"]) for x in items}
    if len(items) >= _PACKED_MIN_ROWS and len(lengths) == 1 and not padded and not has_text:
        raise ConfigError(
            f"DPTrainer: every row of {name} has exactly {lengths.pop()} tokens, no padding and no "
            f"{text_column!r} column: this looks like packed data (records concatenated and cut into blocks), where "
            "one row mixes several records and DP no longer protects a record. Tokenize one record per row "
            f"(truncation=True, no group_texts) and keep its text in a {text_column!r} column")
    return Rows(items, texts)


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
    items, kept, dropped = [], [], 0
    for t in texts:
        enc = encode(parse(t), tokenizer, max_length=args.max_length, loss_on=loss_on)
        if enc["answer_tokens"] == 0:
            dropped += 1
            continue
        items.append({"input_ids": enc["input_ids"], "labels": enc["labels"]})
        kept.append(t)
    if dropped:
        log.warning("sft: %d row(s) of %s lose their whole answer to max_length=%d and are dropped before training",
                    dropped, name, args.max_length)
    if not items and name == "train_dataset":
        raise ConfigError(f"DPTrainer: every row of {name} loses its answer to max_length={args.max_length}; raise it")
    return Rows(items, kept, fmt)


__all__ = ["PadRecords", "Rows", "rows_of", "trainer_rows"]
