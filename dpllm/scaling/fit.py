"""Fit a registered form to runs: input checks, per-configuration means, R², bootstrap intervals.

A *configuration* is one distinct value of the form's inputs (e.g. ``(N, D)`` for chinchilla); runs
that share one (different seeds) are repeats. The fit is made to the per-configuration mean loss, so
R² is on loss (not log-loss) over configurations. The bootstrap resamples seeds within each
configuration when every configuration is repeated, and runs (then re-averages) otherwise.

The result, :class:`FitResult` (:mod:`dpllm.scaling.result`), carries the fitted law and two intervals,
the CI of the mean and the prediction interval for one new run.

Example:
    >>> import numpy as np
    >>> N = np.geomspace(1e3, 1e6, 8)
    >>> res = fit_form("power_law", N=N, loss=2.0 * N**-0.3 + 0.5, n_boot=50, seed=0)
    >>> round(res.params["alpha"], 3), round(res.r2, 4), res.bootstrap["n_ok"]
    (0.3, 1.0, 50)
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from dpllm.scaling.forms import HUBER_DELTA, Form, ScalingError, exponent_bounds, get_form
from dpllm.scaling.result import MAX_SAMPLES, FitResult, degenerate_reasons, domain_of
from dpllm.scaling.runs import PARAMS_FIELDS, parse_epsilon, runs_to_points

JOINT = "joint"  # the label of a fit over all privacy groups at once (dp_noise, noise_batch)
JOINT_FORMS = ("dp_noise", "noise_batch")
BATCH_POINTS = 250_000  # resamples × configurations refitted at once by a form's refit_many (memory, not speed)


def _check_points(form: Form, x: dict[str, np.ndarray], loss: np.ndarray) -> None:
    n = loss.shape[0]
    for name, v in {**x, "loss": loss}.items():
        if v.shape != (n,):
            raise ScalingError(f"{name} has shape {v.shape}; every input needs one value per run ({n})")
        lower_ok = v >= 0 if name == "sigma_bar" else v > 0
        bad = ~(np.isfinite(v) & lower_ok)
        if bad.any():
            i = int(np.argmax(bad))
            raise ScalingError(f"{name}[{i}]={v[i]!r} must be finite and {'≥ 0' if name == 'sigma_bar' else '> 0'}; "
                               f"drop or fix that run")
    for name, need in form.min_distinct.items():
        vals = np.unique(x[name][x[name] > 0])
        if len(vals) < need:
            what = {"N": "model sizes N", "D": "token counts D", "sigma_bar": "positive noise levels σ̄"}[name]
            hint = ("sweep several ε or batch sizes, or fit chinchilla per ε" if name == "sigma_bar"
                    else "add runs there, or use a form without that input")
            raise ScalingError(f"{form.name} needs runs at ≥ {need} distinct {what}; got {len(vals)} "
                               f"({', '.join(f'{v:g}' for v in vals[:5])}); {hint}")
    n_cfg = len(np.unique(np.column_stack([x[k] for k in form.inputs]), axis=0))
    need = len(form.param_names) + 1  # one residual degree of freedom, or R² = 1 says nothing
    if n_cfg < need:
        raise ScalingError(f"{form.name} has {len(form.param_names)} parameters and needs ≥ {need} distinct "
                           f"configurations of ({', '.join(form.inputs)}); got {n_cfg}. Add runs or use a "
                           f"form with fewer parameters")


def fit_form(form: str, *, loss: Iterable[float], N: Iterable[float], D: Iterable[float] | None = None,
             sigma_bar: Iterable[float] | None = None, S: Iterable[float] | None = None, n_boot: int = 1000,
             seed: int = 0, level: float = 0.95, label: str = "", validate: bool = False) -> FitResult:
    """Fit ``form`` to one loss per run and bootstrap its parameters.

    Args:
        form: registered form name (``power_law``, ``chinchilla``, ``dp_noise``).
        loss: final eval loss per run (nats).
        N, D, sigma_bar, S: inputs per run (S = optimizer steps); those the form does not read are ignored.
        n_boot: bootstrap resamples (0 disables intervals).
        seed: bootstrap RNG seed; the same seed gives the same intervals.
        level: interval coverage (percentile bootstrap).
        label: group name stored on the result.
        validate: run the rolling-origin validation of extrapolation along N
            (:func:`dpllm.scaling.extrapolate.validate`, each fold bootstrapped ``max(20, n_boot // 5)`` times)
            and store it as ``extrapolation``, so intervals beyond the data are widened by it.

    Raises:
        ScalingError: unknown form, missing/non-positive/NaN inputs, too few configurations or distinct
            values for the form's parameters.
    """
    f = get_form(form)
    given = {"N": N, "D": D, "sigma_bar": sigma_bar, "S": S}
    for k in f.inputs:
        if given[k] is None:
            raise ScalingError(f"{form} needs {k}; pass it (runs tables give N, D = tokens_seen, S = steps, σ̄)")
    x = {k: np.asarray(list(given[k]), dtype=float) for k in f.inputs}
    y = np.asarray(list(loss), dtype=float)
    _check_points(f, x, y)

    xc, ymean, inverse, counts = _config_means(f, x, y)
    # Sample std over seeds (0 for a single run); shown as error bars and stored per configuration.
    ss = np.bincount(inverse, weights=(y - ymean[inverse]) ** 2)
    ystd = np.sqrt(ss / np.maximum(counts - 1, 1))
    with _one_blas_thread():
        params = f.fit(xc, ymean)
        samples, method = _bootstrap(f, x, y, xc, inverse, counts, params, n_boot, seed)
    pred = f.predict(params, xc)
    ss_tot = float(((ymean - ymean.mean()) ** 2).sum())
    r2 = 1.0 - float(((ymean - pred) ** 2).sum()) / ss_tot if ss_tot > 0 else float("nan")
    tail = 100 * (1 - level) / 2
    ci = ({p: [float(np.percentile(samples[:, j], tail)), float(np.percentile(samples[:, j], 100 - tail))]
           for j, p in enumerate(f.param_names)} if len(samples) else {})
    residuals = [
        {**{k: float(xc[k][i]) for k in f.inputs}, "loss": float(ymean[i]), "loss_std": float(ystd[i]),
         "runs": int(counts[i]), "pred": float(pred[i]), "residual": float(ymean[i] - pred[i])}
        for i in range(len(ymean))
    ]
    at_bound = [k for k, v in params.items()
                if (k in EXPONENTS and not exponent_bounds(k)[0] + 1e-6 < v < exponent_bounds(k)[1] - 1e-6)
                or (k == "L_inf" and v < 1e-9)]
    scatter = _scatter(np.log(y), inverse, counts, np.log(pred), len(f.param_names))
    keep = np.random.default_rng(seed).permutation(len(samples))[:MAX_SAMPLES] if len(samples) else []
    res = FitResult(form=form, params=params, ci=ci, r2=r2, n_points=len(ymean), n_runs=len(y),
                    residuals=residuals, label=label, at_bound=at_bound,
                    bootstrap={"n_boot": n_boot, "n_ok": len(samples), "seed": seed, "level": level,
                               "method": method},
                    domain=domain_of(xc), samples=[[float(v) for v in samples[i]] for i in sorted(keep)],
                    scatter=scatter)
    res.degenerate = degenerate_reasons(res)
    if validate:
        from dpllm.scaling.extrapolate import validate as validate_extrapolation

        res.extrapolation = validate_extrapolation(form, x, y, fit_form=fit_form, axis="N", level=level,
                                                   n_boot=max(20, n_boot // 5), seed=seed)
    return res


EXPONENTS = ("alpha", "beta", "gamma", "kappa", "eta")


def _scatter(logy: np.ndarray, inverse: np.ndarray, counts: np.ndarray, logpred: np.ndarray, n_par: int) -> dict:
    """Per-run residuals whose spread estimates where a new run lands around the law (on log-loss).

    A run's residual is its deviation from its configuration's mean, w, plus that mean's deviation from the
    law, b. A new run carries seed noise σ² and the law's misfit m². Over configurations with r seeds,
    E w² = σ²(1 − 1/r) and E b² ≈ (σ²/r + m²)(n − p)/n (p parameters fitted to n means), so
    w + b·√(n/(n − p)) has variance σ² + m²: no correction is needed on w, only on b.
    """
    n_cfg = len(counts)
    cfg_mean = np.bincount(inverse, weights=logy) / counts
    within, between = logy - cfg_mean[inverse], cfg_mean - logpred
    inflation = float(np.sqrt(n_cfg / max(n_cfg - n_par, 1)))
    return {"log_residuals": [float(v) for v in within + inflation * between[inverse]], "inflation": 1.0,
            "between_inflation": inflation,
            "what": "per run: log(loss) − its configuration's mean log-loss, plus that mean's log residual × "
                    "√(n/(n−p)); prediction intervals resample these around bootstrap laws"}


def _config_means(f: Form, x: Mapping[str, np.ndarray], y: np.ndarray):
    """Distinct configurations of the form's inputs, their mean loss, each run's config, run counts."""
    cfg, inverse, counts = np.unique(np.column_stack([x[k] for k in f.inputs]), axis=0,
                                     return_inverse=True, return_counts=True)
    inverse = inverse.ravel()
    return ({k: cfg[:, i] for i, k in enumerate(f.inputs)}, np.bincount(inverse, weights=y) / counts,
            inverse, counts)


def _one_blas_thread():
    """Limit BLAS to one thread: the fits are tiny, and threads that spin-wait slow them 3-4× when the
    machine is shared (a sweep training beside the fit). No-op without threadpoolctl."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return contextlib.nullcontext()
    # threadpoolctl limits only the libraries loaded when the limit is set: load scipy's BLAS first (the
    # forms import scipy lazily, inside the limit, where its own OpenBLAS escaped it: 6× the CPU time).
    import scipy.optimize  # noqa: F401
    return threadpool_limits(limits=1, user_api="blas")


def _bootstrap(f: Form, x, y, xc, inverse, counts, params, n_boot: int, seed: int) -> tuple[np.ndarray, str]:
    rng = np.random.default_rng(seed)
    if n_boot <= 0:
        return np.empty((0, len(f.param_names))), "none"
    n_cfg = len(counts)
    if counts.min() > 1:
        # Every configuration repeated: keep them all, resample each one's seeds (seed-to-seed noise).
        # Deviations from the configuration mean are scaled by √(n/(n−1)): resampling n seeds otherwise
        # gives the mean a variance (n−1)/n too small (half with 2 seeds; ~85% coverage at 95% seen).
        method = "seeds within configuration (deviations scaled by sqrt(n/(n-1)))"
        mean = np.bincount(inverse, weights=y) / counts
        scale = np.sqrt(counts / np.maximum(counts - 1, 1))[inverse]
        y_adj = mean[inverse] + scale * (y - mean[inverse])
        members = [np.flatnonzero(inverse == c) for c in range(n_cfg)]
        ymeans = np.column_stack([y_adj[m[rng.integers(0, len(m), size=(n_boot, len(m)))]].mean(axis=1)
                                  for m in members])
        present = np.ones((n_boot, n_cfg), bool)
    else:
        # Some configuration has a single run, so its seed noise is unknown: resample runs instead
        # (with one run per configuration this is resampling configurations) and re-average. Each resample's
        # configuration means are summed in the resample's order, as _config_means sums them.
        method = "runs"
        n = len(y)
        idx = rng.integers(0, n, size=(n_boot, n))
        flat = (inverse[idx] + n_cfg * np.arange(n_boot)[:, None]).ravel()
        hits = np.bincount(flat, minlength=n_boot * n_cfg).reshape(n_boot, n_cfg)
        sums = np.bincount(flat, weights=y[idx].ravel(), minlength=n_boot * n_cfg).reshape(n_boot, n_cfg)
        present = hits > 0
        ymeans = np.where(present, sums / np.maximum(hits, 1), 1.0)
    identified = _identified_rows(f, xc, present)
    samples = np.full((n_boot, len(f.param_names)), np.nan)
    solved = np.zeros(n_boot, bool)
    if f.refit_many is not None and identified.any():
        # All resamples at once (batched Newton from the full-data optimum); the few it leaves unsolved
        # (an optimum on a bound, no convergence) are refitted one by one below, as every one was before.
        # In chunks of ~250k resample-points: the batch holds a few (points × params) arrays per resample.
        todo = np.flatnonzero(identified)
        for rows in np.array_split(todo, -(-len(todo) * n_cfg // BATCH_POINTS)):
            got, ok = f.refit_many(xc, ymeans[rows], present[rows].astype(float), params)
            samples[rows[ok]], solved[rows[ok]] = got[ok], True
    # From the full-data optimum, as every refit was before the batched one: starting where Newton stopped (after 60
    # iterations) saved ~30% of these L-BFGS-B iterations on tests/test_scaling_intervals.py's sweeps, but in a flat
    # valley (E towards 0, the other terms taking its place) it ended 22 of 360 resamples elsewhere along the valley
    # (the same objective to 1e-12, parameters far apart): samples that depend on Newton's path, not the reference's.
    # Not done (2026-11-29).
    for i in _progress(np.flatnonzero(identified & ~solved), f.name):
        p = _refit(f, {k: v[present[i]] for k, v in xc.items()}, ymeans[i, present[i]], params)
        if p is not None:
            samples[i], solved[i] = [p[k] for k in f.param_names], True
    if solved.sum() < 0.9 * n_boot:
        warnings.warn(f"{f.name}: only {int(solved.sum())}/{n_boot} bootstrap resamples could be fitted; the "
                      f"interval is from those", stacklevel=2)
    return samples[solved], method


def _identified_rows(f: Form, xc: Mapping[str, np.ndarray], present: np.ndarray) -> np.ndarray:
    """Per resample (a row of ``present``, the configurations it drew), whether it still pins every
    parameter down: enough configurations and distinct positive values of each input. Others are skipped."""
    ok = present.sum(axis=1) >= len(f.param_names)
    for k, need in f.min_distinct.items():
        values, which = np.unique(xc[k], return_inverse=True)
        onehot = np.zeros((len(xc[k]), len(values)))
        onehot[np.arange(len(xc[k])), which.ravel()] = 1.0
        drawn = (present.astype(float) @ onehot) > 0
        ok &= (drawn & (values > 0)).sum(axis=1) >= need
    return ok


def _progress(rows, name: str):
    """A progress bar over the bootstrap's resamples, shown on a terminal once it has run 2 s (tqdm's delay)."""
    from tqdm.auto import tqdm

    return tqdm(rows, desc=f"{name} bootstrap", unit="refit", delay=2.0, leave=False, disable=None)


def _refit(f: Form, x, y, start) -> dict | None:
    # Starting at the full-data optimum keeps each refit to one local search (fast, 1000× per fit).
    try:
        p = f.fit(x, y, start=start)
    except (ValueError, FloatingPointError, np.linalg.LinAlgError):
        return None
    return p if all(np.isfinite(v) for v in p.values()) else None


def _span(v: np.ndarray) -> list[float] | None:
    v = v[np.isfinite(v)]
    return [float(v.min()), float(v.max())] if len(v) else None


def summarise_groups(points: Mapping[str, np.ndarray]) -> dict[str, dict]:
    """Per privacy group: run count, ranges of N and D, distinct σ̄ and seeds (for fit.json).

    Inputs a table did not give (steps, batch for a chinchilla fit from a CSV) are ``None`` / empty."""
    out = {}
    for g in sorted(set(points["group"])):
        m = points["group"] == g
        finite = {k: points[k][m][np.isfinite(points[k][m])] for k in ("D", "S", "B", "sigma_bar")}
        out[g] = {"n_runs": int(m.sum()),
                  "N": _span(points["N"][m]), "D": _span(points["D"][m]),
                  "sigma_bar": sorted({float(s) for s in finite["sigma_bar"]}),
                  "n_distinct_N": int(len(np.unique(points["N"][m]))),
                  "n_distinct_D": int(len(np.unique(finite["D"]))),
                  "S": _span(points["S"][m]),
                  "logical_batch_size": sorted({float(b) for b in finite["B"]})}
    return out


def fit_runs(rows: Iterable[Mapping[str, Any]], *, form: str, params: str = "trainable",
             epsilon: str | float | None = None, n_boot: int = 1000, seed: int = 0, validate: bool = True) -> dict:
    """Fit ``form`` to a runs table and return the ``fit.json`` document.

    ``power_law`` and ``chinchilla`` are fitted once per privacy group (non-private, and each ε rounded
    to 2 significant figures); ``dp_noise`` is fitted once over all groups (``fits["joint"]``).
    A group too small for its form is listed under ``skipped`` with the reason.

    Args:
        rows: runs-table rows (:func:`dpllm.scaling.runs.load_runs`).
        form: registered form name.
        params: ``"trainable"`` or ``"total"`` parameter count as N.
        epsilon: keep only this group (``8``, ``"inf"`` for non-private); ``None`` keeps all.
        n_boot, seed: bootstrap resamples and RNG seed.
        validate: validate extrapolation by rolling origin along N and widen intervals beyond the data by it
            (``fit_form(validate=True)``).

    Raises:
        ScalingError: bad form/params/epsilon, bad values, or no group could be fitted.
    """
    f = get_form(form)
    group = parse_epsilon(epsilon)
    rows = list(rows)
    points = runs_to_points(rows, params=params, group=group, inputs=f.inputs)
    groups = [JOINT] if form in JOINT_FORMS else sorted(set(points["group"]))
    fits, skipped = {}, {}
    for g in groups:
        m = np.ones(len(points["loss"]), bool) if g == JOINT else points["group"] == g
        try:
            fits[g] = fit_form(form, loss=points["loss"][m], N=points["N"][m], D=points["D"][m],
                               sigma_bar=points["sigma_bar"][m], S=points["S"][m], n_boot=n_boot, seed=seed, label=g,
                               validate=validate).to_dict()
        except ScalingError as err:
            if len(groups) == 1:
                raise
            skipped[g] = str(err)
    if not fits:
        raise ScalingError("no group could be fitted: " + "; ".join(f"{g}: {e}" for g, e in skipped.items()))
    return {
        "form": form, "formula": f.formula, "huber_delta": HUBER_DELTA if form != "power_law" else None,
        "filter": {"epsilon": group, "params": params, "N_field": PARAMS_FIELDS[params],
                   "grouping": "privacy_enabled=false → non-private; else ε rounded to 2 significant figures"},
        "inputs": {"n_runs": len(points["loss"]), "n_runs_in_file": len(rows),
                   "groups": summarise_groups(points),
                   # tokens per record actually trained on (tokens_seen / (steps · logical batch)): what a
                   # plan needs to turn (N, B, S) into compute 6·N·B·S·tokens_per_record
                   "tokens_per_record": _tokens_per_record(points)},
        "bootstrap": {"n_boot": n_boot, "seed": seed, "level": 0.95},
        "fits": fits, "skipped": skipped,
    }


def _tokens_per_record(points: Mapping[str, np.ndarray]) -> float | None:
    ratio = points["D"] / (points["S"] * points["B"])
    ratio = ratio[np.isfinite(ratio)]
    return float(np.median(ratio)) if len(ratio) else None  # a table without steps or batch size


def write_fit(doc: Mapping[str, Any], path: str | os.PathLike) -> Path:
    """Write ``doc`` as JSON via a temp file and rename, so a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def load_fit(path: str | os.PathLike) -> dict:
    """Read a ``fit.json``, or a published law named ``published:NAME`` (:mod:`dpllm.scaling.published`).

    Raises:
        ScalingError: the file is missing or not a fit document, or no such published law.
    """
    from dpllm.scaling.published import is_published, published_doc

    if is_published(path):
        return published_doc(str(path))
    path = Path(path)
    if not path.is_file():
        raise ScalingError(f"fit file {path} does not exist; run `dpllm scaling fit` first")
    doc = json.loads(path.read_text())
    if not isinstance(doc, dict) or "fits" not in doc:
        raise ScalingError(f"{path} is not a dpllm scaling fit (no 'fits' key)")
    return doc


__all__ = ["FitResult", "JOINT", "JOINT_FORMS", "degenerate_reasons", "domain_of", "fit_form", "fit_runs", "load_fit",
           "summarise_groups", "write_fit"]
