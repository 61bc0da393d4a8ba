"""Compute-optimal private training from a ``noise_batch`` fit: model size, logical batch, steps and σ.

A candidate is ``(N, B, S)``: N parameters, logical batch B, S optimizer steps. Its compute is
``6·N·B·S·ℓ`` FLOPs (ℓ tokens per record, measured on the sweep) and its noise multiplier σ is calibrated
by :func:`dpllm.privacy.accounting.calibrate_noise` to the privacy budget, at the trainer's sampling rate
``q = 1/⌈records/B⌉`` (:mod:`dpllm.privacy.planning`). The fit then predicts the loss at
``(N, S, σ̄ = σ/B)``; each candidate gets a 95% prediction interval (where a run with that plan will land:
bootstrap laws plus the runs' scatter, ``loss_low``/``loss_high``) and the 95% CI of the law's mean
(bootstrap laws alone, ``mean_low``/``mean_high``).

Two questions:

- :func:`best_for_compute`: the best few candidates within a compute budget (S = ⌊C/(6·N·B·ℓ)⌋).
- :func:`least_compute_for_loss`: the candidate with the least compute whose predicted loss is ≤ a target.

Candidates whose N, S or σ̄ fall outside the fitted range are dropped (and counted); ``extrapolate`` widens
the range by a factor, with a warning. Calibrating σ with the PRV accountant takes seconds per (B, S), so
every candidate is first screened with RDP (an upper bound on the PRV σ at the same budget, hence a
pessimistic loss) and only the best are calibrated with the requested accountant.

Example:
    >>> fit = FitResult(form="noise_batch", params={"E": 1.0, "A": 30.0, "alpha": 0.3, "B": 5.0, "beta": 0.4,
    ...     "C": 1e3, "gamma": 1.0, "kappa": 0.2, "eta": 0.5}, ci={}, r2=1.0, n_points=0, n_runs=0,
    ...     domain={"N": [1e6, 1e8], "S": [100, 3000], "sigma_bar": [1e-5, 1e-1]})
    >>> out = best_for_compute(fit, records=50_000, epsilon=8, delta=1e-6, compute=1e15, tokens_per_record=200,
    ...                        sizes=[1e6, 1e7], batches=[256, 1024], accountant="rdp", top=1)
    >>> c = out["candidates"][0]
    >>> c["N"], c["batch"], c["steps"], c["compute"] <= 1e15
    (1000000.0, 1024, 813, True)
"""

from __future__ import annotations

import math
import warnings
from typing import Iterable, Sequence

import numpy as np

from dpllm.privacy.accounting import PrivacyPlanError, calibrate_noise, check_delta
from dpllm.scaling.extrapolate import describe
from dpllm.scaling.fit import FitResult
from dpllm.scaling.forms import ScalingError
from dpllm.scaling.plan import (
    FLOPS_PER_PARAM_TOKEN,
    UnreachableTargetError,
    check_fit_usable,
    check_in_domain,
)

SCREEN_ACCOUNTANT = "rdp"
SCREEN_TOLERANCE = 0.05  # ε tolerance of the screening calibration; the final one uses the accountant's default
GRID_POINTS = 9


class SigmaTable:
    """σ for ``(batch, steps)`` at one (records, ε, δ), calibrated once per accountant and cached."""

    def __init__(self, *, records: int, epsilon: float, delta: float):
        check_delta(delta, records)
        if not epsilon > 0:
            raise ScalingError(f"epsilon={epsilon} must be positive")
        self.records, self.epsilon, self.delta = int(records), float(epsilon), float(delta)
        self._cache: dict[tuple, float] = {}

    def sample_rate(self, batch: int) -> float:
        """The trainer's Poisson rate: one of ⌈records/B⌉ batches per epoch."""
        return 1.0 / math.ceil(self.records / batch)

    def sigma(self, batch: int, steps: int, accountant: str, tolerance: float = 0.01) -> float:
        key = (batch, steps, accountant, tolerance)
        if key not in self._cache:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # Opacus's RDP order notes: not for the planner's user
                try:
                    self._cache[key] = calibrate_noise(target_epsilon=self.epsilon, delta=self.delta,
                                                       sample_rate=self.sample_rate(batch), steps=steps,
                                                       accountant=accountant, epsilon_tolerance=tolerance)
                except PrivacyPlanError:
                    self._cache[key] = math.inf  # unreachable budget: the candidate is dropped
        return self._cache[key]


