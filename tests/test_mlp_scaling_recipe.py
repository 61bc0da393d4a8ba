"""recipes/mlp_scaling.py --quick in-process: files, structure, ε bookkeeping, fits; the full grid under -m slow."""

import json

import pytest

from dpllm.privacy.accounting import compute_epsilon
from dpllm.scaling import fit_form
from tests.helpers import assert_reproduces_committed, load_recipe


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
    assert "Wall time" in summary and "scaling-law paper" in summary


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


def test_power_law_fit_per_level_with_the_stated_bootstrap(quick):
    """Each level's fit and interval are what fit_form gives on its runs with the recorded n_boot and seed."""
    _, res = quick
    settings = res["settings"]
    assert set(res["fits"]) == {"non-private", "σ=1", "σ=3"}
    for label, fit in res["fits"].items():
        assert fit["form"] == "power_law" and 0 <= fit["params"]["alpha"] <= 5
        assert fit["bootstrap"]["n_boot"] == settings["n_boot"] and fit["bootstrap"]["seed"] == settings["boot_seed"]
        runs = [r for r in res["runs"] if r["level"] == label]
        kwargs = dict(loss=[r["metrics"]["test_loss"] for r in runs], N=[r["n_params"] for r in runs],
                      seed=settings["boot_seed"], label=label)
        again = fit_form("power_law", n_boot=settings["n_boot"], **kwargs)
        assert again.params["alpha"] == pytest.approx(fit["params"]["alpha"], rel=1e-9)
        assert list(again.ci["alpha"]) == pytest.approx(fit["ci"]["alpha"], rel=1e-9)
        # and the interval depends on the number of resamples, so the check above pins it
        assert list(fit_form("power_law", n_boot=7, **kwargs).ci["alpha"]) != pytest.approx(fit["ci"]["alpha"])


@pytest.mark.slow
def test_full_study_reproduces_the_committed_results(tmp_path):
    """The full grid (no --quick, ~30 s) gives back every run of docs/results/mlp_scaling."""
    res = load_recipe("mlp_scaling").main(["--output_dir", str(tmp_path), "--no_progress"])
    assert_reproduces_committed(res, "mlp_scaling", metric_abs=1e-4)
