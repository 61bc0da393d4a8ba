"""Book-keeping (BK) clipping: per-sample clipped gradient sums from a single backward pass.

``grad_sample_mode: bk``. During the one backward pass each trainable layer records its activations and
output gradients (see :mod:`dpllm.privacy.bk.layers` for the per-layer-type rules, ghost norm or
explicit per layer, whichever is cheaper). When the backward pass ends, an autograd callback

1. adds the layers' per-sample squared norms into each record's norm ‖gᵢ‖,
2. turns norms into weights cᵢ = w(‖gᵢ‖) with any :mod:`dpllm.privacy.clipping` function,
3. writes Σᵢ cᵢ·gᵢ into ``p.grad`` for every trainable parameter, from the stored tensors.

Under user-level sampling (``per_user=True``) the trainer calls :meth:`BookKeepingModule.set_users` before
each physical batch; step 1 then adds the squared norm of each *user's* mean gradient, cross terms between
the user's records included (:class:`dpllm.privacy.bk.layers.Units`), the weight is computed once per user,
and every record of user u enters step 3 with cᵤ/(records of u).

Under packing (``data.packing: true``, :mod:`dpllm.packing`) the trainer calls :meth:`BookKeepingModule.set_segments`
before each physical batch with every token's record; each rule then regroups its call's tokens per record
(:class:`dpllm.privacy.bk.layers.Segments`) and steps 1–3 run over the records, not the rows: one norm, one
weight and one term of the sum per record, as if each were a row alone. Both combine: with split long records
packed, ``set_users`` names the source record of each *segment* (a window), and the windows' sum is clipped once.

Opacus stays the owner of noise, accounting and virtual-batch accumulation: the optimizer is Opacus's
``DPOptimizerFastGradientClipping`` (``Distributed...`` under DDP), which adds noise to ``p.grad`` exactly
as for ghost clipping. Under FSDP2 step 3 reduce-scatters each clipped sum into the parameter's shard and
each process noises its own shard (:mod:`dpllm.privacy.bk.sharded`). Unlike Opacus's ghost clipping there is
no second backward pass and no special criterion: ``loss.backward()`` on the mean over records of each
record's loss is all it takes (Opacus's ``loss_reduction="mean"`` convention: gradients are scaled back by
the number of rows).

Why each record is clipped exactly once per backward pass (everything rests on this):

- *Only bk writes a trainable parameter's gradient.* Every rule's autograd function returns no weight
  gradient, so autograd accumulates into a trainable ``p.grad`` only when the parameter is used outside its
  own layer (``F.linear(h, emb.weight)``, ``h @ lin.weight.T``); a hook on every trainable parameter (under
  FSDP on the unsharded copy the forward pass uses, before FSDP's own reduce-scatter could send it)
  refuses that before the gradient reaches ``p.grad`` (the backward pass fails), since bk would add its
  clipped sum to an unclipped gradient. Gradients already there when bk wraps the model are dropped
  (with a warning).
- *One callback per backward pass, at its very end.* The callback is queued once, on the first bk event of
  the pass: a layer's backward, or a layer's forward re-run inside the pass (checkpointing recomputes
  there). Under reentrant checkpointing each segment is differentiated by a *nested* backward pass started
  from a node of the outer one, after the segment's forward was re-run inside the outer pass; so the first
  event is always in the outermost pass, and ``queue_callback`` attaches the callback to it, which runs
  after every nested pass has returned. Should the callback still land on a nested pass (a graph built
  outside backward and differentiated by a backward called from inside a node, with no bk layer in the
  outer pass before it), it finds an autograd node still executing and refuses instead of clipping part
  of the model.
- *One norm and one weight per record.* Every layer's rows must be the batch's records: each layer's
  dimension 0 must equal the number of rows the module was called with (sequence-first ``(T, B, d)`` or
  flattened ``(B·T, d)`` inputs are refused, unless T happens to equal B: a shape cannot tell those apart);
  the squared norms of all layers and all calls add into one norm per record, one weight cᵢ is computed
  from it, and Σᵢ cᵢ·gᵢ is written once, after which the records are cleared.

Example:
    >>> import torch
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1)).double()
    >>> bk = BookKeepingModule(net, clip_weights=lambda n: (1.0 / n).clamp(max=1.0))
    >>> bk(torch.randn(5, 3, dtype=torch.float64)).pow(2).mean().backward()
    >>> bool((bk.last_norms > 0).all()), net[0].weight.grad.shape
    (True, torch.Size([4, 3]))
"""

