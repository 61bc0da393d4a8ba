"""recipes/mlp_clipping.py --quick in-process: every arm at one σ and ε, well-formed intervals; full grid: -m slow."""


import pytest

from tests.helpers import assert_reproduces_committed, load_recipe


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("mlp_clipping")
    return out, load_recipe("mlp_clipping").main(["--output_dir", str(out), "--quick", "--no_progress"])


def test_files(quick):
    out, _ = quick
    for name in ("results.json", "summary.md", "clipping.png"):
        assert (out / name).stat().st_size > 0
    text = (out / "summary.md").read_text()
    assert text.splitlines()[2].startswith("Command: `python recipes/mlp_clipping.py")
    assert "Does PSASC beat flat clipping?" in text


def test_equal_epsilon_across_methods(quick):
    _, res = quick
    dp = [r for r in res["runs"] if r["method"] != "non-private"]
    assert {r["method"] for r in dp} == {"flat", "automatic", "psac", "psasc", "psasc lr×s"}
    assert len({r["noise_multiplier"] for r in dp}) == 1  # one calibration, shared by every arm
    assert len({r["epsilon_prv"] for r in dp}) == 1 and 7.9 < dp[0]["epsilon_prv"] <= 8.0
    sens = {r["method"]: r["sensitivity"] for r in dp}
    assert sens["psasc"] == sens["psasc lr×s"] == 2.0 and sens["flat"] == 1.0
    lrs = {r["method"]: r["config"]["lr"] for r in dp}
    assert lrs["psasc lr×s"] == pytest.approx(0.5 * lrs["psasc"])


def test_intervals(quick):
    _, res = quick
    for row in res["stats"]:
        for metric in ("accuracy", "loss"):
            assert row[metric]["lo"] <= row[metric]["mean"] <= row[metric]["hi"]
        if row["method"] not in ("flat", "non-private"):
            assert row["accuracy_minus_flat"]["lo"] <= row["accuracy_minus_flat"]["hi"]


@pytest.mark.slow
def test_full_study_reproduces_the_committed_results(tmp_path):
    """The full grid (no --quick, ~25 s) gives back every run of docs/results/mlp_clipping."""
    res = load_recipe("mlp_clipping").main(["--output_dir", str(tmp_path), "--no_progress"])
    assert_reproduces_committed(res, "mlp_clipping", metric_abs=1e-4)
