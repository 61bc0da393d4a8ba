"""Bad input, tried as a new user would: one clear line, exit code 2 (or 1), nothing written, nothing deleted.

The training cases go through the recipe's real command entry point (``recipes/finetune_llm.py``'s
``cli``) in-process, so that the table stays fast; one case also runs as a subprocess.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from dpllm import ledger
from dpllm.rundir import RunLock
from tests.helpers import load_recipe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = ["--max_steps", "2", "--logical_batch_size", "16", "--physical_batch_size", "16", "--max_length", "32",
        "--tiny_hidden_size", "32", "--tiny_num_heads", "2", "--eval_every", "0", "--eval_max_records", "8",
        "--progress", "false", "--max_records", "120"]
recipe = load_recipe("finetune_llm")


def snapshot(path):
    """Every file under ``path`` with its bytes: what 'nothing written, nothing deleted' compares."""
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture
def workspace(tmp_path):
    (tmp_path / "data").mkdir()
    rows = [{"text": f"record number {i} says something about the python language {i * 7}"} for i in range(80)]
    (tmp_path / "data" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "data" / "empty.jsonl").write_text("")
    (tmp_path / "data" / "broken.jsonl").write_text(json.dumps(rows[0]) + "\n" + json.dumps(rows[1]) + "\n{oops\n")
    (tmp_path / "data" / "latin1.jsonl").write_bytes(json.dumps(rows[0]).encode() + b"\n" + '{"text": "caf\xe9"}\n'
                                                     .encode("latin-1"))
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("my own notes")
    (tmp_path / "notes" / "data.jsonl").write_text(json.dumps(rows[0]) + "\n")
    (tmp_path / "cfg.yaml").write_text("train:\n  max_steps: 2\n")
    return tmp_path


def cases(w):
    data = str(w / "data" / "train.jsonl")
    out = str(w / "out")
    return [
        ("overwrite a directory that is not a run", ["--dataset", data, "--output_dir", str(w / "notes"),
                                                     "--overwrite_output_dir", "true"], "not a dpllm run directory"),
        ("infinite epsilon", ["--dataset", data, "--output_dir", out, "--target_epsilon", "inf"],
         "target_epsilon=inf must be a finite number"),
        ("nan epsilon", ["--dataset", data, "--output_dir", out, "--target_epsilon", "nan"],
         "target_epsilon=nan must be a finite number"),
        ("nan delta", ["--dataset", data, "--output_dir", out, "--target_delta", "nan"], "target_delta=nan"),
        ("empty jsonl", ["--dataset", str(w / "data" / "empty.jsonl"), "--output_dir", out], "is empty"),
        ("malformed jsonl line", ["--dataset", str(w / "data" / "broken.jsonl"), "--output_dir", out],
         "broken.jsonl:3: not valid JSON"),
        ("non-UTF-8 jsonl line", ["--dataset", str(w / "data" / "latin1.jsonl"), "--output_dir", out],
         "latin1.jsonl:2: not UTF-8"),
        ("dataset path without its extension", ["--dataset", str(w / "data" / "train"), "--output_dir", out],
         "did you mean"),
        ("missing local model path", ["--dataset", data, "--output_dir", out, "--model_name_or_path",
                                      str(w / "no" / "such" / "model")], "no such local directory"),
        ("two --config files", ["--config", str(w / "cfg.yaml"), "--config", str(w / "cfg.yaml"), "--output_dir",
                                out], "more than once"),
        ("delta at 1/N", ["--dataset", data, "--output_dir", out, "--target_delta", "0.05"], "must be in (0, 1/N)"),
        ("unreachable epsilon", ["--dataset", data, "--output_dir", out, "--target_epsilon", "1e-9", "--max_steps",
                                 "500", "--accountant", "rdp"], "cannot be met"),
    ]


@pytest.mark.parametrize("index", range(12))
def test_bad_training_input(workspace, capsys, index):
    name, argv, message = cases(workspace)[index]
    before = snapshot(workspace)
    code = recipe.cli([*FAST, *argv])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2, name
    assert len(errors) == 1 and message in errors[0], f"{name}: {err}"
    assert "Traceback" not in err
    assert snapshot(workspace) == before, f"{name}: something was written or deleted"


def test_overwrite_refuses_a_run_directory_that_holds_the_dataset(tmp_path, capsys):
    out = tmp_path / "run"
    assert recipe.cli([*FAST, "--output_dir", str(out)]) == 0
    data = out / "mine.jsonl"
    data.write_text("".join(json.dumps({"text": f"a private record of mine, number {i}"}) + "\n" for i in range(80)))
    before = snapshot(out)
    assert recipe.cli([*FAST, "--output_dir", str(out), "--dataset", str(data), "--overwrite_output_dir",
                       "true"]) == 2
    assert "contains" in capsys.readouterr().err and snapshot(out) == before


def test_a_locked_run_directory_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    lock = RunLock(out).acquire()  # as a live run holds it
    try:
        assert recipe.cli([*FAST, "--output_dir", str(out)]) == 2
        assert f"in use by another run (pid {os.getpid()})" in capsys.readouterr().err
        assert not (out / "config.yaml").exists()
    finally:
        lock.release()
    assert recipe.cli([*FAST, "--output_dir", str(out)]) == 0  # a released (or dead) holder is no obstacle


def test_resuming_a_finished_run_does_nothing(tmp_path, caplog):
    out = tmp_path / "run"
    assert recipe.cli([*FAST, "--output_dir", str(out), "--save_every", "1"]) == 0
    before = snapshot(out)
    assert recipe.cli([*FAST, "--output_dir", str(out), "--save_every", "1", "--resume_from", "latest"]) == 0
    assert "already finished at step 2" in caplog.text
    assert {k: v for k, v in snapshot(out).items() if k != ".lock"} == {
        k: v for k, v in before.items() if k != ".lock"}


def test_noise_without_signal_warns_with_the_numbers(tmp_path):
    recipe.cli([*FAST, "--output_dir", str(tmp_path / "run"), "--target_epsilon", "0.05"])
    report = json.loads((tmp_path / "run" / "privacy_report.json").read_text())
    assert report["epsilon"] <= 0.05
    assert any("σ/B" in w and "noise leaves little signal" in w for w in report["warnings"])


def test_damaged_report_and_ledger_get_one_line(tmp_path):
    out = tmp_path / "run"
    assert recipe.cli([*FAST, "--output_dir", str(out)]) == 0
    dpllm = os.path.join(os.path.dirname(sys.executable), "dpllm")
    text = (out / "privacy_report.json").read_text()
    (out / "privacy_report.json").write_text(text[: len(text) // 2])
    res = subprocess.run([dpllm, "report", str(out)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "not valid JSON" in res.stderr and "Traceback" not in res.stderr
    assert not ledger.verify(out).ok and "not valid JSON" in ledger.verify(out).message
    (out / "privacy_report.json").write_text(text)
    raw = (out / "privacy_ledger.jsonl").read_bytes().replace(b'"kind"', b'"k\xe9nd"', 1)
    (out / "privacy_ledger.jsonl").write_bytes(raw)
    res = subprocess.run([dpllm, "ledger", "verify", str(out)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "line 1: not UTF-8" in res.stderr and "Traceback" not in res.stderr


def test_a_consistent_rewrite_that_lowers_epsilon_is_caught(tmp_path):
    """Lower ε 4× on every line, re-chain the hashes and edit both reports: the history betrays it."""
    out = tmp_path / "run"
    assert recipe.cli([*FAST, "--output_dir", str(out), "--save_every", "1"]) == 0
    for path in (out / "privacy_report.json", out / "checkpoint" / "privacy_report.json"):
        report = json.loads(path.read_text())
        report["epsilon"] /= 4
        path.write_text(json.dumps(report, indent=2) + "\n")
    entries = ledger.read(out)
    prev = ledger.GENESIS
    for e in entries:
        if e.get("epsilon"):
            e["epsilon"] /= 4
        if e["kind"] == "final":
            e["checkpoint_sha256"] = ledger.dir_sha256(out / "checkpoint")
        e["prev_hash"] = prev
        e["hash"] = prev = ledger.line_hash(e)
    (out / "privacy_ledger.jsonl").write_text("".join(json.dumps(e) + "\n" for e in entries))
    result = ledger.verify(out)
    assert not result.ok and "gives ε=" in result.message


def test_plan_refuses_non_finite_numbers(capsys):
    from dpllm.privacy.planning import cli_main

    base = ["--num-records", "1000", "--batch", "10", "--epochs", "1", "--delta", "1e-5"]
    start = time.time()
    for bad in (["--target-epsilon", "inf"], ["--target-epsilon", "nan"], ["--noise-multiplier", "inf"]):
        assert cli_main(base + bad) == 2
        assert "must be positive and finite" in capsys.readouterr().err
    assert time.time() - start < 10  # today inf hangs for minutes


def test_workers_die_with_their_launcher(tmp_path):
    """A process that asked for die_with_parent() ends when its parent is SIGKILLed (as accelerate's workers do)."""
    child = tmp_path / "child.pid"
    (tmp_path / "child.py").write_text(
        "import os, sys, time\n"
        "from dpllm.distributed import die_with_parent\n"
        "die_with_parent()\n"
        "open(sys.argv[1], 'w').write(str(os.getpid()))\n"
        "time.sleep(60)\n")
    parent_code = (f"import subprocess, sys, time\n"
                   f"subprocess.Popen([sys.executable, {str(tmp_path / 'child.py')!r}, {str(child)!r}])\n"
                   "time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", parent_code], cwd=ROOT)
    deadline = time.time() + 30
    while not child.exists() or not child.read_text():
        assert time.time() < deadline, "child never started"
        time.sleep(0.1)
    pid = int(child.read_text())
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return
        if state in ("Z", "X"):  # dead; only waiting for an init that does not reap
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    pytest.fail("the child outlived its SIGKILLed parent")


