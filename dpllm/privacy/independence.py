"""Refuse, before the first step, a model in which one record's input reaches another record's output.

Per-record clipping bounds what one record adds to an update only if record i's gradient is a function of
record i alone. Two kinds of model break that without any trainable weight in the way, in every engine:

- an operation that mixes rows across the batch (``h + h.mean(0)``, a norm over batch statistics): one
  record moves every other record's output, hence their clipped gradients; add/remove sensitivity 1.30–1.41 × C
  was measured where the bound is C;
- a trainable layer whose rows are not the batch's records: an input laid out sequence-first ``(T, B, d)`` or
  flattened ``(B·T, d)``. Per-sample machinery then clips one gradient per position; bk refuses a row count
  that differs from the batch's, but a shape cannot tell T from B when T = B (replace-one sensitivity 2.35 × C
  measured under bk, bound 2C).

:func:`check_record_independence` runs three extra forward passes without gradients on R rows of the first
batch (R ≥ 2, chosen unequal to every other dimension of the batch, so a sequence-first layer shows T ≠ R rows):

1. *Reference* (training mode, dropout seeded): every layer that owns a trainable parameter must see R rows in
   dimension 0 of its input.
2. *One record changed*: record j's input (its real tokens: ids shifted by one within the vocabulary, or
   embeddings plus noise) changed, same seed. The outputs of the other records, at their real positions, must
   not move by more than ``SAME_SHAPE_TOL`` of the largest reference output: the same kernels run on the same
   shapes, so an independent model reproduces them to rounding noise at most (0 on CPU), while a mean over
   R ≤ 4 rows moves them by a sizeable fraction (0.18–1.1 of the largest output on the toys of
   tests/test_record_independence.py).
3. *Longer padding* (HF-style calls with an ``attention_mask`` only; evaluation mode, since dropout masks cannot
   match across shapes): k more masked positions, as a longer record in the batch would add. Every row's real
   positions must stay within ``PADDED_TOL`` (other shapes run other kernel tilings: float rounding differs).
4. *A record at max_length* (HF-style calls, where the caller gives ``max_length``; evaluation mode): the R
   records cut to their first ``SHORT_PROBE`` positions, alone and then padded to ``max_length`` beside one more
   record of ``max_length`` real tokens. Their real positions must stay within ``PADDED_TOL``. This is what a
   long record does to its batch beyond step 3's padding: the batch's longest *position* is now real, and
   whatever reads it sees it (transformers' ``longrope`` and ``dynamic`` rotary embeddings pick every row's
   frequencies from it; :mod:`dpllm.privacy.positions` refuses those by their config before the run, this step
   sees any other cause in the outputs). A first batch of short records, as steps 1–3 use, never shows it.

The check runs once, inside the first forward pass with gradients enabled (:func:`guard_record_independence`,
installed by :func:`dpllm.privacy.engine.make_private` for every mode, so the recipe's trainer, ``DPTrainer``,
user-level runs and the MLP recipes all pass through it), before that pass goes on. It costs three forward
passes of R ≤ 4 rows without gradients, once per run: on a Llama-3-8B shape at T = 512 about as much as
one training forward pass of a batch of 8 (docs/engines.md); step 4 adds one pass of R × 8 tokens and one of
(R + 1) × ``max_length``. The random state is restored afterwards.
What it cannot see: mixing that happens only for some inputs (it tests one perturbation of one batch) and
dependence weaker than the tolerances.

Example:
    >>> import torch
    >>> from torch import nn
    >>> class Mixing(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.lin = nn.Linear(4, 4)
    ...     def forward(self, x):
    ...         h = self.lin(x)
    ...         return h + h.mean(0)
    >>> check_record_independence(Mixing(), (torch.randn(3, 4),), {})
    Traceback (most recent call last):
    ...
    dpllm.privacy.paths.UnclippableModel: one record's input changes other records' outputs ...
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from dpllm.privacy.paths import UnclippableModel

log = logging.getLogger(__name__)

#: Rows ≠ j may move by at most this share of the largest reference output when record j changes (same shapes).
SAME_SHAPE_TOL = 1e-3
#: Real positions may move by at most this share of the largest output when padding grows (other shapes):
#: float32 rounding across tilings, or bf16/fp16's (2⁻⁸ per operation, compounding over layers).
PADDED_TOL = {torch.float32: 1e-4, torch.float64: 1e-4}
PADDED_TOL_LOW_PRECISION = 3e-2
#: How to pad each HF input along the sequence: the value of a masked position (None: continue the positions).
PAD_VALUES = {"input_ids": 0, "attention_mask": 0, "token_type_ids": 0, "labels": -100, "inputs_embeds": 0.0,
              "position_ids": None}

#: Step 4 cuts the records to this many positions, below any length a model switches at (Phi-3's 4096), so that
#: the one long record it adds passes every switch up to max_length.
SHORT_PROBE = 8

LONG_FIX = ("lower max_length to the length the model switches at (its original context, e.g. rope_parameters' "
            "original_max_position_embeddings), or use a position encoding that treats each position alike in "
            "every batch")
FIX = ("keep every record's computation to its own row: no batch statistics (use LayerNorm/RMSNorm/GroupNorm over "
       "a record's own features, not BatchNorm; no h.mean(0)), and keep every trainable layer's input batch-first "
       "(B, ..., d): batch_first=True, or reshape (B·T, d) back to (B, T, d) before the layer")


def _output_rows(output) -> Optional[torch.Tensor]:
    """The per-row prediction of a forward pass: ``.logits`` of an HF output, else the first tensor."""
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, dict) and isinstance(output.get("logits"), torch.Tensor):
        return output["logits"]
    for t in tree_leaves(output):
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return t
    return None


def _vocab(model: nn.Module, ids: torch.Tensor) -> int:
    emb = getattr(model, "get_input_embeddings", lambda: None)()
    return int(emb.num_embeddings) if isinstance(emb, nn.Embedding) else int(ids.max()) + 1


def _perturb(model: nn.Module, x: torch.Tensor, row: int, real: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``x`` with row ``row`` changed at its real positions; None if there is no way to change it."""
    x = x.clone()
    where = real[row].bool() if real is not None else torch.ones(x.shape[1:2] if x.dim() > 1 else (), dtype=torch.bool,
                                                                  device=x.device)
    if x.is_floating_point():
        gen = torch.Generator().manual_seed(0)
        noise = torch.randn(x[row].shape, generator=gen).to(x.device, x.dtype)
        scale = x.float().std() if x.numel() > 1 and float(x.float().std()) > 0 else torch.tensor(1.0)
        changed = x[row] + noise * scale.to(x.dtype)
    else:
        vocab = _vocab(model, x)
        if vocab < 2:
            return None
        changed = (x[row] + 1) % vocab
    x[row] = torch.where(where.view(*where.shape, *([1] * (x[row].dim() - where.dim()))), changed, x[row])
    return x


