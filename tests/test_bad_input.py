"""Bad input, tried as a new user would: one clear line, exit code 2 (or 1), nothing written, nothing deleted.

The training cases go through the recipe's real command entry point (``recipes/finetune_llm.py``'s
``cli``) in-process, so that the table stays fast; one case also runs as a subprocess.
"""

import json
import math
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
# The default accountant (PRV) calibrates these plans in ~0.1 CPU-s; Opacus's RDP took 2-6 s (its ~150 orders in pure
# Python for each σ tried), so no run here asks for RDP where the accountant is not what it checks.
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
    chat = [{"messages": [{"role": "user", "content": f"question {i}?"}, {"role": "assistant", "content": f"{i}"}]}
            for i in range(40)]
    chat[1] = {"prompt": "question 1?", "completion": "1"}
    (tmp_path / "data" / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat))
    (tmp_path / "data" / "same.jsonl").write_text(json.dumps(rows[0]) + "\n" * 1 + (json.dumps(rows[0]) + "\n") * 199)
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
                                      str(w / "no" / "such" / "model")], "no such file or directory"),
        ("a typo in the data folder", ["--dataset", str(w / "dta" / "train.jsonl"), "--output_dir", out],
         f"no such file or directory; did you mean {w / 'data' / 'train.jsonl'}?"),
        ("output_dir under a regular file", ["--dataset", data, "--output_dir", str(w / "notes" / "todo.txt" / "run")],
         "todo.txt is a file, not a directory; choose another output_dir"),
        ("output_dir that cannot be created", ["--dataset", data, "--output_dir", "/proc/no/such/run"],
         "cannot be created under /proc"),
        ("messages and prompt/completion records in one file", ["--dataset", str(w / "data" / "mixed.jsonl"),
                                                                 "--output_dir", out],
         "record 2 has no 'messages' field (its fields: completion, prompt)"),
        ("two --config files", ["--config", str(w / "cfg.yaml"), "--config", str(w / "cfg.yaml"), "--output_dir",
                                out], "more than once"),
        ("delta at 1/N", ["--dataset", data, "--output_dir", out, "--target_delta", "0.05"], "must be in (0, 1/N)"),
        ("unreachable epsilon", ["--dataset", data, "--output_dir", out, "--target_epsilon", "1e-9", "--max_steps",
                                 "500", "--accountant", "rdp"], "cannot be met"),
        ("negative learning rate", ["--dataset", data, "--output_dir", out, "--learning_rate=-1e-3"],
         "learning_rate=-0.001 must be > 0"),
        ("log_every 0", ["--dataset", data, "--output_dir", out, "--log_every", "0"], "log_every=0 must be ≥ 1"),
        ("200 identical records", ["--dataset", str(w / "data" / "same.jsonl"), "--output_dir", out],
         "1 private records leave no held-out record at heldout_fraction=0.2 (each is held out with that probability, "
         "by a keyed hash of its text); raise heldout_fraction or use more data (199 of 200 records read were exact "
         "duplicates and were removed)"),
    ]


@pytest.mark.parametrize("index", range(19))
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
    # ε 0.2: σ ≈ 4.9 on an expected batch of 16, σ/B ≈ 0.31, three times the warning's 0.1 (ε 0.05, σ ≈ 17.5, took
    # PRV 4 CPU-s to calibrate; 0.2 takes 0.5)
    recipe.cli([*FAST, "--output_dir", str(tmp_path / "run"), "--target_epsilon", "0.2"])
    report = json.loads((tmp_path / "run" / "privacy_report.json").read_text())
    assert report["epsilon"] <= 0.2
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


def test_plan_refuses_non_finite_numbers(capsys, monkeypatch):
    """Refused before any accountant runs (with inf, calibration used to search for minutes)."""
    from dpllm.privacy import accounting
    from dpllm.privacy.planning import cli_main

    def no_accounting(*args, **kwargs):
        raise AssertionError("an accountant ran before the bad number was refused")

    for name in ("compute_epsilon_history", "calibrate_noise", "_epsilon_of"):
        monkeypatch.setattr(accounting, name, no_accounting)
    base = ["--num-records", "1000", "--batch", "10", "--epochs", "1", "--delta", "1e-5"]
    for bad in (["--target-epsilon", "inf"], ["--target-epsilon", "nan"], ["--noise-multiplier", "inf"]):
        assert cli_main(base + bad) == 2
        assert "must be positive and finite" in capsys.readouterr().err


