"""Cyclic Poisson sampling: b groups fixed by each record alone; at step t, group t mod b is Poisson-sampled.

A record's group is a keyed hash of its own text (the key public, as the data split's): adding or removing
one record moves no other record's group, which the add/remove-one neighbouring relation on the file needs.
Under user-level sampling (ULS) the unit is a user: the group is a keyed hash of the user's id, and a sampled
user brings all of its records (``unit_records``), so a user, like a record, joins only its group's steps.
Each record can therefore join only the steps of its group, which are b apart: the participation pattern
under which b-banded MF has the privacy of DP-SGD at the group's rate q_b over ⌈T/b⌉ steps
(:mod:`dpllm.privacy.correlated`).

Example:
    >>> import torch
    >>> groups = assign_groups([f"record {i}" for i in range(6)], bands=3, key=0)
    >>> groups
    [2, 0, 2, 1, 1, 1]
    >>> s = CyclicPoissonBatchSampler(groups=groups, bands=3, sample_rate=1.0, generator=torch.Generator())
    >>> it = iter(s); next(it), next(it), next(it), next(it)  # all of group 0, 1, 2, then 0 again
    ([1], [3, 4, 5], [0, 2], [1])
"""

from __future__ import annotations

import hashlib
from typing import Iterator, Optional, Sequence

import torch

from dpllm.sampling import PoissonBatchSampler


def record_group(content: str, *, bands: int, key: int) -> int:
    """The group in 0 … bands−1 of a record with this text: a keyed hash of the text alone."""
    h = hashlib.blake2b(content.encode("utf-8"), digest_size=8, key=f"dpllm:cyclic-group:{int(key)}".encode()[:64])
    return int.from_bytes(h.digest(), "big") % bands


def assign_groups(texts: Sequence[str], *, bands: int, key: int) -> list[int]:
    """Every record's group (:func:`record_group`), in dataset order."""
    return [record_group(t, bands=bands, key=key) for t in texts]


class CyclicPoissonBatchSampler(PoissonBatchSampler):
    """At step t (counted from ``start``), each record of group ``t mod bands`` joins with probability
    ``sample_rate`` (q_b); no record of another group joins. Yields this process's share, forever.

    The draws are those of :class:`PoissonBatchSampler` (one uniform per record per step, from the same
    generator), then masked by group: with one band it yields exactly the batches Poisson sampling would.
    ``start`` is the step a resumed run continues from (the group turn is a function of the step).

    ``unit_records`` (ULS): ``groups`` are then the units' (users') groups, the draw is over units, and each sampled
    unit yields its records' dataset indices, contiguous, as :class:`dpllm.privacy.user_level.UserPoissonBatchSampler`
    does (``user_of`` maps a record back to its unit); a unit u goes to the process u ≡ rank (mod W) with all its
    records. With one band the batches are that sampler's, draw for draw.
    """

    def __init__(self, *, groups: Sequence[int], bands: int, sample_rate: float, generator: torch.Generator,
                 rank: int = 0, world_size: int = 1, start: int = 0,
                 unit_records: Optional[Sequence[Sequence[int]]] = None):
        super().__init__(num_samples=len(groups), sample_rate=sample_rate, generator=generator, rank=rank,
                         world_size=world_size)
        self.groups = torch.as_tensor(list(groups), dtype=torch.long)
        if len(self.groups) and not (0 <= int(self.groups.min()) and int(self.groups.max()) < bands):
            raise ValueError(f"record groups must lie in 0 … {bands - 1}")
        self.bands, self.start = int(bands), int(start)
        self.unit_records = None if unit_records is None else [list(r) for r in unit_records]
        if self.unit_records is not None:
            if len(self.unit_records) != len(self.groups):
                raise ValueError(f"{len(self.groups)} unit groups for {len(self.unit_records)} units")
            self.user_of = {i: u for u, recs in enumerate(self.unit_records) for i in recs}

    def __iter__(self) -> Iterator[list[int]]:
        t = self.start
        while True:
            mask = torch.rand(self.num_samples, generator=self.generator) < self.sample_rate
            if self.bands > 1:
                mask &= self.groups == t % self.bands
            ids = mask.nonzero(as_tuple=False).reshape(-1)
            mine = ids[ids % self.world_size == self.rank].tolist()
            yield mine if self.unit_records is None else [i for u in mine for i in self.unit_records[u]]
            t += 1