def _seed_dropout(device: torch.device) -> None:
    """Seed the generator the model's dropout draws from. On CPU that is the CPU generator alone:
    ``torch.manual_seed`` would also queue a seeding for every accelerator backend that is not started yet (CUDA,
    XPU, MTIA), each with a formatted stack trace: ~1 ms a call 60 frames deep, six calls per check (a tiny LoRA
    model's check 59.9 -> 54.2 ms). Elsewhere all of them, as before. The check runs inside ``fork_rng``: the run's
    own CPU state (and its device's) is put back."""
    if device.type == "cpu":
        torch.default_generator.manual_seed(0)
    else:
        torch.manual_seed(0)


def check_record_independence(model: nn.Module, args: tuple, kwargs: dict, *,
                              max_length: Optional[int] = None) -> None:
    """Refuse ``model`` if one record's input changes another record's output (see the module docstring).

    Args:
        model: the model as the training loop calls it (no Opacus or bk wrapper in between is needed).
        args, kwargs: one batch's forward-call arguments, rows in dimension 0.
        max_length: the longest record the run may see (``data.max_length``): step 4 adds a record of that
            length to the batch. None: no such step (callers that do not know it).

    Raises:
        dpllm.privacy.paths.UnclippableModel: (a ``ValueError`` and a ``RuntimeError``) naming the problem
            (mixing rows, depending on padding, or a layer whose rows are not the
            records) and the fix.
    """
    from dpllm.privacy.bk import _rows_of, _trainable_modules  # the batch's records, and the layers bk checks

    B = _rows_of(args, kwargs)
    if not B:
        return
    batch_keys = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == B]
    batch_args = [i for i, v in enumerate(args) if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == B]
    other_dims = {d for v in [*args, *kwargs.values()] if isinstance(v, torch.Tensor) for d in v.shape[1:]}
    R = next(r for r in range(2, 64) if r not in other_dims)  # R ≠ T: a (T, R, d) layer input shows T rows
    device = next((v.device for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), torch.device("cpu"))
    index = torch.arange(R, device=device) % B  # a batch smaller than R repeats its records
    args = tuple(v.detach().index_select(0, index) if i in batch_args else v for i, v in enumerate(args))
    kwargs = {k: v.detach().index_select(0, index) if k in batch_keys else v for k, v in kwargs.items()}
    key = next((k for k in ("input_ids", "inputs_embeds") if k in batch_keys), None)
    pos = None if key is not None else next(iter(batch_args), None)
    if key is None and pos is None:
        return
    x = kwargs[key] if key is not None else args[pos]
    mask = kwargs.get("attention_mask")
    real = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape == x.shape[:2] else None
    j = int(real.sum(1).argmax()) if real is not None else R - 1  # the record with the most real tokens
    changed = _perturb(model, x, j, real)

    def call(new_x=None, new_kwargs=None, training=None):
        a, kw = args, dict(new_kwargs if new_kwargs is not None else kwargs)
        if new_x is not None:
            if key is not None:
                kw[key] = new_x
            else:
                a = (*args[:pos], new_x, *args[pos + 1:])
        modes = [(m, m.training) for m in model.modules()]
        try:
            if training is not None:
                model.train(training)
            _seed_dropout(device)  # the same dropout masks in every pass of one shape
            return _output_rows(model(*a, **kw))
        finally:
            for m, was in modes:
                m.training = was

    seen: dict[str, int] = {}

    def rows_seen(name):
        def hook(module, a, kw):
            t = next((v for v in (*a, *kw.values()) if isinstance(v, torch.Tensor) and v.dim() > 0), None)
            if t is not None:
                seen.setdefault(name, t.shape[0])
        return hook

    cuda = [device] if device.type == "cuda" else []
    with torch.no_grad(), torch.random.fork_rng(devices=cuda):
        handles = [m.register_forward_pre_hook(rows_seen(n or type(m).__name__), with_kwargs=True)
                   for n, m in _trainable_modules(model)]
        try:
            ref = call()
        finally:
            for h in handles:
                h.remove()
        wrong = {n: r for n, r in seen.items() if r != R}
        if wrong:
            shown = ", ".join(f"{n} ({r} rows)" for n, r in list(wrong.items())[:3])
            raise UnclippableModel(
                f"trainable layers whose rows are not the batch's records: for a batch of {R} records {shown} "
                f"{'see' if len(wrong) > 1 else 'sees'} another number of rows in dimension 0 (an input laid out "
                "sequence-first (T, B, d) or flattened (B·T, d)), so every engine would clip one gradient per "
                f"position, not per record, and one record would move the model by more than C; {FIX}")
        if ref is None or ref.dim() == 0 or ref.shape[0] != R:
            log.warning("privacy: could not check that records stay independent (the model's output has no row per "
                        "record)")
            return
        if changed is not None:
            out = call(changed)
            _compare(ref, out, real, rows=[i for i in range(R) if i != j], tol=SAME_SHAPE_TOL,
                     problem="one record's input changes other records' outputs (an operation mixes rows of the "
                             "batch: a mean or norm over the batch dimension)")
        padded = _padded(kwargs, real, x.shape[1] if x.dim() > 1 else None, R, model)
        if padded is not None:
            short, long = call(training=False), call(new_kwargs=padded, training=False)
            T = ref.shape[1]
            tol = PADDED_TOL.get(ref.dtype, PADDED_TOL_LOW_PRECISION)
            _compare(short, long[:, :T], real, rows=list(range(R)), tol=tol,
                     problem="the records' outputs change with the batch's padded length (which the longest record "
                             "sets): an operation reads masked positions, e.g. a mean over all positions")
        probe = (_with_long_record(kwargs, key, real, x, R, max_length, model)
                 if max_length is not None and key is not None and not batch_args else None)
        if probe is not None:
            short_kw, long_kw, Ts = probe
            short, long = call(new_kwargs=short_kw, training=False), call(new_kwargs=long_kw, training=False)
            tol = PADDED_TOL.get(ref.dtype, PADDED_TOL_LOW_PRECISION)
            _compare(short, long[:R, :Ts], real[:, :Ts], rows=list(range(R)), tol=tol,
                     problem=f"the records' outputs change when one record of max_length={max_length} tokens joins "
                             "their batch: a computation reads the batch's longest position (e.g. a rotary embedding "
                             "whose frequencies switch with it: rope_type longrope or dynamic)", fix=LONG_FIX)