def test_workers_die_with_their_launcher(tmp_path):
    """A process that asked for die_with_parent() ends when its parent is SIGKILLed (as accelerate's workers do)."""
    child = tmp_path / "child.pid"
    (tmp_path / "child.py").write_text(
        "import os, sys, time\n"
        "from dpllm.stopping import die_with_parent\n"
        "die_with_parent()\n"
        "open(sys.argv[1], 'w').write(str(os.getpid()))\n"
        "time.sleep(60)\n")
    parent_code = (f"import subprocess, sys, time\n"
                   f"subprocess.Popen([sys.executable, {str(tmp_path / 'child.py')!r}, {str(child)!r}])\n"
                   "time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", parent_code], cwd=ROOT)
    deadline = time.time() + 180  # a liveness guard, not a timing: slow under load
    while not child.exists() or not child.read_text():
        assert time.time() < deadline, "child never started"
        time.sleep(0.1)
    pid = int(child.read_text())
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.time() + 60  # the kernel signals at once; generous for a loaded machine
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
    """The documented audit form on a LoRA checkpoint whose adapter names no base (it carries base_model/).

    The audit runs in-process (``mia.__main__.main``, what ``python -m mia`` calls; the module itself runs as a
    subprocess in tests/test_mia_cli.py and tests/test_compliance.py)."""
    from mia.__main__ import main as mia_main

    out = tmp_path / "run"
    assert recipe.cli([*FAST, "--output_dir", str(out), "--finetuning", "lora"]) == 0
    assert json.loads((out / "checkpoint" / "adapter_config.json").read_text())["base_model_name_or_path"] is None
    splits = json.loads((out / "splits.json").read_text())
    from dpllm.data import load_split_texts

    for name, split in (("m.jsonl", "train"), ("n.jsonl", "heldout")):
        texts = load_split_texts(out, split)[:20]
        (tmp_path / name).write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    assert splits["train"]
    assert mia_main(["audit", "--checkpoint", str(out / "checkpoint"), "--members", str(tmp_path / "m.jsonl"),
                     "--nonmembers", str(tmp_path / "n.jsonl"), "--out", str(tmp_path / "audit"), "--attacks", "loss",
                     "--n-bootstrap", "20", "--max-length", "32", "--no-progress"]) == 0
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


