"""The two-stage sweep (public pretraining, LR grid, DP fine-tuning) runs on CPU and resumes from its runs
tables alone, as a fresh device session must."""

import json
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CMD = [sys.executable, "recipes/scaling_sweep.py", "--config", "recipes/configs/tiny/scaling_sweep_twostage_cpu.yaml",
       "--quick", "--no_fit"]


def test_two_stage_quick_sweep_runs_and_resumes_from_tables(tmp_path):
    out = tmp_path / "two"
    res = subprocess.run(CMD + ["--output_dir", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    manifest = json.loads((out / "corpora" / "manifest.json").read_text())
    assert manifest["corpora"]["public"]["records"] == 3000 and manifest["corpora"]["private"]["records"] == 3000
    main = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    lr = [json.loads(line) for line in (out / "lr_runs.jsonl").read_text().splitlines()]
    pre = [json.loads(line) for line in (out / "pretrain_runs.jsonl").read_text().splitlines()]
    assert (len(pre), len(lr), len(main)) == (2, 4, 4)
    assert not any(r["privacy_enabled"] for r in pre) and all(r["privacy_enabled"] for r in lr)
    for r in main:  # fine-tuned from its size's pretrained model, on the private corpus, at the best LR
        cfg = (out / os.path.basename(r["run_dir"]) / "config.yaml").read_text()
        size = os.path.basename(r["run_dir"]).split("_")[0]
        assert f"pre_{size}" in cfg and "private.jsonl" in cfg
        grid = {float(x["run_dir"].rsplit("_lr", 1)[1]): x["final_eval_loss"] for x in lr
                if f"_{size}_" in x["run_dir"]}
        assert f"learning_rate: {min(grid, key=grid.get)}" in cfg
    # A fresh machine gets only the runs tables back: nothing is re-run, not even pretraining.
    for d in out.iterdir():
        if d.is_dir() and d.name != "corpora":
            shutil.rmtree(d)
    res = subprocess.run(CMD + ["--output_dir", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert res.returncode == 0 and "pretrain:" not in res.stdout and "main:" not in res.stdout, res.stdout[-2000:]
