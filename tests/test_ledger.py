"""The privacy ledger: `dpllm ledger verify` passes an intact run and names the first broken line otherwise."""

import json
import shutil

import pytest

from dpllm import ledger
from dpllm.cli import main as dpllm_main
from dpllm.config import parse_config
from dpllm.train import train

RUN = ["--max_steps", "6", "--save_every", "2", "--logical_batch_size", "16", "--physical_batch_size", "8",
       "--max_length", "48", "--tiny_hidden_size", "32", "--tiny_num_heads", "2", "--max_records", "300",
       "--eval_every", "0", "--eval_max_records", "16", "--log_every", "3",
       "--progress", "false"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    out = tmp_path_factory.mktemp("ledger") / "run"
    train(parse_config(["--output_dir", str(out), "--finetuning", "full", "--target_epsilon", "3", *RUN]))
    return out


@pytest.fixture
def copy(finished, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(finished, dst)
    return dst


def lines(run_dir):
    return (run_dir / ledger.LEDGER).read_text().splitlines(keepends=True)


def write(run_dir, content):
    (run_dir / ledger.LEDGER).write_text("".join(content))


def verify_cli(run_dir, capsys):
    rc = dpllm_main(["ledger", "verify", str(run_dir)])
    captured = capsys.readouterr()
    return rc, captured.out + captured.err


def test_intact_run_verifies(finished, capsys):
    rc, text = verify_cli(finished, capsys)
    report = json.loads((finished / "privacy_report.json").read_text())
    entries = ledger.read(finished)
    assert rc == 0 and text.startswith("OK") and "5 lines" in text, text
    assert f"final ε = {report['epsilon']:.6g}" in text
    assert [e["kind"] for e in entries] == ["stage", "checkpoint", "checkpoint", "checkpoint", "final"]
    assert [e["step"] for e in entries] == [0, 2, 4, 6, 6]
    assert entries[0]["prev_hash"] == "0" * 64
    assert all(b["prev_hash"] == a["hash"] for a, b in zip(entries, entries[1:]))
    assert entries[-1]["checkpoint_sha256"] == ledger.dir_sha256(finished / "checkpoint")
    for e in entries[1:]:
        assert (e["sample_rate"], e["noise_multiplier"], e["delta"], e["accountant"]) == (
            report["sample_rate"], report["noise_multiplier"], report["delta"], report["accountant"])


def test_changed_epsilon_is_caught_at_that_line(copy, capsys):
    content = lines(copy)
    entry = json.loads(content[2])
    entry["epsilon"] = entry["epsilon"] / 2
    content[2] = json.dumps(entry) + "\n"
    write(copy, content)
    rc, text = verify_cli(copy, capsys)
    assert rc == 1 and "line 3: content does not match its hash" in text, text


def test_rehashed_edit_is_caught_at_the_next_line(copy, capsys):
    content = lines(copy)
    entry = json.loads(content[2])
    entry["epsilon"] = (entry["epsilon"] + json.loads(content[1])["epsilon"]) / 2  # plausible: still increasing
    entry["hash"] = ledger.line_hash(entry)  # a forger who recomputes the line's own hash
    content[2] = json.dumps(entry) + "\n"
    write(copy, content)
    rc, text = verify_cli(copy, capsys)
    assert rc == 1 and "line 4: prev_hash does not match line 3's hash" in text, text


def test_epsilon_going_back_is_caught(copy, capsys):
    content = lines(copy)
    entry = json.loads(content[2])
    entry["epsilon"] = entry["epsilon"] / 10
    entry["hash"] = ledger.line_hash(entry)
    content[2] = json.dumps(entry) + "\n"
    write(copy, content)
    rc, text = verify_cli(copy, capsys)
    assert rc == 1 and "line 3: step 4 / ε" in text and "goes back" in text, text


def test_deleted_middle_line_is_caught(copy, capsys):
    content = lines(copy)
    write(copy, content[:2] + content[3:])
    rc, text = verify_cli(copy, capsys)
    assert rc == 1 and "line 3:" in text and "missing" in text, text


def test_dropped_last_line_is_caught(copy, capsys):
    write(copy, lines(copy)[:-1])
    rc, text = verify_cli(copy, capsys)
    assert rc == 1 and "line 5: missing" in text and "without a 'final' line" in text, text


def test_file_cut_mid_line_is_caught(copy, capsys):
    raw = (copy / ledger.LEDGER).read_bytes()
    (copy / ledger.LEDGER).write_bytes(raw[:-40])
    rc, text = verify_cli(copy, capsys)
    assert rc == 1 and "line 5: incomplete" in text, text


def test_final_line_must_match_report_and_checkpoint(copy, capsys):
    report = json.loads((copy / "privacy_report.json").read_text())
    (copy / "privacy_report.json").write_text(json.dumps({**report, "epsilon": report["epsilon"] - 0.5}))
    rc, text = verify_cli(copy, capsys)
    assert rc == 1 and "does not match privacy_report.json" in text, text
    (copy / "privacy_report.json").write_text(json.dumps(report))
    (copy / "checkpoint" / "model.safetensors").write_bytes(b"swapped weights")
    rc, text = verify_cli(copy, capsys)
    assert rc == 1 and "checkpoint/ on disk does not match" in text, text


def test_chain_spans_stages(finished, tmp_path, capsys):
    stage1 = tmp_path / "stage1"
    shutil.copytree(finished, stage1)
    stage2 = tmp_path / "stage2"
    train(parse_config(["--output_dir", str(stage2), "--model_name_or_path", str(stage1), "--finetuning", "lora",
                        "--target_epsilon", "5", *RUN]))
    first = ledger.read(stage2)[0]
    assert first["kind"] == "stage" and first["prev_hash"] == "0" * 64
    assert first["previous_stage"] == {"run_dir": str(stage1.resolve()), "ledger_head": ledger.head(stage1)}
    assert first["epsilon"] == pytest.approx(json.loads((stage1 / "privacy_report.json").read_text())["epsilon"])
    rc, text = verify_cli(stage2, capsys)
    assert rc == 0 and f"previous stage {stage1.resolve()} verified" in text, text
    content = lines(stage1)
    write(stage1, content[:-1])  # break the earlier stage: the later one no longer verifies
    rc, text = verify_cli(stage2, capsys)
    assert rc == 1 and "previous stage" in text, text


def test_usage(capsys):
    assert dpllm_main(["ledger", "check", "x"]) == 2
    err = capsys.readouterr().err
    assert "usage: dpllm ledger" in err and "invalid choice: 'check' (choose from 'verify')" in err, err
    assert dpllm_main(["ledger", "verify"]) == 2  # the run directory is required
    assert "RUN_DIR" in capsys.readouterr().err
