"""Long records split into windows, the record still the privacy unit (``data.long_records: split``, issue 48).

A record of L > ``max_length`` = T tokens becomes ⌈L/T⌉ consecutive windows of T tokens (the last one shorter),
of which the first ``max_windows`` are kept. Each window is a row of the batch; the record is the unit:

1. *Sampling.* Records, not windows, are Poisson-sampled: the engine's sampler over units
   (:class:`dpllm.privacy.user_level.UserPoissonBatchSampler`, the one user-level sampling uses) takes each
   record's windows as the unit's rows, at the record-level rate q = B/N over the N source records.
2. *Clipping.* The record's gradient, the **sum** of its windows' gradients, is clipped once to C (bk: per-unit
   norms with the cross terms between a unit's rows, :class:`dpllm.privacy.bk.layers.Units` with weight 1; hooks:
   :class:`dpllm.privacy.user_level.UserLevelDPOptimizer` with ``reduction="sum"``), and a record's windows are in
   one backward pass (``max_windows`` ≤ ``physical_batch_size``).
3. *Accounting.* Adding or removing one record adds or removes one clipped vector of norm ≤ C from one step's
   sum, sampled with probability q: the Gaussian mechanism of record-level DP-SGD, so the plan, σ and ε are
   exactly the record level's over N records (no group privacy: what user-level ELS does with k records does not
   apply, as one record's windows are never sampled apart).

*Overlap* (``data.window_stride`` = s, the overlap Hugging Face tokenizers call ``stride``): each window after the
first starts with the last s tokens of the window before it, as context only (labels -100), then T − s new tokens;
windows start at 0, T − s, 2(T − s), ... so a record has max(1, ⌈(L − s)/(T − s)⌉) of them. Every token but the
record's first is then a target exactly once, and each one after the first window is predicted from at least s
tokens before it (without overlap a window's first token is predicted from nothing and counts in no loss). The
sampling, the clip of the sum over a record's windows, the cap and the accounting are those above.

Nothing about one record's windows depends on another record: they are its own tokens, cut by position, and the
cap keeps its first ``max_windows`` windows. The splits (``splits.json``) are drawn per source record as ever, so
all windows of a record are in one split.

    >>> [len(w) for w in cut([1, 2, 3, 4, 5, 6, 7], max_length=3, max_windows=8)[0]]
    [3, 3, 1]
    >>> cut(list(range(10)), max_length=3, max_windows=2)
    ([[0, 1, 2], [3, 4, 5]], 2)
    >>> cut(list(range(10)), max_length=4, max_windows=8, stride=1)  # each later window: 1 context, 3 new
    ([[0, 1, 2, 3], [3, 4, 5, 6], [6, 7, 8, 9]], 0)
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch
from torch.utils.data import Dataset

from dpllm import truncation
from dpllm.errors import DataError

log = logging.getLogger(__name__)


def cut(ids: Sequence[int], *, max_length: int, max_windows: int, stride: int = 0) -> tuple[list[list[int]], int]:
    """One record's token ids as consecutive windows of ``max_length``, each after the first opening with the last
    ``stride`` tokens of the one before: its first ``max_windows`` windows, and how many the cap dropped (a function
    of this record's ids alone)."""
    check_stride(stride, max_length)
    ids, step = list(ids), max_length - stride
    starts = [0] + list(range(step, len(ids) - stride, step))  # a later window holds ≥ 1 new token
    windows = [ids[i: i + max_length] for i in starts]
    return windows[:max_windows], max(0, len(windows) - max_windows)


def check_stride(stride: int, max_length: int) -> None:
    """Raises DataError unless 0 ≤ ``stride`` < ``max_length`` (a window must add at least one new token)."""
    if not 0 <= stride < max_length:
        raise DataError(f"window_stride={stride} must be ≥ 0 and < the window length max_length={max_length} (the "
                        "tokens a window repeats from the one before, as context); lower it")


def labelled(window: Sequence[int], labels: Optional[Sequence[int]], context: int) -> dict:
    """One window as a row: ``input_ids`` and ``labels`` (the record's own labels, or its ids), -100 on the first
    ``context`` tokens (repeated from the window before: context, never a target twice)."""
    ids = torch.tensor(list(window), dtype=torch.long)
    lab = ids.clone() if labels is None else torch.tensor(list(labels), dtype=torch.long)
    lab[:context] = -100
    return {"input_ids": ids, "labels": lab}


class WindowedRecords(Dataset):
    """Every record's windows, one row each (the rows of one record contiguous, in record order).

    ``WindowedRecords(texts, tokenizer, ...)`` tokenizes whole texts (the recipe); :meth:`of_rows` cuts token rows
    a caller tokenized, with their labels (``DPTrainer``). A row is ``{"input_ids", "labels"}``.

    Attributes:
        items: the windows' ids, each a 1-D LongTensor of at most ``max_length`` ids.
        rows: the windows as rows: ``input_ids`` and ``labels`` (-100 on the ``stride`` context tokens of every
            window after a record's first).
        record_of: the source record (its position in ``texts``) of each window: the privacy unit.
        num_records: the source records, the N of the privacy plan.
        truncation: :func:`dpllm.truncation.summarize` with the split's counts (records split, windows, windows
            and tokens the cap dropped).
    """

    def __init__(self, texts: Sequence[str], tokenizer, max_length: int, max_windows: int, stride: int = 0):
        if not texts:
            raise DataError("no records to tokenize")
        # whole records: every kept window needs its tokens (the cap is by position, after the cut)
        # (verbose=False: a record longer than the model's context is the point here, not a mistake to warn about)
        full = tokenizer(list(texts), truncation=False, verbose=False)["input_ids"]
        self._build(full, None, max_length=max_length, max_windows=max_windows, stride=stride)

    @classmethod
    def of_rows(cls, ids: Sequence[Sequence[int]], labels: Sequence[Sequence[int]], *, max_length: int,
                max_windows: int, stride: int = 0) -> "WindowedRecords":
        """The windows of records already tokenized whole: ``ids[r]`` and ``labels[r]`` of record r (-100 where
        the record's own labels keep a token out of the loss; cut with the ids)."""
        if not ids:
            raise DataError("no records to cut into windows")
        out = cls.__new__(cls)
        out._build(ids, labels, max_length=max_length, max_windows=max_windows, stride=stride)
        return out

    def _build(self, full, labels, *, max_length: int, max_windows: int, stride: int) -> None:
        self.items: list[torch.Tensor] = []
        self.rows: list[dict] = []
        self.record_of: list[int] = []
        for r, ids in enumerate(full):
            ids = [int(x) for x in ids]
            windows, _ = cut(ids, max_length=max_length, max_windows=max_windows, stride=stride)
            lab = None if labels is None else [int(x) for x in labels[r]]
            step = max_length - stride
            for k, w in enumerate(windows):
                row = labelled(w, None if lab is None else lab[k * step: k * step + len(w)], stride if k else 0)
                self.rows.append(row)
                self.items.append(row["input_ids"])
            self.record_of += [r] * len(windows)
        self.num_records = len(full)
        self.truncation = truncation.summarize_split([len(x) for x in full], max_length=max_length,
                                                     max_windows=max_windows, stride=stride)
        short = sum(int((x["labels"][1:] != -100).sum()) == 0 for x in self.rows)
        if short:
            log.warning("%d windows have no token to predict and add no loss", short)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]

    @property
    def num_tokens(self) -> int:
        return sum(len(x) for x in self.items)

    def units(self) -> list[list[int]]:
        """Each source record's window rows (dataset positions), the units the sampler draws."""
        out: list[list[int]] = [[] for _ in range(self.num_records)]
        for pos, r in enumerate(self.record_of):
            out[r].append(pos)
        return out