def test_numeric_options_are_refused_before_the_model_loads(workspace, capsys, monkeypatch):
    import dpllm.train

    def never(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(dpllm.train, "load_base", never)
    for option, value, message in (("--learning_rate", "-0.001", "learning_rate=-0.001 must be > 0"),
                                   ("--momentum", "1", "momentum=1.0 must be ≥ 0 and < 1"),
                                   ("--eval_max_records", "0", "eval_max_records=0 must be ≥ 1"),
                                   ("--lora_dropout", "1.5", "lora_dropout=1.5 must be ≥ 0 and < 1")):
        assert recipe.cli([*FAST, "--output_dir", str(workspace / "out"), f"{option}={value}"]) == 2
        assert message in capsys.readouterr().err
    assert not (workspace / "out").exists()


# ---- tiny data, oversized batches, duplicates: the run goes ahead, and says so in the log and the report ----

def _report(out):
    return json.loads((out / "privacy_report.json").read_text())


def test_two_records_train_on_one_with_loud_warnings(tmp_path, capsys, caplog, recwarn):
    data = tmp_path / "two.jsonl"
    data.write_text("".join(json.dumps({"text": f"record {i} says something about the python language"}) + "\n"
                            for i in range(2)))
    out = tmp_path / "run"
    from dpllm.config import DataConfig
    from dpllm.data import DataError, load_records, make_splits

    def holds_out_one(seed):  # each record is held out by its own keyed hash: a key that holds out one of the two
        cfg = DataConfig(dataset=str(data), split_seed=seed, heldout_fraction=0.5)
        try:
            return len(make_splits(load_records(cfg), cfg).train) == 1
        except DataError:  # both held out, or both trained
            return False

    seed = next(k for k in range(100) if holds_out_one(k))
    assert recipe.cli([*FAST, "--dataset", str(data), "--output_dir", str(out), "--heldout_fraction", "0.5",
                       "--split_seed", str(seed)]) == 0
    report = _report(out)
    assert report["num_records"] == 1 and report["sample_rate"] == 1.0 and report["expected_batch_size"] == 1
    capped, passes, noise = report["warnings"]
    assert "expected passes over the private records (q × steps = 1 × " in passes  # the single-epoch policy
    assert "logical_batch_size=16 ≥ the 1 private training record(s)" in capped and "q = 1" in capped
    assert f"σ/B = {report['noise_multiplier']:.4g}/1 = " in noise  # the batch the run has (1), not 16
    assert capped in caplog.text and noise in caplog.text  # logged when planned
    assert f"warning: {capped}" in capsys.readouterr().out  # and repeated where the run ends
    assert not [w for w in recwarn if "divide by zero" in str(w.message)]  # PRV at q = 1 (see accounting)


def test_prv_at_sample_rate_one_is_the_gaussian_mechanism_without_numpy_warnings():
    """q = 1: T Gaussian steps at σ are one Gaussian at σ/√T, whose exact ε (Balle & Wang 2018) PRV bounds."""
    import warnings

    from scipy.optimize import brentq
    from scipy.stats import norm

    from dpllm.privacy.accounting import compute_epsilon

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eps = compute_epsilon(noise_multiplier=6.0, sample_rate=1.0, steps=100, delta=1e-5, accountant="prv")
    mu = 100 ** 0.5 / 6.0
    exact = brentq(lambda e: norm.cdf(-e / mu + mu / 2) - math.exp(e) * norm.cdf(-e / mu - mu / 2) - 1e-5, 0, 50)
    assert exact <= eps <= exact * 1.01  # 8.0037 ≤ 8.014


def test_a_logical_batch_over_the_data_is_capped_and_said(tmp_path):
    out = tmp_path / "run"
    assert recipe.cli([*FAST, "--output_dir", str(out), "--logical_batch_size", "100000"]) == 0
    report = _report(out)
    n = report["num_records"]
    assert report["sample_rate"] == 1.0 and report["expected_batch_size"] == n
    assert any(f"logical_batch_size=100,000 ≥ the {n:,} private training record(s)" in w and
               f"expected batch {n:,}, not 100,000" in w for w in report["warnings"])


def test_a_huge_record_is_cut_before_it_is_tokenized_and_duplicates_are_counted(workspace, monkeypatch):
    """A huge record trains on its first max_length tokens, and the tokenizer never sees more than a window of
    it; the 30 duplicated lines of the same file are counted in the report.

    (565k characters, not 3.5M: the window is 1,344 characters here, so the record is still ~400 windows and over
    five times the 100k characters the tokenizer may see at once; the report's token count tokenizes all of it, in
    windows, ~2 CPU-s per million characters with the byte tokenizer, twice in this test.)"""
    from transformers import ByT5Tokenizer

    import dpllm.models
    from dpllm.data import truncated_ids
    from dpllm.models import byte_tokenizer

    seen = []
    call = ByT5Tokenizer.__call__

    def spy(self, text, *a, **k):
        seen.append(max(len(t) for t in ([text] if isinstance(text, str) else text)))
        return call(self, text, *a, **k)

    big = " ".join(f"word{i} ünïcödé" for i in range(32_000))  # 565k characters, 0.7 MB
    tok = byte_tokenizer()
    assert truncated_ids([big], tok, 32) == ([call(tok, big[:5000], truncation=True, max_length=32)["input_ids"]],
                                             [True])
    rows = (workspace / "data" / "train.jsonl").read_text().splitlines(keepends=True)
    data = workspace / "data" / "big.jsonl"
    data.write_text("".join(rows + rows[:30]) + json.dumps({"text": big}) + "\n")
    monkeypatch.setattr(ByT5Tokenizer, "__call__", spy)
    # through the tokenizer, as for any tokenizer but the byte one (whose ids dpllm.models.byte_ids computes)
    monkeypatch.setattr(dpllm.models, "byte_ids", lambda *a, **k: None)
    out = workspace / "run"
    assert recipe.cli([*FAST, "--dataset", str(data), "--output_dir", str(out), "--max_records", "200"]) == 0
    assert seen and max(seen) < 100_000
    assert json.loads((out / "splits.json").read_text())["num_records"] == 81
    assert any("30 of 111 records read were exact duplicates" in w for w in _report(out)["warnings"])


# ---- Ctrl-C: one line saying where to resume from, exit 130, checkpoints intact --------------------------------

def _stop_at(monkeypatch, step):
    import dpllm.train

    after = dpllm.train.Trainer.after_step

    def stop(self):
        after(self)
        if self.step == step:
            raise KeyboardInterrupt

    monkeypatch.setattr(dpllm.train.Trainer, "after_step", stop)


def test_ctrl_c_says_how_to_resume_and_the_command_resumes(tmp_path, capsys, monkeypatch):
    import shlex

    out = tmp_path / "run"
    argv = [*FAST, "--max_steps", "3", "--output_dir", str(out), "--save_every", "2"]
    _stop_at(monkeypatch, 2)
    assert recipe.cli(argv) == 130
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert (f"interrupted at step 2 of 3; the last resumable checkpoint is {out / 'checkpoints' / 'step-000002'} "
            "(step 2); resume with: python ") in lines[0]
    command = shlex.split(lines[0].split("resume with: ", 1)[1])
    assert command[-2:] == ["--resume_from", "latest"] and command[2:-2] == argv
    monkeypatch.undo()
    assert recipe.cli(command[2:]) == 0  # the printed command, as printed
    assert json.loads((out / "run_summary.json").read_text())["resumed_from_step"] == 2


def test_ctrl_c_without_checkpoints_says_what_save_every_does(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    _stop_at(monkeypatch, 1)
    assert recipe.cli([*FAST, "--output_dir", str(out), "--overwrite_output_dir", "true"]) == 130
    err = capsys.readouterr().err
    assert "interrupted at step 1 of 2; no resumable checkpoint was written (--save_every N writes one" in err
    assert err.rstrip().endswith("--overwrite_output_dir true") and err.count("--overwrite_output_dir") == 1


@pytest.mark.parametrize("command", [["report"], ["ledger", "verify"], ["export"], ["synthesize"], ["plan"],
                                     ["scaling", "fit"], ["scaling", "predict"], ["scaling", "plan"]])
def test_every_subcommand_has_real_help(command, capsys):
    """`dpllm X --help` prints what X does and every option, and exits 0 (not a bare usage line and 2)."""
    from dpllm.cli import main

    assert main([*command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: dpllm " + " ".join(command)) and "-h, --help" in out
    assert len(out.splitlines()) >= 6, out  # a description and options, not only the usage line


def test_report_and_ledger_name_the_closest_run_directory(tmp_path, capsys):
    from dpllm.cli import main

    (tmp_path / "runs" / "alpha").mkdir(parents=True)
    assert main(["report", str(tmp_path / "runs" / "alpah")]) == 1
    assert f"did you mean {tmp_path / 'runs' / 'alpha'}?" in capsys.readouterr().err
    assert main(["ledger", "verify", str(tmp_path / "rnus" / "alpha")]) == 1
    assert f"did you mean {tmp_path / 'runs' / 'alpha'}?" in capsys.readouterr().err


def test_the_recipe_answers_help_and_typos_before_loading_torch():
    """--help, an unknown option and a missing file are answered without importing torch (a typo costs
    milliseconds, not the import of the whole stack; scripts/bench_cli_latency.py prints the times)."""
    # One interpreter answers the four in turn (a fresh one costs ~2 CPU-s): torch, once imported, stays in
    # sys.modules, so each answer's check covers its own call and every one before it.
    cases = ((["--help"], "exit 0 False"), (["--no_such_option", "1"], "exit 2 False"),
             (["--dataset", "no/such/file.jsonl"], "exit 2 False"),
             (["--output_dir", "/proc/no/such/run"], "exit 2 False"))
    code = ("import json, sys, runpy\n"
            "for argv in json.loads(sys.argv[1]):\n"
            "    sys.argv = ['finetune_llm.py'] + argv\n"
            "    try:\n        runpy.run_path(%r, run_name='__main__')\n"
            "    except SystemExit as e:\n"
            "        print('\\nanswer: exit', e.code, 'torch' in sys.modules, flush=True)\n"
            % os.path.join(ROOT, "recipes", "finetune_llm.py"))
    proc = subprocess.run([sys.executable, "-c", code, json.dumps([argv for argv, _ in cases])], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    answers = [line.removeprefix("answer: ") for line in proc.stdout.splitlines() if line.startswith("answer: ")]
    assert answers == [want for _, want in cases], (proc.stdout[-2000:], proc.stderr[-2000:])
