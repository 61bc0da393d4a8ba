"""The bootstrap's batched refits (dpllm.scaling.newton) give the fit the one-by-one scipy refits give.

The reference is the same bootstrap with the form's ``refit_many`` removed, so every resample is refitted by
L-BFGS-B from the full-data optimum as before (issue 49, item 8). Both draw the same resamples; the
tolerance is L-BFGS-B's own: it stops at ``ftol=1e-15`` on an objective of ~1e-3, which leaves a parameter up
to a few 1e-6 (relative) from the optimum in the flattest direction; Newton stops nearer it (rounding of the
gradient, ~1e-12, limits it to ~1e-7 there), with an objective no higher (test below).
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from dpllm.scaling import fit as fit_module
from dpllm.scaling.forms import HUBER_DELTA, get_form
from dpllm.scaling.newton import newton_many

CHIN = {"E": 1.8172, "A": 482.01, "alpha": 0.3478, "B": 2085.43, "beta": 0.3658}
SAMPLE_RTOL = 2e-5  # each resample's parameters (L-BFGS-B's stopping error, see above)
CI_RTOL = 1e-6  # the 2.5% and 97.5% percentiles over resamples


def _isoflop(rows: int, seed: int) -> tuple[dict, np.ndarray]:
    """An isoFLOP-like scatter, one run per configuration (the bootstrap resamples runs)."""
    rng = np.random.default_rng(seed)
    n = np.exp(rng.uniform(np.log(5e7), np.log(1.6e10), rows))
    d = np.exp(rng.uniform(np.log(6e18), np.log(3e21), rows)) / (6 * n)
    x = {"N": n, "D": d}
    return x, get_form("chinchilla").predict(CHIN, x) * np.exp(rng.normal(0, 0.01, rows))


def _both(form: str, x: dict, y: np.ndarray, n_boot: int = 120, seed: int = 0):
    """(batched, reference) bootstrap samples and the method, from the same resamples."""
    f = get_form(form)
    xc, ymean, inverse, counts = fit_module._config_means(f, x, y)
    with fit_module._one_blas_thread():
        params = f.fit(xc, ymean)
        fast, method = fit_module._bootstrap(f, x, y, xc, inverse, counts, params, n_boot, seed)
        slow, _ = fit_module._bootstrap(dataclasses.replace(f, refit_many=None), x, y, xc, inverse, counts,
                                        params, n_boot, seed)
    return fast, slow, method


def _assert_same_fit(fast: np.ndarray, slow: np.ndarray) -> None:
    assert fast.shape == slow.shape and len(fast) > 0
    np.testing.assert_allclose(fast, slow, rtol=SAMPLE_RTOL)
    for q in (2.5, 97.5):
        np.testing.assert_allclose(np.percentile(fast, q, axis=0), np.percentile(slow, q, axis=0), rtol=CI_RTOL)


def test_resampling_runs_gives_the_reference_samples():
    x, y = _isoflop(80, seed=3)
    fast, slow, method = _both("chinchilla", x, y)
    assert method == "runs"
    _assert_same_fit(fast, slow)


def test_resampling_seeds_gives_the_reference_samples():
    n, d = (a.ravel() for a in np.meshgrid([1e6, 3e6, 1e7, 3e7, 1e8], [1e7, 1e8, 1e9, 1e10]))
    x = {"N": np.repeat(n, 2), "D": np.repeat(d, 2)}
    y = get_form("chinchilla").predict(CHIN, x) * np.exp(np.random.default_rng(1).normal(0, 0.005, 40))
    fast, slow, method = _both("chinchilla", x, y)
    assert method.startswith("seeds within configuration")
    _assert_same_fit(fast, slow)


def test_dp_noise_with_non_private_points_gives_the_reference_samples():
    # σ̄ = 0 drops the noise term at those points: the batched design masks that term out.
    grid = np.array(list(itertools.product([1e6, 1e7, 1e8], [1e7, 1e8, 1e9, 1e10],
                                           [0.0, 1 / 1024, 4 / 1024, 16 / 1024])))
    x = {"N": grid[:, 0], "D": grid[:, 1], "sigma_bar": grid[:, 2]}
    truth = {**CHIN, "C": 30.0, "gamma": 0.8}
    y = get_form("dp_noise").predict(truth, x) * np.exp(np.random.default_rng(2).normal(0, 0.003, len(grid)))
    fast, slow, _ = _both("dp_noise", x, y, n_boot=60)
    _assert_same_fit(fast, slow)


def test_batched_optimum_is_no_worse_than_lbfgsb():
    # On each resample (a subset of the points), Newton's answer has an objective no higher than L-BFGS-B's
    # from the same start: where the two differ, the batched one is nearer the optimum.
    x, y = _isoflop(80, seed=3)
    f = get_form("chinchilla")
    params = f.fit(x, y)
    weight = (np.random.default_rng(0).random((20, 80)) < 0.63).astype(float)
    fast, solved = f.refit_many(x, np.broadcast_to(y, weight.shape), weight, params)
    assert solved.all()

    def objective(row, keep):
        r = np.log(f.predict(dict(zip(f.param_names, row)), {k: v[keep] for k, v in x.items()})) - np.log(y[keep])
        a = np.abs(r)
        return np.where(a <= HUBER_DELTA, 0.5 * r * r, HUBER_DELTA * (a - 0.5 * HUBER_DELTA)).sum()

    for row, w in zip(fast, weight):
        keep = w > 0
        slow = f.fit({k: v[keep] for k, v in x.items()}, y[keep], start=params)
        ref = objective([slow[k] for k in f.param_names], keep)
        assert objective(row, keep) <= ref * (1 + 1e-12)
        np.testing.assert_allclose(row, [slow[k] for k in f.param_names], rtol=SAMPLE_RTOL)


def test_an_optimum_on_the_bound_is_left_to_the_caller():
    # One exponent whose data pull it below 0: Newton must step out of the box and report the row unsolved,
    # so the caller refits it with the bounded scipy search.
    logx = np.linspace(-2, 2, 12)
    A = np.zeros((12, 2, 3))
    A[:, 0, 0] = 1.0
    A[:, 1, 1], A[:, 1, 2] = 1.0, -logx
    mask = np.ones((12, 2), bool)
    rising = np.log(1.0 + 0.1 * np.exp(0.3 * logx))  # loss grows with x: the best exponent is negative
    falling = np.log(1.0 + 0.1 * np.exp(-0.3 * logx))
    theta0 = np.array([0.0, np.log(0.1), 0.3])
    theta, solved = newton_many(A, mask, np.stack([falling, rising]), np.ones((2, 12)), theta0,
                                lower=np.array([-np.inf, -np.inf, 0.0]), upper=np.array([np.inf, np.inf, 5.0]),
                                delta=HUBER_DELTA)
    assert solved.tolist() == [True, False]
    assert theta[0] == pytest.approx(theta0, rel=1e-6, abs=1e-8)


def test_chunked_batches_give_the_same_samples(monkeypatch):
    # Large tables are refitted in chunks of resamples (memory); the chunking changes only rounding (BLAS blocks
    # the batch differently), which can move a resample along its optimum's flattest direction by ~1e-7.
    x, y = _isoflop(60, seed=4)
    whole, _, _ = _both("chinchilla", x, y, n_boot=40)
    monkeypatch.setattr(fit_module, "BATCH_POINTS", 7 * 60)  # chunks of 7 resamples
    chunked, _, _ = _both("chinchilla", x, y, n_boot=40)
    np.testing.assert_allclose(chunked, whole, rtol=SAMPLE_RTOL)


def test_resamples_down_a_flat_valley_settle_in_the_batch():
    # A 5 x 5 grid with 2% noise (tests/test_scaling_intervals.py's sweep): many resamples' optima lie down a valley
    # where E falls towards 0 and the other terms take its place; damped Newton needs 100-200 steps there. They are
    # settled in the batch (24 of these 30 at 200 iterations; at 60, 8), with the samples of one-by-one L-BFGS-B.
    from tests.test_scaling_intervals import _sweep

    n, d, y = _sweep(np.random.default_rng(1007))
    x = {"N": n, "D": d}
    f = get_form("chinchilla")
    xc, ymean, inverse, counts = fit_module._config_means(f, x, y)
    rng = np.random.default_rng(7)
    weight = np.stack([np.bincount(inverse[rng.integers(0, len(y), len(y))], minlength=len(counts)) > 0
                       for _ in range(30)]).astype(float)
    with fit_module._one_blas_thread():
        params = f.fit(xc, ymean)
        _, solved = f.refit_many(xc, np.broadcast_to(ymean, weight.shape), weight, params)
    assert solved.sum() >= 20, int(solved.sum())
    fast, slow, _ = _both("chinchilla", x, y, n_boot=30, seed=7)
    _assert_same_fit(fast, slow)
