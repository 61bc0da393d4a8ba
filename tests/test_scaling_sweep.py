"""The tiny scaling sweep runs end to end (quick mode) and its loss-versus-tokens fits are good.

The recipe and `dpllm scaling fit` run in this process (their ``main``, as the commands call it): a process of
their own would add only its start-up (imports), ~10 s of CPU each."""

import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quick_sweep_end_to_end(tmp_path):
    from dpllm.cli import main as dpllm
    from tests.helpers import load_recipe

    out = tmp_path / "sweep"
    load_recipe("scaling_sweep").main(["--config", os.path.join(ROOT, "recipes/configs/tiny/scaling_sweep_cpu.yaml"),
                                       "--output_dir", str(out), "--quick", "--n_boot", "50"])
    rows = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert len(rows) == 8
    for r in rows:
        assert r["privacy_enabled"] and r["epsilon"] <= 8.0
        assert (out / os.path.basename(r["run_dir"]) / "privacy_report.json").is_file()
    # more tokens, lower loss, for each size
    for n in {r["params_trainable"] for r in rows}:
        losses = [r["final_eval_loss"] for r in sorted(rows, key=lambda r: r["steps"]) if r["params_trainable"] == n]
        assert losses == sorted(losses, reverse=True)
    fit = json.loads((out / "fit" / "fit.json").read_text())
    assert fit["form"] == "chinchilla" and fit["fits"]
    per_size = fit["tokens_power_law"]
    assert len(per_size) == 2
    for f in per_size.values():
        assert f["r2"] > 0.9, f
    assert list((out / "fit").glob("*.png"))
    # the sweep's own fit feeds `dpllm scaling fit` unchanged
    assert dpllm(["scaling", "fit", "--runs", str(out / "runs.jsonl"), "--form", "chinchilla", "--out",
                  str(tmp_path / "fit2"), "--n-boot", "50"]) == 0
