"""Planning with a fitted law: round trips through the prediction, compute optimum, unreachable targets."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.optimize import minimize_scalar

from dpllm.scaling import (
    FitResult,
    ScalingError,
    UnreachableTargetError,
    compute_for_target,
    compute_optimal,
    floor_loss,
    loss_from_ppl,
    params_for_target,
    tokens_for_target,
)

CHIN = FitResult(form="chinchilla", params={"E": 1.7, "A": 400.0, "alpha": 0.34, "B": 410.0, "beta": 0.28},
                 ci={}, r2=1.0, n_points=20, n_runs=20, label="eps=8")
DPN = FitResult(form="dp_noise", params={**CHIN.params, "C": 30.0, "gamma": 0.8}, ci={}, r2=1.0, n_points=48,
                n_runs=48, label="joint")
PL = FitResult(form="power_law", params={"a": 5.0, "alpha": 0.4, "L_inf": 0.05}, ci={}, r2=1.0, n_points=5,
               n_runs=15)


def test_loss_from_ppl():
    assert loss_from_ppl(20) == pytest.approx(2.995732, abs=1e-6)
    with pytest.raises(ScalingError, match="must be a finite number > 1"):
        loss_from_ppl(0.5)


@pytest.mark.parametrize("fit, sigma_bar", [(CHIN, None), (DPN, 1 / 1024)])
def test_tokens_for_target_round_trips_through_prediction(fit, sigma_bar):
    target = loss_from_ppl(20)
    d = tokens_for_target(fit, target_loss=target, n=1.2e8, sigma_bar=sigma_bar)
    assert 1e6 < d < 1e15
    extra = {} if sigma_bar is None else {"sigma_bar": sigma_bar}
    assert float(fit.predict(N=1.2e8, D=d, **extra)) == pytest.approx(target, rel=1e-10)
    n = params_for_target(fit, target_loss=target, d=d, sigma_bar=sigma_bar)
    assert n == pytest.approx(1.2e8, rel=1e-8)


def test_dp_noise_floor_includes_noise_and_needs_more_tokens():
    target = 3.0
    d_clean = tokens_for_target(DPN, target_loss=target, n=1e8, sigma_bar=0.0)
    d_noisy = tokens_for_target(DPN, target_loss=target, n=1e8, sigma_bar=4 / 1024)
    assert d_noisy > d_clean
    assert floor_loss(DPN, sigma_bar=4 / 1024) == pytest.approx(1.7 + 30.0 * (4 / 1024) ** 0.8)
    with pytest.raises(ScalingError, match="dp_noise plans need sigma_bar"):
        tokens_for_target(DPN, target_loss=target, n=1e8)


def test_power_law_params_for_target_round_trip_and_no_tokens():
    n = params_for_target(PL, target_loss=0.2)
    assert float(PL.predict(N=n)) == pytest.approx(0.2, rel=1e-10)
    with pytest.raises(ScalingError, match="power_law has no D term"):
        tokens_for_target(PL, target_loss=0.2, n=1e4)


def test_compute_optimal_is_on_iso_compute_line_and_a_minimum():
    c = 1e20
    opt = compute_optimal(CHIN, compute=c)
    assert 6 * opt["N"] * opt["D"] == pytest.approx(c, rel=1e-12)
    assert opt["loss"] == pytest.approx(float(CHIN.predict(N=opt["N"], D=opt["D"])), rel=1e-12)

    def along(log_n: float) -> float:
        n = math.exp(log_n)
        return float(CHIN.predict(N=n, D=c / (6 * n)))

    for k in (0.5, 0.9, 0.99, 1.01, 1.1, 2.0):  # every neighbour on the line is worse
        assert along(math.log(opt["N"] * k)) > opt["loss"]
    numeric = minimize_scalar(along, bounds=(math.log(1e3), math.log(1e15)), method="bounded",
                              options={"xatol": 1e-10})
    assert math.exp(numeric.x) == pytest.approx(opt["N"], rel=1e-3)


def test_compute_for_target_is_the_least_compute_reaching_it():
    target = 2.6
    need = compute_for_target(CHIN, target_loss=target)
    assert need["compute"] == pytest.approx(6 * need["N"] * need["D"])
    at = compute_optimal(CHIN, compute=need["compute"])
    assert at["loss"] == pytest.approx(target, rel=1e-9)
    assert at["N"] == pytest.approx(need["N"], rel=1e-9)
    assert compute_optimal(CHIN, compute=0.9 * need["compute"])["loss"] > target


def test_unreachable_target_names_floor_and_target():
    with pytest.raises(UnreachableTargetError, match=r"target loss 1.6000 .* not above the fitted floor 1.7000"):
        compute_for_target(CHIN, target_loss=1.6)
    # Above E but below what a 1e6-parameter model can ever reach: E + A/N^α.
    floor_at_n = 1.7 + 400.0 * 1e6**-0.34
    with pytest.raises(UnreachableTargetError, match=rf"fitted floor {floor_at_n:.4f} .* at N=1e\+06"):
        tokens_for_target(CHIN, target_loss=floor_at_n - 0.01, n=1e6)
    with pytest.raises(UnreachableTargetError, match="fitted floor 0.0500"):
        params_for_target(PL, target_loss=0.04)
    assert issubclass(UnreachableTargetError, ValueError)


def test_compute_optimal_rejects_power_law_and_bad_compute():
    with pytest.raises(ScalingError, match="no compute trade-off"):
        compute_optimal(PL, compute=1e20)
    with pytest.raises(ScalingError, match="compute=-1.0 must be a finite positive number"):
        compute_optimal(CHIN, compute=-1.0)
    assert np.isfinite(compute_optimal(DPN, compute=1e20, sigma_bar=1e-3)["loss"])


def test_flat_fit_refuses_to_plan():
    flat = FitResult(form="chinchilla", params={**CHIN.params, "beta": 0.0}, ci={}, r2=0.1, n_points=9, n_runs=9)
    with pytest.raises(ScalingError, match="fitted beta=0 is at its bound 0: the runs show no gain along D"):
        tokens_for_target(flat, target_loss=3.0, n=1e8)
