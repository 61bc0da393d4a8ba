"""Many small robust fits at once: damped Newton on a Huber loss of log-sum-exp residuals, batched in numpy.

The bootstrap refits one law a thousand times, each from the full-data optimum; one scipy L-BFGS-B call per
refit spends most of its time in Python overhead (≈40 iterations of a 240-point objective). Here every
resample is one row of a batch and one Newton iteration serves all of them, so the Python cost is paid per
iteration, not per refit.

The model: log-prediction ``t_i = logsumexp_j (A[i, j] · θ)`` over terms ``j`` (a term whose ``mask[i, j]`` is
False is absent, e.g. the noise term at σ̄ = 0), residual ``r_i = t_i − log y_i``, objective
``Σ_i w_i · huber(r_i)``. With ``p_i = softmax_j(A θ)`` and ``J_i = A_iᵀ p_i`` the gradient is
``Σ ψ(r_i) J_i`` and the Hessian ``Σ (ψ'(r_i) − ψ(r_i)) J_i J_iᵀ + ψ(r_i) A_iᵀ diag(p_i) A_i`` (ψ = clipped r).

A resample is *solved* when a pure Newton step (no damping) inside the parameter box is at most
``step_tol`` (relative): quadratic convergence then leaves it nearer the optimum than L-BFGS-B's stopping rule
does (an objective no higher; ``tests/test_scaling_bootstrap_batched.py``), down to the ~1e-7 that rounding of
the gradient allows along the flattest direction. Anything else (a step that leaves the box, an optimum on a
bound, no convergence within ``max_iter``) is reported unsolved, and the caller refits that resample the
slow, general way.
"""

from __future__ import annotations

import contextlib

import numpy as np


def _evaluate(theta, A, AA, mask, logy, weight, delta):
    """Objective, gradient and Hessian for each row of ``theta`` (batch, params); matrix products throughout
    (einsum without BLAS was most of the time)."""
    b, (n, k, n_par) = theta.shape[0], A.shape
    t = (theta @ A.reshape(n * k, n_par).T).reshape(b, n, k)
    t = np.where(mask, t, -np.inf)
    m = t.max(axis=2)
    p = np.exp(t - m[..., None])
    s = p.sum(axis=2)
    p /= s[..., None]
    r = m + np.log(s) - logy
    absr = np.abs(r)
    quad = absr <= delta
    f = (weight * np.where(quad, 0.5 * r * r, delta * (absr - 0.5 * delta))).sum(axis=1)
    psi = weight * np.clip(r, -delta, delta)
    J = (p[..., None] * A).sum(axis=2)  # (batch, points, params): d t_i / d θ
    g = (psi[:, None, :] @ J)[:, 0]
    H = (np.swapaxes(J, 1, 2) @ (J * (weight * quad - psi)[..., None])
         + ((psi[..., None] * p).reshape(b, n * k) @ AA.reshape(n * k, n_par * n_par)).reshape(b, n_par, n_par))
    return f, g, H


def _solve(H: np.ndarray, g: np.ndarray) -> np.ndarray:
    """``-H⁻¹ g`` per batch row ((batch, p, p), (batch, p, 1) → (batch, p)); NaN where a system is singular."""
    try:
        return -np.linalg.solve(H, g)[..., 0]
    except np.linalg.LinAlgError:  # singular somewhere in the batch: solve row by row
        out = np.full(g.shape[:2], np.nan)
        for i in range(len(H)):
            with contextlib.suppress(np.linalg.LinAlgError):
                out[i] = -np.linalg.solve(H[i], g[i])[:, 0]
        return out


