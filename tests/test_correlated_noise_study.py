"""recipes/correlated_noise_study.py: its MLP loop is the project's DP-SGD, b = 1 is DP-SGD, and --quick's ε
bookkeeping recomputes from what each row records (σ, q, steps, δ, accountant)."""

import json
import math
from pathlib import Path

import pytest
import torch

from dpllm.privacy import accounting
from dpllm.privacy.correlated import blt as blt_math
from dpllm.privacy.correlated import build
from tests.helpers import load_recipe

study = load_recipe("correlated_noise_study")


@pytest.fixture(scope="module")
def data():
    from dpllm.mlp.data import load_dataset

    return load_dataset("gaussian")


def _runs(mechs, seed=7, sigma=2.0, lr=0.1):
    return [{"seed": seed, "mech": m, "noise_multiplier": sigma, "lr": lr} for m in mechs]


def test_study_loop_with_independent_noise_is_the_batched_mlp_trainer(data):
    """Same seed → same init, Poisson batches and noise draws as dpllm.mlp.batched.train_mlps (itself checked against
    Opacus): the study's loop differs from the project's DP-SGD only where the registry's mechanism says so."""
    from dpllm.mlp.batched import train_mlps
    from dpllm.mlp.train import MLPRun, plan_for

    setting = study.Setting("mlp", "t", 64, 3, 0.1)
    steps = 3 * 7
    mech = build("independent", "auto", steps=steps, num_records=data.n_train, batch=64)
    ours = study.train_mlp_runs(_runs([mech]), data, setting=setting)[0]
    run = MLPRun(width=64, epochs=3, lr=0.1, batch_size=64, seed=7, noise_multiplier=2.0, max_grad_norm=1.0)
    theirs = train_mlps([run], data, plans=[plan_for(run, n_train=data.n_train)])[0].record["metrics"]
    for key in ("test_loss", "train_loss", "test_accuracy"):
        assert ours[key] == pytest.approx(theirs[key], abs=1e-5), key
    # and the noise does reach the model: another σ gives another loss
    louder = study.train_mlp_runs(_runs([mech], sigma=20.0), data, setting=setting)[0]
    assert abs(louder["test_loss"] - ours["test_loss"]) > 1e-3


def test_one_band_reproduces_independent_and_more_bands_do_not(data):
    setting = study.Setting("mlp", "t", 64, 3, 0.1)
    kw = dict(steps=21, num_records=data.n_train, batch=64)
    one, ind, four = build("banded", 1, **kw), build("independent", "auto", **kw), build("banded", 4, **kw)
    assert one.event(2.0) == ind.event(2.0) == (2.0, 1 / 7, 21)
    a, b, c = study.train_mlp_runs(_runs([one, ind, four]), data, setting=setting)
    assert a == pytest.approx(b, abs=1e-6)  # same sampler stream, recurrence x = z: DP-SGD's run
    assert abs(c["test_loss"] - b["test_loss"]) > 1e-4  # 4 bands: other batches (cyclic groups) and noise


def test_record_groups_follow_each_records_own_content(data):
    from dpllm.mlp.train import record_texts

    texts = record_texts(data.x_train, data.y_train)
    assert len(set(texts)) == data.n_train  # one group key per record, no two records share one
    assert record_texts(data.x_train[5:6], data.y_train[5:6]) == texts[5:6]  # no other record enters it


def _engine(data, noise, bands, **kw):
    from dpllm.mlp.train import MLPRun, plan_for, train_mlp

    run = MLPRun(width=16, epochs=3, lr=0.1, seed=7, noise_multiplier=2.0, noise=noise, bands=bands,
                 **{"grad_sample_mode": "bk", **kw})
    return train_mlp(run, data, plan=plan_for(run, n_train=data.n_train))


