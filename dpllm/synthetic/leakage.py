"""Does a synthetic set copy its training records? Private-side measurements, never released.

The question is comparative. Held-out records come from the same distribution as the training
records but the model never saw them, so any closeness of synthetic text to held-out text is what the
distribution itself explains; closeness *beyond* that to the training records is what the model
copied. Every rate is therefore computed twice, against the training records and against the held-out
records, with the training side subsampled to the held-out size (nearest-neighbour statistics grow with
the size of the reference set).

* verbatim copy: after whitespace normalisation one text is a prefix of the other (either may be cut
  by a token budget) and the shorter has at least ``min_chars`` characters;
* near duplicate: Jaccard similarity of the character 5-gram sets ≥ ``near`` to the nearest record;
* nearest-neighbour distance: 1 - that Jaccard similarity, per synthetic record; ``closer_to_train``
  is the fraction of synthetic records whose nearest training record is closer than their nearest
  held-out record (ties count one half): 0.5 when the model copies nothing;
* canaries (``canaries.json``): a canary's secret appearing verbatim in any synthetic record, counted
  separately for canaries that were trained on and for those that were not (the control).

Example:
    >>> r = leakage(["the cat sat on the mat today"], ["the cat sat on the mat today"], ["a dog ran"], min_chars=10)
    >>> r["verbatim"]["train_all"], r["verbatim"]["heldout"]
    (1.0, 0.0)
"""

from __future__ import annotations

import random
from typing import Optional, Sequence

import numpy as np

NGRAM = 5


def _norm(text: str) -> str:
    return " ".join(text.split())


