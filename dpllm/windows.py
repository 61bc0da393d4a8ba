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

Nothing about one record's windows depends on another record: they are its own tokens, cut by position, and the
cap keeps its first ``max_windows`` windows. The splits (``splits.json``) are drawn per source record as ever, so
all windows of a record are in one split.

    >>> [len(w) for w in cut([1, 2, 3, 4, 5, 6, 7], max_length=3, max_windows=8)[0]]
    [3, 3, 1]
    >>> cut(list(range(10)), max_length=3, max_windows=2)
    ([[0, 1, 2], [3, 4, 5]], 2)
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch
from torch.utils.data import Dataset

from dpllm import truncation
from dpllm.errors import DataError

log = logging.getLogger(__name__)


def cut(ids: Sequence[int], *, max_length: int, max_windows: int) -> tuple[list[list[int]], int]:
    """One record's token ids as consecutive windows of ``max_length``: its first ``max_windows`` ones, and how
    many windows the cap dropped (a function of this record's ids alone)."""
    ids = list(ids)
    windows = [ids[i: i + max_length] for i in range(0, max(1, len(ids)), max_length)]
    return windows[:max_windows], max(0, len(windows) - max_windows)


class WindowedRecords(Dataset):
    """Every record's windows, one row each (the rows of one record contiguous, in record order).

    Attributes:
        items: the windows, each a 1-D LongTensor of at most ``max_length`` ids.
        record_of: the source record (its position in ``texts``) of each window: the privacy unit.
        num_records: the source records, the N of the privacy plan.
        truncation: :func:`dpllm.truncation.summarize` with the split's counts (records split, windows, windows
            and tokens the cap dropped).
    """

    def __init__(self, texts: Sequence[str], tokenizer, max_length: int, max_windows: int):
        if not texts:
            raise DataError("no records to tokenize")
        # whole records: every kept window needs its tokens (the cap is by position, after the cut)
        # (verbose=False: a record longer than the model's context is the point here, not a mistake to warn about)
        full = tokenizer(list(texts), truncation=False, verbose=False)["input_ids"]
        self.items: list[torch.Tensor] = []
        self.record_of: list[int] = []
        for r, ids in enumerate(full):
            windows, _ = cut(ids, max_length=max_length, max_windows=max_windows)
            self.items += [torch.tensor(w, dtype=torch.long) for w in windows]
            self.record_of += [r] * len(windows)
        self.num_records = len(full)
        self.truncation = truncation.summarize_split([len(x) for x in full], max_length=max_length,
                                                     max_windows=max_windows)
        short = sum(len(x) < 2 for x in self.items)
        if short:
            log.warning("%d windows have < 2 tokens and add no loss", short)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.items[i]

    @property
    def num_tokens(self) -> int:
        return sum(len(x) for x in self.items)

    def units(self) -> list[list[int]]:
        """Each source record's window rows (dataset positions), the units the sampler draws."""
        out: list[list[int]] = [[] for _ in range(self.num_records)]
        for pos, r in enumerate(self.record_of):
            out[r].append(pos)
        return out