from __future__ import annotations

import functools
import logging
from typing import Callable, Optional

import torch
from torch import nn

from dpllm.distributed import is_sharded, unsharded_parameters
from dpllm.privacy.bk.layers import Record, Segments, Units, is_tied_head, rule_for, tied_cross
from dpllm.privacy.bk.sharded import ShardedSums

log = logging.getLogger(__name__)

# -1 outside a backward pass, else the id of the pass running on this thread (as torch's FSDP tests it)
_graph_task = torch._C._current_graph_task_id
# the autograd node executing on this thread: not None inside a backward pass started from a node's backward
_autograd_node = torch._C._current_autograd_node

NESTED_FIX = ("use non-reentrant checkpointing: model.gradient_checkpointing_enable(gradient_checkpointing_kwargs="
              "{'use_reentrant': False}), or torch.utils.checkpoint.checkpoint(..., use_reentrant=False)")

__all__ = ["BookKeepingModule", "make_private_bk", "unsupported_layers"]


def _trainable_modules(model: nn.Module):
    for name, m in model.named_modules():
        if any(p.requires_grad for p in m.parameters(recurse=False)):
            yield name, m


def unsupported_layers(model: nn.Module) -> list[str]:
    """Trainable layers with no BK rule (``name (Type)``); empty when the model can run under ``bk``."""
    bad = [f"{n} ({type(m).__name__})" for n, m in _trainable_modules(model) if rule_for(m) is None]
    seen: dict[int, tuple[str, nn.Module]] = {}
    for n, m in _trainable_modules(model):
        for pn, p in m.named_parameters(recurse=False):
            if p.requires_grad and id(p) in seen and not is_tied_head(seen[id(p)][1], m):
                bad.append(f"{n}.{pn} (parameter shared with {seen[id(p)][0]})")
            seen[id(p)] = (f"{n}.{pn}", m)
    return bad