def _grid(lo: float, hi: float, n: int = GRID_POINTS) -> list[float]:
    return [float(v) for v in np.geomspace(lo, hi, n)] if hi > lo else [float(lo)]


def default_sizes(fit: FitResult, extrapolate: float = 1.0) -> list[float]:
    """Log-spaced model sizes across the fitted N range (widened by ``extrapolate``)."""
    lo, hi = fit.domain["N"]
    return _grid(lo / extrapolate, hi * extrapolate)


def default_batches(records: int, smallest: int = 16) -> list[int]:
    """Powers of two from ``smallest`` up to the number of records (and the records themselves)."""
    out = [2**k for k in range(int(math.log2(smallest)), int(math.log2(records)) + 1)]
    return out + ([records] if records not in out else [])


def _in_domain(fit: FitResult, extrapolate: float, **values: float) -> bool:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            check_in_domain(fit, extrapolate=extrapolate, **values)
        return True
    except ScalingError:
        return False


class _Planner:
    def __init__(self, fit: FitResult, *, records: int, epsilon: float, delta: float, tokens_per_record: float,
                 accountant: str, extrapolate: float, force: bool):
        if fit.form != "noise_batch":
            raise ScalingError(f"DP planning needs a noise_batch fit (loss in N, steps and σ̄); this one is "
                               f"{fit.form}: refit with `dpllm scaling fit --form noise_batch`")
        for k in ("N", "S", "sigma_bar"):
            if k not in fit.domain:
                raise ScalingError(f"the fit has no fitted range for {k}; refit it with this version of dpllm")
        check_fit_usable(fit, force=force)
        if not tokens_per_record > 0:
            raise ScalingError(f"tokens_per_record={tokens_per_record} must be positive")
        self.fit, self.ell, self.accountant, self.x = fit, float(tokens_per_record), accountant, float(extrapolate)
        self.table = SigmaTable(records=records, epsilon=epsilon, delta=delta)
        self.dropped = {"steps outside fitted range": 0, "σ̄ outside fitted range": 0, "budget unreachable": 0}

    def candidate(self, n: float, b: int, s: int, accountant: str, tolerance: float) -> dict | None:
        if not _in_domain(self.fit, self.x, S=s):
            self.dropped["steps outside fitted range"] += 1
            return None
        sigma = self.table.sigma(b, s, accountant, tolerance)
        if not math.isfinite(sigma):
            self.dropped["budget unreachable"] += 1
            return None
        sb = sigma / b
        if not _in_domain(self.fit, self.x, sigma_bar=sb):
            self.dropped["σ̄ outside fitted range"] += 1
            return None
        loss = float(self.fit.predict(N=n, S=s, sigma_bar=sb))
        return {"N": float(n), "batch": int(b), "steps": int(s), "noise_multiplier": sigma, "sigma_bar": sb,
                "sample_rate": self.table.sample_rate(b), "epochs": s * b / self.table.records,
                "tokens": s * b * self.ell, "compute": FLOPS_PER_PARAM_TOKEN * n * s * b * self.ell,
                "loss": loss, "accountant": accountant}

    def finish(self, screened: list[dict], key, top: int) -> list[dict]:
        """Re-calibrate the best screened candidates with the requested accountant, then rank again."""
        out = []
        for c in sorted(screened, key=key)[: 3 * top]:
            final = self.candidate(c["N"], c["batch"], c["steps"], self.accountant, 0.01)
            if final is not None:
                out.append(final)
        out = sorted(out, key=key)[:top]
        for c in out:
            x = {"N": c["N"], "S": c["steps"], "sigma_bar": c["sigma_bar"]}
            lo, hi = self.fit.prediction_interval(**x)  # where a run with this plan will land
            c["loss_low"], c["loss_high"] = float(lo), float(hi)
            lo, hi = self.fit.confidence_interval(**x)  # where the law's mean lies
            c["mean_low"], c["mean_high"] = float(lo), float(hi)
            c["extrapolated"] = not _in_domain(self.fit, 1.0, N=c["N"], S=c["steps"], sigma_bar=c["sigma_bar"])
            factor, name = self.fit.beyond(**x)  # how far beyond the data; the interval above is widened by it
            c["beyond_factor"], c["beyond_input"] = float(factor), (str(name) or None)
        return out

    def header(self) -> dict:
        t = self.table
        return {"records": t.records, "epsilon": t.epsilon, "delta": t.delta, "accountant": self.accountant,
                "screen_accountant": SCREEN_ACCOUNTANT, "tokens_per_record": self.ell, "extrapolate": self.x,
                "fit_domain": self.fit.domain, "fit_label": self.fit.label, "fit_r2": self.fit.r2,
                "interval_calibration": describe(self.fit.extrapolation)}


