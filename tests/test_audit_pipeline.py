"""train → audit → canaries through the real commands, with tests that can fail.

A tiny Llama is trained on a few pydoc records plus m = 1,000 ``rare`` canaries (each in by a fair
coin). Without DP it memorises them: the canary bound must *exceed* 4.0 (a perfect attack on 1,000
canaries reaches about 4.3-4.4 at 95%, so this fails if the attack or the bound loses power). With DP at
ε = 2 the bound must stay at or under 2: the same run without noise would give > 4, so a training
bug that leaks (no noise, no clipping, wrong σ) makes this test fail.

``new_token`` canaries (one new vocabulary token each) go through the same commands. ``@pytest.mark.slow``
checks the issue's targets at its scale (10,000 canaries without DP; white-box and black-box at ε = 8).
"""

import json
import math
import os

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def common(m, max_length):
    # one layer, MLP width 128: the memorising run (40 epochs, ~700 steps) still guesses all of its top 500 canaries
    # right (bound 4.39, as with two layers or width 256; 30 epochs gave 4.28, width 128 at 32 epochs and lr 0.004
    # 4.28, hidden size 32 3.18), at 21.8 instead of 23.9 CPU-s of training (width 256)
    return ["--max_records", "60", "--num_canaries", str(m), "--canary_design", "rare",
            "--max_length", str(max_length), "--tiny_hidden_size", "64", "--tiny_num_layers", "1",
            "--tiny_intermediate_size", "128",
            "--logical_batch_size", "32",
            "--physical_batch_size", "32", "--eval_every", "0", "--progress", "false",
            "--finetuning", "full", "--learning_rate", "0.003"]


def run(*args):
    """``python -m mia ...`` through its entry point (``mia.__main__.main``) in this process: a process of its own
    would add only start-up (the command runs as a process in tests/test_rough_edges.py)."""
    from mia.__main__ import main
    from tests.helpers import in_process

    assert args[:2] == ("-m", "mia"), args
    return in_process(main, list(args[2:]))


def train(out, m, max_length, *extra):
    """The recipe's command entry point (``recipes/finetune_llm.py``'s ``cli``), in this process: a subprocess
    per run would only add its start-up (the script itself runs as one in tests/test_resume.py)."""
    from tests.helpers import load_recipe

    assert load_recipe("finetune_llm").cli([*common(m, max_length), "--output_dir", str(out), *extra]) == 0
    return out


def audit(run_dir):
    r = run("-m", "mia", "audit", "--checkpoint", str(run_dir), "--out", str(run_dir / "audit"),
            "--attacks", "loss,mink", "--n-bootstrap", "200", "--no-progress")
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads((run_dir / "audit" / "mia_report.json").read_text())
    assert (run_dir / "audit" / "mia_roc.png").stat().st_size > 1000
    # The run's own random split: the blind baseline must not call it shifted, and the report says IID.
    assert not report["blind"]["shifted"] and "IID" in report["split"]
    return report


def canaries(run_dir):
    r = run("-m", "mia", "canaries", "--run", str(run_dir), "--no-progress")
    report = json.loads((run_dir / "audit" / "canary_report.json").read_text())
    assert (run_dir / "audit" / "canary_roc.png").is_file()
    return r.returncode, report


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("audit")
    nodp = train(base / "nodp", 1000, 32, "--privacy.enabled", "false", "--epochs", "40")
    dp = train(base / "dp", 1000, 32, "--target_epsilon", "2", "--epochs", "4")
    return nodp, dp


def test_memorising_run_is_caught(runs):
    nodp, _ = runs
    assert audit(nodp)["attacks"]["loss"]["auc"] > 0.8  # seen: 0.93 (48 members, 12 non-members)
    code, canary = canaries(nodp)
    assert code == 0 and canary["verdict"] == "not private" and canary["m"] == 1000
    assert canary["epsilon_lower"] > 4.0  # seen: 4.39 (every one of the top 500 guesses right)


