"""The memory a noise recurrence keeps, and whether it fits: measured before training, refused with the numbers.

Correlated noise keeps, for every trainable parameter, ``extra_tensors_per_parameter`` tensors of that parameter's
shape on this process: b−1 past draws for b-banded MF (:mod:`.banded`), d buffers for BLT (:mod:`.blt`). In what
dtype: banded keeps the draws themselves (the gradient's dtype); BLT keeps float32 buffers at least (float64 for
float64 draws, or the dtype it was built with). Who keeps them: on one process, that process; under DDP rank 0
alone (it adds the noise: Opacus's distributed optimizer); under FSDP2 every process, for its own shards only.

:func:`state_bytes` counts this exactly from the parameters' local shapes (a test compares it with the tensors a
recurrence holds after running); :func:`check_fits` compares every process's need with what its device has free
(CUDA: ``torch.cuda.mem_get_info``; CPU: ``MemAvailable`` of ``/proc/meminfo``, the processes of one host summed)
and refuses a run that cannot fit before any step is taken. Free memory is read once the model is loaded, before
gradients, optimizer state and activations exist: a refusal means the recurrence alone cannot fit; passing the
check does not promise that the rest will.

Example:
    >>> from dpllm.privacy.correlated.banded import BandMF
    >>> rec = BandMF.optimized(bands=3, steps=8).recurrence()
    >>> state_bytes(rec, [torch.zeros(10, 4), torch.zeros(5, dtype=torch.float64)])  # 2 × (40·4 + 5·8)
    400
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

import torch

from dpllm.config import ConfigError

GIB = 2 ** 30


def size(n: int) -> str:
    """``n`` bytes in words: GiB, MiB or KiB with three significant digits.

    Example:
        >>> size(3 * 2**30), size(1536 * 2**10), size(1000)
        ('3 GiB', '1.5 MiB', '0.977 KiB')
    """
    for unit, scale in (("GiB", GIB), ("MiB", 2 ** 20)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n / 2 ** 10:.3g} KiB"


def local_numel(p: torch.Tensor) -> int:
    """Elements of ``p`` held by this process: a DTensor's (FSDP2) local shard, else all of them."""
    return int(p.to_local().numel()) if hasattr(p, "to_local") else int(p.numel())


def state_bytes(recurrence, params: Iterable[torch.Tensor]) -> int:
    """Bytes ``recurrence`` keeps on this process once it is in its steady state, for these trainable parameters."""
    k = getattr(recurrence, "extra_tensors_per_parameter", 0) if recurrence is not None else 0
    if not k:
        return 0
    total = 0
    for p in params:
        total += k * local_numel(p) * torch.empty((), dtype=recurrence.state_dtype(p.dtype)).element_size()
    return total


def available_bytes(device: torch.device) -> tuple[int, str]:
    """Memory free for new tensors on ``device`` now, and where the figure comes from."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), f"free on {device} (torch.cuda.mem_get_info)"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "MemAvailable (/proc/meminfo)"
    except OSError:
        pass
    pages, size = os.sysconf("SC_AVPHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    return int(pages * size), "free physical pages (sysconf)"


@dataclass(frozen=True)
class Need:
    """One process's share: what its recurrence keeps and what its device has free."""

    rank: int
    place: str  # host, and the CUDA device (processes on one host share its RAM; each GPU is its own)
    need: int
    available: int
    source: str


def need_of(recurrence, params, *, rank: int, keeps: bool, device) -> Need:
    """This process's :class:`Need` (``keeps``: whether this process holds the recurrence at all)."""
    device = torch.device(device)
    avail, source = available_bytes(device)
    place = socket.gethostname() + (f"/{device}" if device.type == "cuda" else "")
    return Need(rank=rank, place=place, need=state_bytes(recurrence, params) if keeps else 0, available=avail,
                source=source)


def shortfalls(needs: list[Need]) -> list[tuple[str, int, int, str]]:
    """``(place, needed, available, source)`` of every host or GPU whose processes need more than it has free."""
    out = []
    for place in sorted({n.place for n in needs}):
        here = [n for n in needs if n.place == place]
        needed, avail = sum(n.need for n in here), min(n.available for n in here)
        if needed > avail:
            out.append((place, needed, avail, here[0].source))
    return out


def describe(noise, recurrence, params, needs: list[Need], *, kind: str) -> str:
    """One line for the log: the mechanism, what it keeps, per process, and what is free."""
    dtypes = sorted({str(recurrence.state_dtype(p.dtype)).removeprefix("torch.") for p in params})
    k = recurrence.extra_tensors_per_parameter
    what = (f"b−1 = {k} past draws" if noise.name == "banded" else f"d = {k} buffers")
    who = {"ddp": "rank 0 keeps it (it adds the noise under DDP)", "fsdp": "each process for its own shards"}.get(
        kind, "one process")
    per = ", ".join(f"rank {n.rank}: {size(n.need)} of {size(n.available)} free" for n in needs)
    return (f"correlated noise ({noise.name}, {what} per trainable parameter, {'/'.join(dtypes)}; {who}): {per} "
            f"({needs[0].source})")


def refusal(noise, recurrence, shortfall: list[tuple[str, int, int, str]], *, kind: str, lora: bool) -> str:
    """The error: needed vs available where it does not fit, and what to change."""
    k = recurrence.extra_tensors_per_parameter
    where = "; ".join(f"{place}: needs {size(need)}, {size(avail)} free ({source})"
                      for place, need, avail, source in shortfall)
    fewer = (f"fewer bands (privacy.bands < {noise.bands}: b−1 tensors per parameter)" if noise.name == "banded"
             else f"fewer buffers (privacy.buffers < {k})")
    more = "more FSDP processes (each keeps its own shards)" if kind == "fsdp" else \
        "FSDP2 over several processes (each keeps only its shards)"
    return (f"privacy.noise: {noise.name} keeps {k} model-sized tensor(s) of the trainable parameters per process, "
            f"which do not fit: {where}. Use {fewer}, "
            + ("" if lora else "LoRA (model.finetuning: lora: only the adapters are noised), ")
            + f"{more}, or privacy.noise: independent (keeps nothing)")


def check_fits(noise, params: list[torch.Tensor], *, world, device, lora: bool,
               gather=lambda obj: [obj]) -> Optional[str]:
    """Refuse a correlated-noise run whose recurrence cannot fit; return the line to log (None for DP-SGD).

    Args:
        noise: the run's :class:`dpllm.privacy.correlated.CorrelatedNoise`.
        params: the trainable parameters, as the optimizer holds them (DTensors under FSDP2).
        world: the run's :class:`dpllm.distributed.World` (rank, size, kind).
        device: this process's device.
        lora: whether only adapters are trained (the message then does not suggest LoRA).
        gather: every process's object, in rank order, on every process (:func:`dpllm.distributed.gather_objects`).

    Raises:
        ConfigError: on every process alike, when a host's or a GPU's processes need more than it has free.
    """
    if noise is None or not noise.correlated:
        return None
    rec = noise.recurrence()
    keeps = not (world.kind == "ddp" and world.rank != 0)
    needs = gather(need_of(rec, params, rank=world.rank, keeps=keeps, device=device))
    short = shortfalls(needs)
    if short:
        raise ConfigError(refusal(noise, rec, short, kind=world.kind, lora=lora))
    return describe(noise, rec, params, needs, kind=world.kind)
