"""Refuse, before anything is written, rotary embeddings whose frequencies the batch's longest record picks.

transformers' rotary embeddings (5.x, ``modeling_rope_utils``) compute the frequencies of every position from
the model's config once, except two kinds that re-read them in each forward pass from
``max(position_ids) + 1``, a number of the *whole batch* (dpllm passes positions ``0 … T-1`` on every row, T the
padded length, which the longest record sets):

- ``longrope`` (Phi-3/Phi-3.5 128k, Phi-4-mini, PhiMoE): the long factors (and PhiMoE's ``long_mscale``) for
  every row once that number exceeds ``original_max_position_embeddings``, the short ones otherwise. One record
  longer than the original context changes every other record's forward pass: on the tiny Llama of
  tests/test_rope_positions.py (LoRA, bk, σ = 0) adding it moved the clipped sum of eight short records by
  2.00 × C, against the bound of 1 C;
- ``dynamic`` (NTK-aware scaling; any type whose name contains "dynamic", as transformers tests it): new
  frequencies for every row once that number exceeds ``max_position_embeddings``.

Every other type transformers 5.24 ships (``default``, ``linear``, ``yarn``, ``llama3``, ``proportional``,
Hunyuan's ``ntk_alpha``) computes its frequencies once, at construction, from the config: the rotation of a
position depends on that position alone. Sliding-window attention is a per-position mask as well
(``masking_utils``: a key is kept by its distance from the query), the same for any batch.

:func:`check_rope_per_record` reads each rotary module's own type (the module may override the config's:
Hunyuan relabels a fixed-``alpha`` "dynamic" as "ntk_alpha") and refuses a switch that ``max_length`` can reach.
A switch ``max_length`` cannot reach always takes the same branch, and a switch between equal sets changes
nothing, so both are trained as they are. Anything else that reads the batch's length is left to the
independence check's long-record probe (:mod:`dpllm.privacy.independence`, step 4), which sees it in the
outputs whatever its cause.

Example:
    >>> from types import SimpleNamespace
    >>> rotary = SimpleNamespace(rope_type="longrope", config=SimpleNamespace(rope_parameters={
    ...     "rope_type": "longrope", "short_factor": [1.0], "long_factor": [4.0],
    ...     "original_max_position_embeddings": 4096}))
    >>> length_switches(rotary)
    [('longrope', None, 4096)]
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from dpllm.privacy.paths import UnclippableModel

#: The pairs a longrope switch chooses between; equal pairs make the switch a no-op.
_LONGROPE_PAIRS = (("short_factor", "long_factor"), ("short_mscale", "long_mscale"))


def _types(module) -> list[tuple[Optional[str], str]]:
    """``(layer_type, rope_type)`` of a rotary module: one pair, or one per layer type (Gemma-style dicts)."""
    t = getattr(module, "rope_type", None)
    if isinstance(t, str):
        return [(None, t)]
    if isinstance(t, dict):
        return [(k, v) for k, v in t.items() if isinstance(v, str)]
    return []


def length_switches(module) -> list[tuple[str, Optional[str], int]]:
    """The switches a rotary module flips on the batch's longest position: ``(rope_type, layer_type, N)``, where
    every row changes once ``max(position_ids) + 1 > N``. Empty for a module whose frequencies are fixed.
    """
    params = getattr(getattr(module, "config", None), "rope_parameters", None) or {}
    out = []
    for layer, kind in _types(module):
        p = params.get(layer, {}) if layer is not None else params
        if "dynamic" in kind:  # grows when the batch passes the cached length (max_position_embeddings at first)
            prefix = f"{layer}_" if layer is not None else ""
            cached = getattr(module, f"{prefix}max_seq_len_cached", getattr(module, "max_seq_len_cached", None))
            original = getattr(module, "original_max_seq_len", cached)
            limits = [n for n in (cached, original) if isinstance(n, int)]
            out.append((kind, layer, min(limits) if limits else 0))
        elif kind == "longrope":
            if isinstance(p, dict) and all(p.get(a) == p.get(b) for a, b in _LONGROPE_PAIRS):
                continue  # one set of factors: both branches compute the same frequencies
            n = p.get("original_max_position_embeddings") if isinstance(p, dict) else None
            out.append((kind, layer, n if isinstance(n, int) else 0))
    return out


def check_rope_per_record(model: nn.Module, *, max_length: int) -> None:
    """Refuse ``model`` if a record of up to ``max_length`` tokens can switch its batch's rotary frequencies.

    Args:
        model: the model as loaded (a peft or DDP wrapper is fine: every submodule is read).
        max_length: the longest record the run trains on (``data.max_length``); positions run up to it.

    Raises:
        dpllm.privacy.paths.UnclippableModel: naming the rope type, ``max_length``, the context it switches at
            and the fix.
    """
    for name, module in model.named_modules():
        for kind, layer, n in length_switches(module):
            if max_length <= n:  # the batch never passes the switch: every batch takes the same branch
                continue
            where = f"{name or type(module).__name__}" + (f" ({layer} layers)" if layer else "")
            if kind == "longrope":
                fix = (f"lower max_length to ≤ {n} (the short factors then apply to every batch), or give the model "
                       "one set of factors (rope_parameters short_factor equal to long_factor, and short_mscale to "
                       "long_mscale where set, in its config.json), which fixes its frequencies for every length")
                what = f"switches every row to its long factors once the batch holds a position ≥ {n}"
                context = f"original_max_position_embeddings={n}"
            else:
                fix = f"lower max_length to ≤ {n}"
                what = f"recomputes every row's frequencies once the batch holds a position ≥ {n}"
                context = f"its cached context of {n} positions"
            raise UnclippableModel(
                f"the model's rotary embedding {where} (rope_type {kind}) {what}: with max_length={max_length} "
                f"beyond {context}, one long record changes the forward pass of every other record in its batch, "
                f"so per-record clipping no longer bounds its influence; {fix}")
