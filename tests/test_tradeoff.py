"""dpllm.privacy.tradeoff: bounds on any attack's AUC and TPR at low FPR from a run's privacy history, checked
against closed forms (one Gaussian step), against the best attack simulated on the subsampled Gaussian, and in
the compliance item that compares an audit with them (and the model card, which must not show the verdict)."""

import json
import math
import os
import time
from statistics import NormalDist

import numpy as np
import pytest

from dpllm import compliance
from dpllm.privacy import tradeoff
from dpllm.privacy.report import PrivacyReport

N = NormalDist()


@pytest.mark.parametrize("history", [[(1.1, 0.16, 30)], [(0.8, 0.05, 200), (2.0, 0.5, 10)]])
def test_the_curve_reads_every_epsilon_at_once_and_never_below_one_at_a_time(history):
    # the curve's δ come from dp-accounting's read-out of the whole ε grid in one pass, raised by its rounding bound;
    # one read-out per ε (its direct sum of non-negative terms) is the reference
    from dp_accounting.pld import privacy_loss_distribution

    tradeoff._curve.cache_clear()
    c = tradeoff.privacy_curve(history=history)
    pld = None
    for sigma, q, steps in history:
        one = privacy_loss_distribution.from_gaussian_mechanism(
            sigma, sampling_prob=q, value_discretization_interval=tradeoff.DISCRETIZATION).self_compose(steps)
        pld = one if pld is None else pld.compose(one)
    single = np.array([pld.get_delta_for_epsilon(float(e)) for e in c.epsilons])
    single += tradeoff.ROUNDING * sum(t for _, _, t in history) * np.finfo(float).eps  # the composition's margin
    assert len(c.epsilons) == tradeoff.EPSILON_POINTS and single[0] > 0.1 and single[-1] < 1e-11
    assert np.all(c.deltas >= single) and np.all(c.deltas <= single + 1e-10)


@pytest.mark.parametrize("history,group_size", [([(0.8, 0.01, 1000)], 1), ([(1.0, 1.0, 1)], 1),
                                                ([(0.5, 0.1, 100), (2.0, 0.5, 10)], 1), ([(20.0, 0.001, 10)], 1),
                                                ([(1.0, 0.05, 200)], 3), ([(0.0, 0.1, 10)], 1)])
def test_the_envelope_gives_the_minimum_over_every_line(history, group_size):
    # U(α) from the lower envelope of the lines against the minimum over all 2 x 1,500 of them, at every α of the
    # AUC grid, a log grid down to 1e-12 and the audits' points: never lower (a bound must not drop), and the same
    # number up to rounding (it was not loosened either)
    c = tradeoff.privacy_curve(history=history, group_size=group_size)
    alphas = np.concatenate([np.linspace(0, 1, tradeoff.AUC_POINTS + 1), np.logspace(-12, 0, 500), tradeoff.FPRS])
    e, d = np.exp(c.epsilons)[None, :], c.deltas[None, :]
    every = np.concatenate([np.minimum(d + e * x, 1.0 - (1.0 - d - x) / e).min(axis=1)
                            for x in np.array_split(alphas[:, None], 8)])
    every = np.clip(every, alphas, 1.0)
    got = c.max_tpr(alphas)
    assert np.all(got >= every) and np.all(got <= every + 1e-12)
    assert c.max_tpr(0.01) == got[-2]  # a scalar reads the same line as the array


@pytest.mark.parametrize("sigma", [0.5, 1.0, 2.0, 4.0])
def test_one_gaussian_step_matches_the_closed_form_from_above(sigma):
    # q = 1, one step: the trade-off is exactly β(α) = Φ(Φ⁻¹(1 − α) − 1/σ), so TPR(α) = Φ(Φ⁻¹(α) + 1/σ) and
    # AUC = Φ(1/(σ√2)). The bound may exceed them (pessimistic PLD, finite ε grid, right-hand sums), never undercut.
    c = tradeoff.privacy_curve(history=[(sigma, 1.0, 1)])
    mu = 1 / sigma
    auc = N.cdf(mu / math.sqrt(2))
    assert auc <= c.max_auc() <= auc + 5e-4  # the AUC grid over-estimates by ≤ 1/4000
    for a in (0.01, 0.001, 0.1, 0.5):
        exact = N.cdf(N.inv_cdf(a) + mu)
        assert exact - 1e-9 <= c.max_tpr(a) <= exact * (1 + 1e-3) + 1e-6
    b = c.bounds()
    assert b["auc"] >= auc and b["tpr@fpr=0.01"] >= N.cdf(N.inv_cdf(0.01) + mu)  # printed values rounded up


