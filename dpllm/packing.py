"""Packed rows: several whole records in one row of ``max_length`` tokens (``data.packing: true``, issue 48).

Short records waste most of a padded row; packing puts several into one row, and three things keep each record
exactly what it would be in a row of its own:

1. *Attention never crosses a record.* Each record's position ids restart at 0, and :func:`block_causal_mask`
   is a 4-D additive mask (rows, 1, T, T) that lets a token see only the earlier tokens of its own record
   (transformers passes a 4-D mask through unchanged to eager and sdpa attention). A record's logits inside a
   packed row therefore equal its logits alone.
2. *Per-record loss and clipping.* :func:`packed_sequence_loss` is the mean over records of each record's mean
   next-token loss (the label at a record's first token is -100: no record predicts the next one's start), and
   bk clips each record's gradient, the sum over its own tokens (:class:`dpllm.privacy.bk.layers.Segments`).
   The records, not the rows, are Opacus's samples.
3. *Packing after sampling.* The rows are built per step from the records Poisson sampling drew
   (:func:`plan_batches`), never fixed over the file in advance: each record is still included independently
   with probability q, and since its clipped gradient is a function of its own tokens alone, the step's sum of
   clipped gradients does not depend on which records share a row (up to float rounding). Rows fixed in
   advance would make a row, not a record, what is sampled, and removing one record would re-pack others.

With ``long_records: split`` the pieces packed are the windows; a record's windows stay in one physical batch,
where bk clips their sum once (its unit, as for unpacked windows).

    >>> plan_batches([5, 3, 4, 2], max_length=8, rows_per_batch=4)
    [[[0, 1], [2, 3]]]
    >>> batch = collate_packed([[torch.tensor([7, 8, 9]), torch.tensor([5, 6])]], pad_token_id=0)
    >>> batch["segments"].tolist(), batch["position_ids"].tolist(), batch["labels"].tolist()
    ([[0, 0, 0, 1, 1]], [[0, 1, 2, 0, 1]], [[-100, 8, 9, -100, 6]])
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn


def plan_batches(lengths: Sequence[int], *, max_length: int, rows_per_batch: int,
                 units: Optional[Sequence[int]] = None) -> list[list[list[int]]]:
    """Physical batches of packed rows for one step's sampled pieces: ``[batch][row] = [piece positions]``.

    Units (a record, or the windows of one split record) go in order of their longest piece, longest first
    (ties: first seen), each piece into the first row of the current batch with room (first-fit decreasing);
    a unit whose pieces would need more than ``rows_per_batch`` rows in the current batch starts the next one,
    so a unit's pieces are always in one batch. Deterministic in the pieces' lengths and order alone.

    Args:
        lengths: tokens of each piece (the step's sampled items, in the sampler's order).
        max_length: tokens per row; every piece must fit.
        rows_per_batch: rows per physical batch (``physical_batch_size``).
        units: each piece's unit (None: every piece is a unit).

    Raises:
        ValueError: a piece longer than ``max_length``, or a unit of more than ``rows_per_batch`` pieces.
    """
    units = list(range(len(lengths))) if units is None else list(units)
    groups: dict[int, list[int]] = {}
    for i, u in enumerate(units):
        groups.setdefault(u, []).append(i)
    order = sorted(groups.values(), key=lambda g: (-max(lengths[i] for i in g), g[0]))
    for i, n in enumerate(lengths):
        if n > max_length:
            raise ValueError(f"piece {i} has {n} tokens and does not fit a row of max_length={max_length}")
    batches: list[list[list[int]]] = []
    rows: list[list[int]] = []
    room: list[int] = []
    for group in order:
        if len(group) > rows_per_batch:
            raise ValueError(f"a unit of {len(group)} pieces cannot share one batch of {rows_per_batch} rows")
        placed = _first_fit(group, lengths, rows, room, max_length)
        if len(placed[0]) > rows_per_batch:  # this unit starts the next batch (where it fits: ≤ rows_per_batch)
            batches.append(rows)
            placed = _first_fit(group, lengths, [], [], max_length)
        rows, room = placed
    if rows:
        batches.append(rows)
    return batches


def _first_fit(group: list[int], lengths: Sequence[int], rows: list[list[int]], room: list[int],
               max_length: int) -> tuple[list[list[int]], list[int]]:
    """``rows`` (with ``room`` tokens left each) after placing ``group``'s pieces, longest first, each into
    the first row with room or a new row; the inputs are not changed."""
    rows, room = [list(r) for r in rows], list(room)
    for i in sorted(group, key=lambda i: (-lengths[i], i)):
        k = next((k for k, left in enumerate(room) if left >= lengths[i]), None)
        if k is None:
            rows.append([])
            room.append(max_length)
            k = len(rows) - 1
        rows[k].append(i)
        room[k] -= int(lengths[i])
    return rows, room


def piece_length(item) -> int:
    """Tokens of one dataset item: a 1-D tensor of ids (text records, windows) or an SFT record's dict."""
    return len(item["input_ids"]) if isinstance(item, dict) else len(item)


