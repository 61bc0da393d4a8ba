"""privacy.noise: banded and blt, audited: the canary machinery's ε lower bound stays under the reported ε, and
catches a sampler that does not belong to the mechanism's accounting.

White-box (fast, the power check). The released sequence of the real bk optimizer (``LeanAccumulation.add_noise``
with the run's BandMF or BLT recurrence and generator), over batches drawn by the run's own sampler
(``CorrelatedNoise.sampler``: cyclic over b groups keyed by each record's text). Each of m Dirac canaries
owns one coordinate (its clipped gradient is C·e_j) and is in the dataset by a fair coin; the forward and backward
passes are left out, as in test_quantile_audit.py, so that 1,000 canaries run in a second. The auditor knows
everything but the noise: it whitens the releases with the strategy (C·r = C·G + z), and scores each canary by the
matched filter of its own participation pattern (the one-run bound of mia.canaries takes any score). With q_b = 1:
banded is, by the reduction, DP-SGD at σ over ⌈T/b⌉ full-batch steps (μ = √⌈T/b⌉/σ); BLT is one Gaussian
mechanism with μ = sens(C, b, ⌈T/b⌉)/σ, the largest ‖C·p‖ over participation patterns p that are b apart. The same
releases drawn with plain Poisson sampling at q_b (every record may join every step: the sampler that does not go
with either accounting) are far less private than the report states, and the same audit says so.

End to end: a banded run of the recipe with canaries, then ``python -m mia canaries``: the bound is under the
reported ε, and the canary report names the mechanism and the event ε was computed from.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

M, BANDS, STEPS, TARGET, DELTA = 1000, 8, 16, 2.0, 1e-5


def _whitened_scores(*, cyclic: bool, seed: int, mechanism: str = "banded"):
    """One audited run: (scores, included, reported ε, σ, the accounting's μ, the canaries' ‖w‖)."""
    from dpllm.privacy import correlated
    from dpllm.privacy.accounting import compute_epsilon_history
    from dpllm.privacy.bk.optimizer import LeanAccumulation
    from dpllm.privacy.correlated.groups import assign_groups
    from dpllm.privacy.plan import plan_privacy
    from dpllm.sampling import PoissonBatchSampler

    rng = np.random.default_rng(seed)
    included = rng.random(M) < 0.5
    names = [f"canary {j}: {rng.integers(1 << 30)}" for j in range(M)]
    members = np.flatnonzero(included)
    texts = [names[j] for j in members]
    n = len(texts)
    batch = math.ceil(n / BANDS)  # ⌈N/B⌉ = b groups: q_b = 1, every record of the step's group joins
    extra = {"buffers": 2} if mechanism == "blt" else {"noise_multiplier": 1.0}
    noise = correlated.build(mechanism, BANDS, steps=STEPS, num_records=n, batch=batch, **extra)
    plan = plan_privacy(num_records=n, logical_batch_size=batch, steps=STEPS, target_epsilon=TARGET, delta=DELTA,
                        accountant="prv", noise=noise)
    sigma = plan.noise_multiplier  # the draw's std in units of C
    assert noise.sample_rate == plan.sample_rate == 1.0 and noise.bands == BANDS
    if mechanism == "blt":  # one Gaussian mechanism: μ = sens/σ, nothing credited to sampling
        mu = noise.sensitivity / sigma
        assert noise.sensitivity > 1.0 and plan.history == [(pytest.approx(1 / mu, rel=1e-12), 1.0, 1)]
        band = noise.strategy.blt.matrix(STEPS)  # C (lower-triangular Toeplitz, c₀ = 1)
    else:  # DP-SGD at σ, q_b = 1, ⌈T/b⌉ steps
        mu = math.sqrt(correlated.accounted_steps(STEPS, BANDS)) / sigma
        assert plan.history == [(sigma, 1.0, 2)]
        band = np.zeros((STEPS, STEPS))  # the strategy matrix C (lower-triangular, b bands)
        for i, ci in enumerate(np.asarray(noise.strategy.coefficients)):
            band += ci * np.eye(STEPS, k=-i)
    reported = compute_epsilon_history(history=plan.history, delta=DELTA, accountant="prv")
    gen = torch.Generator().manual_seed(seed + 1)
    sampler = noise.sampler(texts=texts, key=0, generator=gen) if cyclic else \
        PoissonBatchSampler(num_samples=n, sample_rate=noise.sample_rate, generator=gen)
    p = torch.nn.Parameter(torch.zeros(M, dtype=torch.float64))
    opt = LeanAccumulation(torch.optim.SGD([p], lr=0.0), noise_multiplier=sigma, max_grad_norm=1.0,
                           expected_batch_size=batch, generator=torch.Generator().manual_seed(seed + 2))
    opt.recurrence = noise.recurrence()
    released = np.zeros((STEPS, M))
    joined = np.zeros((STEPS, M))
    for t, ids in zip(range(STEPS), iter(sampler)):
        g = torch.zeros(M, dtype=torch.float64)
        g[torch.as_tensor(members[ids], dtype=torch.long)] = 1.0  # each sampled canary's clipped gradient C·e_j
        joined[t, members[ids]] = 1
        p.summed_grad = g
        opt.add_noise()  # the bk optimizer's own draw and recurrence: r_t = G_t + (C⁻¹z)_t
        released[t] = p.grad.detach().numpy()
        p.summed_grad = p.grad = None
    whitened = band @ released  # C·r = C·G + z: z i.i.d. N(0, σ²)
    # the participation pattern the auditor expects of each canary were it in: its group's steps (cyclic), or all
    groups = np.asarray(assign_groups(names, bands=BANDS, key=0))
    pattern = (np.arange(STEPS)[:, None] % BANDS == groups[None, :]).astype(float) if cyclic else np.ones((STEPS, M))
    assert np.array_equal(joined[:, included], pattern[:, included])  # q = 1: the members joined exactly there
    w = band @ pattern  # each canary's signal in C·G
    norm = np.linalg.norm(w, axis=0)
    scores = (w * whitened).sum(0) / (sigma * norm)  # N(‖w‖/σ, 1) in, N(0, 1) out
    return scores, included, reported, sigma, mu, norm


@pytest.mark.parametrize("mechanism", ["banded", "blt"])
def test_a_white_box_audit_stays_under_the_reported_epsilon_and_catches_a_wrong_sampler(mechanism):
    from mia.canaries import one_run_audit

    scores, included, reported, sigma, mu, norm = _whitened_scores(cyclic=True, seed=3, mechanism=mechanism)
    assert reported <= TARGET + 1e-6
    # the measured shift of a member's score is ‖w‖/σ, never above the accounting's μ (banded: ‖w‖ ≤ √⌈T/b⌉, a
    # truncated last band below it; BLT: ‖w‖ ≤ sens, the worst pattern's, which a canary of the last group reaches)
    shift = scores[included].mean() - scores[~included].mean()
    assert np.all(norm <= mu * sigma * (1 + 1e-9)) and norm.max() > 0.9 * mu * sigma
    assert shift <= mu + 4 * math.sqrt(2 / 500)
    assert shift == pytest.approx((norm[included] / sigma).mean(), abs=4 * math.sqrt(2 / 500))
    assert scores[~included].std() == pytest.approx(1.0, abs=0.1)  # the whitened noise is i.i.d. at σ
    found = one_run_audit(scores, included, delta=DELTA)["epsilon_lower"]
    assert 0.1 < found <= reported  # it measures real leakage, and no more than the report states
    wrong, inc2, reported2, *_ = _whitened_scores(cyclic=False, seed=3, mechanism=mechanism)
    assert reported2 == reported  # the same plan, the same σ: only the sampler differs
    assert one_run_audit(wrong, inc2, delta=DELTA)["epsilon_lower"] > reported


def test_a_banded_run_with_canaries_through_the_real_commands(tmp_path, capsys):
    """The recipe trains 4-banded with 300 canaries; ``mia canaries`` bounds ε under the report's and names the
    reduction beside it; ``mia audit``'s bounds come from the reduction's event (q_b, ⌈T/b⌉), not (q_b, T)."""
    import json

    from dpllm.privacy import tradeoff
    from mia.__main__ import main as mia
    from mia.audit import privacy_bounds
    from tests.helpers import in_process, load_recipe
    from tests.test_audit_pipeline import common

    out = tmp_path / "banded"
    assert load_recipe("finetune_llm").cli([*common(300, 32), "--output_dir", str(out), "--target_epsilon", "2",
                                            "--epochs", "1", "--noise", "banded", "--bands", "4"]) == 0
    rep = json.loads((out / "privacy_report.json").read_text())
    steps, q = rep["steps"], rep["sample_rate"]
    assert rep["correlated_noise"]["bands"] == 4 and rep["history"] == [[rep["noise_multiplier"], q, -(-steps // 4)]]
    # `python -m mia canaries` through its entry point in this process (`python -m mia` runs as a process of its own
    # in tests/test_rough_edges.py; here a process would add only its start-up)
    r = in_process(mia, ["canaries", "--run", str(out), "--no-progress"], capsys)
    assert r.returncode == 0, r.stderr[-2000:]
    canary = json.loads((out / "audit" / "canary_report.json").read_text())
    assert canary["m"] == 300 and not canary["privacy_bug"] and canary["verdict"] == "consistent"
    assert 0 <= canary["epsilon_lower"] <= canary["accountant_epsilon"] == pytest.approx(rep["epsilon"])
    words = f"banded correlated noise (b = 4, T = {steps} steps); ε from σ = {rep['noise_multiplier']:.4g}, " \
            f"q = {q:.4g}, {-(-steps // 4)} steps"
    assert canary["accounted_as"] == words and words in r.stdout
    assert words in (out / "audit" / "canary_report.md").read_text()
    bounds = privacy_bounds(out, {})
    reduced = tradeoff.privacy_curve(history=[tuple(h) for h in rep["history"]]).max_auc()
    unreduced = tradeoff.privacy_curve(history=[(rep["noise_multiplier"], q, steps)]).max_auc()
    assert bounds["auc"] == pytest.approx(reduced, abs=1e-4) and reduced < unreduced