def test_our_lora_checkpoint_is_auditable_by_path(tmp_path):
    """The documented audit form on a LoRA checkpoint whose adapter names no base (it carries base_model/)."""
    out = tmp_path / "run"
    assert recipe.cli([*FAST, "--output_dir", str(out), "--finetuning", "lora"]) == 0
    assert json.loads((out / "checkpoint" / "adapter_config.json").read_text())["base_model_name_or_path"] is None
    splits = json.loads((out / "splits.json").read_text())
    from dpllm.data import load_split_texts

    for name, split in (("m.jsonl", "train"), ("n.jsonl", "heldout")):
        texts = load_split_texts(out, split)[:20]
        (tmp_path / name).write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    assert splits["train"]
    res = subprocess.run([sys.executable, "-m", "mia", "audit", "--checkpoint", str(out / "checkpoint"), "--members",
                          str(tmp_path / "m.jsonl"), "--nonmembers", str(tmp_path / "n.jsonl"), "--out",
                          str(tmp_path / "audit"), "--attacks", "loss", "--n-bootstrap", "20", "--max-length", "32"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    assert "loss" in json.loads((tmp_path / "audit" / "mia_report.json").read_text())["attacks"]


def test_a_full_disk_while_writing_the_checkpoint_is_one_clear_error(tmp_path, capsys, monkeypatch):
    import errno

    from transformers import PreTrainedModel

    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", full)
    out = tmp_path / "run"
    assert recipe.cli([*FAST, "--output_dir", str(out), "--finetuning", "full"]) == 2
    err = capsys.readouterr().err
    assert "could not write the checkpoint" in err and "No space left" in err and "Free disk space" in err
    assert not (out / "checkpoint").exists() and not list(out.glob(".checkpoint*"))  # nothing half-written
