"""bk under FSDP2: every process clips its own records over the whole model; the clipped sums meet in the shards.

Under FSDP2 (:func:`dpllm.distributed.shard_model`) each process runs the *whole* model on its own share of
the logical batch: a group's parameters are all-gathered for its forward and again for its backward, so every
trainable layer sees, on every process, the full activations and output gradients of that process's records.
Hence, with no communication:

1. *Each record's norm is over all of its parameters.* The per-layer squared norms that
   :class:`dpllm.privacy.bk.BookKeepingModule` adds up are those of the full layers (the records hold full
   activations and output gradients, never a shard of them), whichever process holds the layer's shard. A
   record lives on one process (the Poisson sampler gives each process a disjoint share; under ULS a user's
   records stay on one process), so its weight cᵢ is computed once, where the record is.
2. *The clipped sum is formed at full shape, then summed over processes into the shards.* Σᵢ cᵢ·gᵢ over this
   process's records needs only the stored tensors (no weights); :func:`scatter_sum` reduce-scatters it into
   the parameter's own placement (FSDP2's ``Shard(0)``, its padding included). :class:`ShardedSums` sends the
   parameters in buckets of about :data:`BUCKET` values (one collective per bucket, laid out as FSDP2 lays out
   its own reduce-scatter; a larger parameter goes alone, without a copy), so a process holds at most about
   one bucket, or one parameter, of full-size clipped gradients beside its shards. Every process sends every
   trainable parameter in the same order (a parameter no record reached contributes zeros), so the
   collectives stay in step.
3. *Each coordinate is noised once.* After the reduce-scatter, process r's ``p.grad`` holds the global clipped
   sum for the coordinates of its shard and no others; :class:`dpllm.privacy.bk.optimizer.ShardedLeanAccumulation`
   draws N(0, σ²C²) for exactly those coordinates from process r's own secret generator
   (:mod:`dpllm.privacy.randomness`). Shards partition the parameter, so every coordinate gets one draw.
   The divisor is the expected *global* batch (the sums are sums, not means over processes).

FSDP2's own gradient path never carries a raw gradient: bk's rules return no weight gradient, so the unsharded
parameters' ``.grad`` stays empty and FSDP's post-backward reduce-scatter has nothing to send; a use of a
parameter outside its layer would put one there, and bk's hook on the *unsharded* parameter
(:func:`dpllm.distributed.unsharded_parameters`) refuses it first.
"""

from __future__ import annotations

import math

import torch

#: values (not bytes) per bucket of clipped sums sent in one reduce-scatter: 2²⁵ (128 MiB in fp32)
BUCKET = 2**25


def scatter_sum(full: torch.Tensor, param) -> torch.Tensor:
    """Sum ``full`` (this process's full-shape tensor) over processes into ``param``'s placement.

    Args:
        full: a tensor of ``param``'s global shape (a clipped gradient sum over this process's records).
        param: an FSDP2 parameter (a DTensor sharded over its device mesh).

    Returns:
        A DTensor laid out as ``param`` (this process holds the summed rows of its own shard).

    Raises:
        RuntimeError: the result's local shape is not the parameter's (a layout bk does not know).
    """
    from torch.distributed.tensor import DTensor, Partial

    mesh = param.device_mesh
    out = DTensor.from_local(full, mesh, [Partial()] * mesh.ndim, run_check=False).redistribute(mesh, param.placements)
    if out.to_local().shape != param.to_local().shape:
        raise RuntimeError(f"grad_sample_mode=bk: a reduce-scattered gradient has local shape "
                           f"{tuple(out.to_local().shape)}, the parameter's shard {tuple(param.to_local().shape)} "
                           f"(placements {param.placements}); a dpllm bug or an FSDP layout bk does not support")
    return out


def _flat_layout(param) -> bool:
    """A one-dimensional mesh and ``Shard(0)``: FSDP2's default, which :class:`ShardedSums` sends in buckets."""
    from torch.distributed.tensor import Shard

    return param.device_mesh.ndim == 1 and tuple(param.placements) == (Shard(0),)


class ShardedSums:
    """Full-shape clipped sums → this process's shards, in buckets; call :meth:`flush` after the last :meth:`add`.

    A bucket is one ``reduce_scatter_tensor`` whose input holds, for each process in turn, that process's rows of
    every parameter in the bucket (each parameter's rows padded to a multiple of the process count, as FSDP2
    pads them), so the output is this process's rows of each parameter, back to back. Parameters laid out
    otherwise (a 2-D mesh, ``Shard(1)``) go one by one through :func:`scatter_sum`.

    Args:
        deposit: called with ``(param, DTensor)`` for every parameter, in the order of :meth:`add`.
        bucket: values per bucket (:data:`BUCKET`).
    """

    def __init__(self, deposit, *, bucket: int = BUCKET):
        self.deposit, self.bucket = deposit, bucket
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.size = 0

    def add(self, param, full: torch.Tensor) -> None:
        if not _flat_layout(param):
            self.flush()
            self.deposit(param, scatter_sum(full, param))
            return
        if self.pending and (self.size + full.numel() > self.bucket or full.dtype != self.pending[0][1].dtype
                             or param.device_mesh != self.pending[0][0].device_mesh):
            self.flush()
        self.pending.append((param, full))
        self.size += full.numel()

    def flush(self) -> None:
        if not self.pending:
            return
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        pending, self.pending, self.size = self.pending, [], 0
        mesh = pending[0][0].device_mesh
        world, rank = mesh.size(), mesh.get_local_rank()
        rows = [math.ceil(full.shape[0] / world) if full.dim() else 1 for _, full in pending]  # rows per process
        padded = [_padded(full, r * world) for (_, full), r in zip(pending, rows)]
        if len(padded) == 1:  # one parameter: its rows are already in process order
            flat = padded[0].reshape(-1)
        else:
            flat = torch.cat([t.reshape(world, -1) for t in padded], dim=1).reshape(-1)
        out = torch.empty(flat.numel() // world, dtype=flat.dtype, device=flat.device)
        dist.reduce_scatter_tensor(out, flat, group=mesh.get_group())
        offset = 0
        for (param, full), r, t in zip(pending, rows, padded):
            n = t.numel() // world
            mine = out[offset: offset + n].view(r, *full.shape[1:])
            offset += n
            local = param.to_local().shape
            start = rank * r
            take = max(0, min(r, (full.shape[0] if full.dim() else 1) - start))
            if (take, *full.shape[1:]) != tuple(local):
                raise RuntimeError(f"grad_sample_mode=bk: {take} rows of {tuple(full.shape)} would land on process "
                                   f"{rank}, whose shard is {tuple(local)}; a dpllm bug or an FSDP layout bk does "
                                   "not support")
            self.deposit(param, DTensor.from_local(mine[:take], mesh, param.placements, run_check=False,
                                                   shape=param.shape, stride=param.stride()))


def _padded(full: torch.Tensor, rows: int) -> torch.Tensor:
    """``full`` with zero rows appended up to ``rows`` (no copy when none are needed)."""
    if full.dim() == 0:
        full = full.reshape(1)
    if full.shape[0] == rows:
        return full.contiguous()
    pad = torch.zeros((rows - full.shape[0], *full.shape[1:]), dtype=full.dtype, device=full.device)
    return torch.cat([full, pad])