def nearest_neighbours(queries: Sequence[str], reference: Sequence[str], *, n: int = NGRAM,
                       chunk: Optional[int] = None) -> tuple[np.ndarray, np.ndarray]:
    """Jaccard similarity of character ``n``-gram sets to each query's nearest reference text, and its index.

    Texts with fewer than ``n`` characters have no n-grams and similarity 0 to everything. Queries go in
    chunks of ``chunk`` rows (default: about 2·10⁷ similarities, 160 MB, at a time).
    """
    from sklearn.feature_extraction.text import CountVectorizer

    queries, reference = [_norm(t) for t in queries], [_norm(t) for t in reference]
    vec = CountVectorizer(analyzer="char", ngram_range=(n, n), binary=True, lowercase=False)
    try:
        vec.fit(list(queries) + list(reference))
    except ValueError:  # no text long enough for a single n-gram
        return np.zeros(len(queries)), np.zeros(len(queries), dtype=int)
    Q, R = vec.transform(queries), vec.transform(reference)
    q_size, r_size = np.asarray(Q.sum(1)).ravel(), np.asarray(R.sum(1)).ravel()
    best, arg = np.zeros(len(queries)), np.zeros(len(queries), dtype=int)
    chunk = chunk or max(1, min(4096, 20_000_000 // max(1, len(reference))))
    for lo in range(0, len(queries), chunk):
        inter = (Q[lo:lo + chunk] @ R.T).toarray()
        union = q_size[lo:lo + chunk, None] + r_size[None, :] - inter
        sim = np.divide(inter, union, out=np.zeros_like(inter, dtype=float), where=union > 0)
        arg[lo:lo + chunk] = sim.argmax(1)
        best[lo:lo + chunk] = sim.max(1)
    return best, arg


def verbatim_copies(queries: Sequence[str], reference: Sequence[str], *, min_chars: int = 48) -> list[Optional[int]]:
    """For each query, the index of a reference text it copies verbatim (see the module docstring), or None."""
    # both texts of a copy share their first min_chars characters: bucket the references by them (linear time)
    buckets: dict[str, list[tuple[int, str]]] = {}
    for j, r in enumerate(map(_norm, reference)):
        if len(r) >= min_chars:
            buckets.setdefault(r[:min_chars], []).append((j, r))
    out: list[Optional[int]] = []
    for q in map(_norm, queries):
        cands = buckets.get(q[:min_chars], []) if len(q) >= min_chars else []
        out.append(next((j for j, r in cands if (r.startswith(q) if len(q) <= len(r) else q.startswith(r))), None))
    return out


def canary_extraction(synthetic: Sequence[str], canaries: Sequence[dict]) -> dict:
    """How many canaries' secrets appear verbatim in the synthetic set, trained-on vs not (the control)."""
    joined = "\n".join(synthetic)
    found = [c for c in canaries if c["text"][len(c["prefix"]):] in joined]
    included = sum(bool(c["included"]) for c in canaries)
    return {"canaries": len(canaries), "included": included, "excluded": len(canaries) - included,
            "extracted_included": sum(bool(c["included"]) for c in found),
            "extracted_excluded": sum(not c["included"] for c in found),
            "extracted_ids": sorted(c["id"] for c in found)}


def leakage(synthetic: Sequence[str], train: Sequence[str], heldout: Sequence[str], *,
            canaries: Optional[Sequence[dict]] = None, near: float = 0.6, min_chars: int = 48, seed: int = 0,
            examples: int = 5) -> dict:
    """Leakage measurements of ``synthetic`` against ``train`` and ``heldout`` (texts without control codes).

    Args:
        synthetic: the synthetic records.
        train, heldout: the run's training records and held-out records.
        canaries: the run's canaries (``canaries.json``), if any.
        near: Jaccard similarity at and above which a record is a near duplicate.
        min_chars: the shortest text a verbatim copy may be.
        seed: seeds the subsample of training records matched to the held-out count.
        examples: how many of the synthetic records closest to a training record to include (private).

    Returns:
        ``{"n", "verbatim", "near", "nn_distance", "closer_to_train", "examples", "canaries"?, "settings"}``
        with per-side rates (``train`` size-matched, ``heldout``; verbatim also ``train_all``) and the
        per-record nearest-neighbour distances under ``nn_distance["train"|"heldout"]["values"]``.

    Raises:
        ValueError: an empty synthetic, training or held-out set.
    """
    if not synthetic or not train or not heldout:
        raise ValueError(f"leakage needs synthetic, training and held-out records (got {len(synthetic)}, "
                         f"{len(train)}, {len(heldout)})")
    matched = list(train)
    if len(matched) > len(heldout):
        matched = random.Random(seed).sample(matched, len(heldout))
    sim_tr, arg_tr = nearest_neighbours(synthetic, matched)
    sim_ho, _ = nearest_neighbours(synthetic, heldout)
    copies_all = verbatim_copies(synthetic, train, min_chars=min_chars)
    copies = {"train": verbatim_copies(synthetic, matched, min_chars=min_chars),
              "heldout": verbatim_copies(synthetic, heldout, min_chars=min_chars)}
    d_tr, d_ho = 1 - sim_tr, 1 - sim_ho
    closer = float(np.mean((d_tr < d_ho) + 0.5 * (d_tr == d_ho)))

    def quantiles(d: np.ndarray) -> dict:
        return {"min": float(d.min()), "p05": float(np.quantile(d, 0.05)), "p25": float(np.quantile(d, 0.25)),
                "median": float(np.median(d)), "mean": float(d.mean()), "values": [round(float(x), 4) for x in d]}

    order = np.argsort(-sim_tr)[:examples]
    result = {
        "n": len(synthetic), "num_train": len(train), "num_heldout": len(heldout), "num_train_matched": len(matched),
        "verbatim": {"train_all": float(np.mean([c is not None for c in copies_all])),
                     "train": float(np.mean([c is not None for c in copies["train"]])),
                     "heldout": float(np.mean([c is not None for c in copies["heldout"]])),
                     "distinct_train_records_copied": len({c for c in copies_all if c is not None})},
        "near": {"train": float(np.mean(sim_tr >= near)), "heldout": float(np.mean(sim_ho >= near))},
        "nn_distance": {"train": quantiles(d_tr), "heldout": quantiles(d_ho)},
        "closer_to_train": closer,
        # the same distance as nn_distance["train"] (1 - similarity), so the table and the pairs agree
        # no shared n-gram (similarity 0): no record is nearer than another, so none is named
        "examples": [{"synthetic": synthetic[i], "nearest_train": matched[arg_tr[i]] if sim_tr[i] > 0 else None,
                      "similarity": round(float(sim_tr[i]), 4), "distance": round(float(d_tr[i]), 4)} for i in order],
        "empty_share": float(np.mean([not t.strip() for t in synthetic])),
        "settings": {"ngram": NGRAM, "near": near, "min_chars": min_chars, "seed": seed},
    }
    if canaries:
        result["canaries"] = canary_extraction(synthetic, canaries)
    return result
