"""Intervals beyond the data (issue 36): rolling-origin validation, and held-out larger sizes covered at the
nominal rate when the law is mis-specified.

Each synthetic sweep has 6 sizes (1e6-1e8) × 4 token counts (1e8-1e10), one run each; the held-out runs are
sizes 3e8 and 1e9 (×3 and ×10 beyond the largest fitted) at the same token counts, drawn from the same truth.
The truth is not the fitted chinchilla form: it has an extra slow N term, an exponent that drifts with N (a bend
at large N), or noise that grows with N. Seeded; small bootstraps.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from dpllm.scaling import FitResult, fit_form, get_form
from dpllm.scaling.extrapolate import calibrate, distance_beyond, effective_distance, needed_kappa, widen, z_of

LAW = get_form("chinchilla")
TRUTH = {"E": 1.7, "A": 400.0, "alpha": 0.34, "B": 410.0, "beta": 0.28}
SIZES, TOKENS, BEYOND = np.geomspace(1e6, 1e8, 6), np.geomspace(1e8, 1e10, 4), np.array([3e8, 1e9])


def _truth(kind: str, n, d):
    if kind == "extra_term":  # a second, slower N term the form lacks: it takes over at large N
        return LAW.predict(TRUTH, {"N": n, "D": d}) + 20.0 * n ** -0.08
    if kind == "curvature":  # the N exponent falls with N: the curve bends away from any one power law
        alpha = TRUTH["alpha"] - 0.012 * np.log(n / 1e6)
        return TRUTH["E"] + TRUTH["A"] * n ** -alpha + TRUTH["B"] * d ** -TRUTH["beta"]
    return LAW.predict(TRUTH, {"N": n, "D": d})


def _noise_sd(kind: str, n):
    return 0.003 * (n / 1e6) ** 0.3 if kind == "heteroscedastic" else 0.005 + 0 * n


def _runs(kind, rng, sizes):
    n, d = (a.ravel() for a in np.meshgrid(sizes, TOKENS))
    return n, d, _truth(kind, n, d) * np.exp(rng.normal(0.0, 1.0, n.size) * _noise_sd(kind, n))


def _study(kind: str, sweeps: int = 4) -> dict:
    inside = {"mean_ci": [], "in_range": [], "widened": []}
    width = {k: [] for k in inside}
    errors = []
    for rep in range(sweeps):
        rng = np.random.default_rng(100 + rep)
        n, d, y = _runs(kind, rng, SIZES)
        fit = fit_form("chinchilla", loss=y, N=n, D=d, n_boot=30, seed=rep, validate=True)
        assert fit.extrapolation["status"] == "calibrated"
        hn, hd, hy = _runs(kind, rng, BEYOND)
        bands = {"mean_ci": fit.confidence_interval(N=hn, D=hd),
                 "in_range": fit.prediction_interval(N=hn, D=hd, widen=False),
                 "widened": fit.prediction_interval(N=hn, D=hd)}
        for k, (lo, hi) in bands.items():
            inside[k].append((lo <= hy) & (hy <= hi))
            width[k].append(np.log(hi / lo))
        errors.append(np.log(hy / fit.predict(N=hn, D=hd)))
    out = {k: float(np.mean(v)) for k, v in inside.items()}
    # The narrowest symmetric interval on log-loss that would have covered 95% of these held-out runs.
    needed = 2 * float(np.quantile(np.abs(np.concatenate(errors)), 0.95))
    return {"coverage": out, "median_width": {k: float(np.median(np.concatenate(v))) for k, v in width.items()},
            "needed_width": needed}


@pytest.mark.parametrize("kind", ["extra_term", "curvature", "heteroscedastic"])
def test_widened_interval_covers_larger_sizes_of_a_misspecified_sweep(kind):
    res = _study(kind)
    cov, w = res["coverage"], res["median_width"]
    print(kind, res)
    # the in-range interval misses the larger sizes; the widened one covers them at >= 90% (nominal 95%)
    assert cov["in_range"] < 0.9 and cov["widened"] >= 0.9, res
    assert cov["mean_ci"] <= cov["in_range"] <= cov["widened"]
    # no wider than needed: within 1.6x of the narrowest interval that covers 95% of these runs
    assert w["widened"] <= 1.6 * res["needed_width"], res


def test_a_point_inside_the_data_keeps_its_in_range_interval():
    rng = np.random.default_rng(5)
    n, d, y = _runs("none", rng, SIZES)
    fit = fit_form("chinchilla", loss=y, N=n, D=d, n_boot=30, seed=0, validate=True)
    x = {"N": np.array([3e6, 3e7]), "D": np.array([1e9, 3e9])}
    assert np.array_equal(fit.prediction_interval(**x), fit.prediction_interval(widen=False, **x))
    factor, name = fit.beyond(**x)
    assert np.all(factor == 1.0) and list(name) == ["", ""]
    # beyond it the interval only grows, and grows with the distance
    factor, name = fit.beyond(N=np.array([2e8, 1e9, 1e10]), D=1e9)
    assert factor == pytest.approx([2.0, 10.0, 100.0]) and list(name) == ["N"] * 3
    if fit.extrapolation["kappa"] > 0:
        lo, hi = fit.prediction_interval(N=np.array([2e8, 1e9, 1e10]), D=1e9)
        plo, phi = fit.prediction_interval(N=np.array([2e8, 1e9, 1e10]), D=1e9, widen=False)
        assert np.all(lo <= plo) and np.all(hi >= phi) and np.all(np.diff(np.log(hi / lo)) > 0)
    # the validation travels with fit.json
    again = FitResult.from_dict(json.loads(json.dumps(fit.to_dict())))
    assert again.extrapolation["kappa"] == fit.extrapolation["kappa"]
    assert np.allclose(again.prediction_interval(N=1e9, D=1e9), fit.prediction_interval(N=1e9, D=1e9))


def test_validation_reports_each_held_out_size():
    rng = np.random.default_rng(6)
    n, d, y = _runs("curvature", rng, SIZES)
    ex = fit_form("chinchilla", loss=y, N=n, D=d, n_boot=20, seed=0, validate=True).extrapolation
    # 6 sizes, folds must train on >= half the log-range: cuts after sizes 4 and 5
    assert [f["cut"] for f in ex["folds"]] == pytest.approx(list(SIZES[3:5]))
    assert [r["cut"] for r in ex["per_size"]] == pytest.approx([SIZES[3], SIZES[3], SIZES[4]])
    assert [r["N"] for r in ex["per_size"]] == pytest.approx([SIZES[4], SIZES[5], SIZES[5]])
    assert [r["n_runs"] for r in ex["per_size"]] == [4, 4, 4] and ex["n_held_out"] == 12
    assert ex["per_size"][1]["beyond_factor"] == pytest.approx(SIZES[5] / SIZES[3])
    assert ex["coverage"]["widened"] >= 0.95 and ex["level"] == 0.95
    assert set(ex["coverage"]) == {"parameter_only", "in_range", "widened", "widened_cv"}


def test_too_few_sizes_say_so():
    n, d = (a.ravel() for a in np.meshgrid([1e6, 1e7], TOKENS))
    y = LAW.predict(TRUTH, {"N": n, "D": d}) * np.exp(np.random.default_rng(0).normal(0, 0.005, n.size))
    fit = fit_form("chinchilla", loss=y, N=n, D=d, n_boot=10, validate=True)
    assert fit.extrapolation["kappa"] is None and "2 distinct N" in fit.extrapolation["status"]
    assert np.array_equal(fit.prediction_interval(N=1e9, D=1e9), fit.prediction_interval(N=1e9, D=1e9, widen=False))


def test_distance_widening_and_calibration_arithmetic():
    dom = {"N": [1e6, 1e8], "D": [1e8, 1e10]}
    delta, name = distance_beyond(dom, {"N": np.array([1e7, 1e9, 1e7, 1e9]), "D": np.array([1e9, 1e9, 1e7, 1e12])},
                                  compute=[6e14, 6e18])
    assert delta == pytest.approx([0.0, np.log(10), np.log(10), np.log(1000)])
    assert list(name) == ["", "N", "D", "compute"]  # 6·1e9·1e12 is ×1000 the largest compute, D only ×100
    assert distance_beyond({"sigma_bar": [1e-3, 1e-2]}, {"sigma_bar": np.array([0.0, 0.1])})[0] == pytest.approx(
        [0.0, np.log(10)])  # σ̄ = 0 is non-private, never beyond
    # Δ(1 + Δ/W): W = log(100) e-folds of N
    assert effective_distance(np.log(10), "N", dom) == pytest.approx(np.log(10) * 1.5)
    lo, hi = widen(0.0, -0.03, 0.04, distance=0.0, kappa=0.05, z=1.96)
    assert (lo, hi) == (-0.03, 0.04)  # inside the data: unchanged
    lo, hi = widen(0.0, -0.03, 0.04, distance=1.0, kappa=0.02, z=z_of(0.95))
    w = 1.959964 * 0.02
    assert (lo, hi) == pytest.approx((-np.hypot(0.03, w), np.hypot(0.04, w)))
    need = needed_kappa(np.array([0.01, 0.05, -0.05]), 0.02, 0.02, np.array([1.0, 1.0, 2.0]), 2.0)
    assert need == pytest.approx([0.0, np.sqrt(0.05**2 - 0.02**2) / 2, np.sqrt(0.05**2 - 0.02**2) / 4])
    assert calibrate(np.arange(20.0), 0.95) == 18.0 and calibrate(np.arange(10.0), 0.95) == 9.0
