"""Paths a user mistypes, output directories that cannot be made, and launches that start fewer processes than
asked: each answered with one line, before any work.

The launch itself (`accelerate launch --num_processes 2` without --multi_gpu starts one process, which says so and
trains as one) runs in tests/test_stopping.py, whose single-process launch it is (its launcher is then signalled):
one launch fewer (its own cost 18.7 CPU-s, launcher and worker, most of it their imports). What only the separate
launch showed, a one-process launch that ends by itself with exit 0, has no test of its own now: its exit path is the
signalled one's (dpllm.stopping.finish_process), and the files a finished run writes are the in-process runs'."""

from __future__ import annotations

import doctest

import pytest

from dpllm import io
from dpllm.distributed import requested_processes


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