def test_mlp_engine_one_band_is_dp_sgd_exactly(data):
    """dpllm.mlp.train with noise=banded, b = 1, through make_private (bk): DP-SGD's batches, noise and weights."""
    one, ind = _engine(data, "banded", "1"), _engine(data, "independent", "auto")
    for a, b in zip(one.model.parameters(), ind.model.parameters()):
        assert torch.equal(a, b)  # the same arithmetic in the same order: the recurrence returns the draw itself
    assert one.record["epsilon_prv"] == ind.record["epsilon_prv"] and one.record["accounted_steps"] == 21


def test_mlp_engine_banded_is_the_study_loop_and_accounts_the_reduction(data):
    """The engine's cyclic sampler and bk recurrence give the study loop's run (so its BLT rows, which the engine
    does not train yet, run the same arithmetic); ε is the DP-SGD event at q_b over ⌈T/b⌉ steps."""
    out = _engine(data, "banded", "4")
    mech = build("banded", 4, steps=21, num_records=data.n_train, batch=64)
    ours = study.train_mlp_runs(_runs([mech]), data, setting=study.Setting("mlp", "t", 64, 3, 0.1), width=16)[0]
    assert ours["test_loss"] == pytest.approx(out.record["metrics"]["test_loss"], abs=1e-5)
    r = out.record
    assert (r["sample_rate"], r["accounted_steps"], r["noise"]["bands"]) == (4 / 7, 6, 4)
    assert r["epsilon_prv"] == pytest.approx(accounting.compute_epsilon(
        noise_multiplier=2.0, sample_rate=4 / 7, steps=6, delta=1e-5, accountant="prv"), rel=1e-9)


def test_mlp_engine_banded_under_hooks_is_bks_run(data):
    """Opacus hooks now take the correlated recurrence too (dpllm.privacy.correlated.optimizer): the same batches,
    draws and recurrence as bk, so the same model up to the engines' different per-sample arithmetic (1e-5)."""
    bk, hooks = _engine(data, "banded", "2"), _engine(data, "banded", "2", grad_sample_mode="hooks")
    assert hooks.record["metrics"]["test_loss"] == pytest.approx(bk.record["metrics"]["test_loss"], abs=1e-5)
    assert hooks.record["epsilon_prv"] == bk.record["epsilon_prv"]
    plain = _engine(data, "independent", "auto", grad_sample_mode="hooks")
    assert abs(plain.record["metrics"]["test_loss"] - hooks.record["metrics"]["test_loss"]) > 1e-4


def test_mlp_paths_refuse_what_they_do_not_run(data):
    from dpllm.mlp.batched import train_mlps
    from dpllm.mlp.train import MLPRun

    with pytest.raises(accounting.PrivacyPlanError, match="noise: blt is not built into the MLP trainer"):
        _engine(data, "blt", "auto")  # one Gaussian mechanism: a PrivacyPlan cannot account it yet
    hooks = MLPRun(width=16, epochs=1, noise_multiplier=2.0, noise="banded", bands="2")  # default hooks
    with pytest.raises(ValueError, match="not in the lockstep trainer"):
        train_mlps([hooks], data, plans=[None])


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("correlated_noise")
    res = study.main(["--output_dir", str(out), "--quick", "--parts", "mlp", "--no_progress"])
    return out, res


def test_quick_writes_json_summary_and_plot(quick):
    out, res = quick
    for name in ("results.json", "summary.md", "correlated_noise.png"):
        assert (out / name).stat().st_size > 0
    assert json.loads((out / "results.json").read_text())["rows"] == json.loads(json.dumps(res["rows"]))
    assert "Command: `python recipes/correlated_noise_study.py" in (out / "summary.md").read_text()
    assert {r["mechanism_key"] for r in res["rows"]} == {"non-private", "independent", "banded", "banded_k", "blt"}


