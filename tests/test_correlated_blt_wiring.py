"""privacy.noise: blt behind the registry: build() pairs its sampler, recurrence and single Gaussian event; no path
accounts it as amplified DP-SGD; the config refuses what is not built in one line; ``dpllm plan --noise blt``
compares it. The BLT math alone is in test_correlated_blt.py; training runs in test_correlated_blt_runs.py."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from dpllm.config import ConfigError, parse_config
from dpllm.privacy import accounting
from dpllm.privacy.accounting import PrivacyPlanError
from dpllm.privacy.correlated import GAUSSIAN, build
from dpllm.privacy.correlated import blt as blt_math
from dpllm.privacy.correlated.groups import CyclicPoissonBatchSampler, assign_groups

sys.path.insert(0, __import__("os").path.dirname(__file__))
from test_correlated_runs import SHORT  # noqa: E402  the tiny recipe's arguments


def _blt(**kw):
    return build("blt", 10, steps=40, num_records=1000, batch=100, buffers=2, **kw)


def test_build_pairs_the_fixed_cyclic_sampler_the_recurrence_and_one_gaussian_event():
    n = _blt()
    s = blt_math.optimize_blt(40, 2, 10)  # the same strategy, recomputed
    assert n.name == "blt" and n.accounting == GAUSSIAN and n.bands == 10 and n.sample_rate == 1.0
    sens = blt_math.toeplitz_sensitivity(s.blt.coefs(40), min_separation=10)  # from the coefficients
    assert n.sensitivity == pytest.approx(sens, rel=1e-9) and sens > 2.0  # 4 participations, positive coefficients
    sigma = 3.0
    assert n.event(sigma) == pytest.approx((sigma / sens, 1.0, 1))
    # the accounted ε is the exact one of the Gaussian mechanism with μ = sens/σ (PRV's bound: never below) ...
    eps = accounting.compute_epsilon_history(history=[n.event(sigma)], delta=1e-5, accountant="prv")
    exact = blt_math.epsilon_for_mu(sens / sigma, 1e-5)
    assert exact <= eps <= 1.005 * exact
    # ... and well above what the amplified reduction (σ, q_b, ⌈T/b⌉) would claim, which BLT has no proof of
    amplified = accounting.compute_epsilon_history(history=[(sigma, n.sample_rate, 4)], delta=1e-5, accountant="prv")
    assert eps > 1.2 * amplified
    rec = n.recurrence()
    assert isinstance(rec, blt_math.BLTRecurrence) and rec.extra_tensors_per_parameter == 2
    texts = [f"record {i}" for i in range(1000)]
    sampler = n.sampler(texts=texts, key=3, generator=torch.Generator().manual_seed(0))
    groups = assign_groups(texts, bands=10, key=3)
    assert isinstance(sampler, CyclicPoissonBatchSampler)
    it = iter(sampler)
    for t in range(12):  # every record of group t mod 10, no other: at most ⌈T/b⌉ steps, exactly b apart
        assert next(it) == [i for i, g in enumerate(groups) if g == t % 10]
    j = n.to_json()
    assert (j["mechanism"], j["accounting"], j["groups"], j["group_sample_rate_credited"]) == ("blt", GAUSSIAN, 10,
                                                                                                False)
    # σ for a target: the draw std is sens·(σ of one Gaussian step at q = 1)
    draw = n.calibrate(target_epsilon=2.0, delta=1e-5)
    assert blt_math.epsilon_for_mu(sens / draw, 1e-5) == pytest.approx(2.0, abs=0.02)
    assert blt_math.epsilon_for_mu(sens / draw, 1e-5) <= 2.0 + 1e-9


def test_no_path_accounts_a_blt_run_as_amplified_dp_sgd():
    """The plan calibrates the draw's σ for one Gaussian mechanism and accounts every partial run as one (with the
    sensitivity of the steps run); the engine's history maps the accountant's per-step (σ, q_b) records to it."""
    from types import SimpleNamespace

    from dpllm.privacy.engine import PrivateTraining
    from dpllm.privacy.plan import plan_privacy

    n = _blt()
    plan = plan_privacy(num_records=1000, logical_batch_size=100, steps=40, target_epsilon=2.0, delta=1e-5,
                        accountant="prv", noise=n)
    assert plan.gaussian and plan.bands == 10 and plan.sample_rate == 1.0 and plan.expected_batch_size == 100
    assert plan.noise_multiplier == n.calibrate(target_epsilon=2.0, delta=1e-5)  # as dpllm plan calibrates it
    sens = n.sensitivity
    assert plan.history == [(pytest.approx(plan.noise_multiplier / sens, rel=1e-15), 1.0, 1)]
    assert plan.history[0][0] * sens >= plan.noise_multiplier * (1 - 1e-15)  # never rounded to less noise
    exact = blt_math.epsilon_for_mu(sens / plan.noise_multiplier, 1e-5)
    assert exact <= plan.epsilon() <= 2.0 and plan.epsilon() <= 1.01 * exact
    # a run stopped after 15 steps: 2 participations, less sensitivity, less ε; none before the first step
    early = blt_math.toeplitz_sensitivity(n.strategy.blt.coefs(15), min_separation=10)
    assert plan.stage_history(15) == [(pytest.approx(plan.noise_multiplier / early, rel=1e-12), 1.0, 1)]
    assert early < sens and plan.epsilon(15) < plan.epsilon() and plan.stage_history(0) == []
    # past the planned 40 steps: k = 5 participations, not the plan's 4 (more ε, never under-reported)
    late = blt_math.toeplitz_sensitivity(n.strategy.blt.coefs(45), min_separation=10)
    assert plan.stage_history(45)[0][0] == pytest.approx(plan.noise_multiplier / late, rel=1e-12) and late > sens
    engine = SimpleNamespace(accountant=SimpleNamespace(history=[(plan.noise_multiplier, 1.0, 15),
                                                                 (plan.noise_multiplier, 1.0, 25)]))
    private = PrivateTraining(model=None, optimizer=None, criterion=None, data_loader=None, engine=engine, plan=plan)
    assert private.history() == plan.history and private.steps_taken() == 40
    engine.accountant.history.append((1.0, 0.1, 1))  # a step at another (σ, q) than the plan's: a bug, refused
    with pytest.raises(RuntimeError, match="a dpllm bug"):
        private.history()
    with pytest.raises(PrivacyPlanError, match="over 40 steps of BLT noise over 10 cyclic groups"):
        plan_privacy(num_records=1000, logical_batch_size=100, steps=40, target_epsilon=2.0, delta=1e-5,
                     accountant="prv", noise=n, noise_multiplier=0.9 * plan.noise_multiplier)


@pytest.mark.parametrize("extra, words", [
    (("--noise", "blt", "--grad_sample_mode", "ghost_fsdp"), "privacy.noise: blt is not built for "
                                                             "grad_sample_mode=ghost_fsdp"),
    (("--noise", "blt", "--noise_schedule", "linear"), "noise_schedule=linear with privacy.noise: blt"),
    (("--noise", "blt", "--clipping", "quantile"), "clipping: quantile with privacy.noise: blt"),
    (("--noise", "blt", "--privacy_unit", "sequence"), "privacy_unit=sequence with privacy.noise: blt"),
    (("--noise", "blt", "--long_records", "split"), "blt is not yet supported with long_records=split"),
    (("--noise", "blt", "--packing", "true"), "packing=true with noise: blt is not built yet"),
    (("--buffers", "3"), "privacy.buffers=3 needs privacy.noise=blt"),
    (("--noise", "banded", "--buffers", "2"), "needs privacy.noise=blt"),
    (("--noise", "blt", "--buffers", "9"), "from 1 to 8"),
    (("--noise", "dense"), "choose one of independent, banded, blt"),
])
def test_config_refuses_what_blt_does_not_cover_and_bad_buffers_in_one_line(tmp_path, extra, words):
    with pytest.raises(ConfigError) as err:
        parse_config(["--output_dir", str(tmp_path / "x"), *SHORT, *extra])
    assert words in str(err.value)
    assert not (tmp_path / "x").exists()


def test_build_refuses_bad_blt_arguments():
    kw = dict(steps=40, num_records=1000, batch=100)
    with pytest.raises(PrivacyPlanError, match="bands ≤ 10"):
        build("blt", 11, **kw)
    for bad in ("0", "9", "many"):
        with pytest.raises(PrivacyPlanError, match="from 1 to 8"):
            build("blt", 10, buffers=bad, **kw)
    with pytest.raises(PrivacyPlanError, match="needs privacy.noise=blt"):
        build("banded", 2, buffers=2, noise_multiplier=1.0, **kw)


def test_plan_compares_the_three_and_blt_recomputes_from_blt_py(capsys):
    """N = 2000, B = 100 (20 batches per epoch), 10 epochs, ε = 8: both correlated mechanisms beat DP-SGD
    (seen σ·RMSE: banded 5.92, BLT 6.36, DP-SGD 7.89), and BLT's figures are those of blt.py's functions."""
    from dpllm.privacy.planning import cli_main

    assert cli_main(["--num-records", "2000", "--batch", "100", "--epochs", "10", "--target-epsilon", "8",
                     "--delta", "1e-5", "--noise", "blt", "--epsilons", "", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    c = plan["correlated_noise"]
    b = c["blt"]
    assert b["bands"] == 20 and b["auto"] and [r["bands"] for r in b["rows"]] == [20, 10, 5, 2]
    s = blt_math.optimize_blt(200, b["buffers"], 20)
    assert b["sensitivity"] == pytest.approx(s.sensitivity(200), rel=1e-9)
    mu = b["mu"]
    assert blt_math.epsilon_for_mu(mu, 1e-5) == pytest.approx(8.0, abs=0.02) and b["epsilon"] <= 8.0
    assert b["error"] == pytest.approx(s.prefix_sum_rmse(200) / mu, rel=1e-9)
    assert b["draw_noise_multiplier"] == pytest.approx(s.sensitivity(200) / mu, rel=1e-9)
    assert b["error"] == min(r["error"] for r in b["rows"])  # 20 groups: fewest participations
    errors = {r["mechanism"]: r["error"] for r in c["comparison"]}
    assert [r["error"] for r in c["comparison"]] == sorted(errors.values()) and c["best"] == c["comparison"][0][
        "mechanism"]
    assert errors["independent"] == pytest.approx(plan["target"]["noise_multiplier"] * math.sqrt(201 / 2), rel=1e-9)
    assert errors["banded"] < 0.85 * errors["independent"] and errors["blt"] < 0.85 * errors["independent"]
    assert cli_main(["--num-records", "2000", "--batch", "100", "--epochs", "10", "--target-epsilon", "8",
                     "--delta", "1e-5", "--noise", "blt", "--bands", "10", "--buffers", "1", "--epsilons", ""]) == 0
    out = capsys.readouterr().out
    assert "BLT, b = 10, 1 buffer(s) (one Gaussian mechanism)" in out and "least expected error first" in out


def test_one_epoch_at_small_epsilon_dp_sgd_beats_unamplified_blt():
    """One epoch, ε = 1: every record joins one step either way; amplification by sampling (which BLT cannot
    claim) lets DP-SGD run at a smaller σ, and correlating the noise cannot make up for it."""
    from dpllm.privacy.planning import correlated_table

    c = correlated_table(num_records=2000, batch=100, steps=20, target_epsilon=1.0, delta=1e-5, noise="blt")
    errors = {r["mechanism"]: r["error"] for r in c["comparison"]}
    assert errors["independent"] < errors["blt"]
