"""One-run audits under f-DP (after Mahloujifar, Melis & Chaudhuri 2024, "Auditing f-Differential
Privacy in One Run").

Setting: ``m`` canaries, each trained on with an independent fair coin. After training the auditor
makes exactly ``k`` guesses (here one-sided: "member" for the ``k`` highest scores; or two-sided)
and abstains on the rest; ``c`` of them are right. A mechanism is f-DP when every test between two
neighbouring datasets with false-positive rate ``α`` has power at most ``F(α) = 1 - f(α)``.

**The argument (ours, written out because everything else rests on it).** Let ``C`` be the number
of correct guesses and, for ``i = 0..k``,

* ``r_i = E[C · 1{C >= i}] / m`` (correct guesses made in runs with at least ``i`` correct),
* ``h_i = E[(k - C) · 1{C >= i}] / m`` (wrong guesses in those runs).

Fix a canary ``j`` and the other coins. "Guess j and at least ``i - 1`` other guesses right" is a
test between training with and without canary ``j``. Under f-DP its power is at most ``F`` of its
false-positive rate; averaging over the other coins and over ``j`` (``F`` is concave) gives

* one-sided guesses: ``r_i <= F(2 h_{i-1}) / 2``;
* two-sided guesses: ``r_i <= F(h_{i-1})`` (an "out" guess tests the reverse direction; the
  average of the two directions costs the factor 2).

Moreover ``r_{i-1} - r_i = (i - 1) P[C = i-1] / m`` and ``h_{i-1} - h_i = (k - i + 1) P[C = i-1] / m``,
and ``r_0 + h_0 = k / m`` because every run makes exactly ``k`` guesses. Suppose ``P[C >= c] >= τ``.
The least total probability mass consistent with the constraints puts ``τ`` at ``C = c`` and then,
level by level downwards, just the mass that the f-DP constraint forces (mass placed lower helps
every later constraint more and costs no more, so the greedy choice is optimal). If even that least
mass exceeds 1, no f-DP mechanism can make ``P[C >= c] >= τ``: the claim is rejected at level τ.
:func:`rejects` runs that recursion; the tests check it against exact binomial tails (pure ε-DP,
where randomized response is the worst case) and against simulated Gaussian mechanisms.

Families of trade-off curves (``F`` and its inverse):

* ``"epsdelta"``: every (ε, δ)-DP mechanism, ``F(x) = min(1, δ + e^ε x, 1 - e^-ε (1 - δ - x))``.
  A rejected ε is a valid lower bound for any mechanism, so it is comparable with an accountant's ε.
* ``"gdp"``: μ-Gaussian DP, ``F(x) = Φ(Φ^-1(x) + μ)``. Rejecting μ says "not μ-GDP"; converting μ to
  ε at δ is the usual reading for Gaussian-like mechanisms (DP-SGD), but it is not an ε lower bound
  for an arbitrary (ε, δ)-DP mechanism.

Example:
    >>> round(lower_bound(m=1000, k=100, c=100, family="epsdelta", delta=1e-5, confidence=0.95), 2)
    3.49
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Callable

_N = NormalDist()
FAMILIES = ("epsdelta", "gdp")


def inverse_power(family: str, theta: float, delta: float = 0.0) -> Callable[[float], float]:
    """``F^{-1}``: the least false-positive rate at which a test can reach power ``y``.

    Args:
        family: ``"epsdelta"`` (``theta`` = ε, with ``delta``) or ``"gdp"`` (``theta`` = μ).
        theta: The curve's parameter.
        delta: δ of the ``"epsdelta"`` family.

    Returns:
        A function of ``y`` returning ``inf`` for ``y > 1`` (no mechanism has power above 1).
    """
    if family == "epsdelta":
        e = math.exp(min(theta, 700.0))

        def inv(y: float) -> float:
            if y > 1.0:
                return math.inf
            return max(0.0, (y - delta) / e, 1.0 - delta - e * (1.0 - y))
        return inv
    if family == "gdp":
        def inv(y: float) -> float:
            if y > 1.0:
                return math.inf
            if y <= 0.0:
                return 0.0
            if y >= 1.0:
                return 1.0
            return _N.cdf(_N.inv_cdf(y) - theta)
        return inv
    raise ValueError(f"family={family!r}; use one of {', '.join(FAMILIES)}")


def least_mass(*, m: int, k: int, c: int, tau: float, inv: Callable[[float], float],
               one_sided: bool = True) -> float:
    """Least total probability any f-DP mechanism needs to have ``P[C >= c] >= tau`` (module doc).

    A value above 1 means no such mechanism exists.
    """
    if not 0 <= c <= k <= m:
        raise ValueError(f"need 0 <= c <= k <= m, got m={m}, k={k}, c={c}")
    if c == 0 or tau <= 0:
        return tau
    r, h = tau * c / m, tau * (k - c) / m
    limit = k / m
    for i in range(c, 0, -1):
        # Level i: the f-DP constraint ties r_i to h_{i-1}.
        need = inv(2.0 * r) / 2.0 if one_sided else inv(r)
        if need <= h:  # no mass needed at i-1; nothing changes below either
            break
        r += (i - 1) / (k - i + 1) * (need - h)
        h = need
        if r + h > limit:
            break
    return (r + h) * m / k


def rejects(*, m: int, k: int, c: int, level: float, family: str, theta: float, delta: float = 0.0,
            one_sided: bool = True) -> bool:
    """True when ``c`` correct out of ``k`` guesses has probability below ``level`` under the curve."""
    inv = inverse_power(family, theta, delta)
    return least_mass(m=m, k=k, c=c, tau=level, inv=inv, one_sided=one_sided) > 1.0


def p_value(*, m: int, k: int, c: int, family: str, theta: float, delta: float = 0.0,
            one_sided: bool = True, tol: float = 1e-9) -> float:
    """Largest ``P[C >= c]`` an f-DP mechanism of the family can have (upper bound; bisection)."""
    if c == 0:
        return 1.0
    inv = inverse_power(family, theta, delta)
    lo, hi = 0.0, 1.0
    if least_mass(m=m, k=k, c=c, tau=1.0, inv=inv, one_sided=one_sided) <= 1.0:
        return 1.0
    while hi - lo > tol * max(lo, 1e-300) and hi - lo > 1e-300:
        mid = (lo + hi) / 2
        if least_mass(m=m, k=k, c=c, tau=mid, inv=inv, one_sided=one_sided) > 1.0:
            hi = mid
        else:
            lo = mid
    return hi


def lower_bound(*, m: int, k: int, c: int, family: str = "epsdelta", delta: float = 0.0,
                confidence: float = 0.95, one_sided: bool = True, tol: float = 1e-6) -> float:
    """Largest ε (``epsdelta``) or μ (``gdp``) rejected at level ``1 - confidence``.

    Returns:
        0.0 when even ``theta = 0`` is not rejected; ``inf`` when every ``theta <= 1000`` is.
    """
    level = 1.0 - confidence

    def rej(theta: float) -> bool:
        return rejects(m=m, k=k, c=c, level=level, family=family, theta=theta, delta=delta,
                       one_sided=one_sided)

    return 0.0 if k == 0 else largest_rejected(rej, tol=tol)


def largest_rejected(rejected: Callable[[float], bool], *, tol: float, cap: float = 1e3) -> float:
    """Largest x ≥ 0 (to ``tol``) with ``rejected(x)``, for a test that rejects every x below some threshold
    and none above it: doubling to bracket, then bisection.

    Returns:
        0.0 when ``rejected(0)`` is false; ``inf`` when x is still rejected beyond ``cap``.
    """
    if not rejected(0.0):
        return 0.0
    lo, hi = 0.0, 1.0
    while rejected(hi):
        lo, hi = hi, 2 * hi
        if hi > cap:
            return math.inf
    while hi - lo > tol:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if rejected(mid) else (lo, mid)
    return lo


def gdp_delta(mu: float, epsilon: float) -> float:
    """δ(ε) of μ-GDP (Dong, Roth & Su 2019, Cor. 2.13)."""
    if mu <= 0:
        return 0.0
    return _N.cdf(-epsilon / mu + mu / 2) - math.exp(epsilon) * _N.cdf(-epsilon / mu - mu / 2)


def gdp_epsilon(mu: float, delta: float, tol: float = 1e-9) -> float:
    """ε at δ of μ-GDP (bisection on :func:`gdp_delta`, which falls as ε grows).

    Example:
        >>> round(gdp_epsilon(1.0, 1e-5), 3)
        4.377
    """
    if mu <= 0 or gdp_delta(mu, 0.0) <= delta:
        return 0.0
    if math.isinf(mu):
        return math.inf
    lo, hi = 0.0, 1.0
    while _safe_gdp_delta(mu, hi) > delta:
        lo, hi = hi, 2 * hi
    while hi - lo > tol * max(1.0, hi):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _safe_gdp_delta(mu, mid) > delta else (lo, mid)
    return lo


def _safe_gdp_delta(mu: float, eps: float) -> float:
    # e^ε Φ(-ε/μ - μ/2) underflows to 0 * inf for large ε; in logs it stays finite.
    a = _N.cdf(-eps / mu + mu / 2)
    z = -eps / mu - mu / 2
    if z < -37:
        return a
    return a - math.exp(eps + math.log(max(_N.cdf(z), 1e-300)))
