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
from scipy.optimize import least_squares, minimize

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
    """

    name: str
    inputs: tuple[str, ...]
    param_names: tuple[str, ...]
    predict: Callable[[Mapping[str, float], Inputs], np.ndarray]
    fit: Callable[..., Params]
    min_distinct: Mapping[str, int]
    formula: str


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


def _lse_objective(theta, logx, signs, masks, logy, delta):
    """Huber loss of log-sum-exp residuals and its gradient; theta = [e, c1, p1, c2, p2, ...]."""
    n, k = logy.shape[0], len(logx)
    t = np.empty((n, k + 1))
    t[:, 0] = theta[0]
    for j in range(k):
        t[:, j + 1] = np.where(masks[j], theta[1 + 2 * j] - signs[j] * theta[2 + 2 * j] * logx[j], -np.inf)
    m = t.max(axis=1)
    w = np.exp(t - m[:, None])
    s = w.sum(axis=1)
    r = m + np.log(s) - logy
    w /= s[:, None]
    absr = np.abs(r)
    f = np.where(absr <= delta, 0.5 * r * r, delta * (absr - 0.5 * delta)).sum()
    dr = np.clip(r, -delta, delta)
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


def _lse_form(name: str, inputs: tuple[str, ...], min_distinct: dict[str, int], formula: str) -> Form:
    names = ("E",) + tuple(p for i in inputs for p in _TERMS[i][:2])
    return Form(
        name=name, inputs=inputs, param_names=names,
        predict=lambda p, x: _lse_predict(p, x, inputs),
        fit=lambda x, y, start=None: _lse_fit(x, y, start, inputs),
        min_distinct=min_distinct, formula=formula,
    )


register_form(_lse_form("chinchilla", ("N", "D"), {"N": 2, "D": 2}, "L(N, D) = E + A/N^alpha + B/D^beta"))
register_form(_lse_form(
    "dp_noise", ("N", "D", "sigma_bar"), {"N": 2, "D": 2, "sigma_bar": 2},
    "L(N, D, σ̄) = E + A/N^alpha + B/D^beta + C·σ̄^gamma, σ̄ = noise_multiplier / logical_batch_size",
))
