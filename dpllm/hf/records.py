"""Rows of a Trainer dataset as dpllm records: one row is one record, the privacy unit.

A row needs ``input_ids``; ``labels`` (with -100 on tokens kept out of the loss) and ``attention_mask``
(rows padded in advance are stripped back to their real tokens) are optional. Each record's text (the
``text_column`` if the row has it, else its decoded tokens) goes to ``OUTPUT_DIR/records.jsonl`` so that
``python -m mia audit`` can read members and non-members back as it does for any dpllm run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.data import Dataset

from dpllm.config import ConfigError

# Rows that all have exactly this many tokens or more, none padded and with no text of their own, are almost
# certainly blocks cut from concatenated records (run_clm's group_texts), where one row mixes records.
_PACKED_MIN_ROWS = 8


class Rows(Dataset):
    """Records as ``{"input_ids", "labels"}`` 1-D LongTensors, and their texts."""

    def __init__(self, items: list[dict], texts: list[str]):
        self.items, self.texts = items, texts

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
