"""Refuse, on every backward pass, a gradient that reaches a trainable parameter around its own layer.

Opacus (``hooks``, ``ghost``) accounts for a parameter's gradient only through the layer that *owns* it: each
record's gradient (hooks) or norm (ghost) is computed from what that layer saw in its own forward call. Any other
path into the parameter escapes the clipping: a view of it made before training (``self.tied = lin.weight.T``),
a copy made in a hook (``W * 1.0``), an autocast-cached cast of it used by another op, ``F.linear(h, emb.weight)``,
a use that appears only on some batches. Ghost clipping adds such a gradient to the update scaled by a coefficient
computed without it (one record moved the model by 52–95 × C on tests/test_gradient_paths.py's toys, C = 1e-3);
hooks mode drops it and trains a different model than the one written. :mod:`dpllm.privacy.owners` watches the
first forward pass for direct uses; this guard checks every pass, whatever form the path takes.

How, on each forward pass and each backward pass:

1. *Forward*: when a layer that owns trainable parameters returns, the autograd nodes its call created are read
   back from its output (everything with a sequence number from after the call began, plus any older node that
   leads only to the layer's own parameters: a cached cast or a stored view). Those that send a gradient to one
   of its parameters, directly or through such a chain, get a hook. A layer of fixed structure (a type bk has
   a rule for) is searched once; later calls find the same nodes by index, and search again if they differ.
2. *Backward*: the hooks note the exact tensor each of those nodes sends. When the gradient arrives at the
   parameter (a tensor hook, before it is accumulated into ``p.grad``), or at a node of the chain, it must be
   what the layer's own nodes sent: the very same tensor when one node sent it (an identity test, free), else
   their sum within float rounding. Anything more came around the layer; the pass fails with the parameter's
   name before that gradient reaches ``p.grad``, the gradients already accumulated in this pass are dropped,
   and the guard refuses every later forward pass.

A contribution that is exactly zero passes (it changes nothing). Each layer's parameters are read at every call,
so under FSDP (``ghost_fsdp``) the check follows the unsharded parameters a layer holds while it runs. Not
covered: a layer's own forward code that reads its weight in ways its per-sample rule does not model (a custom
layer type must be registered with Opacus, whose rule defines what the layer computes), and, under FSDP only, a
weight whose own layer has not yet run with gradients in this process (its unsharded copy gets its check then).
What it costs per step, 35–64 µs of Python per layer with trainable weights: ``scripts/measure_guards.py cost``
and docs/engines.md.

Example:
    >>> import torch
    >>> from torch import nn
    >>> class Tied(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.emb, self.lin = nn.Embedding(5, 3), nn.Linear(3, 3)
    ...         self.view = self.lin.weight.T  # made before training: never seen inside lin's call
    ...     def forward(self, ids):
    ...         return self.lin(self.emb(ids)) @ self.view
    >>> model = Tied()
    >>> _ = guard_gradient_paths(model, "ghost")
    >>> model(torch.tensor([[1, 2]])).sum().backward()
    Traceback (most recent call last):
    ...
    dpllm.privacy.paths.UnclippableModel: grad_sample_mode ghost: trainable parameter lin.weight got a gradient ...
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from dpllm.models import ModelError

_seq = torch._C._autograd._get_sequence_nr  # the sequence number the next autograd node will get (this thread)
_ATTR = "_dpllm_gradient_paths"  # where the guard is kept on the model it watches
_CHAIN_DEPTH = 4  # an older node counts as a cast/view of a layer's own weight if it leads there in ≤ 4 steps

FIX = ("call the layer that owns it wherever it is used (for a tied output head: an nn.Linear whose .weight is "
       "the embedding's weight), give the other use its own parameter (untie it), or freeze it")


_probe = torch.zeros(1, requires_grad=True)
_ACC = type(_probe.mul(1).grad_fn.next_functions[0][0])  # AccumulateGrad: where a leaf's gradient arrives
_CAST = type(_probe.to(torch.float64).grad_fn)  # ToCopyBackward0: autocast caches a weight's cast, shared by all uses
del _probe


class UnclippableModel(ModelError, RuntimeError):
    """A model whose gradients no engine can clip per record as it is built: bad input, said in one line by the
    commands (a ``ValueError``), and a ``RuntimeError`` like the engines' other refusals."""


