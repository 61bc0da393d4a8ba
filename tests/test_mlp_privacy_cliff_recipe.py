"""recipes/mlp_privacy_cliff.py --quick as the real command (a subprocess), then its outputs."""

import json
import os
import subprocess
import sys

import pytest

from dpllm.privacy.accounting import compute_epsilon

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("mlp_cliff")
    proc = subprocess.run([sys.executable, "recipes/mlp_privacy_cliff.py", "--output_dir", str(out), "--quick",
                           "--no_progress"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "mlp_privacy_cliff: 5 runs" in proc.stdout
    return out, json.loads((out / "results.json").read_text())


def test_files_and_command_line(quick):
    out, _ = quick
    for name in ("results.json", "summary.md", "privacy_utility.png", "epsilon_vs_sigma.png"):
        assert (out / name).stat().st_size > 0
    summary = (out / "summary.md").read_text()
    assert summary.splitlines()[2].startswith("Command: `python recipes/mlp_privacy_cliff.py --output_dir")
    assert "seed 002 printed" in summary and "Poisson" in summary


def test_each_run_records_sigma_c_q_steps_and_epsilon(quick):
    _, res = quick
    dp = [r for r in res["runs"] if r["config"]["private"]]
    assert len(dp) == 4 and len(res["runs"]) == 5
    grid = {(r["noise_multiplier"], r["max_grad_norm"]) for r in dp}
    assert grid == {(0.5, 0.1), (0.5, 10.0), (10.0, 0.1), (10.0, 10.0)}
    for r in dp:
        assert r["sample_rate"] == pytest.approx(1 / 7) and r["steps"] == 140 and r["delta"] == 1e-5
        want = compute_epsilon(noise_multiplier=r["noise_multiplier"], sample_rate=r["sample_rate"],
                               steps=r["steps"], delta=r["delta"], accountant="prv")
        assert r["epsilon_prv"] == pytest.approx(want, rel=1e-9)


def test_cliff_and_epsilon_comparison(quick):
    _, res = quick
    cliff = res["cliff"]
    assert cliff["baseline_accuracy"] > 0.9
    assert cliff["threshold"] == pytest.approx(cliff["baseline_accuracy"] / 2)
    assert cliff["detected"] == any(c["accuracy_mean"] < cliff["threshold"] for c in res["configs"])
    by_sigma = {p["noise_multiplier"]: p for p in res["privacy"]}
    # At σ = 10 the seed printed 0.87; Opacus at the seed's q = 0.16 gives ~0.70 (PRV) and ~0.76 (RDP).
    assert by_sigma[10.0]["seed_002_printed"] == 0.87
    at_seed_q = by_sigma[10.0]["at_seed_sample_rate"]
    assert 0.6 < at_seed_q["epsilon_prv"] < at_seed_q["epsilon_rdp"] < 0.87
    assert by_sigma[0.5]["epsilon"] > by_sigma[10.0]["epsilon"]