def collate_packed(rows: list[list], *, pad_token_id: int) -> dict[str, torch.Tensor]:
    """Packed rows of pieces → ``input_ids``, ``labels``, ``position_ids``, ``segments`` (B, T).

    A piece is a 1-D tensor of token ids (labels: the ids) or an SFT record's ``{"input_ids", "labels"}``
    (labels -100 on the prompt, :mod:`dpllm.sft`). ``segments`` numbers the pieces 0..S−1 in row order (−1 on
    padding); T is the fullest row's length. Labels are -100 on padding and on each piece's first token
    (predicting it from the previous piece would join two records).
    """
    T = max(sum(piece_length(x) for x in row) for row in rows)
    B = len(rows)
    ids = torch.full((B, T), pad_token_id, dtype=torch.long)
    labels = torch.full((B, T), -100, dtype=torch.long)
    positions = torch.zeros((B, T), dtype=torch.long)
    segments = torch.full((B, T), -1, dtype=torch.long)
    s = 0
    for b, row in enumerate(rows):
        t = 0
        for x in row:
            x, y = (torch.as_tensor(x["input_ids"]), torch.as_tensor(x["labels"])) if isinstance(x, dict) else (x, x)
            n = len(x)
            ids[b, t: t + n] = x
            labels[b, t + 1: t + n] = y[1:]
            positions[b, t: t + n] = torch.arange(n)
            segments[b, t: t + n] = s
            s, t = s + 1, t + n
    return {"input_ids": ids, "labels": labels, "position_ids": positions, "segments": segments}


def block_causal_mask(segments: torch.Tensor, dtype: Optional[torch.dtype] = torch.float32) -> torch.Tensor:
    """The 4-D attention mask (B, 1, T, T) of packed rows: token i may see token j iff they are in the same
    segment and j ≤ i. ``dtype`` given: additive (0 or the dtype's lowest value, for eager attention); None:
    boolean, True where allowed (sdpa). A padding token sees itself only (no row of all −inf, whose softmax
    would be NaN); no real token sees it."""
    T = segments.shape[1]
    same = segments[:, :, None] == segments[:, None, :]
    causal = torch.ones(T, T, dtype=torch.bool, device=segments.device).tril()
    pad_self = (segments < 0)[:, :, None] & torch.eye(T, dtype=torch.bool, device=segments.device)
    allowed = ((same & causal & (segments >= 0)[:, :, None]) | pad_self).unsqueeze(1)
    if dtype is None:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=segments.device).masked_fill(~allowed, torch.finfo(dtype).min)


#: attention implementations that take a 4-D mask as given, and the mask's dtype (None: boolean)
MASKS = {"sdpa": None, "eager": "additive"}


def attention_of(model: nn.Module) -> tuple[str, Optional[torch.dtype]]:
    """``(implementation, mask dtype)`` for packed rows of ``model`` (an HF model, PEFT- or otherwise wrapped).

    Raises:
        ValueError: an attention implementation that does not take our 4-D mask (flash attention, flex), named.
    """
    inner = model
    while not hasattr(inner, "config") and hasattr(inner, "module"):
        inner = inner.module
    impl = getattr(getattr(inner, "config", None), "_attn_implementation", None) or "eager"
    if impl not in MASKS:
        raise ValueError(f"data.packing needs attention that takes a 4-D block-diagonal mask (sdpa or eager); this "
                         f"model runs attn_implementation={impl!r}: load it with attn_implementation='sdpa', or "
                         "set data.packing: false")
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return impl, (dtype if MASKS[impl] == "additive" else None)