def test_every_epsilon_meets_its_target_and_recomputes_from_the_recorded_event(quick):
    _, res = quick
    private = [r for r in res["rows"] if r["target_epsilon"] is not None]
    assert private
    for r in private:
        assert r["epsilon"] <= r["target_epsilon"]
        sigma, q, steps = r["accounted_event"]
        if r["accounting"] == "amplified_dpsgd":  # DP-SGD's event at the group rate over ⌈T/b⌉ steps
            assert (sigma, q, steps) == (r["noise_multiplier"], r["group_sample_rate"],
                                         math.ceil(r["steps"] / r["bands"]))
            assert r["sensitivity"] == 1.0
        else:  # BLT: one Gaussian mechanism, σ/sens at q = 1, one step, never amplified
            assert r["mechanism"] == "blt" and (q, steps) == (1.0, 1)
            assert sigma == pytest.approx(r["noise_multiplier"] / r["sensitivity"], rel=1e-12)
            # the exact ε of that Gaussian mechanism is never above the accountant's
            assert r["epsilon_exact_gaussian"] <= r["epsilon"] + 1e-3
            strategy = build("blt", r["bands"], steps=r["steps"], num_records=400, batch=r["batch"]).strategy
            assert r["sensitivity"] == pytest.approx(strategy.sensitivity(r["steps"]), rel=1e-12)
        again = accounting.compute_epsilon_history(history=[(sigma, q, steps)], delta=r["delta"],
                                                   accountant=r["accountant"])
        assert again == pytest.approx(r["epsilon"], rel=1e-9)
        assert r["delta"] == 1e-5 and r["accountant"] == "prv"


def test_predictions_are_sigma_times_the_strategys_prefix_sum_rmse(quick):
    _, res = quick
    for r in res["rows"]:
        if r["target_epsilon"] is None:
            continue
        assert r["predicted_error"] == pytest.approx(r["noise_multiplier"] / r["sensitivity"] * r["prefix_sum_rmse"])
        if r["mechanism"] == "independent":
            assert r["prefix_sum_rmse"] == pytest.approx(math.sqrt((r["steps"] + 1) / 2))
        if r["mechanism"] == "blt":
            s = build("blt", r["bands"], steps=r["steps"], num_records=400, batch=r["batch"]).strategy
            assert r["prefix_sum_rmse"] == pytest.approx(blt_math.prefix_sum_rmse_of(
                s.blt.inverse().coefs(r["steps"]), s.sensitivity(r["steps"])))


def test_bands_auto_that_picks_one_band_is_dp_sgd_seed_for_seed(quick):
    """The registry's auto may pick b = 1 (DP-SGD); such a row then trains exactly DP-SGD's run."""
    _, res = quick
    cells = {(c["setting"], c["target_epsilon"], c["mechanism_key"]): c for c in res["cells"]}
    picked_one = [c for c in res["cells"] if c["mechanism_key"] == "banded" and c["bands"] == 1]
    assert picked_one  # ε = 1 over 3 epochs: amplification beats correlation
    for c in picked_one:
        assert c["diff_vs_dpsgd"] == pytest.approx(0.0, abs=1e-9)
        assert c["mean"] == pytest.approx(cells[(c["setting"], c["target_epsilon"], "independent")]["mean"])
    assert torch.get_num_threads() == 1


def test_replot_rebuilds_the_same_tables_from_results_json(quick):
    out, res = quick
    before = (out / "summary.md").read_text()
    again = study.main(["--output_dir", str(out), "--replot"])
    assert (out / "summary.md").read_text() == before
    assert again["cells"] == json.loads(json.dumps(res["cells"]))


