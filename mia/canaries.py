"""Empirical lower bounds on ε from canaries inserted into one training run.

:func:`one_run_audit` is the audit the reports use: the f-DP one-run analysis of :mod:`mia.fdp`
(Mahloujifar, Melis & Chaudhuri 2024) with abstention (only the ``k`` highest scores are guessed
"member") and a Bonferroni correction over a fixed grid of ``k``. The older estimators stay for
comparison, from canary scores (higher = more likely trained on) and the inclusion coins:

* :func:`one_run_epsilon` — the one-run audit of Steinke, Nasr & Jagielski (2023, "Privacy auditing
  with one (1) training run"). Each of ``m`` canaries is included independently with probability
  1/2. The auditor guesses "in" for the ``k_plus`` highest scores and "out" for the ``k_minus``
  lowest and abstains on the rest. Under (ε, δ)-DP the number ``v`` of correct guesses among the
  ``r = k_plus + k_minus`` guesses is, up to a δ-dependent correction, no more likely to be large
  than a Binomial(r, e^ε / (1 + e^ε)) — randomized response at ε. Observing a ``v`` that would be
  improbable (p-value below β) under ε-DP rules ε out; the bound is the largest ε ruled out.
* :func:`clopper_pearson_epsilon` — the classic hypothesis-testing bound
  ``ε >= log((1 - δ - FNR) / FPR)`` with Clopper-Pearson upper limits on FPR and FNR. It treats
  canaries as independent trials, which one training run does not give: it is NOT a valid
  one-run bound and no report uses it any more.

A lower bound above the accountant's ε means the implementation leaks more than it claims: a bug.

Example:
    >>> round(epsilon_lower_bound(m=1000, r=100, v=100, delta=1e-5, confidence=0.95), 2)
    3.47
"""

from __future__ import annotations

import math

import numpy as np
from scipy.special import expit
from scipy.stats import beta as beta_dist
from scipy.stats import binom

from mia.fdp import largest_rejected


