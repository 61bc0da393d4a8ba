"""privacy.noise: blt through the entry points: the bk optimizer's noise, the recipe, its report, ledger, card and
compliance, and a stopped run resumed. The strategy math alone is in test_correlated_blt.py, the registry and
plan in test_correlated_blt_wiring.py; FSDP2 (each process's own shards) in test_fsdp_bk.py."""

from __future__ import annotations

import json
import signal
import sys

import numpy as np
import pytest
import torch

from dpllm import ledger
from dpllm.config import parse_config
from dpllm.privacy.correlated import blt as blt_math
from dpllm.privacy.correlated import build

sys.path.insert(0, __import__("os").path.dirname(__file__))
from test_correlated_runs import SHORT  # noqa: E402  the tiny recipe: 8 steps, N = 236, B = 16 (15 batches per epoch)

# 4 cyclic groups over 8 steps: every record in at most 2 steps, 4 apart; each record of the group sampled at 4/15.
# PLD: one Gaussian mechanism is where RDP is loosest (7.9996 reported against the exact 7.437 at this σ)
BLT = ("--noise", "blt", "--bands", "4", "--buffers", "2", "--accountant", "pld")


def test_bk_optimizer_blt_noise_has_the_covariance_of_the_factorisation():
    """LeanAccumulation draws z ~ N(0, σ²C²) per coordinate and adds x = C⁻¹z through the BLT recurrence: over 40k
    coordinates (each its own sequence) the empirical covariance of the T steps' noise is σ²C²·C⁻¹C⁻ᵀ."""
    from dpllm.privacy.bk.optimizer import LeanAccumulation

    T, sigma, clip = 6, 0.8, 1.5
    noise = build("blt", 2, steps=T, num_records=20, batch=10, buffers=2)  # b = 2 groups, 3 participations
    lin = torch.nn.Linear(200, 200, bias=False, dtype=torch.float64)
    opt = LeanAccumulation(torch.optim.SGD(lin.parameters(), lr=0.0), noise_multiplier=sigma, max_grad_norm=clip,
                           expected_batch_size=1, generator=torch.Generator().manual_seed(4))
    opt.recurrence = noise.recurrence()
    xs = []
    for _ in range(T):
        lin.weight.summed_grad = torch.zeros_like(lin.weight)
        opt.add_noise()
        xs.append(lin.weight.grad.flatten().clone())
    X = torch.stack(xs).numpy()
    got = X @ X.T / X.shape[1]
    cinv = np.linalg.inv(noise.strategy.blt.matrix(T))
    want = (sigma * clip) ** 2 * cinv @ cinv.T
    # entries up to ~1.4; the standard error of one from 40k coordinates is ≈ 1.4·√(2/40k) ≈ 0.01: 0.05 is 5 of them
    np.testing.assert_allclose(got, want, atol=0.05)
    assert np.abs(want - np.diag(np.diag(want))).max() > 0.3  # correlated across steps: not DP-SGD's diagonal
    assert opt.recurrence.extra_tensors_per_parameter == 2


def _run(out, *extra):
    from dpllm.train import train

    return train(parse_config(["--output_dir", str(out), *SHORT, *BLT, *extra]))


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    out = tmp_path_factory.mktemp("blt") / "whole"
    _run(out)
    return out


def _gaussian_epsilon(history, delta):
    """dp-accounting's PLD of the run as one GaussianDpEvent (the closed form's pessimistic neighbour)."""
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dp_accounting.GaussianDpEvent(history[-1][0]))
    return acc.get_epsilon(delta)


