"""The two-stage sweep (public pretraining, LR grid, DP fine-tuning) runs on CPU and resumes from its runs
tables alone, as a fresh device session must. The recipe runs in this process (its ``main``, as the command
calls it): a process of its own would add only its start-up, and the resumed sweep is nothing but start-up."""

import json
import os
import shutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ["--config", os.path.join(ROOT, "recipes/configs/tiny/scaling_sweep_twostage_cpu.yaml"), "--quick", "--no_fit"]


def test_two_stage_quick_sweep_runs_and_resumes_from_tables(tmp_path, capsys):
    from tests.helpers import load_recipe

    sweep = load_recipe("scaling_sweep")
    out = tmp_path / "two"
    sweep.main(ARGS + ["--output_dir", str(out)])
    assert "pretrain:" in capsys.readouterr().out
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
    sweep.main(ARGS + ["--output_dir", str(out)])
    stdout = capsys.readouterr().out
    assert "pretrain:" not in stdout and "main:" not in stdout, stdout[-2000:]
