"""LiRA on synthetic Gaussian shadow confidences with known IN / OUT distributions."""

import numpy as np
import pytest

from mia import lira, metrics


def _synthetic(gap: float, n: int = 400, shadows: int = 16, seed: int = 0):
    rng = np.random.default_rng(seed)
    difficulty = rng.normal(0, 2, n)  # each record has its own mean, as real records do
    # Each record is IN for exactly half the shadows, the balanced design of the LiRA paper.
    shadow_in = rng.permuted(np.arange(shadows)[:, None].repeat(n, 1), axis=0) < shadows // 2
    shadow = difficulty + gap * shadow_in + rng.normal(0, 0.5, (shadows, n))
    target_in = rng.random(n) < 0.5
    target = difficulty + gap * target_in + rng.normal(0, 0.5, n)
    return target, shadow, shadow_in, target_in


@pytest.mark.parametrize("global_variance", [False, True])
def test_online_lira_separates_and_is_chance_without_signal(global_variance):
    target, shadow, shadow_in, is_in = _synthetic(gap=2.0)
    s = lira.lira_online(target, shadow, shadow_in, global_variance=global_variance,
                         input_scale="logit")
    assert metrics.auc(s[is_in], s[~is_in]) > 0.9
    target, shadow, shadow_in, is_in = _synthetic(gap=0.0)
    s = lira.lira_online(target, shadow, shadow_in, global_variance=global_variance,
                         input_scale="logit")
    assert metrics.auc(s[is_in], s[~is_in]) == pytest.approx(0.5, abs=0.07)


def test_offline_lira_separates():
    target, shadow, shadow_in, is_in = _synthetic(gap=2.0)
    s = lira.lira_offline(target, shadow, shadow_in, input_scale="logit")
    assert metrics.auc(s[is_in], s[~is_in]) > 0.9
    # The per-record calibration is what helps: the raw confidence is much weaker.
    assert metrics.auc(target[is_in], target[~is_in]) < 0.8


def test_logit_scaling_is_stable():
    p = np.array([1e-300, 0.25, 0.5, 1 - 1e-12])
    phi = lira.logit_confidence(np.log(p))
    np.testing.assert_allclose(phi[1:3], [np.log(1 / 3), 0.0], atol=1e-12)
    assert np.isfinite(phi).all() and phi[-1] > 25
    assert np.isfinite(lira.logit_confidence(np.array([0.0])))  # p = 1 exactly
    logits = np.array([[2.0, 0.0, -1.0], [0.0, 0.0, 0.0]])
    phi = lira.logit_confidence_from_logits(logits, np.array([0, 2]))
    p = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    np.testing.assert_allclose(phi, np.log(p[[0, 1], [0, 2]] / (1 - p[[0, 1], [0, 2]])))


def test_logprob_input_matches_logit_input():
    target, shadow, shadow_in, _ = _synthetic(gap=1.0)
    # Inverse of phi: log p = -log(1 + e^-phi).
    def to_logp(phi):
        return -np.logaddexp(0, -phi)
    a = lira.lira_online(to_logp(target), to_logp(shadow), shadow_in)
    b = lira.lira_online(target, shadow, shadow_in, input_scale="logit")
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_bad_inputs():
    target, shadow, shadow_in, _ = _synthetic(gap=1.0, shadows=2)
    shadow_in[:, 0] = True  # record 0 has no OUT shadow
    with pytest.raises(ValueError, match="record 0 has 0 OUT"):
        lira.lira_offline(target, shadow, shadow_in, input_scale="logit")
    balanced = _synthetic(gap=1.0, shadows=2)  # exactly 1 IN and 1 OUT shadow per record
    with pytest.raises(ValueError, match="needs >= 2"):
        lira.lira_online(*balanced[:3], input_scale="logit")
    with pytest.raises(ValueError, match="pooled IN variance"):
        lira.lira_online(*balanced[:3], input_scale="logit", global_variance=True)
    with pytest.raises(ValueError, match="shapes disagree"):
        lira.lira_online(target[:-1], shadow, shadow_in)