def one_run_p_value(*, m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """Probability of at least ``v`` correct out of ``r`` guesses if the training is (ε, δ)-DP.

    The pure-DP part is the Binomial(r, q) upper tail with ``q = e^ε / (1 + e^ε)``. For δ > 0 the
    paper's (ε, δ) theorem adds ``2 m δ`` times the largest, over shifts ``i = 1..v``, of the
    Binomial mass on ``[v - i, v - 1]`` divided by ``i``: δ can "buy" a few extra correct guesses,
    each at a price proportional to how many canaries could have supplied them.

    Args:
        m: Number of canaries (all of them, including those the auditor abstained on).
        r: Number of guesses made.
        v: Number of correct guesses.
        epsilon: The ε under test.
        delta: The δ of the guarantee.

    Returns:
        The p-value, capped at 1.
    """
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 <= v <= r <= m, got m={m}, r={r}, v={v}")
    if v == 0:
        return 1.0
    q = float(expit(epsilon))
    tail = float(binom.sf(v - 1, r, q))
    if delta <= 0:
        return min(tail, 1.0)
    # window[i-1] = P[v - i <= Binomial(r, q) <= v - 1], built by summing the pmf downward from v-1.
    window = np.cumsum(binom.pmf(np.arange(v - 1, -1, -1), r, q))
    shift_cost = float(np.max(window / np.arange(1, v + 1)))
    return min(tail + 2.0 * m * delta * shift_cost, 1.0)


def epsilon_lower_bound(*, m: int, r: int, v: int, delta: float, confidence: float = 0.95,
                        tol: float = 1e-6) -> float:
    """Largest ε rejected at level ``1 - confidence`` by :func:`one_run_p_value`.

    Args:
        m: Number of canaries.
        r: Number of guesses.
        v: Number of correct guesses.
        delta: δ of the guarantee being audited.
        confidence: 1 - β; the bound holds with this probability over the canary coins.
        tol: Bisection tolerance on ε.

    Returns:
        ε_lower >= 0 (0 when even ε = 0 cannot be rejected, e.g. half the guesses correct).

    Example:
        >>> epsilon_lower_bound(m=1000, r=100, v=50, delta=1e-5)
        0.0
    """
    beta = 1.0 - confidence

    def rejected(eps: float) -> bool:
        return one_run_p_value(m=m, r=r, v=v, epsilon=eps, delta=delta) <= beta

    return largest_rejected(rejected, tol=tol)  # the p-value grows with ε, so some ε is not rejected


def default_guess_grid(m: int) -> list[tuple[int, int]]:
    """``(k_plus, k_minus)`` pairs tried by default: total guesses of 1%..100% of ``m``, split
    evenly between "in" and "out" guesses, or all "in" (members are usually easier to spot)."""
    grid = []
    for frac in (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0):
        r = max(2, int(round(frac * m)))
        grid += [(r // 2, r - r // 2), (min(r, m), 0)]
    return sorted({g for g in grid if 0 < g[0] + g[1] <= m})


def _guess_outcome(scores, included, k_plus, k_minus, order) -> tuple[int, int]:
    top = order[::-1][:k_plus]
    bottom = order[:k_minus]
    return k_plus + k_minus, int(included[top].sum() + (~included[bottom]).sum())


def one_run_epsilon(scores, included, *, delta: float, confidence: float = 0.95,
                    grid: list[tuple[int, int]] | None = None, selection: str = "bonferroni",
                    seed: int = 0) -> dict:
    """One-run ε lower bound, optimised over the number of guesses.

    The paper reports the best bound over several guess counts. Choosing the count after seeing
    the results is itself part of the test, so it must be paid for:

    * ``"bonferroni"`` (default): every grid point is tested at level β / len(grid); the maximum
      is then a valid (1 - β) bound.
    * ``"split"``: pick the best guess fractions on a random half of the canaries, report the
      bound of that choice on the other half (valid; uses m/2 canaries).
    * ``"none"``: the maximum at level β, as an optimistic number; NOT a valid bound.

    Args:
        scores: Canary scores ``[m]`` (higher = guessed member).
        included: Inclusion coins ``[m]`` (bool).
        delta: δ of the audited guarantee.
        confidence: 1 - β.
        grid: ``(k_plus, k_minus)`` pairs; default :func:`default_guess_grid`.
        selection: ``"bonferroni"``, ``"split"`` or ``"none"``.
        seed: Breaks score ties and draws the split.

    Returns:
        ``{"epsilon_lower", "k_plus", "k_minus", "guesses", "correct", "m", "selection",
        "confidence", "grid": [...]}``.
    """
    scores = np.asarray(scores, dtype=np.float64)
    included = np.asarray(included, dtype=bool)
    if scores.shape != included.shape or scores.size == 0:
        raise ValueError(f"scores {scores.shape} and included {included.shape} must be equal, non-empty")
    if scores.size < 2:
        raise ValueError(f"the one-run audit needs at least 2 canaries, got {scores.size}; "
                         f"train with more canaries (hundreds give useful bounds)")
    rng = np.random.default_rng(seed)
    if selection == "split":
        perm = rng.permutation(scores.size)
        pick, test = perm[: scores.size // 2], perm[scores.size // 2:]
        chosen = one_run_epsilon(scores[pick], included[pick], delta=delta, confidence=confidence,
                                 selection="none", seed=seed)
        k_plus = int(round(chosen["k_plus"] / pick.size * test.size))
        k_minus = int(round(chosen["k_minus"] / pick.size * test.size))
        k_plus = max(k_plus, 1 if k_minus == 0 else 0)
        # One pre-chosen test on fresh canaries: level β, no correction needed.
        out = one_run_epsilon(scores[test], included[test], delta=delta, confidence=confidence,
                              grid=[(k_plus, k_minus)], selection="none", seed=seed)
        out["selection"] = "split"
        return out
    if selection not in ("bonferroni", "none"):
        raise ValueError(f"selection={selection!r}; use 'bonferroni', 'split' or 'none'")
    m = scores.size
    grid = default_guess_grid(m) if grid is None else grid
    level = confidence if selection == "none" else 1.0 - (1.0 - confidence) / len(grid)
    # Random tie-breaking so that equal scores are not resolved by the canaries' file order.
    order = np.lexsort((rng.random(m), scores))
    rows = []
    for k_plus, k_minus in grid:
        r, v = _guess_outcome(scores, included, k_plus, k_minus, order)
        eps = epsilon_lower_bound(m=m, r=r, v=v, delta=delta, confidence=level)
        rows.append({"k_plus": k_plus, "k_minus": k_minus, "guesses": r, "correct": v,
                     "epsilon_lower": eps})
    best = max(rows, key=lambda row: row["epsilon_lower"])
    return {**best, "m": m, "selection": selection, "confidence": confidence,
            "per_test_confidence": level, "grid": rows}


def clopper_pearson_upper(k: int, n: int, alpha: float) -> float:
    """One-sided (1 - alpha) Clopper-Pearson upper limit of a binomial rate from k of n."""
    return 1.0 if k >= n else float(beta_dist.ppf(1.0 - alpha, k + 1, n - k))


def clopper_pearson_epsilon(scores, included, *, delta: float, confidence: float = 0.95,
                            max_thresholds: int = 64, selection: str = "bonferroni") -> dict:
    """ε lower bound from Clopper-Pearson limits on FPR and FNR at the best threshold.

    At threshold ``t`` (guess member iff score >= t), a (ε, δ)-DP training run must satisfy
    ``1 - FNR <= e^ε FPR + δ`` and, swapping roles, ``1 - FPR <= e^ε FNR + δ``. Replacing FPR and
    FNR by their upper limits (each at level β/2, so both hold with probability 1 - β) gives
    ``ε >= max(log((1 - δ - FNR_u) / FPR_u), log((1 - δ - FPR_u) / FNR_u))``.

    Taking the best of many thresholds is a multiple comparison: with ``selection="bonferroni"``
    (default) β is divided by the number of thresholds, which are at most ``max_thresholds``
    evenly spaced order statistics of the scores (chosen without looking at the labels).
    ``selection="none"`` gives the optimistic, invalid maximum.

    Returns:
        ``{"epsilon_lower", "threshold", "fpr", "fnr", "fpr_upper", "fnr_upper", "direction",
        "n_thresholds", "selection", "confidence"}``.
    """
    scores = np.asarray(scores, dtype=np.float64)
    included = np.asarray(included, dtype=bool)
    n_in, n_out = int(included.sum()), int((~included).sum())
    if n_in == 0 or n_out == 0:
        raise ValueError(f"need included and excluded canaries (got {n_in} in, {n_out} out)")
    distinct = np.unique(scores)
    if distinct.size > max_thresholds:
        distinct = distinct[np.linspace(0, distinct.size - 1, max_thresholds).round().astype(int)]
    if selection not in ("bonferroni", "none"):
        raise ValueError(f"selection={selection!r}; use 'bonferroni' or 'none'")
    beta = 1.0 - confidence
    alpha = beta / 2 / (distinct.size if selection == "bonferroni" else 1)
    best = {"epsilon_lower": 0.0, "threshold": None, "direction": None}
    for t in distinct:
        fp = int(((scores >= t) & ~included).sum())
        fn = int(((scores < t) & included).sum())
        fpr_u = clopper_pearson_upper(fp, n_out, alpha)
        fnr_u = clopper_pearson_upper(fn, n_in, alpha)
        for direction, num, den in (("member", fnr_u, fpr_u), ("nonmember", fpr_u, fnr_u)):
            top = 1.0 - delta - num
            eps = math.log(top / den) if top > 0 and den > 0 else 0.0
            if eps > best["epsilon_lower"]:
                best = {"epsilon_lower": eps, "threshold": float(t), "direction": direction,
                        "fpr": fp / n_out, "fnr": fn / n_in, "fpr_upper": fpr_u, "fnr_upper": fnr_u}
    return {**best, "n_thresholds": int(distinct.size), "selection": selection,
            "confidence": confidence}


def one_sided_grid(m: int) -> list[int]:
    """Guess counts ``k`` tried by :func:`one_run_audit`: 0.1% .. 50% of ``m``, fixed in advance.

    The top end stops a little below m/2 as well as at it: about half the canaries are members, so
    a perfect attack is all-correct only while ``k`` stays below their (random) number.
    """
    fracs = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.45, 0.5)
    return sorted({max(1, int(round(f * m))) for f in fracs})


def one_run_audit(scores, included, *, delta: float, confidence: float = 0.95,
                  family: str = "epsdelta", grid: list[int] | None = None, seed: int = 0) -> dict:
    """One-run lower bound, best over the number of guesses ``k`` (and, for ε, over two analyses).

    The auditor guesses "member" for the ``k`` highest scores and abstains on the rest.

    * ``family="epsdelta"``: two valid analyses of the same guesses for (ε, δ)-DP, the f-DP one of
      :mod:`mia.fdp` (tighter when nearly every guess is right) and the ε-DP one of Steinke et al.
      (:func:`epsilon_lower_bound`; tighter at moderate precision). Every (k, analysis) pair is
      tested at level ``(1 - confidence) / (2 len(grid))`` (Bonferroni), so the best of all of
      them is a valid ε lower bound at ``confidence`` over the canaries' coins.
    * ``family="gdp"``: the f-DP analysis for μ-GDP, each ``k`` at ``(1 - confidence) / len(grid)``.

    Args:
        scores: Canary scores ``[m]`` (higher = guessed member).
        included: Inclusion coins ``[m]`` (bool), each a fair coin drawn before training.
        delta: δ of the audited guarantee (``epsdelta``; also the δ at which μ is read as ε).
        confidence: 1 - β of the final bound.
        family: ``"epsdelta"`` (a valid ε lower bound for any (ε, δ)-DP training; the default)
            or ``"gdp"`` (a μ lower bound, "not μ-GDP"; ``epsilon_lower`` is μ's ε at δ).
        grid: Guess counts; default :func:`one_sided_grid`.
        seed: Breaks score ties at random (never by file order).

    Returns:
        ``{"epsilon_lower", "family", "analysis", "k", "correct", "m", "confidence",
        "per_test_confidence", "n_tests", "delta", "grid": [{"k", "correct", "bound", ...}...]}``
        plus ``"mu_lower"`` for ``gdp``; for ``epsdelta`` each grid row also has ``"fdp"`` and
        ``"steinke"``, and ``"analysis"`` names the one that gave the bound.

    Example:
        >>> import numpy as np
        >>> inc = np.arange(1000) % 2 == 0
        >>> round(one_run_audit(inc.astype(float), inc, delta=1e-5)["epsilon_lower"], 2)
        4.39
    """
    from mia import fdp

    scores = np.asarray(scores, dtype=np.float64)
    included = np.asarray(included, dtype=bool)
    if scores.shape != included.shape or scores.ndim != 1 or scores.size < 2:
        raise ValueError(f"scores {scores.shape} and included {included.shape} must be equal 1-D "
                         f"arrays of at least 2 canaries; train with more canaries (1,000+ give useful bounds)")
    if np.isnan(scores).any():
        raise ValueError("canary scores contain NaN; check the signals that produced them")
    if family not in fdp.FAMILIES:
        raise ValueError(f"family={family!r}; use one of {', '.join(fdp.FAMILIES)}")
    m = scores.size
    grid = one_sided_grid(m) if grid is None else sorted({int(k) for k in grid})
    if not grid or grid[0] < 1 or grid[-1] > m:
        raise ValueError(f"guess counts must lie in 1..{m}, got {grid}")
    n_tests = len(grid) * (2 if family == "epsdelta" else 1)
    level = 1.0 - (1.0 - confidence) / n_tests
    rng = np.random.default_rng(seed)
    order = np.lexsort((rng.random(m), scores))[::-1]  # best-scored first, random among ties
    correct_at = np.cumsum(included[order])
    rows = []
    for k in grid:
        c = int(correct_at[k - 1])
        row = {"k": k, "correct": c,
               "fdp": fdp.lower_bound(m=m, k=k, c=c, family=family, delta=delta, confidence=level)}
        if family == "epsdelta":
            row["steinke"] = epsilon_lower_bound(m=m, r=k, v=c, delta=delta, confidence=level)
        row["analysis"] = max(("fdp", "steinke") if family == "epsdelta" else ("fdp",), key=row.get)
        row["bound"] = row[row["analysis"]]
        rows.append(row)
    best = max(rows, key=lambda row: row["bound"])
    out = {"family": family, "analysis": best["analysis"], "k": best["k"], "correct": best["correct"],
           "m": m, "confidence": confidence, "per_test_confidence": level, "n_tests": n_tests,
           "delta": delta, "grid": rows}
    if family == "gdp":
        out["mu_lower"] = best["bound"]
        out["epsilon_lower"] = fdp.gdp_epsilon(best["bound"], delta) if delta > 0 else math.inf * (best["bound"] > 0)
    else:
        out["epsilon_lower"] = best["bound"]
    return out
