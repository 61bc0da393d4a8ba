"""Noise has standard deviation σ·S; every ε comes from Opacus's accountants and calibration lands at target."""

import math

import pytest
import torch

from dpllm.config import PrivacyConfig
from dpllm.data import TokenizedRecords, make_collate
from dpllm.privacy.accounting import PrivacyPlanError, calibrate_noise, check_delta, compute_epsilon
from dpllm.privacy.engine import PrivacyPlan, make_private
from dpllm.privacy.plan import plan_privacy
from dpllm.train import forward_loss
from tests.helpers import TEXTS, batch_of, tiny_model


@pytest.mark.parametrize("mode, clip, s", [("ghost", "flat", 1.0), ("hooks", "flat", 1.0), ("ghost", "psasc", 0.5)])
def test_noise_std_is_sigma_times_sensitivity(mode, clip, s):
    sigma, C = 0.8, 0.3
    model, tok = tiny_model("tiny-llama", "full")
    dataset = TokenizedRecords(TEXTS, tok, 48)
    n = len(dataset)
    cfg = PrivacyConfig(max_grad_norm=C, grad_sample_mode=mode, clipping=clip, clipping_s=s)

    def noisy_minus_clean(noise):
        torch.manual_seed(123)
        m, _ = tiny_model("tiny-llama", "full")
        plan = PrivacyPlan(num_records=n, sample_rate=1.0, steps=1, noise_multiplier=noise, delta=1e-5,
                           accountant="rdp", expected_batch_size=n)
        opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1)
        private = make_private(model=m, optimizer=opt, dataset=dataset, collate_fn=make_collate(tok.pad_token_id),
                               cfg=cfg, plan=plan, logical_batch_size=n)
        private.optimizer.zero_grad()
        forward_loss(private.model, batch_of(tok), private.criterion).backward()
        private.optimizer.pre_step()
        return torch.cat([p.grad.flatten() * n for p in private.optimizer.params])

    noise = noisy_minus_clean(sigma) - noisy_minus_clean(0.0)
    expected = sigma * C / s
    # ~45k independent coordinates: relative std error of the sample std is 0.33%, so 2% is 6 standard errors
    assert noise.numel() > 40_000
    assert noise.std().item() == pytest.approx(expected, rel=0.02)
    assert abs(noise.mean().item()) < 5 * expected / math.sqrt(noise.numel())


def test_known_accountant_values_privacy_cliff_paper_setting():
    # σ = 1, q = 0.16, 140 steps, δ = 1e-5 (the privacy-cliff paper): its simplified bound printed 4.80
    assert compute_epsilon(noise_multiplier=1.0, sample_rate=0.16, steps=140, delta=1e-5, accountant="rdp") == \
        pytest.approx(15.09, abs=0.01)
    assert compute_epsilon(noise_multiplier=1.0, sample_rate=0.16, steps=140, delta=1e-5, accountant="prv") == \
        pytest.approx(13.74, abs=0.02)


def test_rdp_is_opacus_rdp_accountant_with_each_piece_computed_once():
    """dpllm's RDP ε (each (σ, q)'s orders cached, times the steps) is Opacus's RDPAccountant's, piece for piece;
    the cache is keyed by σ and q both (a wrong key would return another piece's orders)."""
    from opacus.accountants import create_accountant

    from dpllm.privacy import accounting

    histories = [[(1.5, 0.05, 30)], [(1.5, 0.05, 30), (2.0, 0.05, 10), (1.5, 0.1, 5)], [(3.0, 0.2, 7), (1.5, 0.05, 0)],
                 [(1.5, 0.1, 30)], [(2.0, 0.05, 30)]]
    for _ in range(2):  # the second pass reads every piece from the cache
        for history in histories:
            acc = create_accountant(mechanism="rdp")
            acc.history = [h for h in history if h[2] > 0]
            mine = accounting.compute_epsilon_history(history=history, delta=1e-5, accountant="rdp")
            assert mine == pytest.approx(acc.get_epsilon(delta=1e-5), rel=1e-12), history
    assert accounting.compute_epsilon_history(history=[(1.5, 0.05, 0)], delta=1e-5, accountant="rdp") == 0.0


@pytest.mark.parametrize("accountant", ["prv", "rdp", "gdp"])
def test_calibration_lands_at_or_just_under_target(accountant):
    sigma = calibrate_noise(target_epsilon=4.0, delta=1e-6, sample_rate=0.01, steps=500, accountant=accountant)
    eps = compute_epsilon(noise_multiplier=sigma, sample_rate=0.01, steps=500, delta=1e-6, accountant=accountant)
    assert 4.0 - 0.05 <= eps <= 4.0


