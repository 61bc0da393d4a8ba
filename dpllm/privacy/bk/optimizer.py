"""Opacus's ghost-clipping optimizer for bk, without its two full copies of the gradient per step.

bk writes a freshly allocated clipped sum into ``p.grad`` at the end of every backward pass. Opacus's
``DPOptimizerFastGradientClipping`` then (1) deep-copies ``p.grad`` into ``p.summed_grad`` and (2) adds
the noise into a third, newly allocated tensor, while ``p.summed_grad`` stays alive through the update.
On a model the size of GPT-2 small each copy is a pass over 124M floats plus the page faults of a fresh
allocation (about 8% of a CPU step at batch 4), and the update holds two gradient-sized tensors (+0.5 GB).

:class:`LeanAccumulation` keeps Opacus's algorithm and its noise draw (``_generate_noise``, secure mode
included) and changes only where the sums live:

- ``accumulate``: the first micro-batch's ``p.grad`` *becomes* ``p.summed_grad`` (later ones are added in
  place). Safe because ``zero_grad`` here always drops ``p.grad`` (``set_to_none``) instead of zeroing it in
  place, which would zero the sum it aliases, and because bk never writes into an existing ``p.grad``.
- ``add_noise``: the sum receives the noise in place and becomes ``p.grad`` (the result is bitwise
  Opacus's ``summed_grad + noise``; the noise tensor lives for one parameter at a time).

Correlated noise (``privacy.noise: banded`` or ``blt``, :mod:`dpllm.privacy.correlated`): ``recurrence`` turns each
parameter's fresh draw ``z`` (from the same generator, in the same order) into this step's correlated noise
``x_t = (C⁻¹z)_t`` before it is added; None (the default) adds the draw itself, as DP-SGD.

Under DDP the class sits between Opacus's distributed optimizer and the base one, so rank 0's
``super().add_noise()`` lands here and the all-reduce stays Opacus's. Under FSDP2,
:class:`ShardedLeanAccumulation` noises the shard that ``p.grad`` holds on this process, and no other
coordinate (:mod:`dpllm.privacy.bk.sharded`).
"""

from __future__ import annotations

from opacus.optimizers import DPOptimizerFastGradientClipping
from opacus.optimizers.ddpoptimizer_fast_gradient_clipping import DistributedDPOptimizerFastGradientClipping
from opacus.optimizers.optimizer import _check_processed_flag, _generate_noise, _mark_as_processed


class LeanAccumulation(DPOptimizerFastGradientClipping):
    """``DPOptimizerFastGradientClipping`` that aliases the first gradient and adds noise in place."""

    recurrence = None  # a dpllm.privacy.correlated NoiseRecurrence, or None (independent noise)

    def accumulate(self):
        for p in self.params:
            if p.summed_grad is not None:
                p.summed_grad.add_(p.grad)
            else:
                p.summed_grad = p.grad  # bk's fresh tensor; zero_grad below never writes into it

    def zero_grad(self, set_to_none: bool = True):
        # Always drop p.grad: zeroing it in place would zero p.summed_grad, which may be the same tensor.
        super().zero_grad(True)

    def add_noise(self):
        sigma = getattr(self, "_adjusted_noise_multiplier", self.noise_multiplier)  # as Opacus (adaptive clipping)
        rec = self.recurrence
        for i, p in enumerate(self.params):
            _check_processed_flag(p.summed_grad)
            noise = _generate_noise(std=sigma * self.max_grad_norm, reference=p.summed_grad,
                                    generator=self.generator, secure_mode=self.secure_mode)
            if rec is not None:  # correlated: this step's x_t from the fresh draw and the parameter's past noise
                noise = rec.apply(i, noise)
            p.grad = p.summed_grad.add_(noise).view_as(p)  # the sum is ours alone: no third tensor
            _mark_as_processed(p.summed_grad)
        if rec is not None:
            rec.end_step()


class DistributedLeanAccumulation(DistributedDPOptimizerFastGradientClipping, LeanAccumulation):
    """The DDP variant: Opacus's rank-0 noise and all-reduce over :class:`LeanAccumulation`'s sums."""


