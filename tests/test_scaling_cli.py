"""`dpllm scaling fit|plan` end to end on a synthetic runs.jsonl (through dpllm.cli.main)."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest

from dpllm.cli import main
from dpllm.scaling import append_run, get_form

TRUTH = {"E": 1.7, "A": 400.0, "alpha": 0.34, "B": 410.0, "beta": 0.28, "C": 30.0, "gamma": 0.8}
BATCH = 1024
# (epsilon, noise multiplier): σ̄ = σ / 1024; None is the non-private baseline.
GROUPS = [(None, 0.0), (8.0, 0.9), (2.0, 3.0)]


def _write_runs(path, groups=GROUPS, seeds=(0, 1), noise=0.003, ns=(1e6, 1e7, 1e8), ds=(1e7, 1e8, 1e9, 1e10)):
    rng = np.random.default_rng(0)
    law = get_form("dp_noise")
    for (eps, sigma), n, d, seed in itertools.product(groups, ns, ds, seeds):
        sb = sigma / BATCH
        loss = float(law.predict(TRUTH, {"N": np.array([n]), "D": np.array([d]), "sigma_bar": np.array([sb])})[0])
        loss *= math.exp(rng.normal(0, noise))
        append_run(path, {
            "run_dir": f"runs/{eps}-{n:g}-{d:g}-{seed}", "model": "tiny", "params_total": 3 * n,
            "params_trainable": n, "tokens_seen": d, "steps": int(d / BATCH / 128), "logical_batch_size": BATCH,
            "epsilon": eps - 0.004 if eps else None, "delta": 1e-7, "noise_multiplier": sigma,
            "privacy_enabled": eps is not None, "final_eval_loss": loss, "final_eval_ppl": math.exp(loss),
            "seed": seed})
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _write_runs(tmp_path_factory.mktemp("sweep") / "runs.jsonl")


def test_fit_chinchilla_per_epsilon_writes_json_and_plots(runs, tmp_path, capsys):
    out = tmp_path / "fit"
    rc = main(["scaling", "fit", "--runs", str(runs), "--form", "chinchilla", "--out", str(out),
               "--n-boot", "100", "--seed", "3"])
    assert rc == 0
    doc = json.loads((out / "fit.json").read_text())
    assert set(doc["fits"]) == {"eps=8", "eps=2", "non-private"}
    assert doc["filter"] == {"epsilon": None, "params": "trainable", "N_field": "params_trainable",
                             "grouping": doc["filter"]["grouping"]}
    assert doc["inputs"]["n_runs"] == 72 and doc["inputs"]["groups"]["eps=8"]["n_runs"] == 24
    np_fit = doc["fits"]["non-private"]
    assert abs(np_fit["params"]["alpha"] - 0.34) < 0.03 and abs(np_fit["params"]["beta"] - 0.28) < 0.03
    assert np_fit["r2"] > 0.999 and np_fit["n_points"] == 12 and np_fit["n_runs"] == 24
    assert np_fit["bootstrap"]["n_boot"] == 100 and len(np_fit["residuals"]) == 12
    assert set(np_fit["ci"]) == {"E", "A", "alpha", "B", "beta"}
    # The noise term is a constant per ε group, so private fits have a higher floor E.
    assert doc["fits"]["eps=2"]["params"]["E"] > doc["fits"]["eps=8"]["params"]["E"] > np_fit["params"]["E"]
    for name in ("loss_vs_N.png", "loss_vs_D.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    printed = capsys.readouterr().out
    assert "[eps=8] points=12 runs=24" in printed and "95% CI" in printed


def test_fit_power_law_filtered_to_one_epsilon(tmp_path, capsys):
    # power_law reads N only, so the sweep holds D fixed.
    ns = (1e6, 3e6, 1e7, 3e7, 1e8)
    runs = _write_runs(tmp_path / "runs.jsonl", groups=[(8.0, 0.9), (None, 0.0)], seeds=(0, 1, 2), ns=ns,
                       ds=(1e9,))
    out = tmp_path / "pl"
    assert main(["scaling", "fit", "--runs", str(runs), "--form", "power_law", "--epsilon", "8",
                 "--out", str(out), "--n-boot", "100"]) == 0
    doc = json.loads((out / "fit.json").read_text())
    assert list(doc["fits"]) == ["eps=8"] and doc["filter"]["epsilon"] == "eps=8"
    assert doc["inputs"]["n_runs"] == 15 and doc["inputs"]["n_runs_in_file"] == 30
    fit = doc["fits"]["eps=8"]
    floor = TRUTH["E"] + TRUTH["B"] * 1e9 ** -TRUTH["beta"] + TRUTH["C"] * (0.9 / BATCH) ** TRUTH["gamma"]
    assert abs(fit["params"]["alpha"] - 0.34) < 0.05
    assert fit["params"]["L_inf"] == pytest.approx(floor, abs=0.05)
    assert fit["ci"]["alpha"][0] <= 0.34 <= fit["ci"]["alpha"][1]
    assert (out / "loss_vs_N.png").stat().st_size > 10_000 and not (out / "loss_vs_D.png").exists()
    capsys.readouterr()
    # Three model sizes cannot pin down three parameters with a residual left over.
    few = _write_runs(tmp_path / "few.jsonl", groups=[(8.0, 0.9)], ns=(1e6, 1e7, 1e8), ds=(1e9,))
    assert main(["scaling", "fit", "--runs", str(few), "--form", "power_law", "--out", str(out)]) == 2
    assert "power_law has 3 parameters and needs ≥ 4 distinct configurations of (N); got 3" in capsys.readouterr().err


def test_fit_dp_noise_jointly_then_plan(runs, tmp_path, capsys):
    out = tmp_path / "dp"
    assert main(["scaling", "fit", "--runs", str(runs), "--form", "dp_noise", "--out", str(out),
                 "--n-boot", "50", "--no-plots"]) == 0
    doc = json.loads((out / "fit.json").read_text())
    assert list(doc["fits"]) == ["joint"]
    p = doc["fits"]["joint"]["params"]
    assert abs(p["gamma"] - 0.8) < 0.15 and abs(p["alpha"] - 0.34) < 0.03
    capsys.readouterr()
    plan = ["scaling", "plan", "--fit", str(out / "fit.json"), "--epsilon", "8", "--target-ppl", "20", "--n", "1e8",
            "--json"]
    # the answer (4.9e10 tokens) lies beyond the fitted D range [1e7, 1e10]: refused, then allowed loudly
    assert main(plan) == 2 and "outside the fitted range [1e+07, 1e+10]" in capsys.readouterr().err
    assert main(plan + ["--extrapolate", "10"]) == 0
    captured = capsys.readouterr()
    assert "WARNING: EXTRAPOLATING: tokens D" in captured.err
    ans = json.loads(captured.out)
    assert ans["sigma_bar"] == pytest.approx(0.9 / BATCH)
    pred = get_form("dp_noise").predict(p, {"N": np.array([1e8]), "D": np.array([ans["D"]]),
                                            "sigma_bar": np.array([ans["sigma_bar"]])})
    assert pred[0] == pytest.approx(math.log(20), rel=1e-9)


def test_plan_from_chinchilla_fit_compute_and_unreachable(runs, tmp_path, capsys):
    out = tmp_path / "fit"
    assert main(["scaling", "fit", "--runs", str(runs), "--form", "chinchilla", "--epsilon", "8",
                 "--out", str(out), "--n-boot", "20", "--no-plots"]) == 0
    fit_json = str(out / "fit.json")
    capsys.readouterr()
    assert main(["scaling", "plan", "--fit", fit_json, "--compute", "1e17", "--json"]) == 0
    ans = json.loads(capsys.readouterr().out)
    assert 6 * ans["N"] * ans["D"] == pytest.approx(1e17)
    # 1e20 FLOPs puts the optimum beyond the largest fitted model (1e8): refused, with the range
    assert main(["scaling", "plan", "--fit", fit_json, "--compute", "1e20"]) == 2
    assert "outside the fitted range [1e+06, 1e+08]" in capsys.readouterr().err
    assert main(["scaling", "plan", "--fit", fit_json, "--target-ppl", "20", "--extrapolate", "100"]) == 0
    text = capsys.readouterr().out
    assert "compute C = 6·N·D =" in text and "target: ppl 20 = loss 2.9957 nats" in text
    assert main(["scaling", "plan", "--fit", fit_json, "--target-ppl", "5", "--n", "1e8"]) == 2
    err = capsys.readouterr().err
    assert "not above the fitted floor" in err and "(ppl 5)" in err
    assert main(["scaling", "plan", "--fit", fit_json, "--epsilon", "2", "--target-ppl", "20"]) == 2
    assert "no fit for eps=2; fitted groups: eps=8" in capsys.readouterr().err


@pytest.mark.parametrize("content, args, message", [
    (None, ["--form", "chinchilla"], "does not exist"),
    ("", ["--form", "chinchilla"], "is empty"),
    ('{"a": 1}\nnot json\n', ["--form", "chinchilla"], ":2: not valid JSON"),
    ("GOOD", ["--form", "kaplan"], "form='kaplan' is not known"),
    ("GOOD", ["--form", "chinchilla", "--epsilon", "3"], "no runs in group eps=3"),
])
def test_fit_bad_inputs_exit_2_with_reason(tmp_path, capsys, content, args, message):
    path = tmp_path / "runs.jsonl"
    if content == "GOOD":
        _write_runs(path, groups=[(8.0, 0.9)], seeds=(0,))
    elif content is not None:
        path.write_text(content)
    assert main(["scaling", "fit", "--runs", str(path), "--out", str(tmp_path / "o"), *args]) == 2
    assert message in capsys.readouterr().err


def test_dp_noise_with_one_noise_level_is_refused(tmp_path, capsys):
    path = _write_runs(tmp_path / "runs.jsonl", groups=[(None, 0.0), (8.0, 0.9)], seeds=(0,))
    assert main(["scaling", "fit", "--runs", str(path), "--form", "dp_noise", "--out", str(tmp_path / "o")]) == 2
    assert "needs runs at ≥ 2 distinct positive noise levels σ̄; got 1" in capsys.readouterr().err
