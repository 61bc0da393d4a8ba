"""recipes/synthetic_study.py: the quick mode end to end; the full study's claims under ``-m slow``."""

import json

import pytest

from tests.helpers import load_recipe


def test_quick_study_writes_results_table_and_plot(tmp_path):
    res = load_recipe("synthetic_study").main(["--quick", "--out", str(tmp_path / "res"),
                                               "--work", str(tmp_path / "work")])
    assert [r["run"] for r in res["runs"]] == ["no_dp", "dp_eps8"]
    nodp, dp = res["runs"]
    assert nodp["epsilon"] is None and "No differential-privacy guarantee" in nodp["card_statement"]
    assert 7.0 < dp["epsilon"] <= 8.0 and dp["delta"] == 1e-5 and "post-processing" in dp["card_statement"]
    for r in res["runs"]:
        assert 0.0 <= r["verbatim_train"] <= 1.0 and 0.0 <= r["closer_to_train"] <= 1.0 and r["frechet"] >= 0.0
        assert r["canaries"]["included"] + r["canaries"]["excluded"] > 0
        assert (tmp_path / "work" / "synthetic" / f"{r['run']}.report.png").is_file()
    assert json.loads((tmp_path / "res" / "results.json").read_text())["quick"] is True
    assert "| dp_eps8 |" in (tmp_path / "res" / "table.md").read_text()
    assert (tmp_path / "res" / "tradeoff.png").stat().st_size > 1000


@pytest.mark.slow
def test_full_study_non_private_model_copies_and_dp_models_do_not(tmp_path):
    res = load_recipe("synthetic_study").main(["--out", str(tmp_path / "res"), "--work", str(tmp_path / "work")])
    runs = {r["run"]: r for r in res["runs"]}
    nodp = runs.pop("no_dp")
    # the memorising model: copies training records, and clearly more than held-out ones
    # (committed run: 14% of samples copy a training record, 7% / 0% against size-matched train / held-out, 77.5%)
    assert nodp["verbatim_train_all"] >= 0.05 and nodp["verbatim_train"] > 3 * max(nodp["verbatim_heldout"], 0.01)
    assert nodp["closer_to_train"] > 0.65
    for r in runs.values():
        assert r["verbatim_train_all"] <= 0.02 and r["canaries"]["extracted_included"] == 0
        assert r["closer_to_train"] < 0.65
