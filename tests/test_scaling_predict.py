"""`dpllm scaling predict`, CSV tables, published priors, plots and --help's imports (issue #27)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from dpllm.cli import main
from dpllm.scaling import FitResult, get_form, load_fit
from dpllm.scaling.published import PUBLISHED, published_fit

TRUTH = {"E": 1.7, "A": 400.0, "alpha": 0.34, "B": 410.0, "beta": 0.28}
BUDGETS = (1e15, 1e16, 1e17, 1e18)


def _isoflop_csv(path, noise=0.01):
    """An isoFLOP sweep as a plain CSV: columns params, tokens, eval_loss (not the runs-table names)."""
    rng = np.random.default_rng(0)
    law = get_form("chinchilla")
    lines = ["params,tokens,eval_loss,seed"]
    for c in BUDGETS:
        for n in np.geomspace(1e6, 1e8, 5):
            d = c / (6 * n)
            if 1e7 <= d <= 1e11:
                for seed in (0, 1):
                    y = float(law.predict(TRUTH, {"N": np.array([n]), "D": np.array([d])})[0])
                    lines.append(f"{n:.6g},{d:.6g},{y * math.exp(rng.normal(0, noise)):.5f},{seed}")
    path.write_text("\n".join(lines) + "\n")
    return path


COLS = ["--params-col", "params", "--tokens-col", "tokens", "--loss-col", "eval_loss"]


@pytest.fixture(scope="module")
def csv_fit(tmp_path_factory):
    out = tmp_path_factory.mktemp("csvfit")
    runs = _isoflop_csv(out / "runs.csv")
    assert main(["scaling", "fit", "--runs", str(runs), *COLS, "--out", str(out / "fit"), "--n-boot", "30"]) == 0
    return out


def test_fit_reports_extrapolation_validation_and_predict_says_where_it_is(csv_fit, capsys):
    # issue 36: the summary and fit.json carry the rolling-origin validation; predict and plan say inside/beyond
    doc = json.loads((csv_fit / "fit" / "fit.json").read_text())
    ex = doc["fits"]["non-private"]["extrapolation"]
    assert ex["status"] == "calibrated" and ex["axis"] == "N" and ex["level"] == 0.95
    assert ex["per_size"] and all({"N", "cut", "beyond_factor", "mean_error_pct", "coverage"} <= set(r)
                                  for r in ex["per_size"])
    data = (csv_fit / "fit" / "extrapolation.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    fit_json = str(csv_fit / "fit" / "fit.json")
    assert main(["scaling", "predict", "--fit", fit_json, "--params", "1e7,1e9", "--tokens", "1e9",
                 "--extrapolate", "20", "--json"]) == 0
    inside, beyond = json.loads(capsys.readouterr().out)["predictions"]
    assert inside["inside_data"] and inside["data"] == "inside the data" and inside["beyond_factor"] == 1.0
    assert (not beyond["inside_data"] and beyond["beyond_input"] == "N"
            and beyond["beyond_factor"] == pytest.approx(10.0))
    assert "rolling-origin validation along N" in beyond["interval_calibration"]
    fit = FitResult.from_dict(doc["fits"]["non-private"])
    assert beyond["prediction_interval"] == pytest.approx([float(v) for v in fit.prediction_interval(N=1e9, D=1e9)])
    assert main(["scaling", "predict", "--fit", fit_json, "--params", "1e9", "--tokens", "1e9",
                 "--extrapolate", "20"]) == 0
    text = capsys.readouterr().out
    assert "BEYOND the data: ×10 in N past the fitted range (fitted N 1e+06 to 1e+08)" in text
    assert "held-out coverage at nominal 95%" in text
    # the planner's "train N at D" comes with the loss range such a run will likely give, and where it is
    assert main(["scaling", "plan", "--fit", fit_json, "--target-loss", "4.0", "--n", "3e7", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    lo, hi = plan["prediction_interval"]
    assert plan["predicted_loss"] == pytest.approx(4.0) and lo < 4.0 < hi
    assert plan["inside_data"] and plan["data"] == "inside the data" and "in-range" in plan["interval_calibration"]


def test_fit_names_the_users_own_columns(tmp_path, capsys):
    # issue 35: the summary said "N = params_trainable" of a table whose column is "params"
    runs = _isoflop_csv(tmp_path / "runs.csv")
    assert main(["scaling", "fit", "--runs", str(runs), *COLS, "--out", str(tmp_path / "fit"), "--n-boot", "0",
                 "--no-plots"]) == 0
    text = capsys.readouterr().out
    assert "N = params; D = tokens; loss = eval_loss; " in text and "params_trainable" not in text
    doc = json.loads((tmp_path / "fit" / "fit.json").read_text())
    assert doc["inputs"]["columns"] == {"N": "params", "D": "tokens", "loss": "eval_loss"}


def test_csv_fit_needs_no_steps_or_batch_and_draws_every_plot(csv_fit, capsys):
    doc = json.loads((csv_fit / "fit" / "fit.json").read_text())
    fit = doc["fits"]["non-private"]
    assert abs(fit["params"]["alpha"] - 0.34) < 0.05 and fit["r2"] > 0.99
    assert doc["inputs"]["tokens_per_record"] is None and doc["inputs"]["groups"]["non-private"]["S"] is None
    assert len(fit["scatter"]["log_residuals"]) == doc["inputs"]["n_runs"]
    for name in ("loss_vs_N.png", "loss_vs_D.png", "pred_vs_obs.png", "residuals.png"):
        data = (csv_fit / "fit" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_predict_prints_loss_with_labelled_intervals(csv_fit, capsys):
    fit_json = str(csv_fit / "fit" / "fit.json")
    args = ["scaling", "predict", "--fit", fit_json, "--params", "1e7,3e7", "--tokens", "1e9"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "95% prediction interval" in text and "(a new run)" in text and "95% CI of the mean" in text
    assert main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    fit = FitResult.from_dict(load_fit(fit_json)["fits"]["non-private"])
    for row, n in zip(out["predictions"], (1e7, 3e7)):
        assert row["N"] == n and row["D"] == 1e9
        assert row["loss"] == pytest.approx(float(fit.predict(N=n, D=1e9)))
        assert row["prediction_interval"] == pytest.approx([float(v) for v in fit.prediction_interval(N=n, D=1e9)])
        lo, hi = row["prediction_interval"]
        mlo, mhi = row["mean_ci"]
        assert lo < mlo < row["loss"] < mhi < hi
    # outside the fitted range: refused with the range, allowed loudly
    assert main(["scaling", "predict", "--fit", fit_json, "--params", "1e10", "--tokens", "1e9"]) == 2
    assert "outside the fitted range" in capsys.readouterr().err
    assert main(["scaling", "predict", "--fit", fit_json, "--params", "1e7"]) == 2
    assert "add --tokens" in capsys.readouterr().err


@pytest.mark.parametrize("write, args, message", [
    (lambda p: p.write_text("N,D,loss\n1e6,1e8,3.0\n"), [], "looks like CSV, not JSONL"),
    (lambda p: p.write_text("params,tokens,eval_loss\n1e6,1e8,3.0\n"), ["--format", "csv", "--loss-col", "loss"],
     "column 'loss' (for final_eval_loss) is not in"),
    (lambda p: p.write_text("params,tokens,eval_loss\n1e6,1e8,3.0\n"), ["--format", "csv"],
     "has no 'params_trainable'; name the column that holds it with --params-col NAME"),
])
def test_table_errors_say_what_to_change(tmp_path, capsys, write, args, message):
    path = tmp_path / "runs.jsonl"
    write(path)
    assert main(["scaling", "fit", "--runs", str(path), "--out", str(tmp_path / "o"), *args]) == 2
    assert message in capsys.readouterr().err


def test_chinchilla_from_jsonl_rows_without_steps(tmp_path):
    law = get_form("chinchilla")
    with open(tmp_path / "runs.jsonl", "w") as fh:
        for n in (1e6, 1e7, 1e8):
            for d in (1e8, 1e9, 1e10):
                y = float(law.predict(TRUTH, {"N": np.array([n]), "D": np.array([d])})[0])
                fh.write(json.dumps({"params_trainable": n, "tokens_seen": d, "final_eval_loss": y, "steps": None,
                                     "logical_batch_size": None, "privacy_enabled": False}) + "\n")
    assert main(["scaling", "fit", "--runs", str(tmp_path / "runs.jsonl"), "--out", str(tmp_path / "f"),
                 "--n-boot", "0", "--no-plots"]) == 0


def test_epsilon_on_a_fit_without_noise_names_the_noise_batch_form(csv_fit, capsys):
    fit_json = str(csv_fit / "fit" / "fit.json")
    for cmd in (["predict", "--fit", fit_json, "--params", "1e7", "--tokens", "1e9", "--epsilon", "8"],
                ["plan", "--fit", fit_json, "--epsilon", "8", "--compute", "1e17"],
                ["plan", "--fit", "published:chinchilla-hoffmann2022", "--epsilon", "8", "--compute", "1e21"]):
        assert main(["scaling", *cmd]) == 2
        err = capsys.readouterr().err
        assert "no noise term" in err and "--form noise_batch" in err and "eps=8" in err


def test_published_priors_predict_plan_and_are_marked(capsys):
    assert main(["scaling", "predict", "--fit", "published:chinchilla-hoffmann2022", "--params", "7e9",
                 "--tokens", "1.4e11", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["prior"]["name"] == "chinchilla-hoffmann2022" and "arXiv:2203.15556" in row["prior"]["citation"]
    assert row["predictions"][0]["loss"] == pytest.approx(1.69 + 406.4 / 7e9**0.34 + 410.7 / 1.4e11**0.28)
    assert main(["scaling", "predict", "--fit", "published:chinchilla-besiroglu2024", "--params", "1e9",
                 "--tokens", "2e10"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("PRIOR, not your data: published:chinchilla-besiroglu2024")
    assert "no prediction interval (a published point estimate)" in text
    # The compute-optimal split N ∝ C^(β/(α+β)): 0.45 for Hoffmann's rounded figures, 0.51 for the replication
    # (which Besiroglu et al. find matches Hoffmann et al.'s approaches 1 and 2).
    for name, expo in (("chinchilla-hoffmann2022", 0.4516), ("chinchilla-besiroglu2024", 0.5126)):
        ns = []
        for c in (1e21, 1e22):
            assert main(["scaling", "plan", "--fit", f"published:{name}", "--compute", str(c), "--json"]) == 0
            ans = json.loads(capsys.readouterr().out)
            assert ans["prior"]["name"] == name and 6 * ans["N"] * ans["D"] == pytest.approx(c)
            ns.append(ans["N"])
        assert math.log10(ns[1] / ns[0]) == pytest.approx(expo, abs=5e-4)
    # outside the published fits' range (70M-16B parameters) a plan is refused like any other
    assert main(["scaling", "plan", "--fit", "published:chinchilla-hoffmann2022", "--compute", "1e17"]) == 2
    assert "outside the fitted range" in capsys.readouterr().err
    assert main(["scaling", "published"]) == 0
    listing = capsys.readouterr().out
    assert all(f"published:{k}" in listing for k in PUBLISHED) and "priors from other data" in listing
    with pytest.raises(Exception, match="no published fit 'kaplan'"):
        published_fit("kaplan")


def test_published_figures_are_the_papers():
    assert PUBLISHED["chinchilla-hoffmann2022"]["params"] == {"E": 1.69, "A": 406.4, "alpha": 0.34, "B": 410.7,
                                                              "beta": 0.28}
    assert PUBLISHED["chinchilla-besiroglu2024"]["params"] == {"E": 1.8172, "A": 482.01, "alpha": 0.3478,
                                                               "B": 2085.43, "beta": 0.3658}


def test_scaling_help_does_not_import_scipy_or_torch():
    code = ("import sys; from dpllm.cli import main; rc = main(['scaling', '--help']); "
            "print(rc, 'scipy.optimize' in sys.modules, 'torch' in sys.modules, 'opacus' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "0 False False False"


def test_plain_tick_labels_and_curves_that_follow_an_isoflop_sweep():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dpllm.scaling.plot import _family, plain_log_axis

    fig, ax = plt.subplots()
    ax.plot([1e4, 5e5], [2.2, 4.6])
    plain_log_axis(ax, "x")
    plain_log_axis(ax, "y")
    fig.canvas.draw()
    labels = [t.get_text() for t in ax.get_yticklabels() + ax.get_xticklabels() if t.get_text()]
    plt.close(fig)
    assert labels and not any("times" in t or "$" in t or "×" in t for t in labels)
    assert {"3", "4"} <= set(labels) and "1e5" in labels
    # an isoFLOP sweep gets lines of constant compute, and each passes through the law at its runs
    n = np.repeat(np.geomspace(1e6, 1e8, 5), 3)
    c = np.tile([1e15, 1e16, 1e17], 5)
    m = {"N": n, "D": c / (6 * n)}
    kind, levels, idx = _family(m, "N", "D")
    assert kind == "iso" and len(levels) == 3
    law = get_form("chinchilla")
    on_curve = law.predict(TRUTH, {"N": n, "D": np.array(levels)[idx] / (6 * n)})
    assert np.allclose(on_curve, law.predict(TRUTH, m), rtol=1e-3)
    # a grid sweep gets one line per D, a sweep with many D bins them
    grid = {"N": np.repeat([1e6, 1e7, 1e8], 3), "D": np.tile([1e8, 1e9, 1e10], 3)}
    assert _family(grid, "N", "D")[0] == "fixed" and _family(grid, "N", "D")[1] == [1e8, 1e9, 1e10]
    rng = np.random.default_rng(0)
    scattered = {"N": np.exp(rng.uniform(14, 18, 40)), "D": np.exp(rng.uniform(18, 23, 40))}
    kind, levels, idx = _family(scattered, "N", "D")
    assert kind == "fixed" and len(levels) == 5 and set(idx) == set(range(5))


def test_predict_from_a_noise_batch_fit_takes_steps_and_sigma_bar(tmp_path, capsys):
    from dpllm.scaling import write_fit

    params = {"E": 1.0, "A": 40.0, "alpha": 0.3, "B": 6.0, "beta": 0.35, "C": 60.0, "gamma": 1.0, "kappa": 0.1,
              "eta": 0.2}
    law = FitResult(form="noise_batch", params=params, ci={}, r2=0.99, n_points=30, n_runs=30,
                    domain={"N": [1e6, 1e8], "S": [100.0, 10000.0], "sigma_bar": [1e-4, 1e-2]}, label="joint")
    write_fit({"form": "noise_batch", "fits": {"joint": law.to_dict()}, "skipped": {},
               "inputs": {"groups": {"eps=8": {"sigma_bar": [1e-3, 2e-3]}}}}, tmp_path / "fit.json")
    base = ["scaling", "predict", "--fit", str(tmp_path / "fit.json"), "--params", "1e7"]
    assert main(base + ["--steps", "1000,3000", "--sigma-bar", "1e-3", "--epsilon", "8", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["predictions"]
    assert [r["S"] for r in rows] == [1000, 3000] and rows[0]["sigma_bar"] == 1e-3
    assert rows[0]["loss"] == pytest.approx(float(law.predict(N=1e7, S=1000, sigma_bar=1e-3)))
    assert main(base + ["--steps", "1000"]) == 2
    assert "add --sigma-bar (σ̄ = noise multiplier / logical batch; 0 = non-private)" in capsys.readouterr().err
    assert main(base + ["--steps", "1000,2000", "--sigma-bar", "0,1e-3,2e-3"]) == 2
    assert "the same number of values" in capsys.readouterr().err
