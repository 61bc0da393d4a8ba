"""Per-sample clipping functions: a registry shared by LLM and MLP training, ghost clipping included.

A clipping function maps each record's gradient norm ‖g‖ to a weight w(‖g‖); the private sum is
Σ w(‖gᵢ‖)·gᵢ + N(0, σ²·S²) where S, the *sensitivity*, bounds ‖w(‖g‖)·g‖ for every g. Under ghost
clipping only the per-sample coefficient changes, so every function works in both modes.

| name       | weight w(n)                 | sensitivity S | reference                       |
|------------|-----------------------------|---------------|---------------------------------|
| flat       | min(1, C / n)               | C             | Abadi et al. 2016               |
| automatic  | C / (n + r)                 | C             | Bu et al. 2022 (normalised)     |
| psac       | C / (n + r / (n + r))       | C             | Xia et al. 2023                 |
| psasc      | C / (s·n + r / (n + r))     | C / s         | Huang et al. 2024 (PSASC paper) |

For psasc, ‖w(n)·g‖ = C·n / (s·n + r/(n+r)) < C/s, so the noise is σ·C/s: a smaller s weights small
gradients up *and* raises the noise by the same factor. Momentum (the PSASC paper's optional variant) is
post-processing of the noisy gradient: use ``optimizer: sgd`` with ``momentum``.

Opacus applies a function through subclasses of its own classes, which :func:`opacus_classes` picks for
:func:`dpllm.privacy.engine.make_private`: under ghost clipping the grad-sample module's
``get_clipping_coef`` returns w(‖g‖) (:class:`ClippingFunctionGhostModule`, ``...FSDP``); under hooks the
optimizer's ``clip_and_accumulate`` sums w(‖gᵢ‖)·gᵢ (:class:`ClippingFunctionDPOptimizer`,
``...DistributedDPOptimizer``). Flat clipping keeps Opacus's classes unchanged.

Example:
    >>> import torch
    >>> from dpllm.config import PrivacyConfig
    >>> fn, cfg = get("psasc"), PrivacyConfig(max_grad_norm=1.0, clipping_r=0.1, clipping_s=0.5)
    >>> n = torch.tensor([1e-3, 0.1, 1.0, 100.0])
    >>> bool(((fn.weights(n, cfg) * n) <= fn.sensitivity(cfg)).all())
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from opacus.grad_sample import GradSampleModuleFastGradientClipping, GradSampleModuleFastGradientClippingFSDP
from opacus.grad_sample.utils import get_gsm_class
from opacus.optimizers import (
    DistributedDPOptimizer,
    DPOptimizer,
    DPOptimizerFastGradientClipping,
    get_optimizer_class,
)
from opacus.optimizers.ddpoptimizer_fast_gradient_clipping import DistributedDPOptimizerFastGradientClipping
from opacus.optimizers.optimizer import _check_processed_flag, _generate_noise, _mark_as_processed
from torch import nn

from dpllm.config import PrivacyConfig


@dataclass(frozen=True)
class ClippingFunction:
    name: str
    weights: Callable[[torch.Tensor, PrivacyConfig], torch.Tensor]
    sensitivity: Callable[[PrivacyConfig], float]


_REGISTRY: dict[str, ClippingFunction] = {}


def register(fn: ClippingFunction) -> ClippingFunction:
    if fn.name in _REGISTRY:
        raise ValueError(f"clipping function {fn.name!r} is already registered")
    _REGISTRY[fn.name] = fn
    return fn


def get(name: str) -> ClippingFunction:
    if name not in _REGISTRY:
        raise ValueError(f"clipping={name!r} is not known; choose one of {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def names() -> list[str]:
    return sorted(_REGISTRY)


def _check_s(cfg: PrivacyConfig) -> float:
    if cfg.clipping_s <= 0:
        raise ValueError(f"clipping_s={cfg.clipping_s} must be positive")
    return cfg.clipping_s


def _check_r(cfg: PrivacyConfig) -> float:
    if cfg.clipping_r <= 0:
        raise ValueError(f"clipping_r={cfg.clipping_r} must be positive")
    return cfg.clipping_r


register(ClippingFunction(
    "flat", lambda n, c: (c.max_grad_norm / (n + 1e-6)).clamp(max=1.0), lambda c: c.max_grad_norm))
register(ClippingFunction(
    "automatic", lambda n, c: c.max_grad_norm / (n + _check_r(c)), lambda c: c.max_grad_norm))
register(ClippingFunction(
    "psac", lambda n, c: c.max_grad_norm / (n + _check_r(c) / (n + _check_r(c))), lambda c: c.max_grad_norm))
register(ClippingFunction(
    "psasc",
    lambda n, c: c.max_grad_norm / (_check_s(c) * n + _check_r(c) / (n + _check_r(c))),
    lambda c: c.max_grad_norm / _check_s(c),
))


def per_sample_norms(grad_samples: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm of each sample's full gradient from per-parameter per-sample gradients."""
    norms = [g.reshape(len(g), -1).norm(2, dim=-1) for g in grad_samples]
    return torch.stack(norms, dim=1).norm(2, dim=1)