def _chain_to(node, own: frozenset, depth: int = 0) -> bool:
    """True if ``node`` is a chain of single-input nodes (casts, views) ending in one of the parameters ``own``."""
    nexts = [f for f, _ in node.next_functions if f is not None]
    if len(nexts) != 1 or depth >= _CHAIN_DEPTH:
        return False
    return id(nexts[0].variable) in own if type(nexts[0]) is _ACC else _chain_to(nexts[0], own, depth + 1)


def _explore(roots: list, own: frozenset, start: int):
    """The edges by which the nodes of one layer call send gradient to its parameters, found by search.

    Walks back from the call's outputs through the nodes it created (sequence number ≥ ``start``) and any older
    chain that leads only to the layer's parameters. An edge counts if it ends at a parameter's accumulator, or at
    a chain node that code outside the call could also reach: an older one, or a cast (autocast's cache hands the
    same cast to every use in its region). Returns ``(edges, plan)``: edges as ``(sender, input index, receiver,
    receiver's slot)``, and the plan that finds them again by index (:func:`_follow`).
    """
    edges, plan, seen = [], [], set()
    stack = [(n, (i,)) for i, n in enumerate(roots)]
    while stack:
        n, path = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        for k, (nxt, slot) in enumerate(n.next_functions):
            if nxt is None:
                continue
            if type(nxt) is _ACC:
                if id(nxt.variable) not in own:
                    continue
            elif nxt._sequence_nr() >= start:
                stack.append((nxt, path + (k,)))
                if type(nxt) is not _CAST or not _chain_to(nxt, own):
                    continue
            elif _chain_to(nxt, own):
                stack.append((nxt, path + (k,)))
            else:
                continue
            edges.append((n, k, nxt, slot))
            plan.append((path, k, type(n), type(nxt)))
    return edges, plan


def _follow(plan: list, roots: list, own: frozenset, start: int):
    """The edges of :func:`_explore`'s ``plan``, found by index in this call's nodes; None if they differ."""
    edges = []
    for path, k, sender_type, receiver_type in plan:
        if path[0] >= len(roots):
            return None
        n = roots[path[0]]
        for i in path[1:]:
            n = n.next_functions[i][0] if i < len(n.next_functions) else None
            if n is None:
                return None
        if type(n) is not sender_type or k >= len(n.next_functions):
            return None
        if n._sequence_nr() < start and not _chain_to(n, own):  # a sender outside this call: search instead
            return None
        nxt, slot = n.next_functions[k]
        if type(nxt) is not receiver_type:
            return None
        if type(nxt) is _ACC:
            if id(nxt.variable) not in own:
                return None
        elif not _chain_to(nxt, own) or (nxt._sequence_nr() >= start and type(nxt) is not _CAST):
            return None
        edges.append((n, k, nxt, slot))
    return edges


def _fixed_structure(module: nn.Module) -> bool:
    """Layer types whose call always builds the same nodes (those bk has rules for: Linear, LoRA's layers,
    Conv1D, Embedding, LayerNorm, RMSNorm); any other layer is searched at every call."""
    from dpllm.privacy.bk.layers import rule_for

    return rule_for(module) is not None


