"""The result of a scaling-law fit: the law, its bootstrap samples and residuals, and what they predict.

Two intervals answer two questions, and every printed one says which it is:

- **95% CI of the mean** (:meth:`FitResult.confidence_interval`): where the law itself (the mean loss over
  seeds at N, D, ...) lies, from the bootstrap parameter vectors alone. It narrows as runs are added.
- **95% prediction interval** (:meth:`FitResult.prediction_interval`): where one new run will land. Each
  draw is a bootstrap law plus one resampled residual of a fitted run (on log-loss; the part of it that is
  the configuration mean's misfit is inflated by √(n/(n−p)) for the p fitted parameters, see
  ``dpllm.scaling.fit._scatter``), so it carries the scatter of runs around the law as well as the
  uncertainty in the law. It does not narrow below that scatter. Beyond the fitted data it is widened by the error of
  extrapolating that :func:`dpllm.scaling.extrapolate.validate` measured on the sweep itself (rolling origin:
  fit the smaller sizes, predict the larger); ``fit_runs`` validates every fit, ``fit_form(validate=True)`` too.

Written by :mod:`dpllm.scaling.fit` (a fit to your runs) and :mod:`dpllm.scaling.published` (a published law as
a prior); read back from ``fit.json`` by :meth:`FitResult.from_dict`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

import numpy as np

from dpllm.scaling.extrapolate import compute_range, distance_beyond, effective_distance, z_of
from dpllm.scaling.extrapolate import widen as widen_interval
from dpllm.scaling.forms import ScalingError, get_form


@dataclass
class FitResult:
    """One fitted curve.

    Attributes:
        form: registry name of the form.
        params: fitted parameters (natural units, e.g. ``A`` not ``log A``).
        ci: ``{name: [low, high]}`` bootstrap percentile interval at ``bootstrap["level"]``.
        r2: coefficient of determination on loss over configuration means.
        n_points: number of configurations fitted; ``n_runs`` the runs behind them.
        residuals: per configuration: inputs, mean loss, std over seeds, runs, prediction, residual.
        bootstrap: ``{n_boot, n_ok, seed, level, method}``.
        label: privacy group (``"eps=8"``, ``"non-private"``) or ``"joint"``.
        at_bound: parameters the optimiser left on a bound (an exponent at 0 or 5, L∞ at 0): the data do
            not pin them down, so neither the value nor plans built on it mean much.
        domain: ``{input: [min, max]}`` over the fitted configurations (σ̄ over its positive values): the
            range a plan may use without extrapolating.
        samples: up to :data:`MAX_SAMPLES` bootstrap parameter vectors (in ``param_names`` order), for
            prediction intervals.
        degenerate: reasons the fit should not be planned with (see :func:`degenerate_reasons`).
        scatter: the runs' scatter around the law, for prediction intervals: ``{"log_residuals": [one per
            run, see :func:`_scatter`], "inflation": factor applied when drawing, "what": ...}``; empty for a
            published prior.
        prior: empty for a fit to your runs; for a published law (:mod:`dpllm.scaling.published`) its name,
            source and caveats: the law was fitted to someone else's data.
        extrapolation: the rolling-origin validation of extrapolation and the widening it calibrated
            (:func:`dpllm.scaling.extrapolate.validate`); empty when the fit was not validated.
    """

    form: str
    params: dict[str, float]
    ci: dict[str, list[float]]
    r2: float
    n_points: int
    n_runs: int
    residuals: list[dict] = field(default_factory=list)
    bootstrap: dict = field(default_factory=dict)
    label: str = ""
    at_bound: list[str] = field(default_factory=list)
    domain: dict[str, list[float]] = field(default_factory=dict)
    samples: list[list[float]] = field(default_factory=list)
    degenerate: list[str] = field(default_factory=list)
    scatter: dict = field(default_factory=dict)
    prior: dict = field(default_factory=dict)
    extrapolation: dict = field(default_factory=dict)

    def predict(self, **inputs: Any) -> np.ndarray:
        """Predicted loss at ``N=..., D=..., sigma_bar=...`` (whichever the form reads)."""
        form = get_form(self.form)
        missing = [k for k in form.inputs if k not in inputs]
        if missing:
            raise ScalingError(f"{self.form} needs {', '.join(missing)} to predict")
        return form.predict(self.params, {k: np.asarray(inputs[k], dtype=float) for k in form.inputs})

    def to_dict(self) -> dict:
        d = asdict(self)
        d["formula"] = get_form(self.form).formula
        d["r2_on"] = "loss, per-configuration means"
        d["ci_is"] = "percentile bootstrap interval of each parameter" if not self.prior else "as published"
        return d

    def _inputs(self, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        form = get_form(self.form)
        missing = [k for k in form.inputs if k not in inputs]
        if missing:
            raise ScalingError(f"{self.form} needs {', '.join(missing)} to predict")
        arrays = np.broadcast_arrays(*(np.asarray(inputs[k], dtype=float) for k in form.inputs))
        return dict(zip(form.inputs, arrays))

    def _sample_preds(self, x: Mapping[str, np.ndarray]) -> np.ndarray:
        """The law at ``x`` under each stored bootstrap parameter vector, shape (samples, *x)."""
        form = get_form(self.form)
        return np.array([form.predict(dict(zip(form.param_names, s)), x) for s in self.samples])

    def confidence_interval(self, level: float = 0.95, **inputs: Any) -> tuple[np.ndarray, np.ndarray]:
        """Percentile interval of the law's value (the mean loss over seeds) at ``inputs``, from the stored
        bootstrap parameter vectors: the **CI of the mean**, not where one run will land; widened to hold the fitted
        law's own value where the samples' percentiles leave it out. nan without samples."""
        x = self._inputs(inputs)
        if not self.samples:
            nan = np.full(np.shape(next(iter(x.values()))), np.nan)
            return nan, nan
        preds = self._sample_preds(x)
        tail = 100 * (1 - level) / 2
        center = get_form(self.form).predict(self.params, x)
        # a thin or skewed bootstrap can leave the fitted law's own value outside its samples' percentiles
        lo, hi = np.percentile(preds, tail, axis=0), np.percentile(preds, 100 - tail, axis=0)
        return np.minimum(lo, center), np.maximum(hi, center)

    def beyond(self, **inputs: Any) -> tuple[np.ndarray, np.ndarray]:
        """How far ``inputs`` lie beyond the fitted data: ``(factor, input)`` per point, factor 1 and input ""
        inside; e.g. ``(3.2, "N")`` for a model 3.2× the largest fitted one (:func:`extrapolate.distance_beyond`,
        compute 6·N·D included)."""
        dist, name = distance_beyond(self.domain, self._inputs(inputs), compute_range(self.residuals))
        return np.exp(dist), name

    def prediction_interval(self, level: float = 0.95, *, widen: bool = True,
                            **inputs: Any) -> tuple[np.ndarray, np.ndarray]:
        """Interval that holds a new run's loss at ``inputs`` with probability ``level``.

        Draws ``log L = log law_b(x) + c·r_j`` over bootstrap laws b (the fitted law alone when the fit has no
        bootstrap samples) and the runs' residuals r_j (:func:`_scatter`; c = ``scatter["inflation"]``, 1 for
        fits written by this version), and takes percentiles. The interval is never narrower than the fitted law's
        own band (its value plus those residuals' percentiles) and always holds the law's prediction: with few
        bootstrap samples, or parameters on a bound, every bootstrap law can fall on one side of the fitted one
        (seen: 5 samples, 9 parameters, 16 runs, 2x beyond the largest fitted N: a prediction above its interval).
        Every (b, j) pair is used when there are at most :data:`MAX_PAIRS`, else that many seeded draws,
        so the interval is reproducible. nan when the fit stores no residuals (a published prior).

        Beyond the fitted data, when the fit carries a calibrated ``extrapolation`` record and ``widen`` is true,
        the interval is widened for the error of extrapolating (:func:`dpllm.scaling.extrapolate.widen`: an extra
        sd of ``kappa`` per e-fold beyond the data, in quadrature); inside the data it is unchanged.
        """
        x = self._inputs(inputs)
        shape = np.shape(next(iter(x.values())))
        r = np.asarray(self.scatter.get("log_residuals", []), dtype=float) * float(self.scatter.get("inflation", 1.0))
        if not len(r):
            nan = np.full(shape, np.nan)
            return nan, nan
        form = get_form(self.form)
        logp = np.log(self._sample_preds(x) if self.samples else form.predict(self.params, x)[None])
        n_b, n_r = len(logp), len(r)
        if n_b * n_r <= MAX_PAIRS:
            bi, ri = np.repeat(np.arange(n_b), n_r), np.tile(np.arange(n_r), n_b)
        else:
            rng = np.random.default_rng(0)
            bi, ri = rng.integers(0, n_b, MAX_PAIRS), rng.integers(0, n_r, MAX_PAIRS)
        tail = 100 * (1 - level) / 2
        center = np.log(form.predict(self.params, x)).reshape(-1)
        own_lo, own_hi = center + np.percentile(r, tail), center + np.percentile(r, 100 - tail)
        flat_p = logp.reshape(n_b, -1)
        lo, hi = np.empty(flat_p.shape[1]), np.empty(flat_p.shape[1])
        for start in range(0, flat_p.shape[1], 64):  # chunks keep (pairs × points) small for plot grids
            draws = flat_p[bi, start:start + 64] + r[ri, None]
            lo[start:start + 64], hi[start:start + 64] = np.percentile(draws, [tail, 100 - tail], axis=0)
        lo, hi = np.minimum.reduce([lo, own_lo, center]), np.maximum.reduce([hi, own_hi, center])
        kappa = self.extrapolation.get("kappa")
        if widen and kappa:
            crange = compute_range(self.residuals)
            dist, name = distance_beyond(self.domain, x, crange)
            dist = effective_distance(dist, name, self.domain, crange)
            lo, hi = widen_interval(center, lo, hi, distance=dist.reshape(-1), kappa=kappa, z=z_of(level))
        return np.exp(lo).reshape(shape), np.exp(hi).reshape(shape)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "FitResult":
        fit = cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})
        if not fit.domain and fit.residuals:  # fit.json written before domains were stored
            fit.domain = domain_of({k: np.array([r[k] for r in fit.residuals]) for k in get_form(fit.form).inputs})
        if not fit.scatter and not fit.prior and all(r.get("pred", 0) > 0 for r in fit.residuals or [{}]):
            # fit.json written before per-run residuals were stored: the configuration means' residuals
            # (narrower than per-run scatter when seeds were averaged, so the interval is a little short).
            logr = [math.log(r["loss"] / r["pred"]) for r in fit.residuals]
            n, p = len(logr), len(get_form(fit.form).param_names)
            fit.scatter = {"log_residuals": logr, "inflation": math.sqrt(n / max(n - p, 1)),
                           "what": "configuration means' log residuals (older fit.json without per-run ones)"}
        # Re-judged on load, so fits written by older versions are flagged too.
        fit.degenerate = degenerate_reasons(fit)
        return fit


MAX_SAMPLES = 200
MAX_PAIRS = 20_000  # (bootstrap law, residual) pairs drawn per prediction interval
# A coefficient this far below the smallest loss contributes nothing anywhere in the data: the optimiser
# pushed it to zero, so the term (or the floor E) is not identified.
NEGLIGIBLE = 1e-6
MIN_R2 = 0.9


def domain_of(x: Mapping[str, np.ndarray]) -> dict[str, list[float]]:
    """``{input: [min, max]}``; σ̄ over its positive values (σ̄ = 0 is the non-private edge, always in range)."""
    out = {}
    for k, v in x.items():
        v = np.asarray(v, dtype=float)
        v = v[v > 0] if k == "sigma_bar" else v
        if len(v):
            out[k] = [float(v.min()), float(v.max())]
    return out


def degenerate_reasons(fit: "FitResult") -> list[str]:
    """Why a fit cannot be trusted to plan: exponents on their bounds, coefficients pushed to ~0,
    zero-width intervals, failed bootstraps, or a poor R². Empty when none applies."""
    out = []
    for k in fit.at_bound:
        out.append(f"{k}={fit.params.get(k, float('nan')):.3g} is on its bound (not determined by the data)")
    losses = [r["loss"] for r in fit.residuals] or [1.0]
    scale = min(losses)
    for k, v in fit.params.items():
        if k in ("E", "A", "B", "C", "a", "L_inf") and v < NEGLIGIBLE * scale:
            out.append(f"{k}={v:.3g} is negligible next to the losses (≥ {scale:.3g}): that term is not identified")
    for k, (lo, hi) in fit.ci.items():
        v = fit.params.get(k, 0.0)
        if hi - lo <= 1e-9 * max(abs(v), 1e-300) and fit.bootstrap.get("n_ok", 0) > 1:
            out.append(f"{k} has a zero-width interval [{lo:.3g}, {hi:.3g}]: every resample gave the same value")
    boot = fit.bootstrap or {}
    if boot.get("n_boot") and boot.get("n_ok", 0) < 0.9 * boot["n_boot"]:
        out.append(f"only {boot.get('n_ok', 0)}/{boot['n_boot']} bootstrap resamples could be fitted")
    if fit.r2 is not None and np.isfinite(fit.r2) and fit.r2 < MIN_R2:
        out.append(f"R²={fit.r2:.3f} < {MIN_R2} on the fitted points")
    return out
