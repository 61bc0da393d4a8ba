"""recipes/mlp_membership.py --quick in-process, and its shadow design; the full study under -m slow."""


import numpy as np
import pytest

from tests.helpers import assert_reproduces_committed, load_recipe


@pytest.fixture(scope="module")
def recipe():
    return load_recipe("mlp_membership")


@pytest.fixture(scope="module")
def quick(recipe, tmp_path_factory):
    out = tmp_path_factory.mktemp("mlp_membership")
    return out, recipe.main(["--output_dir", str(out), "--quick", "--no_progress"])


def test_halves_are_complementary_pairs(recipe):
    mask = recipe.halves(10, 3)
    assert mask.shape == (6, 10) and (mask.sum(1) == 5).all() and (mask.sum(0) == 3).all()
    assert (mask[0::2] ^ mask[1::2]).all()


def test_leave_pair_out_is_unbiased_without_signal(recipe):
    """No membership signal (every model sees noise around a per-record mean): AUCs near 0.5."""
    from mia.metrics import auc

    rng = np.random.default_rng(0)
    mask = recipe.halves(400, 8, seed=1)
    phi = rng.normal(0, 1, 400)[None] + rng.normal(0, 1, mask.shape)
    scores = recipe.leave_pair_out(phi, -phi, mask)
    for name in ("lira", "loss"):
        m = np.concatenate([a for a, _ in scores[name]])
        n = np.concatenate([b for _, b in scores[name]])
        assert abs(auc(m, n) - 0.5) < 0.03


def test_outputs_and_metrics(quick):
    out, res = quick
    for name in ("results.json", "summary.md", "roc.png", "attack_vs_epsilon.png"):
        assert (out / name).stat().st_size > 0
    assert (out / "summary.md").read_text().splitlines()[2].startswith("Command: `python recipes/mlp_membership.py")
    assert [lv["level"] for lv in res["levels"]] == ["non-private", "ε≈8"]
    for lv in res["levels"]:
        for attack in ("lira", "loss"):
            a = lv["attacks"][attack]
            assert 0 <= a["auc"] <= 1 and a["n_members"] == a["n_nonmembers"] == 6 * 32
            assert len(a["auc_per_target"]) == 6
    np_, dp = res["levels"]
    assert np_["attacks"]["loss"]["auc"] > 0.55  # the non-private models overfit the 32-record halves
    assert dp["epsilon_rdp"] == pytest.approx(8.0, abs=0.05) and dp["epsilon_prv"] < dp["epsilon_rdp"]
    assert dp["dp_bound"]["tpr@fpr=0.01"] == pytest.approx(min(1.0, np.exp(dp["epsilon_prv"]) * 0.01 + 1e-5))


@pytest.mark.slow
def test_full_study_reproduces_the_committed_results(tmp_path):
    """The full grid (no --quick, ~30 s) gives back every run of docs/results/mlp_membership."""
    res = load_recipe("mlp_membership").main(["--output_dir", str(tmp_path), "--no_progress"])
    assert_reproduces_committed(res, "mlp_membership", metric_abs=1e-4)
