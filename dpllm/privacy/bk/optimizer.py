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

Correlated noise (``privacy.noise: banded``, :mod:`dpllm.privacy.correlated`): ``recurrence`` turns each
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


class QuantileAccumulation(LeanAccumulation):
    """:class:`LeanAccumulation` for ``clipping: quantile``: the sum noised at σ_g·C, the count at σ_b, then C moves.

    ``quantile`` is the run's :class:`dpllm.privacy.quantile.QuantileClipping`, whose ``weights`` bk clipped every
    record of this step with (adding each record's centred bit to its count). ``noise_multiplier`` stays the plan's
    σ: the accountant's hook reads it, and σ is what the pair (sum, count) spends (the argument is in
    :mod:`dpllm.privacy.quantile`); the gradient's own σ_g is ``_adjusted_noise_multiplier``, which
    :meth:`LeanAccumulation.add_noise` reads. Both noises come from ``self.generator`` (the run's secret noise
    generator, or Opacus's secure one), the gradient's first.
    """

    quantile = None

    def add_noise(self):
        import torch

        q = self.quantile
        self.max_grad_norm = q.clip  # the C every record of this step was clipped at
        self._adjusted_noise_multiplier = q.gradient_noise_multiplier(self.noise_multiplier)
        super().add_noise()
        reference = torch.zeros((1,), dtype=torch.float64, device=self.params[0].device)
        noise = _generate_noise(std=q.count_noise_multiplier, reference=reference, generator=self.generator,
                                secure_mode=self.secure_mode)
        q.release(float(noise.item()))


class DistributedQuantileAccumulation(DistributedLeanAccumulation):
    """DDP, ``clipping: quantile``: as for the gradient, the count is noised once, on rank 0, and summed over the
    processes; every process then moves C by the same noised count, so C stays equal everywhere.

    Opacus's distributed ``add_noise`` noises the gradient on rank 0 only (through :class:`LeanAccumulation`, at
    ``_adjusted_noise_multiplier`` = σ_g) and leaves the all-reduce to ``reduce_gradients``; the count's noise is
    drawn after the gradient's, from the same generator, as on one process.
    """

    quantile = None

    def add_noise(self):
        import torch
        import torch.distributed as dist

        q = self.quantile
        self.max_grad_norm = q.clip
        self._adjusted_noise_multiplier = q.gradient_noise_multiplier(self.noise_multiplier)
        super().add_noise()
        count = torch.tensor([q.count], dtype=torch.float64, device=self.params[0].device)
        if self.rank == 0:
            count += _generate_noise(std=q.count_noise_multiplier, reference=count, generator=self.generator,
                                     secure_mode=self.secure_mode)
        dist.all_reduce(count, op=dist.ReduceOp.SUM)
        q.release_noised(float(count.item()))


def optimizer_class(distributed: bool, sharded: bool = False) -> type:
    if sharded:
        return ShardedLeanAccumulation
    return DistributedLeanAccumulation if distributed else LeanAccumulation
