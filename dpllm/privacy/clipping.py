"""Per-sample clipping functions: a registry shared by LLM and MLP training, ghost clipping included.

A clipping function maps each record's gradient norm ‖g‖ to a weight w(‖g‖); the private sum is
Σ w(‖gᵢ‖)·gᵢ + N(0, σ²·S²) where S, the *sensitivity*, bounds ‖w(‖g‖)·g‖ for every g. Under ghost
clipping only the per-sample coefficient changes, so every function works in both modes.

| name       | weight w(n)                 | sensitivity S | reference                       |
|------------|-----------------------------|---------------|---------------------------------|
| flat       | min(1, C / n)               | C             | Abadi et al. 2016               |
| automatic  | C / (n + r)                 | C             | Bu et al. 2022 (normalised)     |
| psac       | C / (n + r / (n + r))       | C             | Xia et al. 2023                 |
| psasc      | C / (s·n + r / (n + r))     | C / s         | Huang et al. 2024 (seed 004)    |

For psasc, ‖w(n)·g‖ = C·n / (s·n + r/(n+r)) < C/s, so the noise is σ·C/s: a smaller s weights small
gradients up *and* raises the noise by the same factor. Momentum (the seed's optional variant) is
post-processing of the noisy gradient: use ``optimizer: sgd`` with ``momentum``.

Example:
    >>> import torch
    >>> from dpllm.config import PrivacyConfig
    >>> fn, cfg = get("psasc"), PrivacyConfig(max_grad_norm=1.0, clipping_r=0.1, clipping_s=0.5)
    >>> n = torch.tensor([1e-3, 0.1, 1.0, 100.0])
    >>> bool(((fn.weights(n, cfg) * n) <= fn.sensitivity(cfg)).all())
    True
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Callable

import torch

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


def install(fn: ClippingFunction, cfg: PrivacyConfig, *, model, optimizer) -> None:
    """Make an Opacus-wrapped model/optimizer use ``fn`` (flat is Opacus's own and needs nothing).

    Ghost clipping: the module's ``get_clipping_coef`` returns w(‖g‖). Hooks: the optimizer's
    ``clip_and_accumulate`` weights materialised per-sample gradients by w(‖g‖). In both, the optimizer's
    ``max_grad_norm`` (the noise scale) was already set to the function's sensitivity by the caller.
    """
    if fn.name == "flat":
        return
    if hasattr(model, "get_clipping_coef"):
        def get_clipping_coef(self):
            return fn.weights(self.get_norm_sample(), cfg)

        model.get_clipping_coef = types.MethodType(get_clipping_coef, model)
        return

    from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed

    def clip_and_accumulate(self):
        if len(self.grad_samples[0]) == 0:
            weights = torch.zeros((0,), device=self.grad_samples[0].device)
        else:
            weights = fn.weights(per_sample_norms(self.grad_samples), cfg)
        for p in self.params:
            _check_processed_flag(p.grad_sample)
            gs = self._get_flat_grad_sample(p).to(p.dtype)
            grad = torch.einsum("i,i...", weights.to(gs.device, p.dtype), gs)
            p.summed_grad = grad if p.summed_grad is None else p.summed_grad + grad
            _mark_as_processed(p.grad_sample)

    optimizer.clip_and_accumulate = types.MethodType(clip_and_accumulate, optimizer)