def _padded(kwargs: dict, real, T: Optional[int], R: int, model: nn.Module) -> Optional[dict]:
    """``kwargs`` with k ≥ 1 more masked positions (k such that T + k ≠ R); None if the call is not HF-style."""
    if real is None or T is None:
        return None
    if any(isinstance(v, torch.Tensor) and v.dim() > 1 and v.shape[0] == R and v.shape[1] == T and k not in PAD_VALUES
           for k, v in kwargs.items()):
        return None  # an input of unknown meaning along the sequence
    k = 1 if T + 1 != R else 2
    limit = _context(model)
    if isinstance(limit, int) and T + k > limit:
        return None
    return _extend(kwargs, T, k)


def _context(model: nn.Module) -> Optional[int]:
    config = getattr(model, "config", None)
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def _extend(kwargs: dict, T: int, k: int) -> dict:
    """``kwargs`` with every sequence input (length ``T``) given ``k`` more masked positions."""
    out = dict(kwargs)
    for name, v in kwargs.items():
        if not (isinstance(v, torch.Tensor) and v.dim() > 1 and v.shape[1] == T and name in PAD_VALUES):
            continue
        shape = (v.shape[0], k, *v.shape[2:])
        if PAD_VALUES[name] is None:  # positions go on counting
            extra = v[:, -1:] + torch.arange(1, k + 1, device=v.device, dtype=v.dtype).view(1, k)
        else:
            extra = torch.full(shape, PAD_VALUES[name], dtype=v.dtype, device=v.device)
        out[name] = torch.cat([v, extra], dim=1)
    return out