def packed_sequence_loss(logits: torch.Tensor, labels: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
    """Mean over records (segments) of each record's mean next-token loss in packed rows.

    Equals :func:`dpllm.privacy.engine.sequence_loss` over the same records one per row: a target at position
    t+1 is predicted from position t of the same record (``collate_packed`` masks each record's first token),
    and a record without a counted token adds 0 to the sum and 1 to the count, as a row of one token does.
    """
    S = int(segments.max()) + 1 if segments.numel() else 0
    y, seg = labels[:, 1:], segments[:, 1:]
    logits = logits[:, :-1].flatten(0, 1)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16/fp16 logits in float32
    per_token = nn.functional.cross_entropy(logits, y.flatten(), reduction="none",
                                            ignore_index=-100)
    counted = (y != -100).flatten()
    owner = seg.flatten().clamp(min=0)
    total = torch.zeros(S, dtype=per_token.dtype, device=per_token.device).index_add(
        0, owner[counted], per_token[counted])
    counts = torch.zeros(S, dtype=per_token.dtype, device=per_token.device).index_add(
        0, owner[counted], torch.ones_like(per_token[counted]))
    return (total / counts.clamp(min=1)).mean()


def packed_forward_loss(model: nn.Module, batch: dict, *, mask_dtype: Optional[torch.dtype] = None, autocast=None):
    """The model on packed rows (block-diagonal mask, per-record positions), then :func:`packed_sequence_loss`.

    Args:
        mask_dtype: None for a boolean mask (sdpa), else the additive mask's dtype (eager): :func:`attention_of`.
        autocast: a context-manager factory (mixed precision), or None.
    """
    from contextlib import nullcontext

    ctx = autocast() if autocast is not None else nullcontext()
    with ctx:
        out = model(input_ids=batch["input_ids"], attention_mask=block_causal_mask(batch["segments"], mask_dtype),
                    position_ids=batch["position_ids"])
    return packed_sequence_loss(out.logits, batch["labels"], batch["segments"])


def check_records_apart(model: nn.Module, batch: dict, *, mask_dtype: Optional[torch.dtype] = None) -> None:
    """Refuse a model in which one record of a packed row changes another record's outputs.

    The mask and positions are ours, but a model is free to ignore them (an attention that does not read a 4-D
    mask, a layer that mixes positions): one record would then reach the gradients of its row-mates, which no
    per-record clipping bounds. On the first packed batch (gradients off, evaluation mode, random state
    restored) the first record of the fullest row is changed (ids shifted by one) and the other records'
    logits must stay within :data:`dpllm.privacy.independence.SAME_SHAPE_TOL` of the largest logit: the same
    kernels on the same shapes reproduce them exactly where the records are apart.

    Raises:
        dpllm.privacy.paths.UnclippableModel: naming how far the other records moved.
    """
    from dpllm.privacy.independence import SAME_SHAPE_TOL
    from dpllm.privacy.paths import UnclippableModel

    seg = batch["segments"]
    counts = [int(torch.unique(r[r >= 0]).numel()) for r in seg]
    if not counts or max(counts) < 2:
        return  # no row holds two records in this batch: nothing to compare
    row = counts.index(max(counts))
    first = int(seg[row][seg[row] >= 0][0])
    ids = batch["input_ids"].clone()
    where = seg == first
    vocab = getattr(getattr(model, "get_input_embeddings", lambda: None)(), "num_embeddings", None)
    ids[where] = (ids[where] + 1) % int(vocab or int(ids.max()) + 2)
    mask = block_causal_mask(seg, mask_dtype)
    modes = [(m, m.training) for m in model.modules()]
    cuda = [ids.device] if ids.device.type == "cuda" else []
    try:
        model.eval()
        with torch.no_grad(), torch.random.fork_rng(devices=cuda):
            ref = model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=batch["position_ids"]).logits
            out = model(input_ids=ids, attention_mask=mask, position_ids=batch["position_ids"]).logits
    finally:
        for m, was in modes:
            m.training = was
    others = (seg >= 0) & ~where
    a, b = ref[others].float(), out[others].float()
    moved, scale = float((a - b).abs().max()), float(a.abs().max())
    if not moved <= SAME_SHAPE_TOL * max(scale, 1e-12):
        raise UnclippableModel(
            f"data.packing: changing one record of a packed row moved the other records' logits by {moved:.3g} "
            f"(largest {scale:.3g}; tolerance {SAME_SHAPE_TOL:g} of it): this model does not keep the records of a "
            "row apart under the block-diagonal mask and per-record positions, so one record would reach the "
            "others' clipped gradients; set data.packing: false")
