"""Attack scores on hand-made signals."""

import numpy as np
import pytest

from mia import attacks
from mia.signals import Signals


def _signals():
    lp = [np.array([-0.1, -2.0, -0.5, -4.0, -0.2]), np.array([-1.0, -1.0])]
    mu = [np.full(5, -1.0), np.full(2, -0.5)]
    sigma = [np.full(5, 2.0), np.full(2, 0.0)]
    return Signals(loss=np.array([-x.mean() for x in lp]), num_tokens=np.array([5, 2]),
                   zlib_bytes=np.array([10, 4]), token_logprobs=lp, token_mu=mu, token_sigma=sigma)


def test_scores_by_hand():
    sig = _signals()
    np.testing.assert_allclose(attacks.score("loss", sig), [-1.36, -1.0])
    np.testing.assert_allclose(attacks.loss_attack(np.array([0.5, 2.0])), [-0.5, -2.0])
    np.testing.assert_allclose(attacks.score("zlib", sig), [-6.8 / 10, -2.0 / 4])
    # Lowest 20% of 5 tokens = 1 token; of 2 tokens = ceil(0.4) = 1 token.
    np.testing.assert_allclose(attacks.score("mink", sig), [-4.0, -1.0])
    np.testing.assert_allclose(attacks.score("mink", sig, k=0.4), [-3.0, -1.0])
    # Min-K%++: (lp - mu) / sigma, sigma floored at 1e-6 for the deterministic record.
    np.testing.assert_allclose(attacks.score("minkpp", sig), [-1.5, -0.5 / 1e-6])
    ref = Signals(loss=np.array([2.0, 0.5]), num_tokens=np.array([5, 2]), zlib_bytes=np.array([1, 1]),
                  token_logprobs=[], token_mu=[], token_sigma=[])
    np.testing.assert_allclose(attacks.score("ref", sig, reference=ref), [0.64, -0.5])


def test_registry_errors():
    with pytest.raises(ValueError, match="unknown attack 'lira2'.*choose from loss"):
        attacks.parse_attacks("loss,lira2")
    with pytest.raises(ValueError, match="--reference"):
        attacks.score("ref", _signals())
    with pytest.raises(ValueError, match="k=1.5"):
        attacks.score("mink", _signals(), k=1.5)
    assert attacks.parse_attacks(" loss, zlib ") == ["loss", "zlib"]