def _with_long_record(kwargs: dict, key: str, real, x: torch.Tensor, R: int, max_length: int,
                      model: nn.Module) -> Optional[tuple[dict, dict, int]]:
    """Step 4's two batches: ``(short, long, Ts)``. ``short``: the R records cut to their first
    ``Ts = min(T, SHORT_PROBE)`` positions; ``long``: the same records padded to ``max_length``, and one more
    record of ``max_length`` real tokens (the longest record's tokens, repeated). None where there is no such
    pair: no attention mask, an input of unknown meaning along the sequence, ``max_length`` ≤ ``SHORT_PROBE`` or
    beyond the model's context.
    """
    T = x.shape[1] if x.dim() > 1 else None
    if real is None or T is None:
        return None
    Ts = min(T, SHORT_PROBE)
    limit = _context(model)
    # decided by settings alone, never by this process's batch: under FSDP every process runs the same passes
    if max_length <= SHORT_PROBE or (isinstance(limit, int) and max_length > limit):
        return None
    sequence = {n for n, v in kwargs.items() if isinstance(v, torch.Tensor) and v.dim() > 1 and v.shape[0] == R
                and v.shape[1] == T}
    if sequence - set(PAD_VALUES):
        return None  # an input of unknown meaning along the sequence
    short = {n: v[:, :Ts] if n in sequence else v for n, v in kwargs.items()}
    padded = _extend(short, Ts, max_length - Ts)
    j = int(real.sum(1).argmax())
    tokens = x[j][real[j].bool()] if bool(real[j].any()) else x[j][:1]  # a batch of empty records: any token
    long = {}
    for n, v in padded.items():
        if not (isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == R):
            long[n] = v
            continue
        if n == key:  # every position real: the record's tokens, repeated to max_length
            row = tokens.repeat(-(-max_length // tokens.shape[0]), *([1] * (tokens.dim() - 1)))[:max_length]
        elif n == "attention_mask":
            row = torch.ones_like(v[0])
        elif n in sequence and PAD_VALUES[n] is not None and n != "token_type_ids":
            row = torch.full_like(v[0], PAD_VALUES[n])  # labels: none needed, the outputs are compared
        else:  # positions (row 0's, counted on to max_length), token types, per-row values
            row = v[0]
        long[n] = torch.cat([v, row.unsqueeze(0)], dim=0)
    return short, long, Ts


def _compare(ref: torch.Tensor, out: torch.Tensor, real, *, rows: list[int], tol: float, problem: str,
             fix: str = FIX) -> None:
    a, b = ref[rows].float(), out[rows].float()
    if real is not None and a.dim() >= 2 and a.shape[1] == real.shape[1]:
        keep = real[rows].bool()
        a, b = a[keep], b[keep]
    finite = torch.isfinite(a) & torch.isfinite(b)
    if not bool((torch.isfinite(a) == torch.isfinite(b)).all()):
        moved, scale = float("inf"), 1.0
    else:
        moved = float((a - b).abs()[finite].max()) if bool(finite.any()) else 0.0
        scale = float(a.abs()[finite].max()) if bool(finite.any()) else 0.0
    if moved > tol * max(scale, 1e-12):
        raise UnclippableModel(f"{problem}: they moved by {moved:.3g} (largest output {scale:.3g}; tolerance "
                           f"{tol:g} of it). Per-record clipping then bounds no record's influence: it reaches the "
                           f"other records' gradients, clipped or not; {fix}")


def guard_record_independence(model: nn.Module, *, max_length: Optional[int] = None) -> None:
    """Run :func:`check_record_independence` on the first batch ``model`` is called with while gradients are
    enabled, before that forward pass runs; the hook removes itself once the check passes.

    Args:
        model: the bare model (not yet wrapped by Opacus or bk; a DDP wrapper is looked through).
        max_length: the longest record the run may see; step 4 probes with one (None: no step 4).
    """
    inner = model
    while type(inner).__name__ in ("DifferentiallyPrivateDistributedDataParallel", "DistributedDataParallel"):
        inner = inner.module
    state: dict = {"busy": False}

    def hook(module, args, kwargs):
        if state["busy"] or not torch.is_grad_enabled():
            return
        state["busy"] = True
        try:
            check_record_independence(module, args, kwargs, max_length=max_length)
        finally:
            state["busy"] = False
        state["handle"].remove()
        return

    state["handle"] = inner.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)