def newton_many(A: np.ndarray, mask: np.ndarray, logy: np.ndarray, weight: np.ndarray, theta0: np.ndarray, *,
                lower: np.ndarray, upper: np.ndarray, delta: float, max_iter: int = 200,
                step_tol: float = 1e-8) -> tuple[np.ndarray, np.ndarray]:
    """Minimise the Huber loss of log-sum-exp residuals for a batch of weightings of the same points.

    Args:
        A: (points, terms, params) design: term ``j`` of point ``i`` is ``A[i, j] · θ`` in log space.
        mask: (points, terms) bool; False drops the term at that point.
        logy: (batch, points) log-loss per resample (any finite value where the weight is 0).
        weight: (batch, points) weight of each point in each resample (0 = absent).
        theta0: (params,) start shared by the batch (the full-data optimum).
        lower, upper: (params,) box; ±inf where a parameter is free. A solution must lie strictly inside.
        delta: Huber threshold on the log residual.
        max_iter: Newton iterations before a resample is given up as unsolved. A resample whose optimum lies down a
            flat valley (E falling towards 0, the other terms taking its place) needs 100-200 damped steps; at 60,
            135 of the 360 resamples of tests/test_scaling_intervals.py's sweeps were left to one-by-one L-BFGS-B
            (their bootstrap 4.3 CPU-s), at 200 30 (2.75 CPU-s), with the same samples as the reference's; at 300
            one more settles, at another point of its valley than L-BFGS-B stops at (2026-11-29).
        step_tol: a pure Newton step at most this (relative to 1 + |θ|) ends a resample as solved.

    Returns:
        ``(theta, solved)``: (batch, params) solutions and a (batch,) bool mask; unsolved rows hold junk.
    """
    b, n_par = logy.shape[0], theta0.shape[0]
    AA = np.einsum("njp,njq->njpq", A, A)
    theta = np.tile(np.asarray(theta0, dtype=float), (b, 1))
    f, g, H = _evaluate(theta, A, AA, mask, logy, weight, delta)
    lam = np.zeros(b)  # Levenberg damping, relative to the Hessian's scale; 0 = a pure Newton step
    active, solved = np.ones(b, bool), np.zeros(b, bool)
    eye = np.eye(n_par)
    for _ in range(max_iter):
        rows = np.flatnonzero(active)
        if not len(rows):
            break
        Hr, gr = H[rows], g[rows][..., None]
        scale = np.abs(np.diagonal(Hr, axis1=1, axis2=2)).max(axis=1) + 1e-300
        newton = _solve(Hr, gr)
        # A damped step where the last one failed; the pure Newton step decides convergence either way (a
        # damped step near the optimum is small without being at it).
        damped = lam[rows] > 0
        d = newton.copy()
        if damped.any():
            d[damped] = _solve(Hr[damped] + (lam[rows][damped] * scale[damped])[:, None, None] * eye, gr[damped])
        trial = theta[rows] + d
        inside = np.isfinite(trial).all(axis=1) & (trial > lower).all(axis=1) & (trial < upper).all(axis=1)
        pure = theta[rows] + newton
        tiny = (np.isfinite(pure).all(axis=1) & (pure > lower).all(axis=1) & (pure < upper).all(axis=1)
                & (np.abs(newton).max(axis=1) <= step_tol * (1 + np.abs(pure).max(axis=1))))
        trial[tiny] = pure[tiny]
        theta[rows[tiny]] = trial[tiny]  # converged: no need to evaluate there again
        step = inside & ~tiny
        ft, gt, Ht = _evaluate(trial[step], A, AA, mask, logy[rows[step]], weight[rows[step]], delta)
        better = ft <= f[rows[step]]
        acc = rows[step][better]
        theta[acc], f[acc], g[acc], H[acc] = trial[step][better], ft[better], gt[better], Ht[better]
        accept = tiny.copy()
        accept[np.flatnonzero(step)[better]] = True
        lam[acc] = np.where(lam[acc] > 1e-6, lam[acc] / 10, 0.0)
        rej = rows[~accept]
        lam[rej] = np.maximum(lam[rej] * 10, 1e-6)
        done = rows[tiny]
        solved[done] = True
        active[done] = False
        active[rej[lam[rej] > 1e6]] = False  # damping that large is gradient descent: leave it to the caller
    inner = (theta > lower + 1e-6) & (theta < upper - 1e-6)
    return theta, solved & inner.all(axis=1)
