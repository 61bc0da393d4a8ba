"""The DP planner: on a law whose optimum is known it finds it, from the exact law and from a fit to
synthetic runs; it refuses plans outside the fitted range and degenerate fits (issue #16)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from dpllm.scaling import FitResult, ScalingError, fit_form
from dpllm.scaling.dp_plan import SigmaTable, best_for_compute, format_plan, least_compute_for_loss
from dpllm.scaling.plan import DegenerateFitError, OutsideFitError, compute_for_target

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A law with an interior compute optimum at ε = 4 over 20,000 records (found by brute force below):
# the noise term grows with N and, because η < γ/2, with steps, so neither the smallest model, the
# smallest batch nor the largest batch wins.
TRUE = {"E": 1.0, "A": 40.0, "alpha": 0.3, "B": 6.0, "beta": 0.35, "C": 60.0, "gamma": 1.0, "kappa": 0.1,
        "eta": 0.2}
SIZES = [float(v) for v in np.geomspace(5e6, 3e8, 5)]
BATCHES = [64, 128, 256, 512, 1024, 2048]
PRIV = {"records": 20_000, "epsilon": 4.0, "delta": 1e-5}
COMPUTE, ELL = 3e16, 200.0
DOMAIN = {"N": [5e6, 3e8], "S": [100.0, 20000.0], "sigma_bar": [1e-4, 3e-2]}


@pytest.fixture(scope="module")
def brute():
    """Every (N, B) on the grid with its true loss, σ from the same accountant (RDP, for speed)."""
    law = FitResult(form="noise_batch", params=TRUE, ci={}, r2=1.0, n_points=0, n_runs=0)
    table = SigmaTable(**PRIV)
    rows = []
    for n in SIZES:
        for b in BATCHES:
            s = int(COMPUTE // (6 * n * b * ELL))
            if not DOMAIN["S"][0] <= s <= DOMAIN["S"][1]:
                continue
            sb = table.sigma(b, s, "rdp") / b
            rows.append({"N": n, "batch": b, "steps": s, "sigma_bar": sb,
                         "loss": float(law.predict(N=n, S=s, sigma_bar=sb))})
    rows.sort(key=lambda r: r["loss"])
    best = rows[0]
    # the optimum is interior in both N and B, so finding it is not an accident of the grid's edge
    assert SIZES[0] < best["N"] < SIZES[-1] and BATCHES[0] < best["batch"] < BATCHES[-1]
    return rows


def test_planner_finds_the_known_optimum_of_the_exact_law(brute):
    law = FitResult(form="noise_batch", params=TRUE, ci={}, r2=1.0, n_points=0, n_runs=0, domain=DOMAIN)
    out = best_for_compute(law, compute=COMPUTE, tokens_per_record=ELL, sizes=SIZES, batches=BATCHES,
                           accountant="rdp", top=3, **PRIV)
    top = out["candidates"][0]
    assert (top["N"], top["batch"], top["steps"]) == (brute[0]["N"], brute[0]["batch"], brute[0]["steps"])
    assert top["loss"] == pytest.approx(brute[0]["loss"], rel=1e-3)
    assert top["compute"] <= COMPUTE
    assert [c["loss"] for c in out["candidates"]] == sorted(c["loss"] for c in out["candidates"])


def test_planner_from_a_fit_to_synthetic_runs_lands_on_the_optimum(brute):
    rng = np.random.default_rng(0)
    n, s, sb = np.meshgrid(SIZES, [100, 300, 1000, 3000, 10000, 20000], [0, 1e-4, 1e-3, 3e-3, 3e-2], indexing="ij")
    n, s, sb = n.ravel(), s.ravel().astype(float), sb.ravel()
    law = FitResult(form="noise_batch", params=TRUE, ci={}, r2=1.0, n_points=0, n_runs=0)
    loss = law.predict(N=n, S=s, sigma_bar=sb) * np.exp(rng.normal(0, 0.002, len(n)))
    fit = fit_form("noise_batch", loss=loss, N=n, S=s, sigma_bar=sb, n_boot=20, seed=0)
    assert fit.degenerate == [] and fit.domain["sigma_bar"] == [1e-4, 3e-2]
    out = best_for_compute(fit, compute=COMPUTE, tokens_per_record=ELL, sizes=SIZES, batches=BATCHES,
                           accountant="rdp", top=3, **PRIV)
    picked = [(c["N"], c["batch"]) for c in out["candidates"]]
    assert (brute[0]["N"], brute[0]["batch"]) in picked
    true_of_top = next(r for r in brute if (r["N"], r["batch"]) == picked[0])["loss"]
    assert true_of_top <= brute[0]["loss"] * 1.005  # what the plan picks is (near-)optimal under the truth
    top = out["candidates"][0]
    assert top["loss_low"] <= top["loss"] <= top["loss_high"]
    # where a run lands (prediction interval) is wider than where the law's mean lies (CI of the mean)
    assert top["loss_low"] < top["mean_low"] <= top["mean_high"] < top["loss_high"]
    text = format_plan(out)
    assert "95% prediction interval" in text and "95% CI of the mean" in text and "95% interval" not in text
    assert top["loss"] == pytest.approx(true_of_top, rel=0.01)


def test_least_compute_for_loss_meets_target_with_less_compute_than_alternatives():
    law = FitResult(form="noise_batch", params=TRUE, ci={}, r2=1.0, n_points=0, n_runs=0, domain=DOMAIN)
    out = least_compute_for_loss(law, target_loss=2.2, tokens_per_record=ELL, sizes=SIZES[:3], batches=[256, 1024],
                                 steps=[300, 1000, 3000], accountant="rdp", top=2, **PRIV)
    best = out["candidates"][0]
    assert best["loss"] <= 2.2
    # brute force over the same grid: nothing cheaper reaches 2.2
    table = SigmaTable(**PRIV)
    for n in SIZES[:3]:
        for b in (256, 1024):
            for s in (300, 1000, 3000):
                c = 6 * n * b * s * ELL
                if c < best["compute"]:
                    assert float(law.predict(N=n, S=s, sigma_bar=table.sigma(b, s, "rdp") / b)) > 2.2
    with pytest.raises(ScalingError, match="not reached by any candidate"):
        least_compute_for_loss(law, target_loss=1.0, tokens_per_record=ELL, sizes=SIZES[:2], batches=[256],
                               steps=[300], accountant="rdp", **PRIV)


def test_plan_outside_fitted_range_is_refused_and_allowed_loudly():
    law = FitResult(form="noise_batch", params=TRUE, ci={}, r2=1.0, n_points=0, n_runs=0, domain=DOMAIN)
    with pytest.raises(ScalingError, match="inside the fitted range"):
        best_for_compute(law, compute=COMPUTE, tokens_per_record=ELL, sizes=[1e10], batches=[256],
                         accountant="rdp", **PRIV)
    chin = FitResult(form="chinchilla", params={"E": 1.7, "A": 400.0, "alpha": 0.34, "B": 410.0, "beta": 0.28},
                     ci={}, r2=0.99, n_points=20, n_runs=20, domain={"N": [1e6, 1e8], "D": [1e8, 1e10]})
    with pytest.raises(OutsideFitError, match=r"parameters N = .* outside the fitted range \[1e\+06, 1e\+08\]"):
        compute_for_target(chin, target_loss=2.0)
    with pytest.warns(UserWarning, match="EXTRAPOLATING"):
        compute_for_target(chin, target_loss=2.0, extrapolate=1e6)


def test_committed_cpu_fit_is_flagged_and_its_plan_refused(tmp_path, capsys):
    # Issue #16: this command answered N = 1.7e-9 parameters and 0.2 FLOPs without a word. `dpllm scaling plan`
    # through its entry point (dpllm.cli.main) in this process: a process of its own adds only start-up.
    from dpllm.cli import main as dpllm
    from tests.helpers import in_process

    cmd = ["scaling", "plan", "--fit", os.path.join(ROOT, "docs/results/scaling_sweep_cpu/fit.json"),
           "--epsilon", "8", "--target-ppl", "20"]
    res = in_process(dpllm, cmd, capsys)
    assert res.returncode == 2 and "degenerate" in res.stderr, res.stderr
    res = in_process(dpllm, cmd + ["--force"], capsys)
    assert res.returncode == 2 and "outside the fitted range [3.49e+04, 4.06e+05]" in res.stderr, res.stderr
    # the non-private group's E = 1.08e-10 is negligible next to losses of ~2-3 nats: flagged
    from dpllm.scaling import load_fit
    from dpllm.scaling.plan import check_fit_usable

    doc = load_fit(os.path.join(ROOT, "docs/results/scaling_sweep_cpu/fit.json"))
    fit = FitResult.from_dict(doc["fits"]["non-private"])
    assert any(r.startswith("E=") and "negligible" in r for r in fit.degenerate)
    with pytest.raises(DegenerateFitError, match="negligible"):
        check_fit_usable(fit)


def test_zero_width_interval_is_degenerate():
    fit = FitResult(form="chinchilla", params={"E": 1.8e-25, "A": 3.0, "alpha": 0.2, "B": 9.0, "beta": 0.1},
                    ci={"E": [1.8e-25, 1.8e-25]}, r2=0.95, n_points=12, n_runs=12,
                    residuals=[{"N": 1e5, "D": 1e5, "loss": 2.5}], bootstrap={"n_boot": 100, "n_ok": 100})
    reasons = FitResult.from_dict(json.loads(json.dumps(fit.to_dict()))).degenerate
    assert any("zero-width interval" in r for r in reasons) and any("negligible" in r for r in reasons)