class PathGuard:
    """The hooks of :func:`guard_gradient_paths` and what they saw; :meth:`remove` takes them off."""

    def __init__(self, model: nn.Module, mode: str):
        self.mode, self.tripped = mode, None
        self.expected: dict = {}  # receiver → tensors the owning layers' nodes sent it in this backward pass
        self.starts: dict[int, list[int]] = {}  # id(module) → sequence numbers at the start of its open calls
        self.names: dict[int, str] = {}  # id(parameter) → name, for every parameter given a tensor hook
        self.params: list[torch.Tensor] = []
        self.layers: dict[int, str] = {}  # id(layer owning a trainable parameter) → its name
        self.labels: dict[int, str] = {}  # id(layer) → its trainable parameters' names, for messages
        self.plans: dict[int, list] = {}  # id(layer) → where its sending nodes sit (:func:`_explore`)
        self.handles: list = []
        for name, m in model.named_modules():
            if any(p is not None and p.requires_grad for p in m._parameters.values()):
                self.layers[id(m)] = name
                self._watch(m)
                self.handles.append(m.register_forward_pre_hook(self._start))
                # prepended: a user's forward hook on the layer runs after the walk, so its ops count as outside
                self.handles.append(m.register_forward_hook(self._walk, prepend=True, always_call=True))
        self.handles.append(model.register_forward_pre_hook(self._new_pass, prepend=True))

    def _watch(self, module: nn.Module) -> frozenset:
        """The ids of ``module``'s trainable parameters as it holds them now, each given the arrival check once.

        Read at every call: FSDP swaps the registered shards for unsharded parameters around each forward pass,
        and the gradient arrives at those."""
        own = []
        for pname, p in module._parameters.items():
            if p is not None and p.requires_grad:
                own.append(id(p))
                if id(p) not in self.names:
                    prefix = self.layers[id(module)]
                    self.names[id(p)] = name = f"{prefix}.{pname}" if prefix else pname
                    self.params.append(p)
                    self.handles.append(p.register_hook(functools.partial(self._arrive, id(p), name)))
        return frozenset(own)

    def __deepcopy__(self, memo):
        # A deep copy of a layer carries its hooks, bound to this guard (Opacus's functorch rule copies layers):
        # the copy shares the guard, which must not copy the model's parameters it holds.
        return self

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.expected.clear()
        self.tripped = "removed"  # hooks left on long-lived nodes see this and do nothing

    # ---- forward ---------------------------------------------------------------------------------------

    def _new_pass(self, module, args) -> None:
        if not torch.is_grad_enabled():
            return
        if self.tripped not in (None, "removed"):
            raise UnclippableModel(f"{self.tripped} (an earlier backward pass was refused; nothing more runs "
                                   "with this model)")
        self.expected.clear()  # left by a backward pass that failed half-way

    # A copy of a layer carries these hooks too (Opacus's functorch rule deep-copies layers it has no rule for and
    # runs the copy inside backward): only the layers this guard was built on are walked.
    def _start(self, module, args) -> None:
        if id(module) in self.layers:
            self.starts.setdefault(id(module), []).append(_seq())

    def _walk(self, module, args, output) -> None:
        starts = self.starts.get(id(module))
        start = starts.pop() if starts else None
        if start is None or output is None or not torch.is_grad_enabled() or self.tripped is not None:
            return
        own = self._watch(module)
        outs = [output] if isinstance(output, torch.Tensor) else tree_leaves(output)
        roots = [t.grad_fn for t in outs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        plan = self.plans.get(id(module))
        edges = _follow(plan, roots, own, start) if plan is not None else None
        if edges is None:
            edges, plan = _explore(roots, own, start)
            if edges and _fixed_structure(module):  # the same nodes every call: found again by index, not by search
                self.plans[id(module)] = plan
        sends: dict[int, list] = {}
        for sender, k, receiver, slot in edges:
            if type(receiver) is _ACC:
                sends.setdefault(id(sender), [sender]).append((k, id(receiver.variable)))
                continue
            sends.setdefault(id(sender), [sender]).append((k, (id(receiver), slot)))
            if not self._marked(receiver, "receive"):
                label = self.labels.get(id(module)) or self.labels.setdefault(id(module), ", ".join(
                    sorted(self.names[i] for i in own)))
                receiver.register_prehook(functools.partial(self._arrive_node, id(receiver), label))
        for sender, *targets in sends.values():
            if sender._sequence_nr() >= start and type(sender) is not _CAST:  # new in this call: no hooks yet
                sender.register_hook(functools.partial(self._send, tuple(targets)))
                continue
            done = self._marked(sender, "send", set())  # an older node, or a cast other calls may share
            new = tuple(t for t in targets if t not in done)
            if new:
                done.update(new)
                sender.register_hook(functools.partial(self._send, new))

    def _marked(self, node, role: str, value=True):
        """What this guard attached to ``node`` for ``role`` (set to ``value`` the first time, returning None then).

        A node that outlives the step (a stored view, a cached cast) keeps its hooks: they are attached once."""
        key = f"dpllm.paths.{role}"
        mine = node.metadata.get(key)
        if mine is not None and mine[0] is self:
            return mine[1]
        node.metadata[key] = (self, value)
        return value if isinstance(value, set) else None

    # ---- backward --------------------------------------------------------------------------------------

    def _send(self, targets, grad_inputs, grad_outputs) -> None:
        if self.tripped is not None:
            return
        for k, key in targets:
            g = grad_inputs[k]
            if g is not None:
                self.expected.setdefault(key, []).append(g)

    def _arrive_node(self, nid: int, label: str, grad_outputs) -> None:
        if self.tripped is not None:
            return
        for slot, g in enumerate(grad_outputs):
            self._check((nid, slot), g, label)

    def _arrive(self, pid: int, name: str, grad: Optional[torch.Tensor]) -> None:
        if self.tripped is None:
            self._check(pid, grad, name)

    def _check(self, key, arrived: Optional[torch.Tensor], label: str) -> None:
        sent = self.expected.pop(key, ())
        if arrived is None or (len(sent) == 1 and sent[0] is arrived) or _sums_to(arrived, sent):
            return
        for p in self.params:  # gradients accumulated earlier in this pass: none of them may be stepped on
            p.grad = None
        self.expected.clear()
        what = ("ghost clipping would add it to the update unclipped" if "ghost" in self.mode else
                "hooks mode would drop it and train a different model than the one written")
        self.tripped = (
            f"grad_sample_mode {self.mode}: trainable parameter {label} got a gradient through a path outside "
            "its own layer's forward call (a view or copy of it made before training or in a hook, a cast of it "
            "reused elsewhere, or a use outside its layer, possibly one that appears only on some batches); "
            f"Opacus clips per record only what runs through the layer, so {what}. Nothing of this step was "
            f"applied. Fix: {FIX}")
        raise UnclippableModel(self.tripped)


def _sums_to(arrived: torch.Tensor, sent) -> bool:
    """Whether ``arrived`` is the sum of ``sent``: exactly for one tensor, else within the rounding of a sum."""
    if not sent:
        return not bool(arrived.ne(0).any())  # a contribution of exactly zero changes nothing
    if len(sent) == 1:
        return arrived.shape == sent[0].shape and bool(torch.equal(arrived, sent[0]))
    total, size = torch.zeros_like(arrived), torch.zeros_like(arrived)
    for s in sent:
        total += s
        size += s.abs()
    # autograd and this loop each add k terms in some order: each is within (k-1)·u·Σ|sᵢ| of the exact sum
    u = torch.finfo(arrived.dtype).eps / 2 if arrived.is_floating_point() else 0.0
    bound = 2 * (len(sent) - 1) * u * size + torch.finfo(arrived.dtype).tiny
    return bool(((arrived - total).abs() <= bound).all())


def guard_gradient_paths(model: nn.Module, mode: str) -> PathGuard:
    """Make every backward pass through ``model`` fail on a gradient that reaches a trainable parameter other than
    through the forward call of the layer that owns it (see the module docstring).

    Args:
        model: the model, before Opacus wraps it (DDP- or FSDP-wrapped).
        mode: the Opacus mode, for the message (``hooks`` or ``ghost``).

    Returns:
        The :class:`PathGuard`, also kept on ``model`` for :func:`remove_guard`; its ``remove()`` takes the hooks off.
    """
    guard = PathGuard(model, mode)
    model.__dict__[_ATTR] = guard
    return guard


def remove_guard(model: nn.Module) -> None:
    """Take off the guard :func:`guard_gradient_paths` put on ``model``, if any (a model handed back after
    private training trains, or is tied again, like any other)."""
    guard = model.__dict__.pop(_ATTR, None)
    if guard is not None:
        guard.remove()
