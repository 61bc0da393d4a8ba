"""Correlated noise (dpllm.privacy.correlated): the strategy math, the noise recurrence, cyclic sampling and the
accounting reduction, without a model."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dpllm.privacy import accounting
from dpllm.privacy.accounting import PrivacyPlanError
from dpllm.privacy.correlated import MECHANISMS, build
from dpllm.privacy.correlated.banded import (
    BandMF,
    _loss_and_grad,
    column_norms,
    materialize,
    sqrt_coefficients,
    workload_error,
)
from dpllm.privacy.correlated.base import Independent
from dpllm.privacy.correlated.groups import CyclicPoissonBatchSampler, assign_groups, record_group
from dpllm.sampling import PoissonBatchSampler


def _rmse_materialized(c, steps: int) -> float:
    """sqrt(‖A C⁻¹‖²_F / T) from the materialised T×T matrices."""
    A = np.tril(np.ones((steps, steps)))
    return float(np.sqrt(np.sum((A @ np.linalg.inv(materialize(c, steps))) ** 2) / steps))


def test_registry_names_the_three_mechanisms():
    assert set(MECHANISMS) == {"independent", "banded", "blt"}


@pytest.mark.parametrize("bands,steps", [(1, 7), (3, 12), (5, 5)])
def test_error_and_column_norms_match_the_materialised_matrices(bands, steps):
    s = BandMF.optimized(bands=bands, steps=steps)
    assert s.prefix_sum_rmse(steps) == pytest.approx(_rmse_materialized(s.coefficients, steps), rel=1e-10)
    norms = np.linalg.norm(materialize(s.coefficients, steps), axis=0)
    np.testing.assert_allclose(column_norms(s.coefficients, steps), norms, rtol=1e-12)
    assert norms.max() == pytest.approx(1.0, abs=1e-12) and s.sensitivity(steps) == pytest.approx(1.0, abs=1e-12)
    # the last columns are cut by the end of the run: shorter, never longer
    assert norms[-1] == pytest.approx(s.coefficients[0])


def test_gradient_of_the_workload_error_is_exact():
    from scipy.optimize import check_grad

    v = np.array([1.0, 0.6, 0.3, 0.2])
    err = check_grad(lambda x: _loss_and_grad(x, 40)[0], lambda x: _loss_and_grad(x, 40)[1], v)
    assert err < 1e-5 * np.linalg.norm(_loss_and_grad(v, 40)[1])


def test_optimised_bands_beat_dp_sgd_and_approach_the_square_root_factorisation():
    T = 256
    dpsgd = Independent().prefix_sum_rmse(T)
    assert BandMF.optimized(bands=1, steps=T).prefix_sum_rmse(T) == pytest.approx(dpsgd)
    assert dpsgd == pytest.approx(math.sqrt((T + 1) / 2))
    rmse = [BandMF.optimized(bands=b, steps=T).prefix_sum_rmse(T) for b in (1, 2, 4, 16, T)]
    assert all(a > b for a, b in zip(rmse, rmse[1:]))  # seen 11.34, 8.15, 5.98, 3.64, 2.62
    sq = sqrt_coefficients(T)
    sq /= np.linalg.norm(sq)
    sqrt_rmse = math.sqrt(workload_error(sq, T) / T)  # 2.67
    assert rmse[-1] <= sqrt_rmse and rmse[-1] > 0.95 * sqrt_rmse  # the optimum is a few % under sqrt
    full = BandMF.optimized(bands=T, steps=T).coefficients
    np.testing.assert_allclose(full[:8], sq[:8], rtol=0.1)  # and its coefficients are close to sqrt's


def test_generated_noise_has_the_covariance_of_the_factorisation():
    """x = C⁻¹z with z ~ N(0, σ²C²I): Cov(x) = σ²C²·C⁻¹C⁻ᵀ (many draws side by side, one tensor)."""
    T, b, sigma_c, n = 6, 3, 1.5, 200_000
    s = BandMF.optimized(bands=b, steps=T)
    rec = s.recurrence()
    g = torch.Generator().manual_seed(0)
    xs = []
    for _ in range(T):
        z = torch.normal(0.0, sigma_c, (n,), generator=g, dtype=torch.float64)
        xs.append(rec.apply(0, z).clone())
        rec.end_step()
    X = torch.stack(xs).numpy()
    got = X @ X.T / n
    Cinv = np.linalg.inv(materialize(s.coefficients, T))
    want = sigma_c ** 2 * Cinv @ Cinv.T
    # each entry's standard error is about σ²·sqrt(2/n)·(its scale) ≈ 0.3% here; 2% of the largest entry is > 6 s.e.
    np.testing.assert_allclose(got, want, atol=0.02 * np.abs(want).max())
    assert np.abs(want - np.diag(np.diag(want))).max() > 0.1 * np.abs(want).max()  # correlated: not diagonal
    assert rec.extra_tensors_per_parameter == b - 1 and len(rec.history[0]) == b - 1


def test_one_band_reproduces_dp_sgd_noise_exactly():
    from opacus.optimizers.optimizer import _generate_noise

    ref = torch.zeros(5, 7)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    rec = BandMF.optimized(bands=1, steps=10).recurrence()
    for _ in range(4):
        for key in range(2):
            plain = _generate_noise(std=1.3, reference=ref, generator=g1)
            assert torch.equal(rec.apply(key, _generate_noise(std=1.3, reference=ref, generator=g2)), plain)
        rec.end_step()
    assert rec.history == {}


def test_recurrence_state_continues_the_same_sequence():
    s = BandMF.optimized(bands=4, steps=20)
    draws = [torch.randn(3, generator=torch.Generator().manual_seed(i)) for i in range(10)]
    whole = s.recurrence()
    out = []
    for z in draws:
        out.append(whole.apply(0, z.clone()).clone())
        whole.end_step()
    first = s.recurrence()
    for z in draws[:6]:
        first.apply(0, z.clone())
        first.end_step()
    state = first.state_dict()
    resumed = s.recurrence()
    resumed.load_state_dict(state)
    for z, want in zip(draws[6:], out[6:]):
        assert torch.equal(resumed.apply(0, z.clone()), want)
        resumed.end_step()
    with pytest.raises(ValueError, match="coefficients differ"):
        BandMF.optimized(bands=3, steps=20).recurrence().load_state_dict(state)
    with pytest.raises(RuntimeError, match="twice"):
        resumed.apply(1, torch.zeros(1)), resumed.apply(1, torch.zeros(1))


def test_group_of_a_record_is_a_function_of_the_record_alone():
    texts = [f"record number {i}" for i in range(400)]
    groups = assign_groups(texts, bands=4, key=7)
    assert groups == [record_group(t, bands=4, key=7) for t in texts]
    # adding or removing records moves no other record's group
    assert assign_groups(texts[::3] + ["a new record"], bands=4, key=7)[:-1] == groups[::3]
    counts = np.bincount(groups, minlength=4)
    assert counts.min() > 70  # about 100 each
    assert assign_groups(texts, bands=4, key=8) != groups  # the key matters


def test_cyclic_sampler_draws_only_the_group_whose_turn_it_is_at_rate_q_b():
    texts = [f"r{i}" for i in range(3000)]
    groups = assign_groups(texts, bands=3, key=0)
    s = CyclicPoissonBatchSampler(groups=groups, bands=3, sample_rate=0.3, generator=torch.Generator().manual_seed(1))
    it = iter(s)
    seen = np.zeros(3)
    for t in range(30):
        batch = next(it)
        assert {groups[i] for i in batch} <= {t % 3}
        seen[t % 3] += len(batch)
    sizes = np.bincount(groups, minlength=3)
    np.testing.assert_allclose(seen / (10 * sizes), 0.3, atol=0.03)
    # one band: the batches of plain Poisson sampling, draw for draw
    one = iter(CyclicPoissonBatchSampler(groups=[0] * 50, bands=1, sample_rate=0.2,
                                         generator=torch.Generator().manual_seed(2)))
    plain = iter(PoissonBatchSampler(num_samples=50, sample_rate=0.2, generator=torch.Generator().manual_seed(2)))
    assert [next(one) for _ in range(5)] == [next(plain) for _ in range(5)]
    # a resumed sampler (start = the step) continues with the group of that step
    late = iter(CyclicPoissonBatchSampler(groups=groups, bands=3, sample_rate=1.0, generator=torch.Generator(),
                                          start=4))
    assert {groups[i] for i in next(late)} == {1}


def test_accounting_is_dp_accountings_pld_of_the_dp_sgd_event():
    import dp_accounting

    N, B, T, b, sigma, delta = 10_000, 100, 600, 4, 1.2, 1e-5
    n = build("banded", b, steps=T, num_records=N, batch=B, noise_multiplier=sigma)
    assert n.event(sigma) == (sigma, b * B / N, 150)
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(b * B / N, dp_accounting.GaussianDpEvent(sigma)), math.ceil(T / b))
    reference = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4).compose(event).get_epsilon(delta)
    for acc in ("pld", "prv"):
        eps = accounting.compute_epsilon_history(history=[n.event(sigma)], delta=delta, accountant=acc)
        assert reference * (1 - 1e-3) <= eps <= reference * 1.02, acc
    # the partial run after t steps: ⌈t/b⌉ events of group sampling
    assert n.event(sigma, steps=5) == (sigma, 0.04, 2)


def test_build_refuses_what_it_cannot_account():
    kw = dict(steps=100, num_records=1000, batch=100)
    with pytest.raises(PrivacyPlanError, match="bands ≤ 10"):
        build("banded", 11, **kw, noise_multiplier=1.0)
    with pytest.raises(PrivacyPlanError, match="target_epsilon"):
        build("banded", "auto", **kw, noise_multiplier=1.0)
    with pytest.raises(PrivacyPlanError, match="needs privacy.noise=banded"):
        build("independent", 4, **kw)
    for bad in ("0", "two", -1, "2.5"):
        with pytest.raises(PrivacyPlanError, match="positive whole number"):
            build("banded", bad, **kw, noise_multiplier=1.0)
    with pytest.raises(PrivacyPlanError, match="choose one of"):
        build("dense", 2, **kw)
    with pytest.raises(PrivacyPlanError, match="bands ≤ 3"):
        build("banded", 4, steps=3, num_records=1000, batch=100, noise_multiplier=1.0)


def test_auto_picks_the_least_expected_error():
    kw = dict(num_records=10_000, batch=250, target_epsilon=3.0, delta=1e-5, accountant="prv")
    many = build("banded", "auto", steps=400, **kw)  # 10 epochs
    rows = {r["bands"]: r for r in many.choice}
    assert set(rows) == {1, 2, 4, 8, 16, 32}
    # seen σ·RMSE 14.57 (b = 1), 13.65, 12.37, 12.37, 13.04, 14.61 (b = 32): the optimum is inside the range
    assert many.bands == min(rows, key=lambda b: rows[b]["error"]) in (4, 8)
    assert rows[many.bands]["error"] < 0.9 * rows[1]["error"]
    assert rows[1]["noise_multiplier"] < rows[many.bands]["noise_multiplier"]  # fewer, denser steps: more σ
    assert rows[32]["prefix_sum_rmse"] < rows[many.bands]["prefix_sum_rmse"]  # ... which more bands outgrow
    assert many.to_json()["auto"] and many.to_json()["accounted_steps"] == math.ceil(400 / many.bands)
    assert many.sample_rate == many.bands * 250 / 10_000


def test_auto_keeps_dp_sgd_where_banding_does_not_pay_and_the_plan_says_so():
    """Two steps at ε = 1: σ(2) for the denser group sampling outgrows the error banding saves (seen σ·RMSE 1.66
    for b = 1 against 1.91 for b = 2); the plan then is DP-SGD's, and records the comparison that chose it."""
    from dpllm.privacy.plan import plan_privacy
    from dpllm.privacy.report import PrivacyReport

    n = build("banded", "auto", steps=2, num_records=1000, batch=100, target_epsilon=1.0, delta=1e-5)
    assert n.bands == 1 and not n.correlated and n.recurrence() is None
    assert n.choice[0]["error"] < n.choice[1]["error"]
    plan = plan_privacy(num_records=1000, logical_batch_size=100, steps=2, target_epsilon=1.0, delta=1e-5,
                        accountant="prv", noise=n)
    dpsgd = plan_privacy(num_records=1000, logical_batch_size=100, steps=2, target_epsilon=1.0, delta=1e-5,
                         accountant="prv")
    assert plan.history == dpsgd.history and plan.noise["mechanism"] == "independent" and plan.bands == 1
    report = PrivacyReport(enabled=True, num_records=1000, steps=2, logical_batch_size=100, physical_batch_size=100,
                           epsilon=1.0, delta=1e-5, accountant="prv", noise_multiplier=plan.noise_multiplier,
                           sample_rate=plan.sample_rate, max_grad_norm=1.0, clipping="flat",
                           correlated_noise=plan.noise)
    assert "bands=auto chose independent noise" in report.summary()
