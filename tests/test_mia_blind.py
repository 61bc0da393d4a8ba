"""Blind baseline (mia.blind): a planted topic shift is flagged, a random split of one pool is not."""

import random

import pytest

from dpllm.data import pydoc_paragraphs
from mia.blind import blind_baseline


def _paragraphs(*keys):
    """Distinct pydoc paragraphs of at least 32 characters from topics ``keys`` (default all)."""
    return list(dict.fromkeys(p for p in pydoc_paragraphs(*keys) if len(p) >= 32))


def test_planted_topic_shift_is_flagged():
    # Members from one pydoc topic, non-members from another: no model needed to tell them apart.
    members, nonmembers = _paragraphs("compound")[:150], _paragraphs("specialnames")[:150]
    r = blind_baseline(members, nonmembers)
    assert r["shifted"] and r["auc"] > 0.9  # seen: 0.997
    assert "DISTRIBUTION SHIFT" in r["message"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_iid_split_is_not_flagged(seed):
    pool = _paragraphs()
    random.Random(seed).shuffle(pool)
    r = blind_baseline(pool[:200], pool[200:400], seed=seed)
    assert not r["shifted"] and r["auc"] < 0.55  # seen: 0.46-0.49


def test_too_few_texts():
    r = blind_baseline(["a b c"] * 3, ["d e f"] * 3)
    assert r["auc"] is None and not r["shifted"]
