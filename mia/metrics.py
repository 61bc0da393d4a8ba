"""Membership-inference metrics: ROC, AUC, TPR at low FPR, balanced accuracy, loss gap, bootstrap CIs.

Every function takes the attack scores of members and of non-members separately; a HIGHER score
means "more likely a member". Conventions, used everywhere in ``mia`` and stated in the reports:

* An attack at threshold ``t`` predicts "member" for every record with ``score >= t``. Thresholds are
  taken only at observed score values (plus ``+inf``, which predicts nobody), so records with tied
  scores are always classified together.
* ``TPR@FPR<=b`` is the largest TPR over those thresholds whose FPR is at most ``b``. With few
  non-members the achievable FPRs are coarse (multiples of ``1/n_nonmembers``); with fewer than
  ``1/b`` non-members only FPR = 0 qualifies.
* AUC is the Mann-Whitney statistic: P(member score > non-member score) + 1/2 P(tie).

Example:
    >>> import numpy as np
    >>> auc(np.array([3.0, 2.0]), np.array([2.0, 1.0]))
    0.875
    >>> tpr_at_fpr(np.array([3.0, 2.0]), np.array([2.0, 1.0]), 0.0)
    0.5
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from scipy.stats import rankdata

# The low-FPR operating points recommended by Carlini et al. (2022, "Membership inference attacks
# from first principles"): average-case AUC hides attacks that confidently expose a few records.
DEFAULT_FPRS = (0.001, 0.01, 0.1)


def _as_scores(member_scores, nonmember_scores) -> tuple[np.ndarray, np.ndarray]:
    m = np.asarray(member_scores, dtype=np.float64).ravel()
    n = np.asarray(nonmember_scores, dtype=np.float64).ravel()
    if m.size == 0 or n.size == 0:
        raise ValueError(
            f"metrics need at least one member and one non-member score (got {m.size} members, "
            f"{n.size} non-members); pass non-empty score arrays"
        )
    if np.isnan(m).any() or np.isnan(n).any():
        raise ValueError("attack scores contain NaN; check the signals that produced them")
    return m, n


def roc_curve(member_scores, nonmember_scores) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ROC curve with one point per distinct observed score.

    Args:
        member_scores: Scores of records that were trained on (higher = more likely member).
        nonmember_scores: Scores of records that were not.

    Returns:
        ``(fpr, tpr, thresholds)``, each of length ``n_distinct + 1``, ordered by decreasing
        threshold. The first point is ``(0, 0)`` at threshold ``+inf``; point ``i`` counts every
        record with ``score >= thresholds[i]`` (ties included together); the last is ``(1, 1)``.

    Raises:
        ValueError: If either set is empty or a score is NaN.
    """
    m, n = _as_scores(member_scores, nonmember_scores)
    scores = np.concatenate([m, n])
    is_member = np.concatenate([np.ones(m.size), np.zeros(n.size)])
    order = np.argsort(-scores, kind="mergesort")
    scores, is_member = scores[order], is_member[order]
    # The last position of each run of equal scores: a threshold there admits the whole tie group.
    group_end = np.r_[np.flatnonzero(np.diff(scores) != 0), scores.size - 1]
    tp = np.cumsum(is_member)[group_end]
    fp = (group_end + 1) - tp
    fpr = np.r_[0.0, fp / n.size]
    tpr = np.r_[0.0, tp / m.size]
    thresholds = np.r_[np.inf, scores[group_end]]
    return fpr, tpr, thresholds


def auc(member_scores, nonmember_scores) -> float:
    """Area under the ROC curve as the Mann-Whitney statistic (ties count 1/2).

    Args:
        member_scores: Member scores.
        nonmember_scores: Non-member scores.

    Returns:
        P(S_member > S_nonmember) + 0.5 * P(S_member == S_nonmember), in [0, 1].
    """
    m, n = _as_scores(member_scores, nonmember_scores)
    ranks = rankdata(np.concatenate([m, n]))  # average ranks give ties exactly half credit
    u = ranks[: m.size].sum() - m.size * (m.size + 1) / 2.0
    return float(u / (m.size * n.size))


def tpr_at_fpr(member_scores, nonmember_scores, max_fpr: float) -> float:
    """Largest TPR over observed-score thresholds whose FPR is at most ``max_fpr``.

    Args:
        member_scores: Member scores.
        nonmember_scores: Non-member scores.
        max_fpr: The FPR bound, e.g. 0.01 for TPR@1%FPR.

    Returns:
        The TPR; 0.0 when no threshold other than ``+inf`` meets the bound.
    """
    fpr, tpr, _ = roc_curve(member_scores, nonmember_scores)
    return _tpr_at(fpr, tpr, max_fpr)


