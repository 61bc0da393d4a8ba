"""train → audit → canaries through the real commands: leakage is caught without DP, bounded with it.

A tiny Llama trained for many epochs on 96 records plus ~100 canaries memorises them; the same run at
ε = 8 must give attack AUC near 0.5 and a canary lower bound under the accountant's ε.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = ["--max_records", "120", "--num_canaries", "200", "--max_length", "64", "--tiny_hidden_size", "64",
          "--logical_batch_size", "32", "--physical_batch_size", "32", "--eval_every", "0", "--progress", "false",
          "--finetuning", "full", "--learning_rate", "0.003"]


def run(*args):
    res = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=900)
    return res


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("audit")
    nodp, dp = base / "nodp", base / "dp"
    r = run("recipes/finetune_llm.py", *COMMON, "--output_dir", str(nodp), "--privacy.enabled", "false",
            "--epochs", "40")
    assert r.returncode == 0, r.stderr[-2000:]
    r = run("recipes/finetune_llm.py", *COMMON, "--output_dir", str(dp), "--target_epsilon", "8", "--epochs", "10",
            "--physical_batch_size", "16")
    assert r.returncode == 0, r.stderr[-2000:]
    return nodp, dp


def audit(run_dir):
    r = run("-m", "mia", "audit", "--checkpoint", str(run_dir), "--out", str(run_dir / "audit"),
            "--attacks", "loss,mink", "--n-bootstrap", "200")
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads((run_dir / "audit" / "mia_report.json").read_text())
    assert (run_dir / "audit" / "mia_roc.png").stat().st_size > 1000
    return report


def canaries(run_dir):
    r = run("-m", "mia", "canaries", "--run", str(run_dir))
    report = json.loads((run_dir / "audit" / "canary_report.json").read_text())
    return r.returncode, report


def auc_of(report, attack):
    rows = report["attacks"] if "attacks" in report else report
    return rows[attack]["auc"]


def test_memorising_run_is_caught(runs):
    nodp, _ = runs
    report = audit(nodp)
    assert auc_of(report, "loss") > 0.9  # seen: 0.99
    code, canary = canaries(nodp)
    assert code == 0
    assert canary["epsilon_lower"] > 1.0  # seen: 3.2 (one-run, Bonferroni over guess counts)


def test_dp_run_is_bounded(runs):
    _, dp = runs
    report = audit(dp)
    assert 0.3 < auc_of(report, "loss") < 0.7  # seen: 0.47
    code, canary = canaries(dp)
    assert code == 0 and not canary["privacy_bug"]
    assert canary["epsilon_lower"] <= canary["accountant_epsilon"] <= 8.0