class ShardedLeanAccumulation(LeanAccumulation):
    """The FSDP2 variant: ``p.grad`` is a DTensor whose local part is this process's shard of the clipped sum
    over all processes; the noise is drawn for that local part alone, from this process's generator.

    Opacus's ``_generate_noise`` sized by the DTensor would draw the *global* shape on every process. Banded noise:
    the recurrence keeps the past noise of this process's shards only (b−1 shard-sized tensors per parameter).
    ``expected_batch_size`` is the global one: the shards hold sums over all processes, not means.
    """

    def add_noise(self):
        import torch

        sigma = getattr(self, "_adjusted_noise_multiplier", self.noise_multiplier)
        rec = self.recurrence  # banded noise: this process's recurrence over its own shards
        for i, p in enumerate(self.params):
            _check_processed_flag(p.summed_grad)
            with torch.no_grad():
                local = p.summed_grad.to_local()  # the DTensor's own storage: noised in place
                noise = _generate_noise(std=sigma * self.max_grad_norm, reference=local, generator=self.generator,
                                        secure_mode=self.secure_mode)
                local.add_(noise if rec is None else rec.apply(i, noise))
            p.grad = p.summed_grad
            _mark_as_processed(p.summed_grad)
        if rec is not None:
            rec.end_step()


def release_count(quantile, *, generator, secure_mode: bool, device, distributed: bool) -> float:
    """End ``clipping: quantile``'s step: noise the centred count once and move C (every process alike).

    One process: the count plus N(0, σ_b²) from ``generator``. Across processes (DDP or FSDP2, any engine): every
    process's count summed by one all-reduce, and the noise added once, by rank 0 from its own generator, before the
    sum (as Opacus noises the gradient on rank 0 only under DDP); every process then reads the same noised total and
    moves C by the same arithmetic, so C stays equal everywhere. Call it after the gradient's noise, so that on one
    process the count's draw follows the gradient's in the stream.

    ``quantile`` is the run's :class:`dpllm.privacy.quantile.QuantileClipping` (this layer sits below it: only its
    ``count``, ``count_noise_multiplier`` and ``release_noised`` are used).

    Returns:
        b̃, the noised fraction released.
    """
    import torch
    import torch.distributed as dist

    count = torch.tensor([quantile.count], dtype=torch.float64, device=device)
    if not distributed or dist.get_rank() == 0:
        count += _generate_noise(std=quantile.count_noise_multiplier, reference=count, generator=generator,
                                 secure_mode=secure_mode)
    if distributed:
        dist.all_reduce(count, op=dist.ReduceOp.SUM)
    return quantile.release_noised(float(count.item()))


class _QuantileNoise:
    """``clipping: quantile`` over a bk optimizer: the sum noised at σ_g·C, the centred count at σ_b, then C moves.

    ``quantile`` is the run's :class:`dpllm.privacy.quantile.QuantileClipping`, whose ``weights`` bk clipped every
    record of this step with (adding each record's centred bit to its count). ``noise_multiplier`` stays the plan's
    σ: the accountant's hook reads it, and σ is what the pair (sum, count) spends (the argument is in
    :mod:`dpllm.privacy.quantile`); the gradient's own σ_g is ``_adjusted_noise_multiplier``, which the base
    ``add_noise`` reads. Both noises come from ``self.generator`` (the run's secret noise generator, or Opacus's
    secure one), the gradient's first.
    """

    quantile = None
    distributed = False  # the count is summed over processes and noised once, on rank 0 (:func:`release_count`)

    def add_noise(self):
        q = self.quantile
        self.max_grad_norm = q.clip  # the C every record of this step was clipped at
        self._adjusted_noise_multiplier = q.gradient_noise_multiplier(self.noise_multiplier)
        super().add_noise()
        release_count(q, generator=self.generator, secure_mode=self.secure_mode, device=self.params[0].device,
                      distributed=self.distributed)


class QuantileAccumulation(_QuantileNoise, LeanAccumulation):
    """One process: :class:`LeanAccumulation`'s gradient noise at σ_g·C, then the count's."""


class DistributedQuantileAccumulation(_QuantileNoise, DistributedLeanAccumulation):
    """DDP: Opacus's distributed ``add_noise`` noises the gradient on rank 0 only (at σ_g, through
    :class:`LeanAccumulation`) and leaves the all-reduce to ``reduce_gradients``; the count is summed over the
    processes and noised once, on rank 0, after the gradient."""

    distributed = True


class ShardedQuantileAccumulation(_QuantileNoise, ShardedLeanAccumulation):
    """FSDP2: each process noises its own shard of the clipped sum (over all processes) at σ_g·C, as
    :class:`ShardedLeanAccumulation` does at σ·C: every coordinate once. The count is not sharded: each process
    holds the bits of its own records, which are summed over the processes and noised once, on rank 0."""

    distributed = True


def optimizer_class(distributed: bool, sharded: bool = False, quantile: bool = False) -> type:
    """The bk optimizer: one process, DDP or FSDP2 (``sharded``), with ``clipping: quantile``'s count or not."""
    if quantile:
        return ShardedQuantileAccumulation if sharded else (
            DistributedQuantileAccumulation if distributed else QuantileAccumulation)
    if sharded:
        return ShardedLeanAccumulation
    return DistributedLeanAccumulation if distributed else LeanAccumulation
