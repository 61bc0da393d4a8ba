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
   the parameter's own placement (FSDP2's ``Shard(0)``, its padding included), one parameter at a time, so a
   process holds at most one full-size clipped gradient beside its shards. Every process calls it for every
   trainable parameter in the same order (a parameter no record reached contributes zeros), so the collectives
   stay in step.
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

import torch


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