def test_merge_replaces_the_parts_it_is_given_and_keeps_the_others(quick, tmp_path):
    """--merge FILE: the rows of every part FILE holds replace that part's rows in --output_dir's results.json, the
    other parts' rows stay as they were, each part names the command that made it, and merging again replaces
    rather than appends. FILE here is the quick MLP run's rows relabelled as a Llama part (the merge reads only
    ``part``; the real Llama part trains for minutes)."""
    import shutil

    out, res = quick
    study_dir = tmp_path / "study"
    study_dir.mkdir()
    shutil.copy(out / "results.json", study_dir / "results.json")
    mlp_rows = json.loads((out / "results.json").read_text())["rows"]

    def llama_part(shift):
        rows = [{**r, "part": "llama", "metric": r["metric"] + shift} for r in mlp_rows]
        path = tmp_path / f"llama{shift}.json"
        path.write_text(json.dumps({**res, "command": f"python recipes/correlated_noise_study.py --parts llama "
                                               f"# {shift}", "rows": rows}))
        return path

    merged = study.main(["--output_dir", str(study_dir), "--merge", str(llama_part(1.0))])
    assert [r for r in merged["rows"] if r["part"] == "mlp"] == mlp_rows
    assert [r["metric"] for r in merged["rows"] if r["part"] == "llama"] == [r["metric"] + 1.0 for r in mlp_rows]
    assert merged["parts"]["mlp"]["command"] == res["command"]
    assert merged["parts"]["llama"]["command"].endswith("# 1.0")
    text = (study_dir / "summary.md").read_text()
    assert res["command"] in text and "--parts llama # 1.0" in text and "merged by" in text
    assert "## Tiny Llama" in text and "## MLP" in text

    again = study.main(["--output_dir", str(study_dir), "--merge", str(llama_part(2.0))])
    assert len(again["rows"]) == 2 * len(mlp_rows)  # replaced, not appended
    assert [r["metric"] for r in again["rows"] if r["part"] == "llama"] == [r["metric"] + 2.0 for r in mlp_rows]
    assert again["parts"]["mlp"] == merged["parts"]["mlp"]  # the MLP rows' provenance survives a second merge
    before = (study_dir / "summary.md").read_text()
    study.main(["--output_dir", str(study_dir), "--replot"])
    assert (study_dir / "summary.md").read_text() == before

    full = tmp_path / "full.json"
    full.write_text(json.dumps({**json.loads(llama_part(3.0).read_text()), "quick": False}))
    with pytest.raises(ValueError, match="quick is False in the file to merge and True"):
        study.main(["--output_dir", str(study_dir), "--merge", str(full)])
    with pytest.raises(SystemExit, match="does not exist"):
        study.main(["--output_dir", str(tmp_path / "none"), "--merge", str(full)])


COMMITTED = Path(__file__).resolve().parents[1] / "docs" / "results" / "correlated_noise"


def test_committed_study_epsilons_recompute_from_each_rows_recorded_event():
    """docs/results/correlated_noise (and its llama_checks/): every private row's ε is at most its target and is
    what the row's accountant gives on the event(s) it records; every Llama row ran (BLT too), and a BLT row's
    event is one Gaussian mechanism at σ/sens, sens that of the BLT it names (b groups, d buffers, T steps)."""
    from dpllm.privacy.correlated import blt_strategy

    files = [json.loads((COMMITTED / name).read_text()) for name in ("results.json", "llama_checks/results.json")]
    rows = [{"delta": res["delta"], **r} for res in files for r in res["rows"]]  # llama_checks: δ once per file
    assert not [r["status"] for r in rows if r["status"] != "ran"]
    private = [r for r in rows if r["target_epsilon"] is not None]
    assert {r["mechanism_key"] for r in private if r["part"] == "llama"} == {"independent", "banded", "blt"}
    by_event: dict = {}
    for r in private:
        history = tuple(tuple(h) for h in (r.get("history") or [r["accounted_event"]]))
        by_event.setdefault((history, r["delta"], r["accountant"]), []).append(r)
        assert r["epsilon"] <= r["target_epsilon"]
        if r["part"] == "llama" and r["mechanism"] == "blt":
            (sigma, q, steps), = history
            assert (q, steps) == (1.0, 1)
            assert sigma == pytest.approx(r["noise_multiplier"] / r["sensitivity"], rel=1e-9)
            strategy = blt_strategy(steps=r["total_steps"], groups=r["bands"], buffers=r["buffers"])
            assert r["sensitivity"] == pytest.approx(strategy.sensitivity(r["total_steps"]), rel=1e-9)
    for (history, delta, acc), rs in by_event.items():  # one accountant call per distinct event (seeds share it)
        eps = accounting.compute_epsilon_history(history=list(history), delta=delta, accountant=acc)
        for r in rs:
            assert r["epsilon"] == pytest.approx(eps, rel=1e-9)
