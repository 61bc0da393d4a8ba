"""How much of the training text ``max_length`` cut off (issue 49): one summary for the console, the privacy
report (its ``data`` field), ``dpllm report`` and the model card.

A record longer than ``max_length`` tokens trains on its first ``max_length`` tokens only; nothing past the cut
reaches the model. The summary counts the records cut and the tokens lost, and says which ``max_length`` would keep
95% of the records (or all of them) whole.

    >>> s = summarize([10, 40, 100], max_length=32)
    >>> s["truncated_records"], s["tokens_total"], s["tokens_kept"], s["tokens_lost_max"]
    (2, 150, 74, 68)
    >>> describe(summarize([3, 5], max_length=8))
    'no training record was truncated: all 2 fit in max_length=8 tokens (the longest has 5)'
"""

from __future__ import annotations

import math
import statistics
from typing import Optional, Sequence

SPLIT_HINT = ("or split them: data.long_records: split (DPTrainer: PrivacyArguments long_records='split') trains on "
              "every window of a long record, the record one privacy unit")


def summarize(full_lengths: Sequence[int], *, max_length: int, estimated: int = 0) -> dict:
    """The truncation summary of records with ``full_lengths`` tokens each (before the cut at ``max_length``).

    Args:
        full_lengths: every training record's token count, untruncated.
        max_length: the cut.
        estimated: how many of those counts were estimated (very long records are counted in pieces).

    Returns:
        ``{"max_length", "records", "truncated_records", "tokens_total", "tokens_kept", "tokens_lost_median",
        "tokens_lost_max", "max_length_for_95pct", "max_length_for_all"}`` (plus ``"estimated_records"`` when
        some counts were estimated): the ``max_length_for_*`` values keep that share of the records whole.
    """
    n = [int(x) for x in full_lengths]
    lost = sorted(x - max_length for x in n if x > max_length)
    ordered = sorted(n)
    out = {"max_length": int(max_length), "records": len(n), "truncated_records": len(lost),
           "tokens_total": sum(n), "tokens_kept": sum(min(x, max_length) for x in n),
           "tokens_lost_median": statistics.median(lost) if lost else 0, "tokens_lost_max": lost[-1] if lost else 0,
           "max_length_for_95pct": ordered[max(0, math.ceil(0.95 * len(n)) - 1)] if n else 0,
           "max_length_for_all": ordered[-1] if n else 0}
    if estimated:
        out["estimated_records"] = int(estimated)
    return out


def summarize_split(full_lengths: Sequence[int], *, max_length: int, max_windows: int, stride: int = 0) -> dict:
    """The summary of ``long_records: split`` (:mod:`dpllm.windows`): a record longer than ``max_length`` becomes
    ⌈L/max_length⌉ windows (with an overlap of ``stride`` tokens, max(1, ⌈(L − stride)/(max_length − stride)⌉)),
    of which the first ``max_windows`` are trained on.

    Returns:
        :func:`summarize`'s fields, where a record counts as truncated (and its tokens as lost) only when the window
        cap dropped some of its windows, plus ``"long_records": "split"``, ``"max_windows"``, ``"split_records"``
        (records longer than max_length, split into windows), ``"windows"`` (rows trained on, all records),
        ``"windows_dropped"``, ``"capped_records"`` (records that lost windows to the cap) and ``"window_stride"``.

        >>> s = summarize_split([10, 40, 100], max_length=32, max_windows=2)
        >>> s["split_records"], s["windows"], s["windows_dropped"], s["capped_records"], s["tokens_kept"]
        (2, 5, 2, 1, 114)
    """
    n = [int(x) for x in full_lengths]
    step = max_length - stride  # new tokens per window after the first
    span = max_length + step * (max_windows - 1)  # tokens of the first max_windows windows
    lost = sorted(x - span for x in n if x > span)
    windows = [max(1, math.ceil((x - stride) / step)) for x in n]
    out = summarize(n, max_length=max_length)
    out.update(truncated_records=len(lost), tokens_kept=sum(min(x, span) for x in n),
               tokens_lost_median=statistics.median(lost) if lost else 0, tokens_lost_max=lost[-1] if lost else 0,
               long_records="split", max_windows=int(max_windows), split_records=sum(w > 1 for w in windows),
               windows=sum(min(w, max_windows) for w in windows),
               windows_dropped=sum(max(0, w - max_windows) for w in windows),
               capped_records=sum(w > max_windows for w in windows), window_stride=int(stride))
    return out


def unknown(max_length: int, why: str) -> dict:
    """A summary for rows whose untruncated length dpllm cannot know (``why`` says what would tell it)."""
    return {"max_length": int(max_length), "truncated_records": None, "unknown": why}


def describe(s: Optional[dict]) -> str:
    """The summary in one sentence for a person ('' for none): the counts, and the fix when records were cut."""
    if not s:
        return ""
    if s.get("truncated_records") is None:
        return f"whether max_length cut any record is unknown: {s.get('unknown', 'not recorded')}"
    if s.get("long_records") == "split":
        return _describe_split(s)
    if not s["truncated_records"]:
        return (f"no training record was truncated: all {s['records']:,} fit in max_length={s['max_length']} tokens "
                f"(the longest has {s['max_length_for_all']:,})")
    total, kept = s["tokens_total"], s["tokens_kept"]
    approx = (f" ({s['estimated_records']:,} very long records counted approximately)"
              if s.get("estimated_records") else "")
    keep95 = (f"max_length={s['max_length_for_95pct']:,} keeps 95% of the records whole and "
              if s["max_length"] < s["max_length_for_95pct"] < s["max_length_for_all"] else "")
    return (f"{s['truncated_records']:,} of {s['records']:,} training records "
            f"({100 * s['truncated_records'] / max(1, s['records']):.0f}%) are longer than max_length="
            f"{s['max_length']} tokens and were cut to it: {total - kept:,} of {total:,} tokens "
            f"({100 * (total - kept) / max(1, total):.0f}%) were never trained on (lost per cut record: median "
            f"{s['tokens_lost_median']:,g}, max {s['tokens_lost_max']:,}){approx}. To train on them, raise max_length: "
            f"{keep95}max_length={s['max_length_for_all']:,} keeps every record whole; {SPLIT_HINT}")


def _describe_split(s: dict) -> str:
    """:func:`describe` for ``long_records: split``: records split, windows, and what the window cap dropped."""
    total, kept = s["tokens_total"], s["tokens_kept"]
    overlap = (f", each after the first repeating {s['window_stride']} tokens of the one before as context"
               if s.get("window_stride") else "")
    head = (f"{s['split_records']:,} of {s['records']:,} training records are longer than max_length="
            f"{s['max_length']} tokens and were split into windows of {s['max_length']} tokens{overlap}, each record "
            f"one privacy unit ({s['windows']:,} windows trained on in all)")
    if not s["truncated_records"]:
        return head + f"; every token was trained on (max_windows={s['max_windows']} dropped none)"
    return (head + f"; max_windows={s['max_windows']} dropped {s['windows_dropped']:,} windows of "
            f"{s['truncated_records']:,} records: {total - kept:,} of {total:,} tokens "
            f"({100 * (total - kept) / max(1, total):.0f}%) were never trained on (lost per capped record: median "
            f"{s['tokens_lost_median']:,g}, max {s['tokens_lost_max']:,}). To train on them, raise max_windows (with "
            f"physical_batch_size) or max_length: max_length={s['max_length_for_all']:,} keeps every record whole")