def test_bounds_fall_as_noise_grows_and_rise_with_group_size():
    rows = [tradeoff.privacy_curve(history=[(s, 0.02, 500)]).bounds() for s in (0.6, 0.8, 1.0, 1.5, 3.0)]
    for key in ("auc", "tpr@fpr=0.01", "tpr@fpr=0.001"):
        values = [r[key] for r in rows]
        assert values == sorted(values, reverse=True) and values[0] > values[-1], (key, values)
    # σ = 3 over 500 steps at q = 0.02 is close to μ-GDP with μ = q·√(T·(e^{1/σ²} − 1)) = 0.153 (the CLT), whose
    # AUC is Φ(μ/√2) = 0.543: barely better than a coin
    assert 0.54 < rows[-1]["auc"] < 0.55
    one = tradeoff.privacy_curve(history=[(1.0, 0.05, 50)]).bounds()
    k1 = tradeoff.privacy_curve(history=[(1.0, 0.05, 50)], group_size=1, discretization=1e-2).bounds()
    k3 = tradeoff.privacy_curve(history=[(1.0, 0.05, 50)], group_size=3).bounds()
    assert k1["auc"] >= one["auc"] - 1e-3  # a coarser grid is looser, never tighter
    assert k3["auc"] > one["auc"] and k3["tpr@fpr=0.01"] > one["tpr@fpr=0.01"]


def _likelihood_ratio_attack(sigma, q, steps, n, rng):
    """The optimal test of 'the record was in' on the scalar DP-SGD channel: each step releases
    B·1 + N(0, σ²) with B ~ Bernoulli(q) for a member (0 otherwise); score = log-likelihood ratio."""
    def scores(member):
        y = rng.normal(0.0, sigma, size=(n, steps))
        if member:
            y += rng.random((n, steps)) < q
        return np.log1p(q * np.expm1((2 * y - 1) / (2 * sigma ** 2))).sum(axis=1)

    return scores(True), scores(False)


@pytest.mark.parametrize("sigma,q,steps", [(1.0, 0.1, 20), (0.7, 0.05, 40), (2.0, 1.0, 1)])
def test_never_below_the_best_simulated_attack_on_the_gaussian(sigma, q, steps):
    from mia.metrics import auc, tpr_at_fpr

    rng = np.random.default_rng(7)
    n = 100_000
    m, o = _likelihood_ratio_attack(sigma, q, steps, n, rng)
    b = tradeoff.privacy_curve(history=[(sigma, q, steps)]).bounds()
    measured = {"auc": auc(m, o), "tpr@fpr=0.01": tpr_at_fpr(m, o, 0.01), "tpr@fpr=0.001": tpr_at_fpr(m, o, 0.001)}
    for key, value in measured.items():
        se = math.sqrt(max(value * (1 - value), 1e-4) / n)
        assert value <= b[key] + 4 * se, (key, value, b[key])
    # and the bound is near what the best attack reaches: within 15% relative at FPR 1%
    assert b["tpr@fpr=0.01"] <= 1.15 * measured["tpr@fpr=0.01"] + 4 * math.sqrt(0.01 / n)


def test_no_noise_bounds_nothing_and_no_steps_bounds_everything():
    assert tradeoff.privacy_curve(history=[(0.0, 0.1, 10)]).bounds()["auc"] == 1.0
    b = tradeoff.privacy_curve(history=[(1.0, 0.1, 0)]).bounds()
    assert 0.5 <= b["auc"] <= 0.5 + 1 / tradeoff.AUC_POINTS and b["tpr@fpr=0.01"] == 0.01  # right-hand sums


def _report(**kw):
    base = {"enabled": True, "num_records": 1000, "steps": 100, "logical_batch_size": 10, "physical_batch_size": 10,
            "epsilon": 3.0, "delta": 1e-5, "accountant": "prv", "noise_multiplier": 1.0, "sample_rate": 0.01,
            "history": [[1.0, 0.01, 100]], "noise_secret": True, "max_grad_norm": 1.0, "clipping": "flat"}
    return PrivacyReport(**{**base, **kw})


def test_for_report_units_and_refusals():
    rec = tradeoff.for_report(_report()).bounds()
    assert rec["unit"] == "record" and rec["group_size"] == 1
    els = _report(privacy_unit="user", user_level={"sampling": "els", "max_records_per_user": 4, "group_size": 4,
                                                   "record_delta": 2.5e-6})
    assert tradeoff.for_report(els).bounds()["auc"] > rec["auc"]  # a user of 4 records is easier to spot
    uls = _report(privacy_unit="user", user_level={"sampling": "uls", "max_records_per_user": 4, "group_size": 1})
    assert tradeoff.for_report(uls).bounds()["auc"] == rec["auc"]  # the history already counts users
    with pytest.raises(tradeoff.TradeoffError, match="per user"):
        tradeoff.for_report(uls, unit="record")
    uncapped = _report(user_level={"sampling": "record", "max_records_per_user": None, "group_size": None})
    assert tradeoff.for_report(uncapped).unit == "record"
    with pytest.raises(tradeoff.TradeoffError, match="max_records_per_user"):
        tradeoff.for_report(uncapped, unit="user")
    with pytest.raises(tradeoff.TradeoffError, match="without DP"):
        tradeoff.for_report(_report(enabled=False))