def _tpr_at(fpr: np.ndarray, tpr: np.ndarray, max_fpr: float) -> float:
    # A tiny tolerance so that e.g. FPR = 1/100 counts as <= 0.01 despite float rounding.
    return float(tpr[fpr <= max_fpr + 1e-12].max())


def balanced_accuracy(member_scores, nonmember_scores) -> float:
    """Best balanced accuracy ``(TPR + TNR) / 2`` over observed-score thresholds (>= 0.5)."""
    fpr, tpr, _ = roc_curve(member_scores, nonmember_scores)
    return float(((tpr + 1.0 - fpr) / 2.0).max())


def loss_gap(member_losses, nonmember_losses) -> float:
    """Mean non-member loss minus mean member loss, in nats (positive = members fit better)."""
    m, n = _as_scores(member_losses, nonmember_losses)
    return float(n.mean() - m.mean())


def _point_metrics(m: np.ndarray, n: np.ndarray, fprs) -> dict[str, float]:
    fpr, tpr, _ = roc_curve(m, n)
    out = {"auc": auc(m, n), "balanced_accuracy": float(((tpr + 1.0 - fpr) / 2.0).max())}
    for b in fprs:
        out[tpr_key(b)] = _tpr_at(fpr, tpr, b)
    return out


def tpr_key(max_fpr: float) -> str:
    """Name of the TPR@FPR metric in result dicts, e.g. ``tpr@fpr=0.001``."""
    return f"tpr@fpr={max_fpr:g}"


def bootstrap_ci(
    stat: Callable[[np.ndarray, np.ndarray], dict[str, float] | float],
    member_scores,
    nonmember_scores,
    *,
    n_bootstrap: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> dict[str, tuple[float, float]] | tuple[float, float]:
    """Percentile bootstrap confidence interval of a statistic of (members, non-members).

    Members and non-members are resampled separately (with replacement, keeping both sizes), so
    every replicate has the original class balance.

    Args:
        stat: ``f(member_scores, nonmember_scores)`` returning a float or a dict of floats.
        member_scores: Member scores.
        nonmember_scores: Non-member scores.
        n_bootstrap: Number of replicates.
        confidence: Two-sided coverage of the interval.
        seed: Seed of the resampling generator (results are reproducible).

    Returns:
        ``(low, high)``, or a dict of them when ``stat`` returns a dict.
    """
    m, n = _as_scores(member_scores, nonmember_scores)
    rng = np.random.default_rng(seed)
    reps = []
    for _ in range(n_bootstrap):
        reps.append(stat(m[rng.integers(0, m.size, m.size)], n[rng.integers(0, n.size, n.size)]))
    q = [(1 - confidence) / 2 * 100, (1 + confidence) / 2 * 100]
    if isinstance(reps[0], dict):
        return {k: tuple(float(x) for x in np.percentile([r[k] for r in reps], q)) for k in reps[0]}
    return tuple(float(x) for x in np.percentile(reps, q))


def evaluate(
    member_scores,
    nonmember_scores,
    *,
    member_losses=None,
    nonmember_losses=None,
    fprs=DEFAULT_FPRS,
    n_bootstrap: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> dict:
    """All metrics of one attack, with bootstrap CIs.

    Args:
        member_scores: Member scores (higher = more likely member).
        nonmember_scores: Non-member scores.
        member_losses: Optional per-record member losses, for the loss gap.
        nonmember_losses: Optional per-record non-member losses.
        fprs: FPR bounds at which TPR is reported.
        n_bootstrap: Bootstrap replicates for the CIs (0 disables them).
        confidence: CI coverage.
        seed: Bootstrap seed.

    Returns:
        ``{"auc", "balanced_accuracy", "tpr@fpr=...", "loss_gap"?, "ci": {metric: [lo, hi]},
        "n_members", "n_nonmembers"}``.
    """
    m, n = _as_scores(member_scores, nonmember_scores)
    out: dict = _point_metrics(m, n, fprs)
    if member_losses is not None and nonmember_losses is not None:
        out["loss_gap"] = loss_gap(member_losses, nonmember_losses)
    if n_bootstrap > 0:
        ci = bootstrap_ci(lambda a, b: _point_metrics(a, b, fprs), m, n,
                          n_bootstrap=n_bootstrap, confidence=confidence, seed=seed)
        out["ci"] = {k: list(v) for k, v in ci.items()}
        out["ci_confidence"] = confidence
    out["n_members"], out["n_nonmembers"] = int(m.size), int(n.size)
    return out