def test_dp_run_is_bounded(runs):
    _, dp = runs
    # No ε-DP model lets any attack exceed AUC e^ε/(1+e^ε) (0.881 at ε = 2; the memorising run above scores
    # ~0.93). The noise is secret and fresh, so the AUC moves between runs (seen 0.47-0.74 with 12 non-members);
    # a fixed window around 0.5 would be a coin flip, the DP ceiling is the claim that must hold.
    rep = audit(dp)  # exits 0: no attack above the run's own bounds beyond sampling error
    assert rep["attacks"]["loss"]["auc"] <= math.exp(2.0) / (1 + math.exp(2.0))
    # The run's trade-off curve allows far less than that ceiling (dpllm.privacy.tradeoff), and the audit says so.
    bounds = rep["privacy_bounds"]
    assert bounds["exceeded"] == [] and bounds["unit"] == "record"
    assert 0.5 < bounds["auc"] < math.exp(2.0) / (1 + math.exp(2.0)) and bounds["tpr@fpr=0.01"] < 0.1
    # the curve the ROC plot draws: non-decreasing, above chance, and through the reported TPR bound at FPR 1%
    fpr, tpr = np.array(bounds["curve"]["fpr"]), np.array(bounds["curve"]["tpr"])
    assert np.all(np.diff(tpr) >= -1e-12) and np.all(tpr >= fpr - 1e-12) and tpr[-1] == pytest.approx(1.0)
    assert np.interp(0.01, fpr, tpr) == pytest.approx(bounds["tpr@fpr=0.01"], rel=0.05)
    code, canary = canaries(dp)
    assert canary["accountant_epsilon"] <= 2.0 + 1e-6
    assert code == 0 and not canary["privacy_bug"]
    assert canary["epsilon_lower"] <= canary["accountant_epsilon"]


def test_new_token_canaries_through_the_real_commands(tmp_path):
    # The recipe adds 1,000 tokens, the checkpoint keeps them, `mia canaries` reloads and scores them:
    # two epochs without DP already separate members from non-members completely.
    nodp = train(tmp_path / "nt", 1000, 32, "--canary_design", "new_token", "--privacy.enabled", "false",
                 "--epochs", "2")
    assert json.loads((nodp / "checkpoint" / "config.json").read_text())["vocab_size"] == 384 + 1000
    code, canary = canaries(nodp)
    assert code == 0 and canary["epsilon_lower"] > 4.0  # seen: 4.28 (all 450 top guesses right)


@pytest.mark.slow
def test_issue_scale_targets(tmp_path):
    """Issue #12 at its scale (docs/results/audit): without DP, 10,000 new-token canaries prove ε̂ >= 6;
    at ε = 8, white-box with 10,000 Dirac canaries proves ε̂ >= 2 and black-box with 5,000 new-token
    canaries ε̂ >= 0.5, both under 8. The DP run draws its noise from the seed (reproducible_noise) so
    the number is the same on every run; docs/results/audit has three seeds with fresh noise."""
    from mia.whitebox import whitebox_audit

    rep = whitebox_audit(m=10000, steps=20, sample_rate=0.2, target_epsilon=8.0)
    assert 2.0 <= rep["epsilon_lower"] <= rep["accountant_epsilon"] <= 8.0 + 1e-6  # seen: 2.74
    nodp = train(tmp_path / "nodp", 10000, 32, "--canary_design", "new_token", "--privacy.enabled", "false",
                 "--epochs", "3")
    code, canary = canaries(nodp)
    assert code == 0 and canary["epsilon_lower"] >= 6.0  # seen: 6.59
    dp = train(tmp_path / "dp", 5000, 32, "--canary_design", "new_token", "--target_epsilon", "8", "--epochs", "10",
               "--logical_batch_size", "128", "--physical_batch_size", "128", "--reproducible_noise", "true")
    code, canary = canaries(dp)
    assert code == 0 and 0.5 <= canary["epsilon_lower"] <= canary["accountant_epsilon"] <= 8.0 + 1e-6  # seen: 0.94