def test_a_blt_run_trains_and_its_report_and_ledger_recompute(whole):
    out = whole
    r = json.loads((out / "privacy_report.json").read_text())
    c = r["correlated_noise"]
    assert (c["mechanism"], c["bands"], c["buffers"], c["steps"], c["max_participations"]) == ("blt", 4, 2, 8, 2)
    assert r["sample_rate"] == c["group_sample_rate"] == pytest.approx(4 / 15)  # q_b = b/⌈N/B⌉, not credited
    assert r["expected_batch_size"] == 15  # the fixed public batch ⌊N/⌈N/B⌉⌋ every step's noisy sum is divided by
    # the strategy recomputed from its own decays and scales: sens over the 8 steps from the dense coefficients
    strategy = blt_math.optimize_blt(8, 2, 4)
    assert c["theta"] == strategy.blt.theta.tolist()
    sens = blt_math.toeplitz_sensitivity(strategy.blt.coefs(8), min_separation=4)
    assert sens > 1.1  # two participations of positive coefficients
    assert r["history"] == [[pytest.approx(r["noise_multiplier"] / sens, rel=1e-12), 1.0, 1]]
    # the reported ε is the Gaussian mechanism's with μ = sens/σ: ≥ the exact closed form, ≈ dp-accounting's PLD
    exact = blt_math.epsilon_for_mu(sens / r["noise_multiplier"], r["delta"])
    assert r["accountant"] == "pld" and exact <= r["epsilon"] <= 8.0
    assert r["epsilon"] == pytest.approx(exact, rel=1e-3)
    assert _gaussian_epsilon(r["history"], r["delta"]) == pytest.approx(r["epsilon"], rel=1e-3)
    # every checkpoint line: the steps run so far as one Gaussian mechanism (sens of 2, 4, 6 steps), recomputed
    assert ledger.verify(out).ok
    lines = {e["step"]: e for e in ledger.read(out) if e["kind"] == "checkpoint"}
    for step in (2, 4, 6):
        k_sens = blt_math.toeplitz_sensitivity(strategy.blt.coefs(step), min_separation=4)
        assert lines[step]["history"] == [[pytest.approx(r["noise_multiplier"] / k_sens, rel=1e-12), 1.0, 1]]
    assert lines[2]["epsilon"] < lines[6]["epsilon"] < r["epsilon"]  # 1 participation, then 2 with more overlap
    # the buffers are secret: in the owner-only rng_state.pt under checkpoints/, never in the released checkpoint/
    state = out / "checkpoints" / "step-000008" / "rng_state.pt"
    saved = torch.load(state, weights_only=True)[0]["noise_recurrence"]
    assert saved["step"] == 8 and all(v.shape[0] == 2 for v in saved["buffers"].values())
    assert state.stat().st_mode & 0o077 == 0 and not any("rng" in p.name for p in (out / "checkpoint").iterdir())
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(row["loss"] == row["loss"] for row in rows if "loss" in row)  # finite: it trained
    from dpllm import compliance
    from dpllm.export import model_card, release_report
    from dpllm.hub import dp_metadata
    from dpllm.privacy.report import PrivacyReport

    report = PrivacyReport.read(out)
    assert "BLT correlated noise, 2 buffer(s), cyclic sampling over 4 groups" in report.summary()
    assert any("no amplification" in line for line in report.details())
    single = {i.name: i for i in compliance.check(out)}["single_epoch"]
    assert "= 2 (⌈8/4⌉ steps of its cyclic group) = 0.533 expected passes" in single.evidence
    released = release_report(report)
    assert released.correlated_noise["sensitivity"] == pytest.approx(sens)  # the bundle's report recomputes ε
    assert "BLT matrix factorization, 2 buffer(s)" in model_card(released, lora=False, has_base=False)
    assert dp_metadata(released)["mechanism"].startswith("BLT correlated noise")


def test_a_stopped_blt_run_resumes_the_same_noise_sequence(whole, tmp_path, monkeypatch):
    """Stopped at step 4 (a scheduler's SIGTERM: checkpoint, then stop) and resumed: the BLT buffers, the cyclic
    group's turn and the generators continue, so the weights, metrics and every ledger ε equal the uninterrupted run's
    (seeded noise; the same arithmetic in the same order)."""
    import dpllm.train
    from dpllm.resume import Interrupted

    after = dpllm.train.Trainer.after_step

    def stop_at_4(self):
        after(self)
        if self.step == 4:
            self.stops.requested = signal.SIGTERM

    monkeypatch.setattr(dpllm.train.Trainer, "after_step", stop_at_4)
    out = tmp_path / "stopped"
    with pytest.raises(Interrupted):
        _run(out)
    assert not (out / "privacy_report.json").exists()
    monkeypatch.setattr(dpllm.train.Trainer, "after_step", after)
    resumed = _run(out, "--resume_from", "latest")
    assert resumed["resumed_from_step"] == 4
    a, b = (json.loads((d / "privacy_report.json").read_text()) for d in (out, whole))
    assert a["history"] == b["history"] and a["epsilon"] == b["epsilon"]
    eps = {e["step"]: e["epsilon"] for e in ledger.read(out) if e["kind"] == "checkpoint"}
    assert eps == {e["step"]: e["epsilon"] for e in ledger.read(whole) if e["kind"] == "checkpoint"}
    assert ledger.verify(out).ok
    assert (out / "checkpoint" / "model.safetensors").read_bytes() == \
        (whole / "checkpoint" / "model.safetensors").read_bytes()