def test_plain_reading_quotes_the_bounds():
    b = tradeoff.privacy_curve(history=[(1.0, 0.01, 100)]).bounds()
    text = tradeoff.plain_reading(b, plural="conversations")
    assert f"at most {100 * b['tpr@fpr=0.01']:.3g}% of the conversations" in text and "wrongly flags 1%" in text
    assert f"{100 * b['auc']:.1f}%" in text


# ---- the compliance item and the card ----------------------------------------------------------------------

def _audited_run(tmp_path, name, *, auc, tpr1, tpr01, n=5000):
    run = tmp_path / name
    (run / "checkpoint").mkdir(parents=True)
    (run / "checkpoint" / "model.safetensors").write_text("weights")
    old = time.time() - 100
    os.utime(run / "checkpoint" / "model.safetensors", (old, old))
    (run / "audit").mkdir()
    attack = {"auc": auc, "tpr@fpr=0.01": tpr1, "tpr@fpr=0.001": tpr01, "n_members": n, "n_nonmembers": n}
    (run / "audit" / "mia_report.json").write_text(json.dumps({"attacks": {"loss": attack}}))
    return run


def test_the_audit_item_fails_above_the_bound_and_passes_below(tmp_path):
    report = _report()  # σ = 1, q = 0.01, 100 steps
    b = tradeoff.for_report(report).bounds()
    assert b["auc"] < 0.56 and b["tpr@fpr=0.01"] < 0.02  # far below the old ceiling e^ε/(1+e^ε) = 0.953 at ε = 3
    below = _audited_run(tmp_path, "below", auc=0.51, tpr1=0.012, tpr01=0.001)
    item = compliance._audit(below, report)
    assert item.status == compliance.MET, item.evidence
    assert f"AUC {b['auc']:.4f}" in item.evidence
    # an AUC of 0.60 on 5,000 + 5,000 records is above the 0.55 any attack can reach: an implementation bug
    above = _audited_run(tmp_path, "above", auc=0.60, tpr1=0.012, tpr01=0.001)
    item = compliance._audit(above, report)
    assert item.status == compliance.NOT_MET and "exceeds what the mechanism allows" in item.evidence
    # so is finding 10% of members at 1% FPR
    low_fpr = _audited_run(tmp_path, "lowfpr", auc=0.52, tpr1=0.10, tpr01=0.001)
    assert compliance._audit(low_fpr, report).status == compliance.NOT_MET
    # the same AUC on 60 + 60 records is within sampling error of the bound: no verdict of a bug
    small = _audited_run(tmp_path, "small", auc=0.60, tpr1=0.0, tpr01=0.0, n=60)
    assert compliance._audit(small, report).status == compliance.MET


def test_the_card_shows_that_an_audit_ran_never_its_result(tmp_path):
    report = _report()
    passed = compliance._audit(_audited_run(tmp_path, "a", auc=0.51, tpr1=0.01, tpr01=0.001), report)
    failed = compliance._audit(_audited_run(tmp_path, "b", auc=0.70, tpr1=0.3, tpr01=0.1), report)
    assert (passed.status, failed.status) == (compliance.MET, compliance.NOT_MET)
    card_a, card_b = compliance.public_table([passed]), compliance.public_table([failed])
    assert card_a == card_b
    assert compliance.AUDITED in card_a and "audit/mia_report.json" in card_a and "0.70" not in card_b
    assert "public" not in compliance.to_json([failed])[0]


def test_the_model_card_says_what_one_unit_is_and_reads_epsilon_through_the_bounds(tmp_path):
    from dpllm.export import declared_record_kind, model_card, release_report

    released = release_report(_report(stages=[{"name": "sft", "enabled": True, "train_on": "private", "steps": 100,
                                                "history": [[1.0, 0.01, 100]]}]))
    b = tradeoff.for_report(released).bounds()
    chat = model_card(released, lora=False, has_base=False, record_kind="messages")
    assert "one **conversation**" in chat and "all of its turns" in chat
    assert f"can find at most {100 * b['tpr@fpr=0.01']:.3g}% of the conversations that were" in chat
    assert "the chance that any one record is used in a given training step" in chat
    unknown = model_card(released, lora=False, has_base=False)
    assert "one whole conversation for chat or instruction data" in unknown and "of the records that were" in unknown
    user = _report(privacy_unit="user", user_level={"unit": "user", "sampling": "els", "max_records_per_user": 4,
                                                     "group_size": 4, "record_delta": 2.5e-6,
                                                     "group_privacy": "mixture"})
    card = model_card(release_report(user), lora=False, has_base=False, record_kind="messages")
    assert "one **person**" in card and "at most 4 records" in card and "of the people that were" in card
    # the record shape reaches the card only when the publisher declared it (auto-detection reads the private file)
    (tmp_path / "config.yaml").write_text("data:\n  data_format: auto\n")
    assert declared_record_kind(tmp_path) is None
    (tmp_path / "config.yaml").write_text("data:\n  data_format: prompt_completion\n")
    assert declared_record_kind(tmp_path) == "prompt_completion"
