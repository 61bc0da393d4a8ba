"""Scaling-law forms: pure prediction and fitting functions in a string-keyed registry.

A *form* maps inputs (``N`` parameters, ``D`` tokens, ``sigma_bar`` = noise multiplier / logical batch)
to a loss and knows how to fit its parameters to ``(inputs, loss)`` points. Nothing here reads files,
draws plots or resamples; :mod:`dpllm.scaling.fit` adds validation, R² and the bootstrap.

    power_law   L(N)       = a·N^(−α) + L∞                      (trust-region least squares on loss)
    chinchilla  L(N, D)    = E + A/N^α + B/D^β                  (Huber on log-loss, L-BFGS from a grid)
    dp_noise    L(N, D, σ̄) = E + A/N^α + B/D^β + C·σ̄^γ          (same method as chinchilla)

Example:
    >>> import numpy as np
    >>> form = get_form("power_law")
    >>> x = {"N": np.array([1e3, 1e4, 1e5, 1e6])}
    >>> y = form.predict({"a": 10.0, "alpha": 0.5, "L_inf": 1.0}, x)
    >>> fitted = form.fit(x, y)
    >>> round(fitted["alpha"], 3), round(fitted["L_inf"], 3)
    (0.5, 1.0)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

Inputs = Mapping[str, np.ndarray]
Params = dict[str, float]

HUBER_DELTA = 1e-3  # Hoffmann et al. (2022): robust to outlier runs, ~L1 beyond 1e-3 in log-loss
MAX_EXPONENT = 5.0


class ScalingError(ValueError):
    """Bad scaling input or an impossible request; the message says what to change."""


@dataclass(frozen=True)
class Form:
    """One registered scaling-law form.

    Attributes:
        name: registry key.
        inputs: input names the form reads, in order (subset of ``N``, ``D``, ``sigma_bar``).
        param_names: fitted parameter names, in report order.
        predict: ``predict(params, inputs) -> loss`` (vectorised over points).
        fit: ``fit(inputs, loss, start=None) -> params``; with ``start`` only that start is refined
            (used by the bootstrap, which starts from the full-data optimum).
        min_distinct: least number of distinct values each input needs for the fit to be identified.
        formula: human-readable formula for reports.
        refit_many: optional ``refit_many(inputs, loss, weight, start) -> (params, solved)``: refits from
            ``start`` for a batch of resamples at once (``loss`` and ``weight`` are (batch, points); params come
            back (batch, parameters) in ``param_names`` order). Rows not ``solved`` are refitted with ``fit``.
    """

    name: str
    inputs: tuple[str, ...]
    param_names: tuple[str, ...]
    predict: Callable[[Mapping[str, float], Inputs], np.ndarray]
    fit: Callable[..., Params]
    min_distinct: Mapping[str, int]
    formula: str
    refit_many: Callable[..., tuple[np.ndarray, np.ndarray]] | None = None


FORMS: dict[str, Form] = {}


def register_form(form: Form) -> Form:
    """Add ``form`` to the registry (a later registration under the same name replaces it)."""
    FORMS[form.name] = form
    return form


def get_form(name: str) -> Form:
    """Look a form up by name.

    Raises:
        ScalingError: if ``name`` is not registered.
    """
    if name not in FORMS:
        raise ScalingError(f"form={name!r} is not known; choose one of {', '.join(sorted(FORMS))}")
    return FORMS[name]


# ---------------------------------------------------------------------------------------- power law
def _power_law_predict(p: Mapping[str, float], x: Inputs) -> np.ndarray:
    logn = np.log(np.asarray(x["N"], dtype=float))
    return p["a"] * np.exp(-p["alpha"] * logn) + p["L_inf"]


def _power_law_fit(x: Inputs, y: np.ndarray, start: Mapping[str, float] | None = None) -> Params:
    logn = np.log(np.asarray(x["N"], dtype=float))
    y = np.asarray(y, dtype=float)
    # Centre log N so the optimiser sees a' = a·N_ref^(−α) of the size of the loss, not a = 1e3..1e9.
    ref = float(logn.mean())
    u = logn - ref

    def resid(t: np.ndarray) -> np.ndarray:
        return t[0] * np.exp(-t[1] * u) + t[2] - y

    def jac(t: np.ndarray) -> np.ndarray:
        e = np.exp(-t[1] * u)
        return np.column_stack([e, -t[0] * u * e, np.ones_like(u)])

    lo, hi = np.array([1e-12, 0.0, 0.0]), np.array([np.inf, MAX_EXPONENT, np.inf])
    if start is not None:
        a0, al0 = start["a"], float(np.clip(start["alpha"], 1e-6, MAX_EXPONENT - 1e-6))
        starts = [(max(a0 * np.exp(-al0 * ref), 1e-9), al0, max(start["L_inf"], 0.0))]
    else:
        spread = max(float(y.max() - y.min()), 1e-6)
        starts = [
            (spread, alpha, linf)
            for alpha in (0.1, 0.3, 0.7, 1.5, 3.0)
            for linf in (0.0, 0.5 * float(y.min()), 0.9 * float(y.min()))
        ]
    from scipy.optimize import least_squares  # imported here: `dpllm scaling --help` need not load scipy

    best = None
    for s in starts:
        sol = least_squares(resid, np.array(s, dtype=float), jac=jac, bounds=(lo, hi), method="trf",
                            x_scale="jac")
        if best is None or sol.cost < best.cost:
            best = sol
    a_ref, alpha, linf = best.x
    return {"a": float(a_ref * np.exp(alpha * ref)), "alpha": float(alpha), "L_inf": float(linf)}


register_form(Form(
    name="power_law", inputs=("N",), param_names=("a", "alpha", "L_inf"),
    predict=_power_law_predict, fit=_power_law_fit, min_distinct={"N": 3},
    formula="L(N) = a·N^(−alpha) + L_inf",
))


# ------------------------------------------------- log-sum-exp forms (chinchilla, dp_noise), Huber fit
# Each term k is exp(c_k − s_k·p_k·log x_k): s = +1 for N and D (loss falls as they grow), s = −1 for σ̄
# (loss rises with noise). The constant term is exp(e). log L̂ = logsumexp(e, terms), as in Hoffmann et al.
_TERMS = {"N": ("A", "alpha", 1.0), "D": ("B", "beta", 1.0), "sigma_bar": ("C", "gamma", -1.0)}


def _lse_predict(p: Mapping[str, float], x: Inputs, inputs: tuple[str, ...]) -> np.ndarray:
    out = np.full(np.shape(x[inputs[0]]), float(p["E"]))
    for name in inputs:
        coef, expo, sign = _TERMS[name]
        v = np.asarray(x[name], dtype=float)
        with np.errstate(divide="ignore"):
            # σ̄ = 0 (non-private) contributes nothing; 0**γ would be nan at γ = 0.
            term = np.where(v > 0, p[coef] * np.exp(-sign * p[expo] * np.log(np.where(v > 0, v, 1.0))), 0.0)
        out = out + term
    return out


def _lse_huber(t, logy, delta):
    """Huber loss of ``logsumexp(t, axis=1) - logy``; returns (loss, clipped residuals, softmax weights of t)."""
    m = t.max(axis=1)
    w = np.exp(t - m[:, None])
    s = w.sum(axis=1)
    r = m + np.log(s) - logy
    w /= s[:, None]
    absr = np.abs(r)
    f = np.where(absr <= delta, 0.5 * r * r, delta * (absr - 0.5 * delta)).sum()
    return f, np.clip(r, -delta, delta), w


def _lse_objective(theta, logx, signs, masks, logy, delta):
    """Huber loss of log-sum-exp residuals and its gradient; theta = [e, c1, p1, c2, p2, ...]."""
    n, k = logy.shape[0], len(logx)
    t = np.empty((n, k + 1))
    t[:, 0] = theta[0]
    for j in range(k):
        t[:, j + 1] = np.where(masks[j], theta[1 + 2 * j] - signs[j] * theta[2 + 2 * j] * logx[j], -np.inf)
    f, dr, w = _lse_huber(t, logy, delta)
    g = np.empty_like(theta)
    g[0] = dr @ w[:, 0]
    for j in range(k):
        g[1 + 2 * j] = dr @ w[:, j + 1]
        g[2 + 2 * j] = dr @ (w[:, j + 1] * -signs[j] * logx[j])
    return f, g


def _grid_objective(grid, logx, signs, masks, logy, delta):
    """Huber objective for every row of ``grid`` at once (cheap screening of starting points)."""
    t = [np.broadcast_to(grid[:, :1], (grid.shape[0], logy.shape[0]))]
    for j in range(len(logx)):
        tj = grid[:, 1 + 2 * j, None] - signs[j] * grid[:, 2 + 2 * j, None] * logx[j][None, :]
        t.append(np.where(masks[j][None, :], tj, -np.inf))
    pred = np.logaddexp.reduce(np.stack(t), axis=0)
    absr = np.abs(pred - logy[None, :])
    return np.where(absr <= delta, 0.5 * absr**2, delta * (absr - 0.5 * delta)).sum(axis=1)


def _lse_fit(x: Inputs, y: np.ndarray, start: Mapping[str, float] | None, inputs: tuple[str, ...],
             n_starts: int = 8) -> Params:
    y = np.asarray(y, dtype=float)
    logy = np.log(y)
    signs, masks, logx, refs = [], [], [], []
    for name in inputs:
        v = np.asarray(x[name], dtype=float)
        mask = v > 0
        lv = np.log(np.where(mask, v, 1.0))
        # Centring log x (per input) decorrelates each coefficient from its exponent; the reported
        # coefficient is converted back to the uncentred a = log A below.
        ref = float(lv[mask].mean())
        signs.append(_TERMS[name][2])
        masks.append(mask)
        logx.append(np.where(mask, lv - ref, 0.0))
        refs.append(ref)

    def to_theta(p: Mapping[str, float]) -> np.ndarray:
        th = [np.log(p["E"])]
        for name, ref, sg in zip(inputs, refs, signs):
            coef, expo, _ = _TERMS[name]
            th += [np.log(p[coef]) - sg * p[expo] * ref, float(np.clip(p[expo], 0.0, MAX_EXPONENT))]
        return np.array(th)

    if start is not None:
        starts = to_theta(start)[None, :]
    else:
        # Grid in centred units: each term starts at a fraction of the mean loss, E below the minimum.
        ybar = float(y.mean())
        e_grid = np.log(float(y.min()) * np.array([0.05, 0.4, 0.8, 0.95]))
        c_grid = np.log(ybar * np.array([0.01, 0.1, 0.3, 1.0]))
        p_grid = {1.0: (0.1, 0.3, 0.6, 1.0, 2.0), -1.0: (0.5, 1.0, 2.0)}
        axes = [e_grid] + [a for sg in signs for a in (c_grid, np.array(p_grid[sg]))]
        grid = np.array(list(itertools.product(*axes)))
        score = np.concatenate([
            _grid_objective(chunk, logx, signs, masks, logy, HUBER_DELTA)
            for chunk in np.array_split(grid, max(1, len(grid) // 4096))
        ])
        starts = grid[np.argsort(score)[:n_starts]]
    bounds = [(None, None)] + [b for _ in inputs for b in ((None, None), (0.0, MAX_EXPONENT))]
    from scipy.optimize import minimize

    best = None
    for th0 in starts:
        sol = minimize(_lse_objective, th0, args=(logx, signs, masks, logy, HUBER_DELTA), jac=True,
                       method="L-BFGS-B", bounds=bounds,
                       # the objective is ~1e-4 in size, so L-BFGS-B's default tolerances stop too early
                       options={"maxiter": 3000, "ftol": 1e-15, "gtol": 1e-12})
        if best is None or sol.fun < best.fun:
            best = sol
    th = best.x
    out: Params = {"E": float(np.exp(th[0]))}
    for j, (name, ref, sg) in enumerate(zip(inputs, refs, signs)):
        coef, expo, _ = _TERMS[name]
        out[coef] = float(np.exp(th[1 + 2 * j] + sg * th[2 + 2 * j] * ref))
        out[expo] = float(th[2 + 2 * j])
    return out


def _lse_refit_many(x: Inputs, y: np.ndarray, weight: np.ndarray, start: Mapping[str, float],
                    inputs: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
    """The bootstrap's refits of :func:`_lse_fit` from ``start``, all at once (:mod:`dpllm.scaling.newton`).

    Same parameters as ``_lse_fit`` (centred the same way, from all points), solved to its optimum by batched
    Newton; returns (batch, params) in ``E, coef, exponent, ...`` order and which rows were solved.
    """
    from dpllm.scaling.newton import newton_many

    n = np.shape(x[inputs[0]])[0]
    n_par = 1 + 2 * len(inputs)
    A = np.zeros((n, len(inputs) + 1, n_par))
    mask = np.ones((n, len(inputs) + 1), bool)
    A[:, 0, 0] = 1.0
    theta0, refs, signs = [np.log(start["E"])], [], []
    for j, name in enumerate(inputs):
        coef, expo, sg = _TERMS[name]
        v = np.asarray(x[name], dtype=float)
        mask[:, j + 1] = v > 0
        lv = np.log(np.where(mask[:, j + 1], v, 1.0))
        ref = float(lv[mask[:, j + 1]].mean())
        A[:, j + 1, 1 + 2 * j] = 1.0
        A[:, j + 1, 2 + 2 * j] = -sg * np.where(mask[:, j + 1], lv - ref, 0.0)
        theta0 += [np.log(start[coef]) - sg * start[expo] * ref, float(np.clip(start[expo], 0.0, MAX_EXPONENT))]
        refs.append(ref)
        signs.append(sg)
    lower = np.array([-np.inf] + [b for _ in inputs for b in (-np.inf, 0.0)])
    upper = np.array([np.inf] + [b for _ in inputs for b in (np.inf, MAX_EXPONENT)])
    weight = np.asarray(weight, dtype=float)
    logy = np.log(np.where(weight > 0, y, 1.0))
    th, solved = newton_many(A, mask, logy, weight, np.array(theta0), lower=lower, upper=upper,
                             delta=HUBER_DELTA)
    out = np.empty_like(th)
    out[:, 0] = np.exp(th[:, 0])
    for j, (ref, sg) in enumerate(zip(refs, signs)):
        out[:, 1 + 2 * j] = np.exp(th[:, 1 + 2 * j] + sg * th[:, 2 + 2 * j] * ref)
        out[:, 2 + 2 * j] = th[:, 2 + 2 * j]
    return out, solved & np.isfinite(out).all(axis=1)


def _lse_form(name: str, inputs: tuple[str, ...], min_distinct: dict[str, int], formula: str) -> Form:
    names = ("E",) + tuple(p for i in inputs for p in _TERMS[i][:2])
    return Form(
        name=name, inputs=inputs, param_names=names,
        predict=lambda p, x: _lse_predict(p, x, inputs),
        fit=lambda x, y, start=None: _lse_fit(x, y, start, inputs),
        min_distinct=min_distinct, formula=formula,
        refit_many=lambda x, y, weight, start: _lse_refit_many(x, y, weight, start, inputs),
    )


register_form(_lse_form("chinchilla", ("N", "D"), {"N": 2, "D": 2}, "L(N, D) = E + A/N^alpha + B/D^beta"))
register_form(_lse_form(
    "dp_noise", ("N", "D", "sigma_bar"), {"N": 2, "D": 2, "sigma_bar": 2},
    "L(N, D, σ̄) = E + A/N^alpha + B/D^beta + C·σ̄^gamma, σ̄ = noise_multiplier / logical_batch_size",
))


# ----------------------------------------------- noise_batch: log-sum-exp of monomials (several inputs)
# A term is exp(c + Σ_j s_j·p_j·log x_j): a coefficient times a product of powers. The single-input terms
# above are the special case of one factor. The noise term below multiplies three inputs, which is why
# this form has its own (small) fitter rather than the one of chinchilla / dp_noise.
#
#   L(N, S, σ̄) = E + A/N^α + B/S^β + C·σ̄^γ·N^κ/S^η
#
# Why this shape (docs/scaling.md has the longer version): DP-SGD adds Gaussian noise of standard deviation
# σ·c/B per coordinate to the averaged clipped gradient, so the noise a step sees is fixed by σ̄ = σ/B
# (McKenna et al. 2025: the noise-batch ratio). Convex DP-SGD theory puts the excess loss from that noise at
# about σ̄·√(d/T) for d parameters after T steps: it grows with the model and averages out over steps.
# The noise term keeps that structure with free exponents (γ, κ, η; theory says 1, ½, ½); E + A/N^α + B/S^β
# is the non-private law in model size and steps at the sweep's batch (σ̄ = 0 drops the noise term).
_MONO_TERMS = {
    "noise_batch": (
        ("A", (("N", "alpha", -1.0),)),
        ("B", (("S", "beta", -1.0),)),
        ("C", (("sigma_bar", "gamma", 1.0), ("N", "kappa", 1.0), ("S", "eta", -1.0))),
    ),
}


def _mono_predict(p: Mapping[str, float], x: Inputs, terms) -> np.ndarray:
    first = terms[0][1][0][0]
    out = np.full(np.shape(x[first]), float(p["E"]))
    for coef, factors in terms:
        active = np.ones(np.shape(out), bool)
        log_t = np.full(np.shape(out), np.log(p[coef]) if p[coef] > 0 else -np.inf)
        for name, expo, sign in factors:
            v = np.asarray(x[name], dtype=float)
            active &= v > 0
            log_t = log_t + sign * p[expo] * np.log(np.where(v > 0, v, 1.0))
        out = out + np.where(active, np.exp(log_t), 0.0)  # σ̄ = 0 (non-private): no noise term
    return out


def _mono_objective(theta, design, masks, logy, delta):
    """Huber loss of log-sum-exp residuals; theta = [e, c_1, p_1..., c_2, p_2..., ...]."""
    n = logy.shape[0]
    t = [np.full(n, theta[0])]
    pos = 1
    slices = []
    for X, mask in zip(design, masks):  # X: (n, k) signed centred log inputs of the term's factors
        k = X.shape[1]
        t.append(np.where(mask, theta[pos] + X @ theta[pos + 1: pos + 1 + k], -np.inf))
        slices.append((pos, k))
        pos += 1 + k
    t = np.column_stack(t)
    f, dr, w = _lse_huber(t, logy, delta)
    g = np.empty_like(theta)
    g[0] = dr @ w[:, 0]
    for j, ((pos, k), X) in enumerate(zip(slices, design)):
        wj = dr * w[:, j + 1]
        g[pos] = wj.sum()
        g[pos + 1: pos + 1 + k] = wj @ X
    return f, g


def _mono_fit(x: Inputs, y: np.ndarray, start: Mapping[str, float] | None, terms, bounds_of,
              n_starts: int = 8) -> Params:
    y = np.asarray(y, dtype=float)
    logy = np.log(y)
    refs = {}
    for name in {f[0] for _, fs in terms for f in fs}:
        v = np.asarray(x[name], dtype=float)
        refs[name] = float(np.log(v[v > 0]).mean()) if (v > 0).any() else 0.0
    design, masks = [], []
    for _, factors in terms:
        mask = np.ones(len(y), bool)
        cols = []
        for name, _, sign in factors:
            v = np.asarray(x[name], dtype=float)
            mask &= v > 0
            cols.append(sign * (np.log(np.where(v > 0, v, 1.0)) - refs[name]))
        design.append(np.column_stack(cols))
        masks.append(mask)

    def to_theta(p: Mapping[str, float]) -> np.ndarray:
        th = [np.log(p["E"])]
        for coef, factors in terms:
            lo_hi = [bounds_of(e) for _, e, _ in factors]
            ps = [float(np.clip(p[e], lo + 1e-9, hi - 1e-9)) for (_, e, _), (lo, hi) in zip(factors, lo_hi)]
            c = np.log(max(p[coef], 1e-300)) + sum(sg * pe * refs[n] for (n, _, sg), pe in zip(factors, ps))
            th += [c] + ps
        return np.array(th)

    bounds = [(None, None)]
    for _, factors in terms:
        bounds += [(None, None)] + [bounds_of(e) for _, e, _ in factors]
    if start is not None:
        starts = to_theta(start)[None, :]
    else:
        ybar = float(y.mean())
        axes = [np.log(float(y.min()) * np.array([0.05, 0.4, 0.8, 0.95]))]
        for _, factors in terms:
            axes.append(np.log(ybar * np.array([0.01, 0.1, 0.3, 1.0])))
            for _, e, _ in factors:
                lo, hi = bounds_of(e)
                axes.append(np.array([v for v in (0.1, 0.3, 0.6, 1.0) if lo <= v <= hi] if len(factors) == 1
                                     else [v for v in (0.25, 0.5, 1.0) if lo <= v <= hi]))
        grid = np.array(list(itertools.product(*axes)))
        score = np.concatenate([_mono_grid(chunk, design, masks, logy)
                                for chunk in np.array_split(grid, max(1, len(grid) // 2048))])
        starts = grid[np.argsort(score)[:n_starts]]
    from scipy.optimize import minimize

    best = None
    for th0 in starts:
        sol = minimize(_mono_objective, th0, args=(design, masks, logy, HUBER_DELTA), jac=True,
                       method="L-BFGS-B", bounds=bounds, options={"maxiter": 3000, "ftol": 1e-15, "gtol": 1e-12})
        if best is None or sol.fun < best.fun:
            best = sol
    th = best.x
    out: Params = {"E": float(np.exp(th[0]))}
    pos = 1
    for coef, factors in terms:
        ps = th[pos + 1: pos + 1 + len(factors)]
        out[coef] = float(np.exp(th[pos] - sum(sg * pe * refs[n] for (n, _, sg), pe in zip(factors, ps))))
        for (_, e, _), pe in zip(factors, ps):
            out[e] = float(pe)
        pos += 1 + len(factors)
    return out


def _mono_grid(grid, design, masks, logy):
    """Huber objective for every row of ``grid`` at once (screening of starting points)."""
    t = [np.broadcast_to(grid[:, :1], (grid.shape[0], logy.shape[0]))]
    pos = 1
    for X, mask in zip(design, masks):
        k = X.shape[1]
        tj = grid[:, pos, None] + grid[:, pos + 1: pos + 1 + k] @ X.T
        t.append(np.where(mask[None, :], tj, -np.inf))
        pos += 1 + k
    pred = np.logaddexp.reduce(np.stack(t), axis=0)
    absr = np.abs(pred - logy[None, :])
    return np.where(absr <= HUBER_DELTA, 0.5 * absr**2, HUBER_DELTA * (absr - 0.5 * HUBER_DELTA)).sum(axis=1)


# κ (how the noise term grows with model size) may come out negative on real data; allow it, within reason.
EXPONENT_BOUNDS = {"kappa": (-2.0, MAX_EXPONENT)}


def exponent_bounds(name: str) -> tuple[float, float]:
    """The (low, high) box an exponent is fitted in (0..5 unless listed in :data:`EXPONENT_BOUNDS`)."""
    return EXPONENT_BOUNDS.get(name, (0.0, MAX_EXPONENT))


def _mono_form(name: str, min_distinct: dict[str, int], formula: str) -> Form:
    terms = _MONO_TERMS[name]
    inputs = tuple(dict.fromkeys(f[0] for _, fs in terms for f in fs))
    names = ("E",) + tuple(p for coef, fs in terms for p in (coef,) + tuple(f[1] for f in fs))
    return Form(name=name, inputs=inputs, param_names=names,
                predict=lambda p, x: _mono_predict(p, x, terms),
                fit=lambda x, y, start=None: _mono_fit(x, y, start, terms, exponent_bounds),
                min_distinct=min_distinct, formula=formula)


register_form(_mono_form(
    "noise_batch", {"N": 2, "S": 2, "sigma_bar": 2},
    "L(N, S, σ̄) = E + A/N^alpha + B/S^beta + C·σ̄^gamma·N^kappa/S^eta, S = optimizer steps, "
    "σ̄ = noise_multiplier / logical_batch_size",
))