def best_for_compute(fit: FitResult, *, records: int, epsilon: float, delta: float, compute: float,
                     tokens_per_record: float, sizes: Sequence[float] | None = None,
                     batches: Iterable[int] | None = None, accountant: str = "prv", top: int = 5,
                     extrapolate: float = 1.0, force: bool = False) -> dict:
    """The ``top`` candidates with the lowest predicted loss within ``compute`` FLOPs at (ε, δ).

    Args:
        fit: a ``noise_batch`` fit (from fit.json via :func:`dpllm.scaling.plan.select_fit`).
        records: private records (the privacy unit); δ must be < 1/records.
        epsilon, delta: the privacy budget.
        compute: FLOPs; each (N, B) trains S = ⌊compute/(6·N·B·ℓ)⌋ steps.
        tokens_per_record: ℓ (fit.json ``inputs.tokens_per_record`` for the sweep's data).
        sizes, batches: the grid (default: 9 sizes across the fitted N range; batches 16, 32, … ≤ records).
        accountant: the accountant the trainer will use (default prv).
        top: how many to return; extrapolate, force: see :func:`dpllm.scaling.plan.check_in_domain`.

    Returns:
        ``{"question", ..., "candidates": [{N, batch, steps, noise_multiplier, sigma_bar, sample_rate, epochs,
        tokens, compute, loss, loss_low, loss_high (95% prediction interval), mean_low, mean_high (95% CI of the
        mean), extrapolated, accountant}], "dropped": {reason: count}}``.

    Raises:
        ScalingError: not a noise_batch fit, bad inputs, or no candidate inside the fitted range.
        DegenerateFitError: a degenerate fit without ``force``.
    """
    if not (compute > 0 and math.isfinite(compute)):
        raise ScalingError(f"compute={compute} must be a finite positive number of FLOPs")
    pl = _Planner(fit, records=records, epsilon=epsilon, delta=delta, tokens_per_record=tokens_per_record,
                  accountant=accountant, extrapolate=extrapolate, force=force)
    sizes = list(sizes) if sizes is not None else default_sizes(fit, extrapolate)
    batches = [int(b) for b in (batches if batches is not None else default_batches(records)) if 0 < b <= records]
    screened = []
    for n in sizes:
        for b in batches:
            s = int(compute // (FLOPS_PER_PARAM_TOKEN * n * b * pl.ell))
            if s < 1:
                continue
            c = pl.candidate(n, b, s, SCREEN_ACCOUNTANT, SCREEN_TOLERANCE)
            if c is not None:
                screened.append(c)
    if not screened:
        raise ScalingError(f"no (N, B, S) within compute={compute:.3g} FLOPs falls inside the fitted range "
                           f"{_fmt_domain(fit)} (dropped: {_fmt_dropped(pl.dropped)}); change the compute, or "
                           f"allow --extrapolate")
    best = pl.finish(screened, key=lambda c: c["loss"], top=top)
    return {"question": "lowest predicted loss within the compute", "compute": float(compute), **pl.header(),
            "candidates": best, "screened": len(screened), "dropped": pl.dropped}


def least_compute_for_loss(fit: FitResult, *, records: int, epsilon: float, delta: float, target_loss: float,
                           tokens_per_record: float, sizes: Sequence[float] | None = None,
                           batches: Iterable[int] | None = None, steps: Sequence[int] | None = None,
                           accountant: str = "prv", top: int = 5, extrapolate: float = 1.0,
                           force: bool = False) -> dict:
    """The candidates with the least compute whose predicted loss is ≤ ``target_loss`` at (ε, δ).

    The search is over a grid (sizes × batches × steps, by default 9 log-spaced steps across the fitted
    range), so the answer is the least compute *on that grid*; refine the grid around it for more.

    Raises:
        UnreachableTargetError: no candidate in the fitted range reaches the target (the best is named).
        ScalingError, DegenerateFitError: as :func:`best_for_compute`.
    """
    pl = _Planner(fit, records=records, epsilon=epsilon, delta=delta, tokens_per_record=tokens_per_record,
                  accountant=accountant, extrapolate=extrapolate, force=force)
    sizes = list(sizes) if sizes is not None else default_sizes(fit, extrapolate)
    batches = [int(b) for b in (batches if batches is not None else default_batches(records)) if 0 < b <= records]
    if steps is None:
        lo, hi = fit.domain["S"]
        steps = sorted({max(1, int(round(v))) for v in _grid(lo / extrapolate, hi * extrapolate)})
    screened = []
    for b in batches:
        for s in steps:
            for n in sizes:
                c = pl.candidate(n, b, int(s), SCREEN_ACCOUNTANT, SCREEN_TOLERANCE)
                if c is not None:
                    screened.append(c)
    if not screened:
        raise ScalingError(f"no (N, B, S) on the grid falls inside the fitted range {_fmt_domain(fit)} "
                           f"(dropped: {_fmt_dropped(pl.dropped)}); allow --extrapolate")
    reach = [c for c in screened if c["loss"] <= target_loss]
    # The final accountant's σ is at most the screening σ, so a screened candidate that reaches the target
    # still reaches it after re-calibration; candidates just above it may too, so they are re-checked as well.
    near = [c for c in screened if c["loss"] <= target_loss + 0.01 * abs(target_loss)]
    if not near:
        best = min(screened, key=lambda c: c["loss"])
        raise UnreachableTargetError(
            f"target loss {target_loss:.4f} is not reached by any candidate inside the fitted range; the best is "
            f"{best['loss']:.4f} at N={best['N']:.3g}, B={best['batch']}, S={best['steps']} "
            f"(compute {best['compute']:.3g} FLOPs); raise the target, the budget ε, or the records")
    final = [c for c in pl.finish(reach or near, key=lambda c: c["compute"], top=3 * top) if c["loss"] <= target_loss]
    if not final:
        raise UnreachableTargetError(f"target loss {target_loss:.4f}: candidates reached it only with the screening "
                                     f"accountant ({SCREEN_ACCOUNTANT}); none does with {accountant}")
    return {"question": "least compute whose predicted loss reaches the target", "target_loss": float(target_loss),
            **pl.header(), "candidates": sorted(final, key=lambda c: c["compute"])[:top],
            "screened": len(screened), "dropped": pl.dropped}


def frontier(fit: FitResult, *, computes: Sequence[float], **kw) -> list[dict]:
    """The best candidate at each compute (the compute-optimal frontier); computes with none are skipped.

    Raises:
        DegenerateFitError: a degenerate fit without ``force``.
        ScalingError: no compute has a candidate inside the fitted range.
    """
    check_fit_usable(fit, force=kw.get("force", False))
    out = []
    for c in computes:
        try:
            best = best_for_compute(fit, compute=c, top=1, **kw)["candidates"]
        except ScalingError:
            continue
        if best:
            out.append({"budget": float(c), **best[0]})
    if not out:
        raise ScalingError(f"no compute in [{min(computes):.3g}, {max(computes):.3g}] FLOPs has a candidate inside "
                           f"the fitted range {_fmt_domain(fit)}; change the compute range or allow --extrapolate")
    return out


def _fmt_domain(fit: FitResult) -> str:
    return ", ".join(f"{k} ∈ [{lo:.3g}, {hi:.3g}]" for k, (lo, hi) in fit.domain.items())


def _fmt_dropped(d: dict) -> str:
    return ", ".join(f"{v} {k}" for k, v in d.items() if v) or "none"


def format_plan(doc: dict) -> str:
    """The human view of :func:`best_for_compute` / :func:`least_compute_for_loss`."""
    lines = [f"fit: noise_batch [{doc['fit_label']}] R²={doc['fit_r2']:.4f}; fitted range {_fmt_domain_dict(doc)}",
             f"records={doc['records']:,}  ε={doc['epsilon']:g}  δ={doc['delta']:g}  accountant={doc['accountant']}"
             f" (screened with {doc['screen_accountant']})  tokens/record={doc['tokens_per_record']:.4g}",
             f"{doc['question']}: " + (f"compute ≤ {doc['compute']:.4g} FLOPs" if "compute" in doc
                                       else f"loss ≤ {doc['target_loss']:.4f} "
                                            f"(ppl {math.exp(doc['target_loss']):.4g})"),
             f"{doc['screened']} candidates screened; dropped: {_fmt_dropped(doc['dropped'])}", "",
             f"{'N':>10} {'batch':>7} {'steps':>7} {'epochs':>7} {'σ':>8} {'σ̄':>10} {'FLOPs':>10} "
             f"{'pred. loss':>10}  {'95% prediction interval':<23}  95% CI of the mean"]
    for c in doc["candidates"]:
        band = (f"{_band(c.get('loss_low'), c.get('loss_high'), 'no residuals'):<23}  "
                f"{_band(c.get('mean_low'), c.get('mean_high'), 'no bootstrap samples')}")
        lines.append(f"{c['N']:>10.3g} {c['batch']:>7d} {c['steps']:>7d} {c['epochs']:>7.3g} "
                     f"{c['noise_multiplier']:>8.4g} {c['sigma_bar']:>10.3g} {c['compute']:>10.3g} "
                     f"{c['loss']:>10.4f}  {band}" + (f"  EXTRAPOLATED ×{c.get('beyond_factor', float('nan')):.2g} in "
                                                     f"{c.get('beyond_input')}" if c.get("extrapolated") else ""))
    if any(c.get("extrapolated") for c in doc["candidates"]) and doc.get("interval_calibration"):
        lines.append(f"intervals of EXTRAPOLATED candidates: {doc['interval_calibration']}")
    return "\n".join(lines)


def _band(lo: float | None, hi: float | None, missing: str) -> str:
    return f"[{lo:.4f}, {hi:.4f}]" if lo is not None and np.isfinite(lo) else f"({missing})"


def _fmt_domain_dict(doc: dict) -> str:
    return ", ".join(f"{k} ∈ [{lo:.3g}, {hi:.3g}]" for k, (lo, hi) in doc["fit_domain"].items())


__all__ = ["SigmaTable", "best_for_compute", "default_batches", "default_sizes", "format_plan", "frontier",
           "least_compute_for_loss"]
