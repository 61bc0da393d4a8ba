"""privacy.noise: blt beyond bk at record level: Opacus's hooks and ghost optimizers (one process and DDP's rank rule),
user-level sampling (ULS: the user is the unit grouped, clipped and accounted), DPTrainer and the scaling sweep.

BLT's run is one Gaussian mechanism, (σ/sens(C, b, ⌈n/b⌉), q = 1, 1 step), whatever clips the units: these tests
check that each entry point draws through the BLT recurrence and reports exactly the plan's event. The bk recipe
run is in test_correlated_blt_runs.py, the banded equivalents in test_correlated_engines.py."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from dpllm import ledger
from dpllm.config import ConfigError, parse_config
from dpllm.privacy import accounting, correlated
from dpllm.privacy.correlated import blt as blt_math
from dpllm.privacy.plan import plan_privacy

sys.path.insert(0, __import__("os").path.dirname(__file__))
from test_correlated_engines import uls_plan, uls_run_by_turns  # noqa: E402
from test_correlated_runs import SHORT  # noqa: E402  the tiny recipe: N = 236, B = 16 (15 batches per epoch)

# The Opacus optimizers' BLT draws (C·X = Z on hooks and ghost, DDP's rank-0 rule) are tested with banded's in
# test_correlated_engines.py (parametrized by mechanism).


# ---- the recipe on hooks and ghost -------------------------------------------------------------------------------

# 2 cyclic groups over 4 steps: every record in at most 2 steps, 2 apart (sensitivity > 1); one buffer
BLT = ("--noise", "blt", "--bands", "2", "--buffers", "1", "--max_steps", "4", "--save_every", "2", "--eval_every", "0")


def _run(out, *extra):
    from dpllm.train import train

    return train(parse_config(["--output_dir", str(out), *SHORT, *BLT, *extra]))


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_a_blt_run_on_opacus_engines_reports_the_plans_gaussian_mechanism(tmp_path, mode):
    """hooks / ghost with blt: σ, q, the history (σ/sens(C, 2, ⌈4/2⌉), 1, 1) and ε are the plan's for N = 236, B = 16,
    T = 4 (what the bk run reports: test_correlated_blt_runs.py), the ledger recomputes every line and the secret
    buffers are saved for a resume."""
    out = tmp_path / mode
    _run(out, "--grad_sample_mode", mode)
    r = json.loads((out / "privacy_report.json").read_text())
    assert r["grad_sample_mode"] == mode and r["num_records"] == 236
    cfg = parse_config(["--output_dir", str(tmp_path / "x"), *SHORT, *BLT])
    noise = correlated.build("blt", 2, steps=4, num_records=236, batch=16, buffers=1)
    plan = plan_privacy(num_records=236, logical_batch_size=16, steps=4, target_epsilon=cfg.privacy.target_epsilon,
                        delta=cfg.privacy.target_delta, accountant=cfg.privacy.accountant, noise=noise)
    assert (r["noise_multiplier"], r["sample_rate"]) == (plan.noise_multiplier, plan.sample_rate)
    assert r["sample_rate"] == pytest.approx(2 / 15)
    sens = blt_math.toeplitz_sensitivity(blt_math.optimize_blt(4, 1, 2).blt.coefs(4), min_separation=2)
    assert sens > 1.2  # two participations of positive coefficients
    assert r["history"] == [list(h) for h in plan.history] == [[pytest.approx(plan.noise_multiplier / sens), 1.0, 1]]
    assert r["epsilon"] == pytest.approx(plan.epsilon(), rel=1e-9) and r["epsilon"] <= cfg.privacy.target_epsilon
    c = r["correlated_noise"]
    assert (c["mechanism"], c["bands"], c["buffers"], c["accounting"]) == ("blt", 2, 1, correlated.GAUSSIAN)
    assert ledger.verify(out).ok
    lines = {e["step"]: e for e in ledger.read(out) if e["kind"] == "checkpoint"}
    early = blt_math.toeplitz_sensitivity(blt_math.optimize_blt(4, 1, 2).blt.coefs(2), min_separation=2)
    assert lines[2]["history"] == [[pytest.approx(plan.noise_multiplier / early), 1.0, 1]]  # 2 steps: 1 participation
    saved = torch.load(out / "checkpoints" / "step-000004" / "rng_state.pt", weights_only=True)[0]["noise_recurrence"]
    assert saved["mechanism"] == "blt" and saved["step"] == 4 and saved["buffers"]  # the recurrence ran on every step
    assert all(v.shape[0] == 1 and v.abs().sum() > 0 for v in saved["buffers"].values())
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("loss" in row for row in rows) and all(row["loss"] == row["loss"] for row in rows if "loss" in row)


# ---- user-level sampling ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["bk", "hooks"])
def test_a_blt_uls_run_is_one_gaussian_mechanism_over_users(tmp_path, mode, monkeypatch):
    """ULS + blt: users (not records) are grouped by their id and sampled whole, each clipped once per step, so a user
    joins at most ⌈T/b⌉ steps b apart and the user-level ε is the Gaussian mechanism's (σ/sens(C, b, ⌈T/b⌉), 1, 1)
    itself: no ELS mixture or group privacy on top (k = 1), the same σ as `dpllm plan --unit user --sampling uls`."""
    from dpllm.export import correlated_note
    from dpllm.privacy.report import PrivacyReport

    run = uls_run_by_turns(tmp_path, mode, monkeypatch, steps=4, noise="blt", buffers=1)
    r = PrivacyReport.read(run)
    u, c = r.user_level, r.correlated_noise
    assert r.privacy_unit == "user" and r.grad_sample_mode == mode and (c["mechanism"], c["bands"]) == ("blt", 2)
    k = -(-u["num_users"] // u["users_per_batch"])
    assert r.sample_rate == pytest.approx(2 / k) == c["group_sample_rate"]
    sens = blt_math.toeplitz_sensitivity(blt_math.optimize_blt(4, 1, 2).blt.coefs(4), min_separation=2)
    assert r.history == [[pytest.approx(r.noise_multiplier / sens, rel=1e-12), 1.0, 1]]
    assert r.epsilon == pytest.approx(accounting.compute_epsilon_history(
        history=[(r.noise_multiplier / sens, 1.0, 1)], delta=1e-3, accountant=r.accountant), rel=1e-9)
    assert blt_math.epsilon_for_mu(sens / r.noise_multiplier, 1e-3) <= r.epsilon <= 8.0
    assert u["group_size"] == 1 and "user_epsilon" not in u and "record_epsilon" not in u  # no reduction on top
    assert ledger.verify(run).ok
    assert "the users were split into 2 groups by a keyed hash of each user's id" in correlated_note(r)
    assert any("each user in at most ⌈4/2⌉ = 2 steps" in line for line in r.details())
    planned = uls_plan(r, 4, "--noise", "blt", "--bands", "2", "--buffers", "1")["blt"]
    assert planned["draw_noise_multiplier"] == pytest.approx(r.noise_multiplier, rel=1e-9)


@pytest.mark.parametrize("sampling, words", [("els", "user_sampling=els with privacy.noise: blt"),
                                             ("record", "user_sampling=record with privacy.noise: blt")])
def test_blt_refuses_user_sampling_that_groups_records_one_by_one(tmp_path, sampling, words):
    """ELS / record sampling put a user's records in different groups (more than ⌈T/b⌉ steps): refused, before
    anything is written."""
    with pytest.raises(ConfigError, match=words):
        parse_config(["--output_dir", str(tmp_path / "x"), *SHORT, "--noise", "blt", "--privacy_unit", "user",
                      "--user_column", "u", "--user_sampling", sampling, "--max_records_per_user", "4"])
    assert not (tmp_path / "x").exists()


# ---- DPTrainer ----------------------------------------------------------------------------------------------------

def test_dptrainer_runs_blt_noise_with_the_recipes_plan(tmp_path):
    """PrivacyArguments(noise="blt", bands="2", buffers="1"): σ, q and ε are what the recipe's plan (correlated.build,
    then plan_privacy) gives for the same N, B and T, and the report names the mechanism."""
    from tests.helpers import tiny_dptrainer

    trainer = tiny_dptrainer(tmp_path / "run", noise="blt", bands="2", buffers="1", reproducible_noise=True)
    metrics = trainer.train().metrics
    noise = correlated.build("blt", "2", steps=4, num_records=24, batch=8, buffers="1")
    plan = plan_privacy(num_records=24, logical_batch_size=8, steps=4, target_epsilon=8.0, delta=1e-3,
                        accountant="rdp", noise=noise)
    assert (metrics["noise_multiplier"], metrics["sample_rate"]) == (plan.noise_multiplier, plan.sample_rate)
    assert plan.sample_rate == pytest.approx(2 / 3) and metrics["epsilon"] == pytest.approx(plan.epsilon(), rel=1e-9)
    report = trainer.privacy_report
    assert report.correlated_noise["mechanism"] == "blt" and report.correlated_noise["buffers"] == 1
    assert report.history == [list(h) for h in plan.history] and plan.history[0][1:] == (1.0, 1)
    assert "BLT correlated noise, 1 buffer(s), cyclic sampling over 2 groups" in report.summary()


# ---- the sweep ----------------------------------------------------------------------------------------------------

def test_sweep_passes_blt_to_every_private_run_and_refuses_a_sigma_bar_fit(tmp_path):
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "recipes"))
    import scaling_sweep

    def doc():
        return {"base": {"privacy": {"target_delta": 1e-5}}, "sweep": {"max_steps": [4], "epsilons": [8.0, None]},
                "fit": {"form": "dp_noise"}}

    with pytest.raises(ConfigError, match="fit form dp_noise reads σ̄.*with privacy.noise: blt"):
        scaling_sweep.with_noise(doc(), noise="blt", bands="2", buffers="1", form=None)
    with pytest.raises(ConfigError, match="privacy.buffers=2 needs privacy.noise=blt"):
        scaling_sweep.with_noise(doc(), noise="banded", bands="2", buffers="2", form=None, fit=False)
    scaling_sweep.with_noise(doc(), noise="blt", bands="2", buffers="1", form="chinchilla")  # a form without σ̄
    d = scaling_sweep.with_noise(doc(), noise="blt", bands="2", buffers="1", form=None, fit=False)
    cfgs = dict(scaling_sweep.expand(d, quick=False))
    private, public = cfgs["size0_steps4_eps8_seed0"], cfgs["size0_steps4_nodp_seed0"]
    assert (private["privacy"]["noise"], private["privacy"]["bands"], private["privacy"]["buffers"],
            private["privacy"]["enabled"]) == ("blt", "2", "1", True)
    assert public["privacy"]["enabled"] is False
    args = scaling_sweep.build_parser().parse_args(["--config", "c.yaml", "--noise", "blt", "--buffers", "3"])
    assert (args.noise, args.buffers) == ("blt", "3")
