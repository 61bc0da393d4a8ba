"""recipes/mlp_privacy_cliff.py --quick through its ``main`` (in this process, as ``python recipes/...`` runs it:
what it prints, the files it writes), then its outputs; full grid: -m slow."""

import json

import pytest

from dpllm.privacy.accounting import compute_epsilon
from tests.helpers import assert_reproduces_committed, load_recipe


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """The recipe's ``main`` in this process (a second interpreter's imports were most of its cost); the global
    settings it makes for its own process (one torch thread, Opacus's warnings silenced) are undone after it."""
    import contextlib
    import io
    import warnings

    import torch

    out = tmp_path_factory.mktemp("mlp_cliff")
    threads, printed = torch.get_num_threads(), io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(printed):
            load_recipe("mlp_privacy_cliff").main(["--output_dir", str(out), "--quick", "--no_progress"])
    finally:
        torch.set_num_threads(threads)
    assert "mlp_privacy_cliff: 5 runs" in printed.getvalue()
    return out, json.loads((out / "results.json").read_text())


def test_files_and_command_line(quick):
    out, _ = quick
    for name in ("results.json", "summary.md", "privacy_utility.png", "epsilon_vs_sigma.png"):
        assert (out / name).stat().st_size > 0
    summary = (out / "summary.md").read_text()
    assert summary.splitlines()[2].startswith("Command: `python recipes/mlp_privacy_cliff.py --output_dir")
    assert "paper printed" in summary and "Poisson" in summary


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


def test_cliff_is_the_stated_criterion(quick):
    _, res = quick
    cliff = res["cliff"]
    assert cliff["baseline_accuracy"] > 0.9
    assert cliff["threshold"] == pytest.approx(cliff["baseline_accuracy"] / 2)
    assert cliff["detected"] == any(c["accuracy_mean"] < cliff["threshold"] for c in res["configs"])
    by_sigma = {p["noise_multiplier"]: p for p in res["privacy"]}
    assert by_sigma[0.5]["epsilon"] > by_sigma[10.0]["epsilon"]


def test_paper_epsilon_sits_beside_the_accountants_at_its_sample_rate(quick):
    """Each σ's printed ε is set against Opacus's ε at the paper's q = B/N, in results.json and the summary."""
    out, res = quick
    recipe = load_recipe("mlp_privacy_cliff")
    from mlp_study import fmt

    table = [[c.strip() for c in line.strip("|").split("|")] for line in (out / "summary.md").read_text().splitlines()
             if line.startswith("| ") and line.count("|") == 8]  # the 7-column ε table
    for p in res["privacy"]:
        at_paper_q = p["at_paper_sample_rate"]
        assert at_paper_q["sample_rate"] == pytest.approx(64 / 400)  # B/N on the 400 training records
        for acc in ("prv", "rdp"):
            want = compute_epsilon(noise_multiplier=p["noise_multiplier"], sample_rate=64 / 400, steps=p["steps"],
                                   delta=p["delta"], accountant=acc)
            assert at_paper_q[f"epsilon_{acc}"] == pytest.approx(want, rel=1e-9)
        printed = recipe.PAPER_EPSILON.get(p["noise_multiplier"])  # None where the paper's value is not legible
        assert p["paper_printed"] == printed
        row = next(r for r in table if r[0] == fmt(p["noise_multiplier"]))
        assert row[3:6] == [fmt(at_paper_q["epsilon_prv"]), fmt(at_paper_q["epsilon_rdp"]), fmt(printed)]
        assert row[6] == (f"{at_paper_q['epsilon_prv'] / printed:.2f}×" if printed else "—")
    # At σ = 10 the paper's bound is loose rather than unsafe: both rigorous accountants give less.
    ten = next(p for p in res["privacy"] if p["noise_multiplier"] == 10.0)
    at_paper_q = ten["at_paper_sample_rate"]
    assert 0.6 < at_paper_q["epsilon_prv"] < at_paper_q["epsilon_rdp"] < ten["paper_printed"]


@pytest.mark.slow
def test_full_study_reproduces_the_committed_results(tmp_path):
    """The full grid (no --quick, ~15 s) gives back every run of docs/results/mlp_privacy_cliff."""
    res = load_recipe("mlp_privacy_cliff").main(["--output_dir", str(tmp_path), "--no_progress"])
    assert_reproduces_committed(res, "mlp_privacy_cliff", metric_abs=1e-4)