class BookKeepingModule(nn.Module):
    """Wrap ``module`` so that each backward pass leaves the clipped per-sample gradient sum in ``p.grad``.

    Args:
        module: the model; every trainable layer must have a rule (:func:`unsupported_layers`).
        clip_weights: per-sample norms (B,) → weights (B,), e.g. ``lambda n: fn.weights(n, cfg)``.
        loss_reduction: ``"mean"`` if the loss is the mean over the batch's rows (gradients are scaled
            by the number of rows), ``"sum"`` if it is their sum.
        per_user: clip one mean gradient per user (ULS); every backward pass then needs :meth:`set_users`.

    Raises:
        NotImplementedError: a trainable layer without a rule, or a parameter shared by two layers.
        RuntimeError: in backward, a use bk cannot clip: a trainable parameter used outside its layer, a layer
            whose rows are not the batch's records, or clipping that would end a nested backward pass.
    """

    def __init__(self, module: nn.Module, *, clip_weights: Callable[[torch.Tensor], torch.Tensor],
                 loss_reduction: str = "mean", per_user: bool = False):
        super().__init__()
        bad = unsupported_layers(module)
        if bad:
            raise NotImplementedError(
                f"grad_sample_mode=bk cannot handle trainable {', '.join(bad[:5])}; freeze them, untie shared "
                "weights, or use grad_sample_mode: auto (Opacus hooks or ghost for such layers)"
            )
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction={loss_reduction!r}; use 'mean' or 'sum'")
        self._module = module
        self.clip_weights, self.loss_reduction = clip_weights, loss_reduction
        self.last_norms: Optional[torch.Tensor] = None  # per-sample (per-user) gradient norms of the last backward
        self.per_user = per_user
        self._units: Optional[Units] = None
        self._records: list[Record] = []
        self._queued = False
        self._segments: Optional[Segments] = None  # packed rows: each token's record, for the next backward pass
        self._rows: Optional[int] = None  # records in the batch of the last forward pass, when it can be told
        for _, m in _trainable_modules(module):
            rule = rule_for(m)
            record = Record(rule, m, self._on_layer_backward)
            # The layer runs through the rule's autograd function while attached (undone by detach()).
            m.forward = functools.partial(self._layer_forward, rule.forward, m, record)
            self._records.append(record)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        stale = [n for n, p in named if p.grad is not None and bool(p.grad.detach().ne(0).any())]
        if stale:  # bk adds its clipped sum to p.grad: a gradient already there would go out unclipped
            log.warning("bk: dropped the gradients that %d trainable parameters (%s...) held from before wrapping; "
                        "only clipped sums may reach p.grad", len(stale), ", ".join(stale[:3]))
            for _, p in named:
                p.grad = None
        self._params = [p for _, p in named]
        # FSDP2 (sharded.py): the clipped sums are reduce-scattered into the shards, and the forward pass uses
        # unsharded parameter objects, not the registered DTensors: those are the ones a raw gradient reaches.
        self._sharded = is_sharded(module)
        if self._sharded:
            seen: set[int] = set()
            used = [(n, p) for n, _, p in unsharded_parameters(module)
                    if p.requires_grad and not (id(p) in seen or seen.add(id(p)))]
        else:
            used = named
        # Autograd never brings these a gradient (the rules return none) unless a parameter is used outside
        # its layer; the hook sees it before it reaches p.grad and refuses.
        self._hooks = [p.register_hook(functools.partial(_refuse_raw_gradient, n)) for n, p in used]
        # an output head sharing the input embedding's weight: its norm needs the cross term (layers.tied_cross)
        self._ties = [(e, h) for e in self._records for h in self._records if is_tied_head(e.module, h.module)]
        # Where each record's clipped sums go: the registered parameters, captured now (under FSDP a module's
        # attribute is the unsharded copy while its group runs). A tied embedding comes after its head, which
        # leaves the shared weight's full sum for the embedding to add its rows into. The order is the same on
        # every process: under FSDP each parameter's sum is a collective.
        self._tied_heads = {id(h) for _, h in self._ties}
        self._tied_embeddings = {id(e) for e, _ in self._ties}
        self._targets = [(r, {n: p for n, p in r.module.named_parameters(recurse=False) if p.requires_grad})
                         for r in sorted(self._records, key=lambda r: id(r) in self._tied_embeddings)]

    def set_policy(self, policy: str) -> None:
        """Per-sample norms of Linear/Conv1D weights: "auto" (the cheaper), "ghost" or "explicit" everywhere."""
        if policy not in ("auto", "ghost", "explicit"):
            raise ValueError(f"policy={policy!r}; use auto, ghost or explicit")
        for r in self._records:
            r.policy = policy

    def set_users(self, users, *, reduction: str = "mean") -> None:
        """The user (any integer id) of each row of the next batch: its backward clips one mean per user
        (``reduction="sum"``: one sum per unit, the windows of one long record)."""
        if not self.per_user:
            raise RuntimeError("set_users() on a record-level BookKeepingModule; build it with per_user=True")
        ids = torch.as_tensor(list(users), dtype=torch.long)
        self._units = Units.sum_over(ids) if reduction == "sum" else Units.mean_over(ids)
        self._set_rows_per_unit()

    def set_segments(self, segment: Optional[torch.Tensor]) -> None:
        """Packed rows: the record (segment id 0..S−1, −1 for padding) of every token (B, T) of the next batch.

        Its backward pass then clips each record's gradient, the sum over its tokens only, and the loss's "mean"
        is over the S records (:func:`dpllm.packing.packed_sequence_loss`). ``None``: rows are records again.
        Under ``per_user`` a later :meth:`set_users` names one unit per *segment*.
        """
        self._segments = None if segment is None else Segments(segment)
        for r in self._records:
            r.segments = self._segments
        self._set_rows_per_unit()

    def _set_rows_per_unit(self) -> None:
        """The most rows one unit spans (a user's records, a record's windows, a packed segment's sub-rows): the
        ghost norm's cost grows with it (a cost only: the norms are exact either way)."""
        most = (max(1, self._units.largest) if self._units is not None else 1) * (
            self._segments.most if self._segments is not None else 1)
        for r in self._records:
            r.rows_per_unit = most

    def forward(self, *args, **kwargs):
        if _graph_task() == -1:  # a new forward pass, not a recomputation inside backward
            self._reset()  # anything left over is from a backward pass that failed half-way
            if torch.is_grad_enabled():
                self._rows = _rows_of(args, kwargs)
        return self._module(*args, **kwargs)

    def expect_rows(self, rows: int) -> None:
        """The number of records of the next backward pass, for a loss that calls the inner layers directly
        (:func:`dpllm.privacy.bk.loss.causal_lm_chunked_loss`) instead of this module's forward."""
        self._reset()
        self._rows = int(rows)

    def detach(self) -> nn.Module:
        """Restore the layers' own forward methods, remove bk's hooks and return the bare module."""
        for r in self._records:
            r.module.__dict__.pop("forward", None)
        for h in self._hooks:
            h.remove()
        self._records, self._hooks = [], []
        return self._module

    def _reset(self) -> None:
        for r in self._records:
            r.clear()
        self._queued, self._rows = False, None

    def _layer_forward(self, forward, module, record, *args, **kwargs):
        if _graph_task() != -1 and torch.is_grad_enabled():
            # Recomputation inside a backward pass (checkpointing): this pass, or a pass nested in it
            # (reentrant checkpointing), will differentiate the layer; clip at the end of this one.
            self._on_layer_backward()
        return forward(module, record, *args, **kwargs)

    def _on_layer_backward(self) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _refuse(self, message: str):
        self._reset()
        self._units = None
        self.set_segments(None)
        return RuntimeError(f"grad_sample_mode=bk: {message}")

    @torch.no_grad()
    def _finish_backward(self) -> None:
        self._queued = False
        active = [r for r in self._records if r.batch_size() is not None]
        if not active:
            self.set_segments(None)
            return
        if _autograd_node() is not None:  # this pass was started from inside another pass's node
            raise self._refuse("the backward pass that ends here runs inside another one (reentrant gradient "
                               "checkpointing, or a custom autograd function that calls backward), so clipping "
                               "now would clip part of the model separately; " + NESTED_FIX)
        sizes = {r.batch_size() for r in active}
        rows, B = self._rows, max(sizes)
        packed = self._segments
        if packed is not None:  # the records are the segments of the packed rows, each over its sub-rows
            rows = len(packed.owner)
        if len(sizes) != 1 or (rows is not None and B != rows):
            seen = ", ".join(sorted({f"{type(r.module).__name__}: {r.batch_size()}" for r in active}))
            batch = f"a batch of {rows} records" if rows is not None else "one batch"
            raise self._refuse(
                f"{batch}, but the trainable layers saw rows ({seen}) in dimension 0: a layer whose input is "
                "sequence-first (T, B, d) or flattened (B·T, d) gets one norm per position, not per record. Keep "
                "every trainable layer's input batch-first (B, ..., d): batch_first=True, or reshape (B·T, d) back "
                "to (B, T, d) before the layer")
        self._rows = None
        units, self._units = self._units, None
        self.set_segments(None)
        records = packed.count if packed is not None else B  # the loss's mean is over the records (segments)
        if self.per_user and (units is None or len(units.inverse) != records):
            raise RuntimeError(f"user-level bk got {records} rows (packed segments) but set_users() gave "
                               f"{None if units is None else len(units.inverse)} users; a dpllm bug")
        if packed is not None:  # each segment's sub-rows (and a split record's segments) summed into one unit
            units = packed.units(units)
        scale = float(records) if self.loss_reduction == "mean" else 1.0
        norm2 = None
        for r in active:
            part = r.rule.norm2(r, units)
            norm2 = part if norm2 is None else norm2 + part
        for e, h in self._ties:
            if e in active and h in active:
                norm2 = norm2 + 2 * tied_cross(e, h, units)
        norms = norm2.clamp(min=0).sqrt() * scale
        coef = self.clip_weights(norms).to(norms.dtype) * scale
        if units is not None:  # a user's weight, shared by its records in proportion 1/(its records)
            coef = coef[units.inverse.to(coef.device)] * units.weight.to(coef.device, coef.dtype)
        self._write_clipped(active, coef)
        for p in self._params:  # a layer the loss did not reach contributes zero, as under autograd
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.last_norms = norms

    def _write_clipped(self, active: list[Record], coef: torch.Tensor) -> None:
        """Σᵢ cᵢ·gᵢ of every record into its parameters' ``.grad`` (under FSDP reduce-scattered into the shards).

        Every parameter is deposited exactly once per pass, in ``self._targets``' order, whatever the records saw
        (under FSDP a deposit is a collective); a tied weight once, at its embedding's turn, with both parts.
        """
        on = {id(r) for r in active}
        held: dict[int, Optional[torch.Tensor]] = {}  # a tied weight's sum, from its head to its embedding's turn
        sums = ShardedSums(self._add_grad) if self._sharded else None
        for r, params in self._targets:
            embedding = id(r) in self._tied_embeddings
            into = held.get(id(params.get("weight"))) if embedding else None
            grads = r.rule.clipped(r, coef, **({"into": into} if into is not None else {})) if id(r) in on else {}
            for name, p in params.items():
                grad = grads.get(name)
                grad = None if grad is None else grad.to(p.dtype)
                if name == "weight" and id(r) in self._tied_heads:  # its embedding adds its rows in place
                    held[id(p)] = grad
                    continue
                if name == "weight" and embedding:
                    kept = held.pop(id(p), None)
                    grad = kept if grad is None else grad if kept is None else kept + grad
                if sums is not None:  # collectives: every process sends each parameter's sum, zeros if none
                    sums.add(p, torch.zeros(p.shape, dtype=p.dtype, device=p.device) if grad is None else grad)
                elif grad is not None:
                    self._add_grad(p, grad)
            r.clear()
        if sums is not None:
            sums.flush()

    @staticmethod
    def _add_grad(p: torch.Tensor, grad: torch.Tensor) -> None:
        p.grad = grad if p.grad is None else p.grad + grad