class ClippingFunctionGhostMixin:
    """Ghost clipping with a clipping function: the per-sample coefficient is w(‖gᵢ‖), not Opacus's flat one.

    Opacus computes ‖gᵢ‖ without materialising gᵢ and scales the second backward pass by
    ``get_clipping_coef()``; that coefficient is all a clipping function changes.
    """

    def __init__(self, m: nn.Module, *, clip_weights: Callable[[torch.Tensor], torch.Tensor], **kwargs):
        super().__init__(m, **kwargs)
        self.clip_weights = clip_weights

    def get_clipping_coef(self) -> torch.Tensor:
        return self.clip_weights(self.get_norm_sample())


class ClippingFunctionGhostModule(ClippingFunctionGhostMixin, GradSampleModuleFastGradientClipping):
    """Opacus's ``GradSampleModuleFastGradientClipping`` weighting each record by ``clip_weights(‖gᵢ‖)``."""


class ClippingFunctionGhostModuleFSDP(ClippingFunctionGhostMixin, GradSampleModuleFastGradientClippingFSDP):
    """Opacus's ``GradSampleModuleFastGradientClippingFSDP`` weighting each record by ``clip_weights(‖gᵢ‖)``."""


class ClippingFunctionOptimizerMixin:
    """Hooks mode with a clipping function: materialised per-sample gradients are summed as Σ w(‖gᵢ‖)·gᵢ.

    The same loop as Opacus's ``DPOptimizer.clip_and_accumulate`` with the flat factor replaced by
    ``clip_weights``; it uses the processed-flag helpers Opacus's own subclasses use (``AdaClipDPOptimizer``).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *,
                 clip_weights: Callable[[torch.Tensor], torch.Tensor], **kwargs):
        super().__init__(optimizer, **kwargs)
        self.clip_weights = clip_weights

    def clip_and_accumulate(self) -> None:
        if len(self.grad_samples[0]) == 0:  # an empty share: zero records, zero sum
            weights = torch.zeros((0,), device=self.grad_samples[0].device)
        else:
            weights = self.clip_weights(per_sample_norms(self.grad_samples))
        for p in self.params:
            _check_processed_flag(p.grad_sample)
            grad_sample = self._get_flat_grad_sample(p).to(p.dtype)
            grad = torch.einsum("i,i...", weights.to(grad_sample.device, p.dtype), grad_sample)
            p.summed_grad = grad if p.summed_grad is None else p.summed_grad + grad
            _mark_as_processed(p.grad_sample)


class ClippingFunctionDPOptimizer(ClippingFunctionOptimizerMixin, DPOptimizer):
    """Opacus's ``DPOptimizer`` summing per-sample gradients weighted by ``clip_weights(‖gᵢ‖)``."""


class ClippingFunctionDistributedDPOptimizer(ClippingFunctionOptimizerMixin, DistributedDPOptimizer):
    """Opacus's ``DistributedDPOptimizer`` (DDP) summing gradients weighted by ``clip_weights(‖gᵢ‖)``."""


class QuantileNoiseMixin:
    """``clipping: quantile`` under Opacus hooks or ghost: the sum noised at σ_g·C, the centred count at σ_b, then C
    moves (the argument that the pair spends the plan's σ is in :mod:`dpllm.privacy.quantile`).

    ``quantile`` is the run's ``QuantileClipping``, whose ``weights`` clipped every record of this step (hooks: the
    optimizer's ``clip_weights``; ghost: the module's). ``noise_multiplier`` stays the plan's σ, which the
    accountant's hook reads; the noise below uses σ_g. Both noises come from ``self.generator``, the gradient's
    first, in Opacus's order over ``self.params``. Across processes (DDP, the ``Distributed`` classes below) the
    gradient is noised on rank 0 only, as Opacus does, and the processes' counts are summed and noised once, on
    rank 0 (:func:`dpllm.privacy.bk.optimizer.release_count`).
    """

    quantile = None
    distributed = False

    def add_noise(self) -> None:
        from dpllm.privacy.bk.optimizer import release_count

        q = self.quantile
        self.max_grad_norm = q.clip  # the C every record of this step was clipped at
        std = q.gradient_noise_multiplier(self.noise_multiplier) * q.clip
        noised = not self.distributed or self.rank == 0  # Opacus's DDP: the noise once, on rank 0
        for p in self.params:
            _check_processed_flag(p.summed_grad)
            noise = _generate_noise(std=std, reference=p.summed_grad, generator=self.generator,
                                    secure_mode=self.secure_mode) if noised else 0.0
            p.grad = (p.summed_grad + noise).view_as(p)
            _mark_as_processed(p.summed_grad)
        release_count(q, generator=self.generator, secure_mode=self.secure_mode, device=self.params[0].device,
                      distributed=self.distributed)


