"""clipping: quantile, audited: the released pair (noised clipped sum, noised centred count) of the real bk optimizer
is a Gaussian mechanism no stronger than the σ accounted, and a white-box membership test with a worst-case record
finds an ε lower bound (Clopper-Pearson, mia.canaries) under the reported ε, while the same test run on a mis-split
mechanism (the gradient at σ instead of σ_g, the count barely noised) finds one above it: the test has the power to
fail.

The mechanism: one step of the bk optimizer (its add_noise, after the records were clipped and counted by
QuantileClipping.weights, as bk's backward pass does: the forward and backward passes are left out to run 4,000
releases in seconds), no subsampling (the record is in or out by the auditor's choice; q = 1), over five
fixed records and, in half the trials, a canary whose gradient 100·e₁ is far above C: clipped to C·e₁, its centred
bit is −½. The auditor knows everything but the noise, and scores each trial by the Neyman-Pearson statistic of
the pair: the canary's shift of the sum along e₁ over σ_g²C², plus its shift of the count over σ_b². C stays fixed
(η = 0: C's move is post-processing and plays no part in one release).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

TRIALS = 2000  # per world (canary in, canary out)
SIGMA, SIGMA_B, C, DELTA = 1.0, 0.6, 1.0, 1e-5  # σ_b near σ/2: the count carries most of the pair's budget


def _releases(*, canary: bool, broken: bool = False, seed: int) -> np.ndarray:
    """TRIALS releases of the real bk optimizer, each as (sum along e₁, noised count)."""
    from opacus import PrivacyEngine

    from dpllm.privacy.bk import make_private_bk
    from dpllm.privacy.quantile import QuantileClipping

    torch.manual_seed(0)
    d = 6
    net = nn.Linear(d, 1, bias=False).double()
    base = torch.randn(5, d, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 0.2  # norms < C
    x = torch.cat([base, 100.0 * torch.eye(d, dtype=torch.float64)[:1]]) if canary else base
    q = QuantileClipping(initial=C, target_quantile=0.5, lr=0.0, count_noise_multiplier=0.05 if broken else SIGMA_B,
                         expected_batch_size=6)
    if broken:  # the mis-split control: the count almost noiseless and the gradient at the full σ
        q.gradient_noise_multiplier = lambda sigma: sigma
    counts = []
    real = q.release_noised
    q.release_noised = lambda noised: counts.append(noised) or real(noised)
    _, opt = make_private_bk(engine=PrivacyEngine(accountant="rdp"), model=net,
                                 optimizer=torch.optim.SGD(net.parameters(), lr=0.0), clip_weights=q.weights,
                                 noise_multiplier=SIGMA, max_grad_norm=C, expected_batch_size=6,
                                 noise_generator=torch.Generator().manual_seed(seed), quantile=q)
    weight = net.weight
    sums = []
    for _ in range(TRIALS):
        # what bk's backward pass leaves for the optimizer: the records clipped at C by q.weights (which adds their
        # centred bits to the count), summed; then the optimizer's own noise for the pair (one step, unscaled)
        norms = x.norm(dim=1)
        weight.summed_grad = (q.weights(norms)[:, None] * x).sum(0).view_as(weight)
        opt.add_noise()
        sums.append(float(weight.grad[0, 0]))
        weight.summed_grad = weight.grad = None
    assert q.clip == C and q.steps == TRIALS
    return np.c_[sums, counts]


def test_the_released_pair_is_no_stronger_than_sigma_and_an_audit_stays_under_the_reported_epsilon():
    from dpllm.privacy.accounting import compute_epsilon_history
    from dpllm.privacy.quantile import gradient_noise_multiplier
    from mia.canaries import clopper_pearson_epsilon

    reported = compute_epsilon_history(history=[(SIGMA, 1.0, 1)], delta=DELTA, accountant="prv")
    sigma_g = gradient_noise_multiplier(SIGMA, SIGMA_B)
    found = {}
    for broken in (False, True):
        out, inn = _releases(canary=False, broken=broken, seed=11), _releases(canary=True, broken=broken, seed=12)
        # the white-box view: the canary's shift of each part and each part's noise, measured
        shift = inn.mean(0) - out.mean(0)
        std = np.sqrt((inn.var(0) + out.var(0)) / 2)
        mu = float(np.hypot(*(shift / std)))  # the pair's measured sensitivity in units of its noise
        # Neyman-Pearson score of "canary in" for the mechanism the auditor knows (σ_g, σ_b; here the real split)
        s_noise, k_noise = (SIGMA, 0.05) if broken else (sigma_g, SIGMA_B)
        both = np.r_[out, inn]
        scores = both[:, 0] * C / (s_noise * C) ** 2 - both[:, 1] * 0.5 / k_noise ** 2
        included = np.r_[np.zeros(TRIALS, bool), np.ones(TRIALS, bool)]
        found[broken] = {"mu": mu, "shift": shift, "std": std,
                         "eps": clopper_pearson_epsilon(scores, included, delta=DELTA)["epsilon_lower"]}
    real = found[False]
    # the canary moved the sum by C and the centred count by -½ (a record above C), and the noises are σ_g·C, σ_b
    assert real["shift"][0] == pytest.approx(C, abs=5 * sigma_g * C * math.sqrt(2 / TRIALS))
    assert real["shift"][1] == pytest.approx(-0.5, abs=5 * SIGMA_B * math.sqrt(2 / TRIALS))
    assert real["std"] == pytest.approx([sigma_g * C, SIGMA_B], rel=0.06)  # 2000 draws: ~1.6% each
    # the pair's μ measured from the releases is the accounted 1/σ (sampling error of the shifts: ~±0.1)
    assert real["mu"] == pytest.approx(1 / SIGMA, abs=0.12)
    assert 0.3 < real["eps"] < reported  # the audit finds real leakage, and no more than the report states
    assert found[True]["mu"] > 5 and found[True]["eps"] > reported  # a mis-split pair is caught
