"""Batch samplers for one or many processes, with random state that a checkpoint can save and restore.

Both samplers decide the *global* batch first and then hand each process its share, so a run on W
processes trains on exactly the batches a single process would (same seed, same logical batch size).

- :class:`PoissonBatchSampler` (private training): every record joins each logical batch independently
  with probability q, the sampling the accountants assume. All processes draw the same global mask from
  generators in the same state; process r keeps the selected records whose id ≡ r (mod W). Opacus's
  own distributed sampler skips a process's empty share, which desynchronises the processes' step
  counts; here an empty share is yielded as an empty batch and the trainer still steps (noise, accounting
  and the gradient all-reduce happen on every process).
- :class:`ShuffledBatchSampler` (non-private training): epoch-wise shuffles, global batches of exactly
  ``batch_size`` records (an epoch's remainder is dropped, so every process always has records and the
  gradient average needs no count from the others), no random state at all (batch k is a function of
  seed and k), so a resumed run starts at batch k.

Example:
    >>> import torch
    >>> def first_batch(rank=0, world_size=1):
    ...     g = torch.Generator().manual_seed(0)
    ...     return next(iter(PoissonBatchSampler(num_samples=10, sample_rate=0.5, generator=g, rank=rank,
    ...                                          world_size=world_size)))
    >>> sorted(first_batch(0, 2) + first_batch(1, 2)) == first_batch()
    True
"""

from __future__ import annotations

import hashlib
import itertools
from typing import Iterator

import torch
from opacus.utils.uniform_sampler import UniformWithReplacementSampler


def stream_seed(seed: int, stream: str) -> int:
    """A 63-bit seed for one named random stream of a run, so streams never share state."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{stream}".encode()).digest()[:8], "big") >> 1


class PoissonBatchSampler(UniformWithReplacementSampler):
    """Poisson sampling of the whole dataset; yields this process's share of each logical batch, forever.

    Subclasses Opacus's sampler so that ``len(loader)`` (Opacus derives q = 1/len from it), Opacus's
    ``BatchMemoryManager`` and ``secure_mode``'s generator switch work unchanged.

    Args:
        num_samples: records in the (global) training set.
        sample_rate: q, the inclusion probability of each record in each batch.
        generator: source of the inclusion draws; must be in the same state on every process.
        rank: this process's index; world_size: number of processes.
    """

    def __init__(self, *, num_samples: int, sample_rate: float, generator: torch.Generator, rank: int = 0,
                 world_size: int = 1):
        super().__init__(num_samples=num_samples, sample_rate=sample_rate, generator=generator)
        # len() stays 1/q batches (one expected epoch), which is what Opacus reads q from.
        self.steps = round(1 / sample_rate)
        self.rank, self.world_size = rank, world_size

    def __iter__(self) -> Iterator[list[int]]:
        # Infinite: the trainer stops at its step count, and a resumed run never re-enters an "epoch"
        # boundary that an uninterrupted run would not have (no hidden state but the generator's).
        while True:
            mask = torch.rand(self.num_samples, generator=self.generator) < self.sample_rate
            ids = mask.nonzero(as_tuple=False).reshape(-1)
            yield ids[ids % self.world_size == self.rank].tolist()


class ShuffledBatchSampler:
    """Fixed-size batches over per-epoch shuffles; yields this process's share from global batch ``start``.

    Args:
        num_samples: records in the training set.
        batch_size: records per global batch (all of them when there are fewer).
        seed: shuffle seed; epoch e uses ``stream_seed(seed, f"shuffle:{e}")``.
        start: index of the first global batch to yield (a resumed run passes its step count).
    """

    def __init__(self, *, num_samples: int, batch_size: int, seed: int, start: int = 0, rank: int = 0,
                 world_size: int = 1):
        self.num_samples, self.batch_size, self.seed, self.start = num_samples, batch_size, seed, start
        self.rank, self.world_size = rank, world_size
        self.batch_size = min(batch_size, num_samples)
        self.batches_per_epoch = num_samples // self.batch_size
        self._perm: tuple[int, torch.Tensor] = (-1, torch.empty(0))

    def __len__(self) -> int:
        return self.batches_per_epoch

    def global_batch(self, k: int) -> list[int]:
        epoch, b = divmod(k, self.batches_per_epoch)
        if self._perm[0] != epoch:
            g = torch.Generator().manual_seed(stream_seed(self.seed, f"shuffle:{epoch}"))
            self._perm = (epoch, torch.randperm(self.num_samples, generator=g))
        return self._perm[1][b * self.batch_size:(b + 1) * self.batch_size].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        for k in itertools.count(self.start):
            yield self.global_batch(k)[self.rank::self.world_size]
