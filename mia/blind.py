"""Blind baseline: can the member and non-member *texts alone* be told apart, without the model?

Membership-inference results on LLMs are easily produced by a distribution shift between the two
sets (different dates, sources or topics) rather than by memorisation: Das et al. (2024, "Blind
baselines beat membership inference attacks for foundation models") beat published attacks with
classifiers that never query the model, and Duan et al. (2024) traced many MIA results to such
shifts. Every audit therefore also trains a model-free classifier on the texts: bag of word 1-2
grams and character 2-4 grams (hashed) plus log length, logistic regression, ``folds``-fold
cross-validation. Its out-of-fold scores give an AUC like any attack's.

Verdict: the sets are **distribution-shifted** when that AUC exceeds 0.55 *and* exceeds chance
significantly (one-sided Mann-Whitney normal approximation, p < 0.05; cross-validated AUCs of a
shift-free pair sit at or slightly below 0.5, so the test is conservative). Then attack AUCs on
those sets are not evidence of memorisation.

Example:
    >>> r = blind_baseline(["def f(x): return x"] * 30, ["The cat sat on the mat."] * 30)  # doctest: +SKIP
    >>> r["shifted"]  # doctest: +SKIP
    True
"""

from __future__ import annotations

import math

import numpy as np

AUC_THRESHOLD = 0.55
P_THRESHOLD = 0.05


def _features(texts: list[str]):
    from scipy.sparse import csr_matrix, hstack
    from sklearn.feature_extraction.text import HashingVectorizer

    words = HashingVectorizer(analyzer="word", ngram_range=(1, 2), n_features=2 ** 16,
                              alternate_sign=False, norm="l2")
    chars = HashingVectorizer(analyzer="char_wb", ngram_range=(2, 4), n_features=2 ** 16,
                              alternate_sign=False, norm="l2")
    length = np.log1p([[len(t)] for t in texts]) / 10.0
    return hstack([words.transform(texts), chars.transform(texts), csr_matrix(length)]).tocsr()


def blind_baseline(members: list[str], nonmembers: list[str], *, folds: int = 5, seed: int = 0) -> dict:
    """Cross-validated AUC of a model-free text classifier (module doc) and the shift verdict.

    Args:
        members: Member texts.
        nonmembers: Non-member texts.
        folds: Cross-validation folds (reduced when a set is smaller).
        seed: Fold assignment.

    Returns:
        ``{"auc", "p_value", "shifted", "n_members", "n_nonmembers", "folds", "method",
        "threshold", "message"}``; ``auc`` is None (and ``shifted`` False) when a set has fewer
        than 4 texts.
    """
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import StratifiedKFold

    from mia.metrics import auc as mw_auc

    n1, n0 = len(members), len(nonmembers)
    base = {"n_members": n1, "n_nonmembers": n0, "threshold": AUC_THRESHOLD,
            "method": "logistic regression on hashed word 1-2 and char 2-4 grams + log length, "
                      "out-of-fold scores"}
    folds = min(folds, n1, n0)
    if folds < 2 or min(n1, n0) < 4:
        return {**base, "auc": None, "p_value": None, "shifted": False, "folds": folds,
                "message": "too few texts for the blind baseline (need 4+ of each)"}
    texts = list(members) + list(nonmembers)
    y = np.r_[np.ones(n1, int), np.zeros(n0, int)]
    X = _features(texts)
    scores = np.zeros(len(texts))
    for train, test in StratifiedKFold(folds, shuffle=True, random_state=seed).split(X, y):
        clf = LogisticRegression(C=10.0, solver="liblinear")
        clf.fit(X[train], y[train])
        scores[test] = clf.decision_function(X[test])
    auc = float(mw_auc(scores[:n1], scores[n1:]))
    sd = math.sqrt((n1 + n0 + 1) / (12.0 * n1 * n0))
    p = float(0.5 * math.erfc((auc - 0.5) / sd / math.sqrt(2)))
    shifted = bool(auc > AUC_THRESHOLD and p < P_THRESHOLD)
    if shifted:
        msg = (f"DISTRIBUTION SHIFT: a classifier that never sees the model separates members from "
               f"non-members by their text alone (AUC {auc:.3f}, p = {p:.2g}). Attack AUCs on these "
               f"sets are not evidence of memorisation; audit with an IID split (e.g. a run "
               f"directory's own splits.json) or with canaries.")
    else:
        msg = (f"No distribution shift detected: the blind text classifier reaches AUC {auc:.3f} "
               f"(p = {p:.2g}; flagged above {AUC_THRESHOLD} with p < {P_THRESHOLD}).")
    return {**base, "auc": auc, "p_value": p, "shifted": shifted, "folds": folds, "message": msg}
