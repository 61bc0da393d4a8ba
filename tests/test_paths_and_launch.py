"""Paths a user mistypes, output directories that cannot be made, and launches that start fewer processes than
asked: each answered with one line, before any work."""

from __future__ import annotations

import doctest
import os
import subprocess
import sys

import pytest

from dpllm import io
from dpllm.distributed import requested_processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_doctests():
    import dpllm.distributed

    assert doctest.testmod(io).failed == 0
    assert doctest.testmod(dpllm.distributed).failed == 0


def test_did_you_mean(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("{}\n")
    m = io.missing_path_error
    assert m(str(tmp_path / "data" / "train"), option="dataset").endswith(
        f"did you mean {tmp_path / 'data' / 'train.jsonl'}?")  # the extension left out
    assert m(str(tmp_path / "dat" / "trian.jsonl"), option="dataset").endswith(
        f"did you mean {tmp_path / 'data' / 'train.jsonl'}?")  # a typo in two components
    assert m(str(tmp_path / "elsewhere" / "x.jsonl"), option="dataset").endswith("check the path (a Hub id looks "
                                                                                   "like org/name)")
    assert m("org/name", option="dataset") is None and m("pydoc", option="dataset") is None  # a Hub id, a built-in
    assert m(str(tmp_path / "data" / "train.jsonl"), option="dataset") is None


def test_output_dir_problems(tmp_path):
    (tmp_path / "file").write_text("x")
    assert io.output_dir_error(tmp_path / "new" / "run") is None and not (tmp_path / "new").exists()
    assert "is a file, not a directory" in io.output_dir_error(tmp_path / "file")
    assert f"{tmp_path / 'file'} is a file" in io.output_dir_error(tmp_path / "file" / "deeper" / "run")
    assert "cannot be created under /proc" in io.output_dir_error("/proc/no/such/run")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # the probe left nothing behind


@pytest.mark.parametrize("cmdline, asked", [
    (["accelerate", "launch", "--num_processes", "2", "r.py", "--num_processes", "5"], 2),  # the script's own: not
    (["accelerate", "launch", "--num_processes=4", "r.py"], 4),
    (["accelerate", "launch", "r.py"], None),
    (["torchrun", "--nproc_per_node", "2", "r.py"], None),
])
def test_requested_processes(cmdline, asked):
    assert requested_processes(cmdline) == asked


def test_requested_processes_from_an_accelerate_config(tmp_path):
    cfg = tmp_path / "multi.yaml"
    cfg.write_text("distributed_type: MULTI_GPU\nnum_processes: 8\n")
    assert requested_processes(["accelerate", "launch", "--config_file", str(cfg), "r.py"]) == 8


def test_a_launch_without_multi_gpu_warns_that_one_process_trains(tmp_path):
    """accelerate starts one process when asked for two without --multi_gpu: the run says so, and trains as the
    single-process launch does (this is also the suite's smoke run of ``accelerate launch`` with the tiny CPU config:
    the launcher's one-process path, the README's config file under SIGTERM in tests/test_stopping.py)."""
    import json

    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    out = tmp_path / "run"
    proc = subprocess.run([accelerate, "launch", "--num_processes", "2",
                           os.path.join(ROOT, "recipes", "finetune_llm.py"),
                           "--config", os.path.join(ROOT, "recipes", "configs", "tiny", "llama_lora_cpu.yaml"),
                           "--max_steps", "1", "--logical_batch_size", "8", "--physical_batch_size", "8",
                           "--max_length", "32", "--tiny_hidden_size", "32", "--tiny_num_heads", "2", "--eval_every",
                           "0", "--max_records", "60", "--progress", "false", "--output_dir", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)  # PRV: RDP calibrates σ < 1 slowly
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "accelerate launch was asked for 2 processes but started 1" in proc.stderr
    assert "--multi_gpu" in proc.stderr
    assert "privacy: (ε = " in proc.stdout
    assert (out / "checkpoint" / "adapter_model.safetensors").is_file()
    assert (out / "checkpoint" / "base_model" / "config.json").is_file()
    report = json.loads((out / "privacy_report.json").read_text())
    assert 0 < report["epsilon"] <= 8.0 and report["steps"] == 1
    assert json.loads((out / "run_summary.json").read_text())["world_size"] == 1
