"""recipes/mlp_scaling.py --quick, run in-process: files, structure, ε bookkeeping, fits."""

import json

import pytest

from tests.helpers import load_recipe

from dpllm.privacy.accounting import compute_epsilon



@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("mlp_scaling")
    res = load_recipe("mlp_scaling").main(["--output_dir", str(out), "--quick", "--no_progress"])
    return out, res


def test_writes_results_summary_and_plots(quick):
    out, res = quick
    for name in ("results.json", "summary.md", "scaling_laws.png", "accuracy.png"):
        assert (out / name).stat().st_size > 0
    assert json.loads((out / "results.json").read_text())["runs"] == res["runs"]
    summary = (out / "summary.md").read_text()
    assert "Command: `python recipes/mlp_scaling.py --output_dir" in summary.splitlines()[2]
    assert "Wall time" in summary and "seed 000" in summary


def test_grid_and_recorded_epsilon(quick):
    _, res = quick
    assert len(res["runs"]) == 3 * 4  # levels × quick widths × 1 seed
    assert {r["level"] for r in res["runs"]} == {"non-private", "σ=1", "σ=3"}
    for r in res["runs"]:
        if r["config"]["private"]:
            for acc in ("prv", "rdp"):
                want = compute_epsilon(noise_multiplier=r["noise_multiplier"], sample_rate=r["sample_rate"],
                                       steps=r["steps"], delta=r["delta"], accountant=acc)
                assert r[f"epsilon_{acc}"] == pytest.approx(want, rel=1e-9)
        assert 0 < r["metrics"]["test_loss"] < 5 and 0 <= r["metrics"]["test_accuracy"] <= 1
    eps = {p["level"]: p["epsilon_prv"] for p in res["privacy"]}
    assert eps["σ=3"] < eps["σ=1"]
    np_runs = [r for r in res["runs"] if r["level"] == "non-private" and r["config"]["width"] == 64]
    assert np_runs[0]["metrics"]["test_accuracy"] > 0.9


def test_power_law_fit_per_level(quick):
    _, res = quick
    assert set(res["fits"]) == {"non-private", "σ=1", "σ=3"}
    for fit in res["fits"].values():
        assert fit["form"] == "power_law" and 0 <= fit["params"]["alpha"] <= 5
        assert fit["bootstrap"]["n_boot"] == 50 and fit["bootstrap"]["seed"] == 2026
        assert len(fit["ci"]["alpha"]) == 2