class QuantileDPOptimizer(QuantileNoiseMixin, ClippingFunctionDPOptimizer):
    """Hooks mode, ``clipping: quantile``: flat weights at the current C from ``clip_weights``, then
    :class:`QuantileNoiseMixin`'s noise."""


class QuantileGhostOptimizer(QuantileNoiseMixin, DPOptimizerFastGradientClipping):
    """Ghost mode, ``clipping: quantile``: the module clipped with the current C; :class:`QuantileNoiseMixin`'s
    noise."""


class QuantileDistributedDPOptimizer(QuantileNoiseMixin, ClippingFunctionDistributedDPOptimizer):
    """Hooks mode under DDP, ``clipping: quantile``: Opacus's all-reduce of the gradients, the noise on rank 0."""

    distributed = True


class QuantileDistributedGhostOptimizer(QuantileNoiseMixin, DistributedDPOptimizerFastGradientClipping):
    """Ghost mode under DDP, ``clipping: quantile``: Opacus's all-reduce of the gradients, the noise on rank 0."""

    distributed = True


_SUBCLASSES = {
    GradSampleModuleFastGradientClipping: ClippingFunctionGhostModule,
    GradSampleModuleFastGradientClippingFSDP: ClippingFunctionGhostModuleFSDP,
    DPOptimizer: ClippingFunctionDPOptimizer,
    DistributedDPOptimizer: ClippingFunctionDistributedDPOptimizer,
}


def opacus_classes(fn: ClippingFunction, cfg: PrivacyConfig, *, grad_sample_mode: str, distributed: bool,
                   quantile=None):
    """Opacus's module and optimizer classes for ``grad_sample_mode``, subclassed to apply ``fn``.

    Flat clipping is Opacus's own, so its classes come back unchanged. Otherwise the class that clips is
    replaced by its subclass above: the module under ghost clipping (the coefficient of the second backward
    pass), the optimizer under hooks (the weighted sum of materialised per-sample gradients). In both the
    optimizer's ``max_grad_norm``, the noise scale, is the function's sensitivity, passed by the caller.

    With ``quantile`` (``clipping: quantile``'s ``QuantileClipping``) the weights are its ``weights`` and the
    optimizer is :class:`QuantileDPOptimizer` or :class:`QuantileGhostOptimizer` (``QuantileDistributed...`` under DDP;
    the caller sets its ``quantile``).

    Returns:
        ``(module_class, module_kwargs, optimizer_class, optimizer_kwargs)``: the extra keyword arguments
        (``clip_weights``) each constructor takes besides Opacus's own.
    """
    module_cls = get_gsm_class(grad_sample_mode)
    optimizer_cls = get_optimizer_class(clipping="flat", distributed=distributed, grad_sample_mode=grad_sample_mode)
    if quantile is not None:  # clipping: quantile: weights at the current C, the pair's noise
        known = {DPOptimizer: QuantileDPOptimizer, DPOptimizerFastGradientClipping: QuantileGhostOptimizer,
                 DistributedDPOptimizer: QuantileDistributedDPOptimizer,
                 DistributedDPOptimizerFastGradientClipping: QuantileDistributedGhostOptimizer}
        if optimizer_cls not in known:  # ghost_fsdp: Opacus's FSDP optimizer
            raise ValueError(f"clipping: quantile is not yet supported with grad_sample_mode={grad_sample_mode}")
        extra = {"clip_weights": quantile.weights}
        if "ghost" in grad_sample_mode:
            return _SUBCLASSES[module_cls], extra, known[optimizer_cls], {}
        return module_cls, {}, known[optimizer_cls], extra
    if fn.name == "flat":
        return module_cls, {}, optimizer_cls, {}
    extra = {"clip_weights": lambda norms: fn.weights(norms, cfg)}
    if "ghost" in grad_sample_mode:
        return _SUBCLASSES[module_cls], extra, optimizer_cls, {}
    return module_cls, {}, _SUBCLASSES[optimizer_cls], extra
