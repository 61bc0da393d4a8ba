"""Per-layer-type rules of the book-keeping engine: what a layer records in backward, its per-sample
squared gradient norm, and its clipped gradient sum. A registry keyed by module type.

Every rule runs its layer through a custom autograd function that returns *no* weight gradient: the
function's backward computes only the input gradient and hands (activation, output gradient) to the
layer's :class:`Record`. Autograd therefore never forms Σᵢ aᵢᵀgᵢ itself; the engine forms Σᵢ cᵢ·aᵢᵀgᵢ
once the clip factors cᵢ are known. Because activations are read from ``ctx.saved_tensors`` in backward,
gradient checkpointing (``use_reentrant=False``) recomputes them once and they are recorded once.

Linear (LoRA's A and B are ``nn.Linear``) and GPT-2's ``Conv1D`` pick, per call, the cheaper of
- ghost norm: ‖Σₜ gₜaₜᵀ‖² = Σₜₜ' (aₜ·aₜ')(gₜ·gₜ'), cost ~B·T²·(d_in + d_out), keeps a and g;
- explicit: Gᵢ = gᵢᵀaᵢ per sample, cost ~B·T·d_in·d_out, keeps B·d_in·d_out (LoRA's rank-r factors).
Embedding: exact per-sample norm by summing the gradients of equal token ids (sort, O(B·T·d)).
LayerNorm / RMSNorm: explicit per-sample gradients (B·d).

User-level sampling (ULS) clips one gradient per *unit* (a user): the mean of its rows' gradients. Every
rule's ``norm2`` then takes :class:`Units` and returns one squared norm per unit, with the cross terms
between a unit's rows (ghost: Σᵢⱼ over the pairs of a unit; explicit: the weighted per-row gradients summed
per unit; Embedding: token ids grouped per unit instead of per row). The clipped sum needs no change:
Σᵤ cᵤ·Σ_{i∈u} wᵢgᵢ is the per-row sum with coefficient cᵤ₍ᵢ₎·wᵢ.

Packed rows (``data.packing: true``) hold several records each, every token tagged with its record's segment
(:class:`Segments`). A record's gradient is the sum over *its tokens* of the per-token terms (gₜaₜᵀ for a weight,
gₜ for a bias, gₜ⊙x̂ₜ for a norm's weight, gₜ into row xₜ of an embedding): attention never crosses a segment, so
the loss of every other record has no path to this record's tokens. So every rule, when it records a call,
gathers each segment's tokens into rows of their own, (B, T, d) → (sub-rows, w, d): a segment of L tokens fills
⌈L/w⌉ sub-rows of w positions, zeros after its end. The engine then treats a segment's sub-rows as one unit,
exactly as the windows of a split record (``Units``, weight 1): the ghost norm pairs only tokens of one segment
(the block-diagonal part of the T×T Gram matrices, with nothing else computed), the explicit per-sample gradient
is summed over the segment's sub-rows, the embedding groups token ids per segment, and the clipped sum scales
each segment's tokens by its own factor. Zeros add nothing to any of these sums, so the result is exactly each
record's own gradient, as if it had been a row alone.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Units:
    """Rows grouped into privacy units: row i enters unit ``inverse[i]``'s gradient with ``weight[i]``.

    Under ULS a unit is a user and ``weight[i]`` is 1/(the user's rows), so a unit's gradient is the mean
    of its records' gradients. A long record split into windows (``data.long_records: split``) is a unit whose
    rows are its windows, each of weight 1: its gradient is the sum over its windows.
    """

    inverse: torch.Tensor  # (B,) long, values in [0, count)
    weight: torch.Tensor  # (B,)
    count: int
    _pairs: Optional[tuple[torch.Tensor, torch.Tensor]] = field(default=None, repr=False, compare=False)

    @classmethod
    def mean_over(cls, users: torch.Tensor) -> "Units":
        """Units from each row's user id (any integers): weight 1/(rows of that user)."""
        _, inverse = torch.unique(users, return_inverse=True)
        counts = torch.bincount(inverse)
        return cls(inverse=inverse, weight=1.0 / counts[inverse].to(torch.float64), count=len(counts))

    @classmethod
    def sum_over(cls, units: torch.Tensor) -> "Units":
        """Units from each row's unit id (any integers): weight 1, so a unit's gradient is its rows' sum."""
        _, inverse = torch.unique(units, return_inverse=True)
        return cls(inverse=inverse, weight=torch.ones(len(inverse), dtype=torch.float64),
                   count=int(inverse.max()) + 1 if len(inverse) else 0)

    @property
    def largest(self) -> int:
        return int(torch.bincount(self.inverse).max()) if len(self.inverse) else 0

    def scale_rows(self, v: torch.Tensor) -> torch.Tensor:
        return v * self.weight.to(v.device, v.dtype).view(-1, *([1] * (v.dim() - 1)))

    def sum_rows(self, v: torch.Tensor) -> torch.Tensor:
        """(B, ...) per-row tensors → (count, ...) weighted sums per unit."""
        out = torch.zeros((self.count, *v.shape[1:]), dtype=v.dtype, device=v.device)
        return out.index_add_(0, self.inverse.to(v.device), self.scale_rows(v))

    def pairs(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """All ordered pairs (i, j) of rows in the same unit, i = j included: Σ_u k_u² of them (found once per
        batch, shared by every layer)."""
        if self._pairs is None:
            same = self.inverse[:, None] == self.inverse[None, :]
            self._pairs = same.nonzero(as_tuple=True)
        i, j = self._pairs
        return i.to(device), j.to(device)


class Segments:
    """The records of packed rows: token (b, t) belongs to segment ``segment[b, t]`` (−1: no record, padding).

    :meth:`rows` gathers each segment's tokens, in position order, into rows of their own of ``width`` positions:
    a segment of L tokens fills ⌈L/width⌉ consecutive *sub-rows* (``owner`` names each sub-row's segment), the
    last one zero after the segment's end. The engine then groups a segment's sub-rows back into one unit
    (:class:`Units`, weight 1: the segment's gradient is the sum over its sub-rows, cross terms included), so
    the width changes the cost, never the result. It is chosen to waste few positions: one row per segment at
    the longest segment's length would pad every short record to it. Segment ids must be 0..S−1, each with at
    least one token; a segment may not span rows (the packer never makes one), though the gathering would not
    care.

        >>> seg = Segments(torch.tensor([[0, 0, 1, -1], [2, 2, 2, 2]]), width=2)
        >>> seg.rows(torch.arange(8.).view(2, 4, 1)).squeeze(-1), seg.owner
        (tensor([[0., 1.],
                [2., 0.],
                [4., 5.],
                [6., 7.]]), tensor([0, 1, 2, 2]))
    """

    #: positions a sub-row costs beyond its width when choosing the width (per-row overheads, cross-row pairs)
    ROW_COST = 16

    def __init__(self, segment: torch.Tensor, *, width: Optional[int] = None):
        if segment.dim() != 2:
            raise ValueError(f"segment ids must be (rows, positions), got shape {tuple(segment.shape)}")
        self.shape = tuple(segment.shape)
        flat = segment.detach().flatten().cpu().long()
        pos = (flat >= 0).nonzero().squeeze(1)
        seg = flat[pos]
        order = torch.argsort(seg, stable=True)  # by segment, each segment's tokens in position order
        pos, seg = pos[order], seg[order]
        self.count = int(seg.max()) + 1 if len(seg) else 0
        lengths = torch.bincount(seg, minlength=self.count)
        if bool((lengths == 0).any()):
            raise ValueError(f"segment ids must be 0..{self.count - 1} with a token each; "
                             f"{int((lengths == 0).sum())} ids have none")
        self.lengths = lengths
        self.width = int(width) if width is not None else self.choose_width(lengths.tolist())
        subrows = (lengths + self.width - 1) // self.width  # per segment
        first = torch.cumsum(subrows, 0) - subrows  # its first sub-row
        col = torch.arange(len(seg)) - (torch.cumsum(lengths, 0) - lengths)[seg]  # position within the segment
        row = first[seg] + col // self.width
        self.owner = torch.repeat_interleave(torch.arange(self.count), subrows)
        self.most = int(subrows.max()) if self.count else 1  # the most sub-rows of one segment
        self.index = torch.zeros(len(self.owner), self.width, dtype=torch.long)
        self.mask = torch.zeros(len(self.owner), self.width, dtype=torch.bool)
        self.index[row, col % self.width] = pos
        self.mask[row, col % self.width] = True
        self._on: dict = {}

    @classmethod
    def choose_width(cls, lengths: list[int]) -> int:
        """The sub-row width (a power of two from 16, or the longest segment) that minimises the positions
        gathered, Σ ⌈L/w⌉·(w + ROW_COST): padding against many small rows."""
        longest = max(lengths, default=1)
        options = [w for w in (2 ** k for k in range(4, 20)) if w < longest] + [longest]
        return min(options, key=lambda w: (sum(-(-n // w) * (w + cls.ROW_COST) for n in lengths), -w))

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        """(B, T, ...) per-token values of the packed rows → (sub-rows, width, ...) per segment, zero (id 0) after
        a segment's end."""
        if tuple(t.shape[:2]) != self.shape:
            raise RuntimeError(
                f"grad_sample_mode=bk with packed rows: a trainable layer saw {tuple(t.shape[:2])} (rows, positions) "
                f"where the packed batch is {self.shape}; every trainable layer must see each token of the rows once "
                "(a head over chunks of positions, or pooled inputs, cannot be split by record): use data.packing: "
                "false for this model or loss")
        if t.device not in self._on:
            self._on[t.device] = (self.index.to(t.device), self.mask.to(t.device))
        index, mask = self._on[t.device]
        out = t.flatten(0, 1)[index]
        keep = mask.view(*mask.shape, *([1] * (t.dim() - 2)))
        return out.masked_fill(~keep, 0)

    def units(self, of_segment: Optional[Units] = None) -> Units:
        """The sub-rows grouped per segment (``of_segment`` None) or per unit of segments (split windows: a
        record's windows summed), each sub-row of weight 1."""
        if of_segment is None:
            return Units.sum_over(self.owner)
        if not bool((of_segment.weight == 1).all()):
            raise RuntimeError("packed rows take units that sum their segments (split windows), not user means")
        return Units.sum_over(of_segment.inverse[self.owner])


class Record:
    """What one trainable layer saw during the current backward pass (possibly over several calls)."""

    def __init__(self, rule: "Rule", module: nn.Module, on_backward: Callable[[], None]):
        self.rule, self.module, self.on_backward = rule, module, on_backward
        self.ghost: list[tuple[torch.Tensor, torch.Tensor]] = []  # (a, g), each (B, T, d)
        self.explicit: dict[str, torch.Tensor] = {}  # parameter name -> per-sample gradients (B, ...)
        self.policy = "auto"  # Linear/Conv1D: "auto" (cheaper of the two), "ghost" or "explicit"
        self.rows_per_unit = 1  # ULS: the most rows one unit has (the ghost norm's cost grows with it)
        self.segments: Optional[Segments] = None  # packed rows: each call's tokens regrouped per record
        self.cache: dict = {}

    def add_explicit(self, name: str, per_sample: torch.Tensor) -> None:
        prev = self.explicit.get(name)
        self.explicit[name] = per_sample if prev is None else prev + per_sample

    def clear(self) -> None:
        self.ghost, self.explicit = [], {}
        self.cache: dict = {}  # work norm2 and clipped share within one backward pass (EmbeddingRule)

    def per_record(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(B, T, ...) tensors of one call as rows of records: unchanged, or per segment of packed rows."""
        if self.segments is None:
            return tensors
        return tuple(self.segments.rows(t) for t in tensors)

    def batch_size(self) -> Optional[int]:
        for a, _ in self.ghost:
            return a.shape[0]
        for v in self.explicit.values():
            return v.shape[0]
        return None


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _autocast(x: torch.Tensor, *tensors):
    """Cast to the autocast dtype explicitly, so saved activations are kept in that (smaller) dtype."""
    dev = x.device.type
    if not torch.is_autocast_enabled(dev):
        return (x, *tensors)
    dt = torch.get_autocast_dtype(dev)
    return tuple(t if t is None or not t.is_floating_point() else t.to(dt) for t in (x, *tensors))


class Rule:
    """One layer type: how to run it, and how to turn its record into norms and clipped sums."""

    types: tuple = ()

    def forward(self, module: nn.Module, record: Record, *args, **kwargs):  # installed as module.forward
        raise NotImplementedError

    def norm2(self, record: Record, units: Optional[Units] = None) -> torch.Tensor:
        """Per-sample squared norm (B,) of the layer's raw (loss-scale) gradient, or per unit (count,) of the
        units' weighted gradient sums; None if nothing explicit."""
        parts = []
        for v in record.explicit.values():
            v = v.to(_acc_dtype(v))
            parts.append((v if units is None else units.sum_rows(v)).flatten(1).pow(2).sum(1))
        return sum(parts[1:], parts[0]) if parts else None

    def clipped(self, record: Record, coef: torch.Tensor) -> dict[str, torch.Tensor]:
        """Σᵢ coefᵢ·(sample i's gradient) per parameter name."""
        return {name: torch.einsum("i,i...->...", coef.to(v.dtype), v) for name, v in record.explicit.items()}


# ---- Linear and GPT-2 Conv1D ------------------------------------------------------------------------

class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, record, transposed):
        x, w, b = _autocast(x, weight, bias)
        w_lin = w.t() if transposed else w  # Conv1D keeps (in, out)
        ctx.save_for_backward(x, w_lin)
        ctx.record = record
        return F.linear(x, w_lin, b)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gx = g @ w.to(g.dtype) if ctx.needs_input_grad[0] else None
        ctx.record.rule.record(ctx.record, x, g)
        ctx.record.on_backward()
        return gx, None, None, None, None


class LinearRule(Rule):
    types = (nn.Linear,)
    transposed = False

    def forward(self, module, record, x):
        return _LinearFn.apply(x, module.weight, module.bias, record, self.transposed)

    def record(self, record: Record, x: torch.Tensor, g: torch.Tensor) -> None:
        B = x.shape[0]
        a, g = record.per_record(x.reshape(B, -1, x.shape[-1]), g.reshape(B, -1, g.shape[-1]))
        m = record.module
        T, d_in, d_out = a.shape[1], a.shape[2], g.shape[2]
        if m.bias is not None and m.bias.requires_grad:
            record.add_explicit("bias", g.sum(1, dtype=_acc_dtype(g)))
        if not m.weight.requires_grad:
            return
        # ghost pairs each row with the rows of its unit (one row under record-level DP)
        ghost = (record.rows_per_unit * T * (d_in + d_out) < d_in * d_out if record.policy == "auto"
                 else record.policy == "ghost")
        if ghost:  # the weight's clipped sum is formed from a and g after clipping
            record.ghost.append((a, g))
        else:
            ps = torch.bmm(g.transpose(1, 2), a).to(_acc_dtype(g))  # (B, out, in)
            record.add_explicit("weight", ps.transpose(1, 2) if self.transposed else ps)

    def norm2(self, record, units=None):
        total = super().norm2(record, units)
        if record.ghost:
            a, g = _joined(record.ghost)
            if units is None:
                ga, gg = torch.bmm(a, a.transpose(1, 2)), torch.bmm(g, g.transpose(1, 2))
                ghost = (ga.to(_acc_dtype(ga)) * gg.to(_acc_dtype(gg))).sum((1, 2))
            else:  # ‖Σ_{i∈u} wᵢ aᵢᵀgᵢ‖² = Σ_{i,j∈u} wᵢwⱼ Σₜₜ' (aᵢₜ·aⱼₜ')(gᵢₜ·gⱼₜ')
                i, j = units.pairs(a.device)
                ga = torch.bmm(a[i], a[j].transpose(1, 2))
                gg = torch.bmm(g[i], g[j].transpose(1, 2))
                acc = _acc_dtype(ga)
                w = units.weight.to(a.device, acc)
                pair = (ga.to(acc) * gg.to(acc)).sum((1, 2)) * w[i] * w[j]
                ghost = torch.zeros(units.count, dtype=acc, device=a.device).index_add_(
                    0, units.inverse.to(a.device)[i], pair)
            total = ghost if total is None else total + ghost
        return total

    def clipped(self, record, coef):
        out = super().clipped(record, coef)
        if record.ghost:
            w = None
            for a, g in record.ghost:
                # Σᵢ cᵢ gᵢᵀaᵢ: scale whichever side is narrower (an output layer's g is B×T×vocabulary)
                if g.shape[-1] > a.shape[-1]:
                    a = a * coef.to(a.dtype)[:, None, None]
                else:
                    g = g * coef.to(g.dtype)[:, None, None]
                a2, g2 = a.flatten(0, 1), g.flatten(0, 1)
                part = a2.t() @ g2 if self.transposed else g2.t() @ a2  # the parameter's own layout, contiguous
                w = part if w is None else w + part
            out["weight"] = w if "weight" not in out else out["weight"] + w
        return out


def _joined(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The calls' (a, g) joined along positions; a layer called once is not copied."""
    if len(pairs) == 1:
        return pairs[0]
    return torch.cat([a for a, _ in pairs], 1), torch.cat([g for _, g in pairs], 1)


class Conv1DRule(LinearRule):
    transposed = True

    @functools.cached_property
    def types(self):
        from transformers.pytorch_utils import Conv1D

        return (Conv1D,)


# ---- Embedding ----------------------------------------------------------------------------------------

class _EmbeddingFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, record):
        m = record.module
        ctx.save_for_backward(ids)
        ctx.record = record
        return F.embedding(ids, weight, m.padding_idx, m.max_norm, m.norm_type, m.scale_grad_by_freq, m.sparse)

    @staticmethod
    def backward(ctx, g):
        (ids,) = ctx.saved_tensors
        B = ids.shape[0]
        ctx.record.ghost.append(ctx.record.per_record(ids.reshape(B, -1), g.reshape(B, -1, g.shape[-1])))
        ctx.record.on_backward()
        return None, None, None


class EmbeddingRule(Rule):
    types = (nn.Embedding,)

    def forward(self, module, record, ids):
        if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
            raise NotImplementedError(f"{module}: max_norm, scale_grad_by_freq and sparse are not supported by bk")
        return _EmbeddingFn.apply(ids, module.weight, record)

    @staticmethod
    def _grouped(record, units: Optional[Units] = None):
        """Per (sample, token id), or per (unit, token id) with the rows' weights: the summed output
        gradient. Returns (sample or unit, row, summed (n, d), B or unit count). Record-level grouping is
        kept for :meth:`clipped` (one sort per backward pass)."""
        if units is None and "grouped" in record.cache:
            return record.cache["grouped"]
        ids, g = _joined(record.ghost)
        B, T = ids.shape
        V = record.module.num_embeddings
        owner = torch.arange(B, device=ids.device) if units is None else units.inverse.to(ids.device)
        keys = (ids + V * owner[:, None]).flatten()
        g = g.to(_acc_dtype(g))
        if units is not None:
            g = units.scale_rows(g)
            B = units.count
        g = g.flatten(0, 1)
        pad = record.module.padding_idx
        if pad is not None:  # F.embedding gives the padding row no gradient
            g = g * (ids.flatten() != pad).unsqueeze(1).to(g.dtype)
        uniq, inv = torch.unique(keys, return_inverse=True)
        summed = torch.zeros(len(uniq), g.shape[1], dtype=g.dtype, device=g.device).index_add_(0, inv, g)
        out = uniq // V, uniq % V, summed, B
        if units is None:
            record.cache["grouped"] = out
        return out

    def norm2(self, record, units=None):
        sample, _, summed, B = self._grouped(record, units)
        return torch.zeros(B, dtype=summed.dtype, device=summed.device).index_add_(0, sample, summed.pow(2).sum(1))

    def clipped(self, record, coef, into: Optional[torch.Tensor] = None):
        """As :meth:`Rule.clipped`; with ``into`` (a tied head's clipped sum, already in ``weight.grad``) the
        rows are added there in place and nothing is returned: no second vocabulary-sized tensor."""
        sample, row, summed, _ = self._grouped(record)
        w = record.module.weight
        rows = summed * coef.to(summed.dtype)[sample, None]
        if into is not None:
            into.index_add_(0, row, rows.to(into.dtype))
            return {}
        grad = torch.zeros(w.shape, dtype=summed.dtype, device=w.device)
        grad.index_add_(0, row, rows)
        return {"weight": grad}


# ---- an output layer tied to the input embedding (GPT-2, BERT, Llama 3.2 1B) ------------------------------

def is_tied_head(embedding: nn.Module, head: nn.Module) -> bool:
    """``head`` (a Linear d → V) uses ``embedding``'s (V, d) weight as its own: the one tie bk clips exactly."""
    return (layer_type(embedding) is nn.Embedding and layer_type(head) is nn.Linear
            and head.weight is embedding.weight)


def tied_cross(emb: Record, head: Record, units: Optional[Units] = None) -> torch.Tensor:
    """⟨E, H⟩ per sample (or per unit) for a weight shared by an embedding (gradient E) and an output head (H).

    The shared weight's per-sample gradient is E + H, so its squared norm is ‖E‖² + ‖H‖² + 2⟨E, H⟩; the
    layers' own rules give the first two. With token ids xₜ and output gradients eₜ of the embedding, and
    inputs aₛ and output gradients gₛ (over the vocabulary) of the head:
    ⟨E, H⟩ = Σₜ Σₛ gₛ[xₜ]·(eₜ·aₛ), a B·T_e·T_h·d computation; from an explicit H it is Σₜ H[xₜ]·eₜ.
    Under ULS the same sum runs over the pairs (i, j) of rows of one unit, weighted wᵢwⱼ.
    """
    ids, e = _joined(emb.ghost)
    acc = _acc_dtype(e)
    e = e.to(acc)
    pad = emb.module.padding_idx
    if pad is not None:  # F.embedding gives the padding row no gradient
        e = e * (ids != pad).unsqueeze(-1).to(acc)
    i, j = (None, None) if units is None else units.pairs(ids.device)

    def rows(x, idx):  # record level pairs each row with itself: no copy
        return x if idx is None else x[idx]

    ids_i, e_i = rows(ids, i), rows(e, i)
    pair = torch.zeros(ids_i.shape[0], dtype=acc, device=ids.device)
    if head.ghost:
        a, g = _joined(head.ghost)
        a_j, g_j = rows(a, j), rows(g, j)
        k = torch.bmm(e_i, a_j.to(acc).transpose(1, 2))  # (pairs, T_e, T_h): eₜ·aₛ
        picked = g_j.gather(2, ids_i.unsqueeze(1).expand(-1, g.shape[1], -1)).to(acc)  # (pairs, T_h, T_e): gₛ[xₜ]
        pair = pair + (k * picked.transpose(1, 2)).sum((1, 2))
    if "weight" in head.explicit:
        h = rows(head.explicit["weight"], j)  # (pairs, V, d)
        pair = pair + (h.gather(1, ids_i.unsqueeze(-1).expand(-1, -1, e.shape[-1])).to(acc) * e_i).sum((1, 2))
    if units is None:
        return pair
    w = units.weight.to(ids.device, acc)
    return torch.zeros(units.count, dtype=acc, device=ids.device).index_add_(
        0, units.inverse.to(ids.device)[i], pair * w[i] * w[j])


# ---- LayerNorm / RMSNorm ------------------------------------------------------------------------------

class _AffineNormFn(torch.autograd.Function):
    """y = rule.apply(x, weight, bias); backward recomputes it under autograd for the input gradient only."""

    @staticmethod
    def forward(ctx, x, weight, bias, record):
        ctx.save_for_backward(x)
        ctx.record = record
        return record.rule.apply(record.module, x, weight, bias)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        record, m = ctx.record, ctx.record.module
        gx = None
        with torch.enable_grad():
            xr = x.detach().requires_grad_(ctx.needs_input_grad[0])
            xhat = record.rule.normalized(m, xr)
            if ctx.needs_input_grad[0]:
                b = getattr(m, "bias", None)
                y = record.rule.apply(m, xr, m.weight.detach(), None if b is None else b.detach())
                (gx,) = torch.autograd.grad(y, xr, g)
        B = x.shape[0]
        gf, xh = record.per_record(g.reshape(B, -1, g.shape[-1]), xhat.detach().reshape(B, -1, g.shape[-1]))
        acc = _acc_dtype(g)
        if m.weight.requires_grad:
            record.add_explicit("weight", (gf.to(acc) * xh.to(acc)).sum(1))
        if getattr(m, "bias", None) is not None and m.bias.requires_grad:
            record.add_explicit("bias", gf.sum(1, dtype=acc))
        record.on_backward()
        return gx, None, None, None


class LayerNormRule(Rule):
    types = (nn.LayerNorm,)

    def forward(self, module, record, x):
        return _AffineNormFn.apply(x, module.weight, module.bias, record)

    def apply(self, m, x, w, b):
        return F.layer_norm(x, m.normalized_shape, w, b, m.eps)

    def normalized(self, m, x):
        return F.layer_norm(x, m.normalized_shape, None, None, m.eps)


class LlamaRMSNormRule(LayerNormRule):
    """Llama's ``weight * normalize(x.to(float32)).to(x.dtype)`` (Mistral, Qwen2 and others copy it)."""

    # Classes whose forward is Llama's line for line (checked against transformers 5.23).
    known = (("llama", "LlamaRMSNorm"), ("mistral", "MistralRMSNorm"), ("qwen2", "Qwen2RMSNorm"),
             ("qwen3", "Qwen3RMSNorm"))

    @functools.cached_property
    def types(self):
        import importlib

        found = []
        for module, name in self.known:
            try:
                found.append(getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name))
            except (ImportError, AttributeError):
                pass
        return tuple(found)

    def forward(self, module, record, x):
        return _AffineNormFn.apply(x, module.weight, None, record)

    def normalized(self, m, x):
        h = x.to(torch.float32)
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + m.variance_epsilon)).to(x.dtype)

    def apply(self, m, x, w, b):
        return w * self.normalized(m, x)


class RMSNormRule(LlamaRMSNormRule):
    types = (nn.RMSNorm,)

    def normalized(self, m, x):
        return F.rms_norm(x, m.normalized_shape, None, m.eps)


RULES: list[Rule] = [LinearRule(), Conv1DRule(), EmbeddingRule(), LayerNormRule(), LlamaRMSNormRule(), RMSNormRule()]


def layer_type(module: nn.Module) -> type:
    """The module's own class; a layer sharded on its own by FSDP2 (``fully_shard(layer)``, as Opacus's
    ``FSDP2Wrapper`` does) has a class made for it, ``FSDP<Layer>(FSDPModule, Layer)``, computing as the layer."""
    from torch.distributed.fsdp import FSDPModule

    cls = type(module)
    if len(cls.__bases__) == 2 and cls.__bases__[0] is FSDPModule:
        return cls.__bases__[1]
    return cls


def rule_for(module: nn.Module) -> Optional[Rule]:
    """The rule for this exact module type (subclasses may compute differently, so they must register)."""
    cls = layer_type(module)
    for rule in RULES:
        if cls in rule.types:
            return rule
    return None
