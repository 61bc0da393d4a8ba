"""`dpllm plan`: every ε/σ it prints agrees with dpllm.privacy.accounting, and bad plans are refused."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dpllm.cli import main
from dpllm.privacy.accounting import PrivacyPlanError, compute_epsilon
from dpllm.privacy.plan import steps_for
from dpllm.privacy.planning import noise_to_signal, plan_table, round_up

BASE = ["plan", "--num-records", "1000000", "--batch", "1024", "--epochs", "1", "--delta", "1e-7"]


def test_text_output_sigma_gives_the_printed_epsilon_under_target(capsys):
    # Default accountant (prv), as a user would run it; no table to keep the test quick.
    assert main([*BASE, "--target-epsilon", "8", "--epsilons", ""]) == 0
    out = capsys.readouterr().out
    assert "sample rate q=1/⌈N/B⌉=0.00102354" in out and "steps=977 (ceil(1 epochs × ⌈N/B⌉))" in out
    m = re.search(r"target epsilon 8: noise multiplier σ=([\d.]+) → epsilon=([\d.]+), NSR=([\d.e-]+)", out)
    assert m, out
    sigma, eps, nsr = (float(g) for g in m.groups())
    again = compute_epsilon(noise_multiplier=sigma, sample_rate=1 / 977, steps=977, delta=1e-7,
                            accountant="prv")
    assert again == pytest.approx(eps, abs=5e-5)
    assert 7.9 < again <= 8.0
    assert nsr == pytest.approx(sigma * 1.0 / 1024, rel=1e-3)
    # σ is rounded *up*: a hair less noise would overshoot or sit at the target.
    assert compute_epsilon(noise_multiplier=sigma - 0.002, sample_rate=1 / 977, steps=977, delta=1e-7,
                           accountant="prv") > again


def test_json_given_noise_and_table_are_the_accountant_values(capsys):
    args = [*BASE, "--accountant", "rdp", "--noise-multiplier", "0.7", "--grad-norm", "0.5",
            "--max-grad-norm", "2", "--epsilons", "10,1,4,2,8", "--json"]
    assert main(args) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["steps"] == 977 and plan["sample_rate"] == 1 / 977 and plan["target"] is None
    given = plan["given_noise"]
    assert given["epsilon"] == compute_epsilon(noise_multiplier=0.7, sample_rate=plan["sample_rate"],
                                               steps=977, delta=1e-7, accountant="rdp")
    assert given["nsr"] == pytest.approx(0.7 * 2 / (1024 * 0.5))
    table = plan["table"]
    assert [r["target_epsilon"] for r in table] == [1, 2, 4, 8, 10]
    sigmas = [r["noise_multiplier"] for r in table]
    assert all(a > b for a, b in zip(sigmas, sigmas[1:])), sigmas  # smaller ε → larger σ
    for r in table:
        assert r["epsilon"] == compute_epsilon(noise_multiplier=r["noise_multiplier"], sample_rate=1 / 977,
                                               steps=977, delta=1e-7, accountant="rdp")
        assert 0.97 * r["target_epsilon"] <= r["epsilon"] <= r["target_epsilon"]


def test_delta_at_or_above_one_over_n_is_refused(capsys):
    rc = main(["plan", "--num-records", "1000000", "--batch", "1024", "--epochs", "1", "--delta", "1e-6",
               "--target-epsilon", "8"])
    assert rc != 0
    err = capsys.readouterr().err
    assert "target_delta=1e-06 must be in (0, 1/N)" in err and "use e.g. delta=1e-07" in err


@pytest.mark.parametrize("args, message", [
    (["--num-records", "100", "--batch", "200", "--epochs", "1", "--delta", "1e-3"], "batch=200 must be in [1"),
    (["--num-records", "1000", "--batch", "10", "--epochs", "0", "--delta", "1e-4"], "epochs=0.0 must be positive"),
    (["--num-records", "1000", "--batch", "10", "--steps", "5", "--delta", "1e-4", "--epsilons", "a,b"],
     "--epsilons 'a,b' must be comma-separated numbers"),
    (["--num-records", "1000", "--batch", "10", "--epochs", "1", "--delta", "1e-4", "--target-epsilon", "0",
      "--epsilons", ""], "target_epsilon=0.0 must be positive"),
])
def test_bad_plans_exit_2_with_reason(capsys, args, message):
    assert main(["plan", *args]) == 2
    assert message in capsys.readouterr().err


def test_epochs_and_steps_are_exclusive(capsys):
    assert main(["plan", "--num-records", "1000", "--batch", "10", "--epochs", "1", "--steps", "5",
                 "--delta", "1e-4"]) == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_pure_helpers():
    # an epoch is ⌈1000/300⌉ = 4 Poisson batches, as in the trainer
    assert steps_for(num_records=1000, batch=300, epochs=1.5) == 6
    assert steps_for(num_records=1000, batch=300, epochs=2) == 8
    # 3 epochs at N = 1e6, B = 1024: ⌈N/B⌉ = 977 batches an epoch, 2931 steps (not ⌈3·N/B⌉ = 2930)
    assert steps_for(num_records=1_000_000, batch=1024, epochs=3) == 2931
    assert steps_for(num_records=699, batch=128, epochs=7) == 42
    assert steps_for(num_records=1000, batch=300, steps=11) == 11
    with pytest.raises(PrivacyPlanError, match="exactly one of epochs or steps"):
        steps_for(num_records=1000, batch=300)
    assert round_up(0.43383) == 0.4339 and round_up(0.4339) == 0.4339 and round_up(12.3401) == 12.35
    assert noise_to_signal(noise_multiplier=2.0, max_grad_norm=1.0, batch=100, grad_norm=0.25) == 0.08
    with pytest.raises(PrivacyPlanError, match="1/N"):
        plan_table(num_records=10, batch=2, delta=0.5, epochs=1)


def test_console_script_runs_once_as_a_subprocess():
    # the installed `dpllm` script with the default accountant (PRV: this process imports neither torch nor opacus,
    # so it costs ~1 CPU-s where RDP's, through Opacus, costs ~6; RDP's path is the in-process tests above)
    script = Path(sys.executable).with_name("dpllm")
    proc = subprocess.run([str(script), *BASE, "--target-epsilon", "4", "--epsilons", "", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    t = plan["target"]
    assert plan["accountant"] == "prv"
    assert t["epsilon"] == compute_epsilon(noise_multiplier=t["noise_multiplier"], sample_rate=1 / 977,
                                           steps=977, delta=1e-7, accountant="prv")
    assert t["epsilon"] <= 4 and math.isclose(t["nsr"], t["noise_multiplier"] / 1024)
