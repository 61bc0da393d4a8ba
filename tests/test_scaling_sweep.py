"""The tiny scaling sweep runs end to end (quick mode) and its loss-versus-tokens fits are good."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quick_sweep_end_to_end(tmp_path):
    out = tmp_path / "sweep"
    res = subprocess.run([sys.executable, "recipes/scaling_sweep.py", "--config",
                          "recipes/configs/tiny/scaling_sweep_cpu.yaml", "--output_dir", str(out), "--quick",
                          "--n_boot", "50"], capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
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
    res = subprocess.run([os.path.join(os.path.dirname(sys.executable), "dpllm"), "scaling", "fit", "--runs",
                          str(out / "runs.jsonl"), "--form", "chinchilla", "--out", str(tmp_path / "fit2"),
                          "--n-boot", "50"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