def test_gdp_never_reports_below_rdp():
    kw = dict(noise_multiplier=0.9, sample_rate=0.05, steps=50, delta=1e-5)
    assert compute_epsilon(**kw, accountant="gdp") >= compute_epsilon(**kw, accountant="rdp")


def test_unreachable_target_is_refused_with_advice():
    with pytest.raises(PrivacyPlanError, match="cannot be met.*raise"):
        calibrate_noise(target_epsilon=1e-4, delta=1e-5, sample_rate=1.0, steps=10_000, accountant="rdp")


@pytest.mark.parametrize("delta, n", [(1e-3, 1000), (0.5, 10), (0.0, 100), (1e-5, 0)])
def test_bad_delta_refused(delta, n):
    with pytest.raises(PrivacyPlanError):
        check_delta(delta, n)


def test_plan_refuses_given_noise_over_target():
    with pytest.raises(PrivacyPlanError, match="gives ε="):
        plan_privacy(num_records=1000, logical_batch_size=100, steps=100, target_epsilon=1.0, noise_multiplier=0.5,
                     delta=1e-5, accountant="prv")


def test_plan_composes_with_prior_stage():
    common = dict(num_records=1000, logical_batch_size=100, steps=50, target_epsilon=6.0, delta=1e-5,
                  accountant="rdp")
    prior = [(1.0, 0.1, 50)]
    plan = plan_privacy(**common, prior_history=prior)
    total = compute_epsilon(noise_multiplier=1.0, sample_rate=0.1, steps=50, delta=1e-5, accountant="rdp")
    assert total < plan.epsilon() <= 6.0
    alone = plan_privacy(**common)
    assert plan.noise_multiplier > alone.noise_multiplier  # the earlier stage spent part of the budget


@pytest.mark.parametrize("jitter", [0.0, 2e-3])
def test_the_false_position_search_finds_the_bisections_sigma_in_fewer_evaluations(jitter):
    """accounting.smallest_smooth_noise (PLD's calibration: false position on the grid from RDP's σ) against
    bisecting the grid from σ = 1 (accounting.smallest_grid_noise) on a smooth decreasing ε(σ), and on one that
    jitters as PLD's does from one σ to the next (a few thousandths of ε): the same σ where ε is monotone; under
    jitter a σ that meets the target while the grid point below does not; in under half the evaluations."""
    import random

    from dpllm.privacy import accounting

    def curve(c, k):
        def eps(sigma):
            calls.append(sigma)
            return c / sigma**k * (1 + jitter * random.Random(round(sigma, 9)).uniform(-1, 1))
        return eps

    for c, k, target, start in [(1.0, 2.0, 4.0, 0.55), (0.3, 1.5, 1.0, 0.5), (40.0, 1.0, 100.0, 0.5),
                                (2.0, 2.5, 0.5, 2.0), (5.0, 2.0, 8.0, 0.9)]:
        calls: list = []
        eps = curve(c, k)
        found = accounting.smallest_smooth_noise(eps, target, digits=4, unreachable=ValueError, start=start)
        searched = len(set(calls))
        calls.clear()
        bisected = accounting.smallest_grid_noise(eps, target, digits=4, unreachable=ValueError)
        below = accounting.prv.grid_below(found, 4)
        assert eps(found) <= target < eps(below), (c, k, target)
        if not jitter:
            assert found == bisected, (c, k, target)
        assert searched <= 10 and 2 * searched <= len(calls), (c, k, target, searched, len(calls))  # seen: 4-8, 17-20


def test_pld_calibration_meets_the_target_and_the_point_below_does_not(monkeypatch):
    """calibrate_noise with PLD searches as above (seen: 4 PLD evaluations; bisecting took 16)."""
    from dpllm.privacy import accounting

    calls = []
    pld = accounting.pld_epsilon
    monkeypatch.setattr(accounting, "pld_epsilon", lambda **kw: calls.append(kw["history"]) or pld(**kw))
    monkeypatch.setattr(accounting, "_PLD_CACHE", {})  # nothing remembered from other tests
    q, steps, delta, target = 0.05, 40, 1e-5, 3.0
    sigma = accounting.calibrate_noise(target_epsilon=target, delta=delta, sample_rate=q, steps=steps,
                                       accountant="pld")
    assert len(calls) <= 8, calls
    below = accounting.prv.grid_below(sigma, 4)
    assert compute_epsilon(noise_multiplier=sigma, sample_rate=q, steps=steps, delta=delta, accountant="pld") <= target
    assert compute_epsilon(noise_multiplier=below, sample_rate=q, steps=steps, delta=delta, accountant="pld") > target
