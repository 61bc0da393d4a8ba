"""Training options that depend on the hardware or interact with DP: mixed precision, gradient checkpointing."""

import json
import logging
import math

import pytest
import torch

from dpllm.config import ConfigError, parse_config
from dpllm.train import train

FAST = ["--max_steps", "3", "--logical_batch_size", "16", "--physical_batch_size", "8", "--max_length", "48",
        "--tiny_hidden_size", "32", "--tiny_num_heads", "2", "--max_records", "300", "--eval_every", "0",
        "--eval_max_records", "16", "--progress", "false"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU bf16 autocast is used, not the CPU fallback")
def test_bf16_falls_back_to_fp32_on_cpu(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="dpllm.train"):
        summary = train(parse_config(["--output_dir", str(tmp_path / "run"), *FAST, "--mixed_precision", "bf16"]))
    assert "mixed_precision=bf16 needs a GPU here; falling back to fp32 on CPU" in caplog.text
    assert summary["steps"] == 3 and math.isfinite(summary["final_eval_loss"])
    report = json.loads((tmp_path / "run" / "privacy_report.json").read_text())
    assert 0 < report["epsilon"] <= 8.0
    # the resolved config keeps what was asked for; the weights stayed fp32
    assert "mixed_precision: bf16" in (tmp_path / "run" / "config.yaml").read_text()
    from safetensors.torch import load_file

    weights = load_file(str(tmp_path / "run" / "checkpoint" / "adapter_model.safetensors"))
    assert all(w.dtype == torch.float32 for w in weights.values())


def test_gradient_checkpointing_is_refused_under_dp(tmp_path):
    # Tried with HF's non-reentrant checkpointing (transformers 5.23, opacus 1.6): recomputation re-fires
    # Opacus's hooks; hooks mode loses per-sample gradients ("Per sample gradient is not initialized") and
    # ghost mode fails its parameter-tying / norm-sample checks. Until an equivalence test against explicit
    # per-sample gradients passes, it stays refused, before anything is written.
    # Book-keeping (grad_sample_mode: bk) reads activations from autograd's saved tensors, so it is allowed
    # there (tests/test_bk_checkpointing.py proves it equal); Opacus's ghost and hooks modes stay refused.
    with pytest.raises(ConfigError, match="gradient_checkpointing=true under DP needs grad_sample_mode: bk"):
        train(parse_config(["--output_dir", str(tmp_path / "run"), *FAST, "--gradient_checkpointing", "true",
                            "--grad_sample_mode", "ghost"]))
    assert not (tmp_path / "run").exists()


def test_gradient_checkpointing_under_dp_with_bookkeeping_trains(tmp_path):
    summary = train(parse_config(["--output_dir", str(tmp_path / "run"), *FAST, "--gradient_checkpointing", "true"]))
    report = json.loads((tmp_path / "run" / "privacy_report.json").read_text())
    assert summary["steps"] == 3 and report["grad_sample_mode"] == "bk" and 0 < report["epsilon"] <= 8


def test_gradient_checkpointing_without_dp_trains(tmp_path):
    summary = train(parse_config(["--output_dir", str(tmp_path / "run"), *FAST, "--gradient_checkpointing", "true",
                                  "--privacy.enabled", "false"]))
    assert summary["steps"] == 3 and summary["epsilon"] is None
