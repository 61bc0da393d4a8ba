"""Opacus's hooks and ghost optimizers with a correlated mechanism's noise (``privacy.noise: banded``, ...).

Opacus's ``add_noise`` adds to each parameter's clipped sum a fresh draw ``z ~ N(0, σ²C²)`` from the optimizer's
generator (the run's secret noise generator, or Opacus's secure one). :func:`correlated_class` subclasses any of
Opacus's one-process or DDP optimizers (hooks or ghost, any clipping function, per-user clipping) so that the same
draw, in the same order over ``self.params``, goes through the mechanism's noise recurrence
(:class:`dpllm.privacy.correlated.base.NoiseRecurrence`) and ``x_t = (C⁻¹z)_t`` is added instead. The recurrence is
whatever the registry built (BandMF's b−1 past draws, BLT's buffers): this class never looks inside it. With the
identity recurrence (one band) ``x_t`` is ``z`` itself and the step is Opacus's, bit for bit.

Under DDP Opacus noises on rank 0 only and all-reduces the sums afterwards; so does this class: rank 0 keeps the
recurrence and the other ranks add nothing (their recurrence is never advanced), so the noise in the all-reduced
gradient is rank 0's ``x_t``, as on one process. bk has its own in-place variant
(:class:`dpllm.privacy.bk.optimizer.LeanAccumulation`); Opacus's FSDP optimizer (``ghost_fsdp``) is not covered.

Example:
    >>> import torch
    >>> from opacus.optimizers import DPOptimizer
    >>> from dpllm.privacy.correlated.banded import BandMF
    >>> lin = torch.nn.Linear(2, 1)
    >>> opt = correlated_class(DPOptimizer)(torch.optim.SGD(lin.parameters(), lr=0.1), noise_multiplier=1.0,
    ...                                     max_grad_norm=1.0, expected_batch_size=1)
    >>> opt.recurrence = BandMF.optimized(bands=2, steps=4).recurrence()
    >>> type(opt).__name__
    'CorrelatedDPOptimizer'
"""

from __future__ import annotations

import functools

from opacus.optimizers import DistributedDPOptimizer, DPOptimizer
from opacus.optimizers.ddpoptimizer_fast_gradient_clipping import DistributedDPOptimizerFastGradientClipping
from opacus.optimizers.optimizer import _check_processed_flag, _generate_noise, _mark_as_processed

_DISTRIBUTED = (DistributedDPOptimizer, DistributedDPOptimizerFastGradientClipping)


class CorrelatedNoiseMixin:
    """``add_noise`` with ``recurrence`` mapping each parameter's fresh draw to this step's correlated noise.

    ``recurrence`` must be set before the first step (:func:`dpllm.privacy.engine.make_private` does); None is
    refused rather than falling back to independent noise, which the plan would not account.
    """

    recurrence = None  # a dpllm.privacy.correlated.base.NoiseRecurrence

    def add_noise(self) -> None:
        rec = self.recurrence
        if rec is None:
            raise RuntimeError("correlated-noise optimizer without a noise recurrence; a dpllm bug")
        noised = not isinstance(self, _DISTRIBUTED) or self.rank == 0  # Opacus's DDP: the noise once, on rank 0
        sigma = getattr(self, "_adjusted_noise_multiplier", self.noise_multiplier)  # as Opacus's ghost optimizer
        for key, p in enumerate(self.params):
            _check_processed_flag(p.summed_grad)
            if noised:
                z = _generate_noise(std=sigma * self.max_grad_norm, reference=p.summed_grad, generator=self.generator,
                                    secure_mode=self.secure_mode)
                p.grad = (p.summed_grad + rec.apply(key, z)).view_as(p)  # a new tensor: the recurrence keeps x_t
            else:
                p.grad = p.summed_grad.view_as(p)
            _mark_as_processed(p.summed_grad)
        if noised:
            rec.end_step()


@functools.lru_cache(maxsize=None)
def correlated_class(base: type) -> type:
    """``base`` (an Opacus ``DPOptimizer`` subclass, hooks or ghost, one process or DDP) with
    :class:`CorrelatedNoiseMixin`'s ``add_noise`` (one class per base: the same call returns the same class).

    Raises:
        ValueError: ``base`` is not a ``DPOptimizer``, or it already overrides the noise itself (``clipping:
            quantile``'s pair of releases), which a correlated mechanism does not cover.
    """
    if not (isinstance(base, type) and issubclass(base, DPOptimizer)):
        raise ValueError(f"correlated noise needs an Opacus DPOptimizer class, not {base!r}")
    if hasattr(base, "quantile"):  # dpllm.privacy.clipping.QuantileNoiseMixin's classes: add_noise is the pair's
        raise ValueError(f"correlated noise does not cover {base.__name__} (clipping: quantile)")
    return type(f"Correlated{base.__name__}", (CorrelatedNoiseMixin, base),
                {"__doc__": f"Opacus's {base.__name__} adding a correlated mechanism's noise "
                            "(:class:`dpllm.privacy.correlated.optimizer.CorrelatedNoiseMixin`).",
                 "__module__": __name__})
