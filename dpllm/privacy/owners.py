"""Refuse, before the first step, a trainable weight that Opacus's per-sample machinery cannot see.

Opacus (``hooks``, ``ghost``) computes each record's gradient, or its norm, layer by layer from what the
layer that *owns* a parameter saw in its own forward call. A trainable weight used anywhere else
(``F.linear(h, emb.weight)``, ``h @ lin.weight.T``, or peft's DoRA reading ``lora_A.weight`` in its parent)
reaches ``p.grad`` through plain autograd: ghost clipping scales that gradient by a coefficient computed
from the other uses only, so one record can move the model by several times C (5.13 × C measured on a
tied-head toy with ghost); hooks mode drops it and trains a different model than the one written. bk has
its own refusal of the same thing (:mod:`dpllm.privacy.bk`).

:func:`guard_parameter_uses` watches the first forward pass that runs with gradients enabled, with a
``TorchFunctionMode`` and a stack of the modules being called: an operation whose inputs include a trainable
parameter and whose output carries a gradient, while the innermost module being called does not own that
parameter, is such a use. The pass then fails with the parameter's name and the fix, before any backward
pass or step. Only that one pass is watched (the check costs Python time on every operation): a model whose
forward takes a different path on later batches is checked on the path of its first one; every backward
pass is then checked at the level of gradients by :mod:`dpllm.privacy.paths`, which also sees views and copies
of a weight that this identity test cannot. Under FSDP (``ghost_fsdp``) the forward pass uses unsharded copies,
not the registered parameters; ``make_private`` passes those (:func:`dpllm.distributed.unsharded_parameters`).

Example:
    >>> import torch
    >>> from torch import nn
    >>> class Tied(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.emb = nn.Embedding(5, 3)
    ...     def forward(self, ids):
    ...         return self.emb(ids) @ self.emb.weight.T
    >>> model = Tied()
    >>> _ = guard_parameter_uses(model, "ghost")
    >>> model(torch.tensor([[1, 2]]))
    Traceback (most recent call last):
    ...
    RuntimeError: a trainable parameter is used outside its own layer: emb.weight (in Tied). ...
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

FIX = ("call the layer that owns it wherever it is used (for a tied output head: an nn.Linear whose .weight "
       "is the embedding's weight), or freeze it")


class _Watch(TorchFunctionMode):
    """Records each trainable parameter that an operation uses outside its owner's forward call."""

    def __init__(self, owners: dict[int, tuple[str, frozenset[int]]], stack: list[nn.Module]):
        super().__init__()
        self.owners, self.stack, self.found = owners, stack, {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # only a result that carries a gradient back is a use (p.dtype, p.shape, p.detach() are not; p.T is)
        if not any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_leaves(out)):
            return out
        inner = self.stack[-1] if self.stack else None
        for t in tree_leaves((args, kwargs)):
            owner = self.owners.get(id(t)) if isinstance(t, torch.Tensor) else None
            if owner is not None and (inner is None or id(inner) not in owner[1]):
                self.found.setdefault(owner[0], type(inner).__name__ if inner is not None else "no layer")
        return out


def guard_parameter_uses(model: nn.Module, mode: str, *,
                         parameters: Optional[Iterable[tuple[str, nn.Module, torch.Tensor]]] = None
                         ) -> Callable[[], None]:
    """Make the first forward pass of ``model`` with gradients enabled fail on a use of a trainable parameter
    outside the layer that owns it (see the module docstring). Returns a function that removes the guard
    (it removes itself after that pass).

    ``parameters``: ``(name, owning module, parameter)`` of the objects the forward pass uses, when they are not
    the registered ones (FSDP2); default: every module's own parameters."""
    if parameters is None:
        parameters = [(f"{mname}.{pname}" if mname else pname, module, p)
                      for mname, module in model.named_modules() for pname, p in module.named_parameters(recurse=False)]
    owners: dict[int, tuple[str, set[int]]] = {}
    for pname, module, p in parameters:
        if p.requires_grad:
            name, ids = owners.setdefault(id(p), (pname, set()))
            ids.add(id(module))
    frozen = {k: (name, frozenset(ids)) for k, (name, ids) in owners.items()}
    stack: list[nn.Module] = []
    handles: list = []
    state: dict = {}

    def remove() -> None:
        for h in handles:
            h.remove()
        handles.clear()

    def push(module, args):
        if module is model and not stack:
            if not torch.is_grad_enabled():
                return
            state["watch"] = _Watch(frozen, stack).__enter__()
        if "watch" in state:
            stack.append(module)

    def pop(module, args, output):
        if "watch" not in state:
            return
        stack.pop()
        if module is not model or stack:
            return
        watch = state.pop("watch")
        watch.__exit__(None, None, None)
        remove()
        if watch.found:
            uses = ", ".join(f"{name} (in {where})" for name, where in sorted(watch.found.items()))
            raise RuntimeError(
                f"a trainable parameter is used outside its own layer: {uses}. Opacus's grad_sample_mode {mode} "
                f"computes each record's gradient layer by layer, so it cannot clip that use per record (ghost "
                f"would add it unclipped, hooks would drop it); {FIX}")

    for module in model.modules():
        handles.append(module.register_forward_pre_hook(push))
        handles.append(module.register_forward_hook(pop, always_call=True))
    return remove