def _refuse_raw_gradient(name: str, grad: Optional[torch.Tensor]) -> None:
    if grad is None:  # what every rule gives its parameters
        return
    raise RuntimeError(
        f"grad_sample_mode=bk: trainable parameter {name} got a gradient from a use outside its own layer (e.g. "
        "F.linear(h, emb.weight) or h @ lin.weight.T); bk clips only what runs through the layer's forward and "
        "would add an unclipped gradient. Call the layer itself (emb(ids), lin(h)), give the other use its own "
        "layer (untie the weights), or freeze the parameter")


def _rows_of(args, kwargs) -> Optional[int]:
    """Records in a batch: dimension 0 of ``input_ids``, ``inputs_embeds`` or the first tensor argument."""
    for key in ("input_ids", "inputs_embeds"):
        if isinstance(kwargs.get(key), torch.Tensor):
            return kwargs[key].shape[0]
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            return v.shape[0]
    return None


def make_private_bk(*, engine, model: nn.Module, optimizer: torch.optim.Optimizer, clip_weights: Callable,
                    noise_multiplier: float, max_grad_norm: float, expected_batch_size: float, world_size: int = 1,
                    noise_generator: Optional[torch.Generator] = None, secure_mode: bool = False,
                    per_user: bool = False, quantile=None):
    """Wrap ``model`` for BK and ``optimizer`` as Opacus's ghost-clipping optimizer (noise, accumulation).

    The caller attaches ``engine``'s accountant hook, as for every mode. The optimizer class is the one
    Opacus picks for ``grad_sample_mode="ghost"`` (it adds noise to, and accumulates, ``p.grad``), subclassed
    to skip two copies of the gradient (:mod:`dpllm.privacy.bk.optimizer`); under FSDP2 the subclass that
    noises this process's shard alone (:mod:`dpllm.privacy.bk.sharded`).

    Args:
        expected_batch_size: records (users under ``per_user``) per logical batch over all processes.
        world_size: the number of processes. Under DDP Opacus averages the processes' sums, so its optimizer
            divides by the per-process share; under FSDP the shards hold sums, divided by the global batch.
        per_user: ULS, one clipped mean gradient per user.
        quantile: ``clipping: quantile``'s :class:`dpllm.privacy.quantile.QuantileClipping` (one process, DDP or
            FSDP2): ``clip_weights`` is its ``weights``, and the optimizer is :class:`dpllm.privacy.bk.optimizer.
            QuantileAccumulation` (``Distributed...``, ``Sharded...``), which noises the count and moves C.

    Returns:
        ``(model, optimizer)``.

    Raises:
        NotImplementedError: layers bk cannot handle.
        ValueError: a noise generator under secure mode (as Opacus).
    """
    from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dpllm.privacy.bk.optimizer import optimizer_class

    if noise_generator is not None and secure_mode:
        raise ValueError("Passing seed is prohibited in secure mode")
    ddp = isinstance(model, (DPDDP, DDP))
    # Opacus's, minus two gradient copies; clipping: quantile's variant also noises the count and moves C
    cls = optimizer_class(distributed=ddp, sharded=is_sharded(model), quantile=quantile is not None)
    dp_optimizer = cls(optimizer, noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
                       expected_batch_size=expected_batch_size / world_size if ddp else expected_batch_size,
                       loss_reduction="mean",
                       generator=engine.secure_rng if secure_mode else noise_generator, secure_mode=secure_mode)
    if quantile is not None:
        dp_optimizer.quantile = quantile
    return BookKeepingModule(model, clip_weights=clip_weights, per_user=per_user), dp_optimizer
