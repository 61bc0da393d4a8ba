"""The MLP study code on the real privacy engine: data, one run, ε bookkeeping, hooks = ghost."""

import math

import pytest
import torch

from dpllm.mlp.data import digits, gaussian_clusters, load_dataset
from dpllm.mlp.train import PRV_SKIP_ABOVE, MLPRun, epsilons, plan_for, train_mlp
from dpllm.privacy.accounting import compute_epsilon


@pytest.fixture(scope="module")
def gaussian():
    return load_dataset("gaussian")


@pytest.fixture(scope="module")
def caches():
    """Plans and ε shared across tests: a PRV evaluation costs more than a whole tiny training run."""
    return {"plans": {}, "eps": {}}


def test_gaussian_data_is_deterministic_balanced_and_standardised():
    a, b = gaussian_clusters(), gaussian_clusters()
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    assert (a.n_train, len(a.y_test), a.n_features, a.n_classes) == (400, 100, 10, 5)
    y = torch.cat([a.y_train, a.y_test])
    assert torch.bincount(y).tolist() == [100] * 5
    x = torch.cat([a.x_train, a.x_test])
    # Standardised with population moments, so the sample moments are close to, not exactly, 0 and 1.
    assert x.mean(0).abs().max() < 0.3 and (x.std(0) - 1).abs().max() < 0.3
    assert not torch.equal(gaussian_clusters(seed=1).x_train, a.x_train)


def test_digits_offline_scaled_to_unit_interval():
    d = digits()
    assert (d.n_train + len(d.y_test), d.n_features, d.n_classes) == (1797, 64, 10)
    assert d.x_train.min() >= 0 and d.x_train.max() <= 1
    with pytest.raises(ValueError, match="choose one of gaussian, digits"):
        load_dataset("mnist")


def test_non_private_gaussian_accuracy_above_090(gaussian):
    rec = train_mlp(MLPRun(width=64, epochs=20, lr=0.1, private=False), gaussian).record
    assert rec["metrics"]["test_accuracy"] > 0.9
    assert rec["noise_multiplier"] == 0.0 and rec["epsilon_prv"] is None
    assert rec["n_params"] == 10 * 64 + 64 + 64 * 5 + 5


def test_private_run_records_the_planned_privacy(gaussian):
    run = MLPRun(width=16, epochs=3, noise_multiplier=2.0, max_grad_norm=0.5)
    rec = train_mlp(run, gaussian, plan=plan_for(run, n_train=gaussian.n_train)).record
    assert rec["steps"] == 3 * math.ceil(400 / 64) and rec["sample_rate"] == pytest.approx(1 / 7)
    assert (rec["noise_multiplier"], rec["max_grad_norm"], rec["sensitivity"], rec["delta"]) == (2.0, 0.5, 0.5, 1e-5)
    for acc in ("prv", "rdp"):
        want = compute_epsilon(noise_multiplier=2.0, sample_rate=1 / 7, steps=rec["steps"], delta=1e-5, accountant=acc)
        assert rec[f"epsilon_{acc}"] == pytest.approx(want, rel=1e-9)
    assert rec["epsilon_prv"] < rec["epsilon_rdp"]  # PRV is the tighter of the two upper bounds


def test_same_seed_same_result_and_more_noise_hurts(gaussian, caches):
    cache, recs = {}, []
    for sigma in (1.0, 1.0, 50.0):
        run = MLPRun(width=32, epochs=10, noise_multiplier=sigma)
        recs.append(train_mlp(run, gaussian, plan=plan_for(run, n_train=400, cache=cache),
                              eps_cache=caches["eps"]).record)
    assert recs[0]["metrics"] == recs[1]["metrics"]
    assert recs[2]["metrics"]["test_loss"] > recs[0]["metrics"]["test_loss"]
    assert len(cache["plans"]) == 2  # plans are shared between runs that differ only in seed


@pytest.mark.parametrize("clipping", ["flat", "psasc"])
def test_hooks_and_ghost_train_the_same_model(gaussian, caches, clipping):
    """Same seed, same batches and noise: per-sample (hooks) and ghost clipping give one model."""
    params = []
    for mode in ("hooks", "ghost"):
        run = MLPRun(width=16, epochs=2, noise_multiplier=1.0, grad_sample_mode=mode, clipping=clipping,
                     clipping_s=0.5)
        model = train_mlp(run, gaussian, plan=plan_for(run, n_train=400, cache=caches["plans"]),
                          eps_cache=caches["eps"]).model
        params.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    torch.testing.assert_close(params[0], params[1], rtol=0, atol=1e-6)


def test_psasc_noise_scale_is_c_over_s(gaussian, caches):
    run = MLPRun(width=16, epochs=2, noise_multiplier=1.0, max_grad_norm=1.0, clipping="psasc", clipping_s=0.5)
    rec = train_mlp(run, gaussian, plan=plan_for(run, n_train=400, cache=caches["plans"]),
                    eps_cache=caches["eps"]).record
    assert rec["sensitivity"] == 2.0


def test_calibrated_run_meets_target(gaussian):
    run = MLPRun(width=16, epochs=2, target_epsilon=3.0)
    rec = train_mlp(run, gaussian, plan=plan_for(run, n_train=400)).record
    assert 2.9 < rec["epsilon_prv"] <= 3.0


def test_huge_epsilon_skips_prv_and_plans_with_rdp():
    eps = epsilons(noise_multiplier=0.01, sample_rate=1 / 7, steps=140, delta=1e-5)
    assert eps["epsilon_prv"] is None and eps["epsilon_rdp"] > PRV_SKIP_ABOVE and "PRV not run" in eps["prv_note"]
    plan = plan_for(MLPRun(noise_multiplier=0.01), n_train=400)
    assert plan.accountant == "rdp" and plan.noise_multiplier == 0.01


def test_private_run_without_plan_is_refused(gaussian):
    with pytest.raises(ValueError, match="needs plan_for"):
        train_mlp(MLPRun(noise_multiplier=1.0), gaussian)


def test_empty_poisson_batches_still_count_as_dp_steps(gaussian):
    """Six records at q = 1/6: a third of the batches are empty; each is still a noised, accounted step."""
    from dpllm.mlp.data import Split

    tiny = Split("tiny", gaussian.x_train[:6], gaussian.y_train[:6], gaussian.x_test, gaussian.y_test, 5)
    run = MLPRun(width=8, epochs=5, batch_size=1, noise_multiplier=1.0, delta=1e-3)
    rec = train_mlp(run, tiny, plan=plan_for(run, n_train=6)).record  # raises if the accountant lost a step
    assert rec["steps"] == 30 and math.isfinite(rec["metrics"]["test_loss"])
