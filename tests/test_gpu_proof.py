"""scripts/gpu_proof.py --smoke: every phase of the GPU proof runs on CPU with tiny shapes, so the script cannot rot
between GPU windows (issue 47). One run of the real command (its ``main``, in this process), then checks of
what each phase wrote: the keys and numbers the GPU run will be read for, and the scaling phase's pre-registration
(its prediction for the largest size written, with a timestamp, before that size's first run started)."""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def proof(tmp_path_factory):
    """``python scripts/gpu_proof.py --smoke --out OUT`` through the script's ``main``, in this process: a process of
    its own would add only its imports (~8 CPU-s of torch, transformers, opacus and peft, which this process has).
    What the script changes in the process it runs in is put back after it: the variables it sets where unset
    (``LOCAL_RANK``, ``TOKENIZERS_PARALLELISM``), its ``sys.path`` entries, the SIGALRM handler of its time limits and
    the working directory; its process group of one it ends itself. On the GPU machine it runs as a process of its
    own (scripts/gpu_proof.sh)."""
    import contextlib
    import importlib.util
    import io
    import signal

    out = tmp_path_factory.mktemp("gpu_proof")
    stdout, alarm, path = io.StringIO(), signal.getsignal(signal.SIGALRM), list(sys.path)
    env = {name: os.environ.get(name) for name in ("LOCAL_RANK", "TOKENIZERS_PARALLELISM")}
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)
        try:
            spec = importlib.util.spec_from_file_location("gpu_proof_smoke", ROOT / "scripts" / "gpu_proof.py")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            with contextlib.redirect_stdout(stdout):
                summary = module.main(["--smoke", "--out", str(out)])
        finally:
            signal.signal(signal.SIGALRM, alarm)
            sys.path[:] = path
            for name, value in env.items():  # LOCAL_RANK set here would make later runs look launched
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
    import torch.distributed as dist

    assert not dist.is_initialized()  # its FSDP2 step's process group of one ended with it
    phases = {name: _read(out, f"{name}.json") for name in ("1_engine", "2_recipe", "3_scaling", "4_extras")}
    failed = {name: rec.get("traceback") or rec.get("why") for name, rec in phases.items() if rec["status"] != "ok"}
    assert not failed, (summary, failed)
    return out, stdout.getvalue()


def _read(out: Path, name: str) -> dict:
    return json.loads((out / name).read_text())


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _time(s: str) -> dt.datetime:
    return dt.datetime.fromisoformat(s)


def test_every_phase_wrote_its_json(proof):
    out, stdout = proof
    summary = _read(out, "9_summary.json")
    assert summary["phases"] == {"engine": "ok", "recipe": "ok", "scaling": "ok", "extras": "ok"}, summary
    env = _read(out, "0_environment.json")
    assert env["smoke"] is True and env["torch"] and "opacus" in env["versions"]
    for name in ("1_engine", "2_recipe", "3_scaling", "4_extras"):
        rec = _read(out, f"{name}.json")
        assert rec["status"] == "ok" and rec["parts"], name
        assert _number(rec["wall_s"]) and rec["wall_s"] <= rec["limit_s"] + 1, name  # its own limit held
        assert _time(rec["started_at"]) <= _time(rec["ended_at"])
    assert not list(out.glob("*.tmp")), "a JSON left half-written"
    assert "phase 4 extras: ok" in stdout


def test_engine_rows(proof):
    out, _ = proof
    parts = _read(out, "1_engine.json")["parts"]
    got = {(p["finetuning"], p["mode"]) for p in parts}
    assert {("lora", "nodp"), ("lora", "bk"), ("full", "nodp"), ("full", "bk")} <= got
    for p in parts:
        for key in ("step_s", "tokens_per_s", "peak_memory_mib", "max_batch_fits", "time_ratio_vs_nodp",
                    "memory_ratio_vs_nodp"):
            assert _number(p[key]), (p["mode"], key, p.get(key))
        assert p["resolved_mode"] == p["mode"] and p["max_batch_fits"] >= p["ref_batch"]
        assert p["tokens_per_s"] == pytest.approx(p["ref_batch"] * p["seq"] / p["step_s"])
    assert all(p["time_ratio_vs_nodp"] == 1.0 for p in parts if p["mode"] == "nodp")


def test_recipe_runs_the_shipped_config_in_both_dtypes(proof):
    out, _ = proof
    rec = _read(out, "2_recipe.json")
    assert rec["config"] == "recipes/configs/llama3_8b/lora_eps8.yaml" and rec["documented_physical_batch"] == 16
    assert {p["dtype"] for p in rec["parts"]} == {"bfloat16", "float32"}
    for p in rec["parts"]:
        assert p["returncode"] == 0 and p["recipe_rc"] == 0 and p["steps"] == 3, p
        assert _number(p["step_s"]) and _number(p["peak_memory_mib"]) and 7.9 < p["epsilon_at_end"] <= 8.0
        assert "--random_init true" in p["command"]
    assert _number(rec["bf16_vs_fp32"]["step_time_ratio_bf16_over_fp32"])


def test_scaling_prediction_is_written_before_the_largest_size_trains(proof):
    out, _ = proof
    rec = _read(out, "3_scaling.json")
    pre = _read(out, "3_scaling_prediction.json")
    assert pre == rec["prediction"]  # the copy in the phase's JSON is the pre-registered one, unchanged
    parts = rec["parts"]
    largest = max(p["size"] for p in parts)
    assert largest == 4 and len({p["N"] for p in parts}) == 5
    fitted, held = [p for p in parts if p["size"] < largest], [p for p in parts if p["size"] == largest]
    assert len(fitted) == 16 and len(held) == 2 and pre["fit"]["n_points"] == 16
    written = _time(pre["written_at"])
    assert all(_time(p["ended_at"]) <= written for p in fitted)
    assert all(written < _time(p["started_at"]) for p in held)  # the pre-registration
    by = {(p["steps"], p["logical_batch"]): p for p in pre["predictions"]}
    for p in held:
        pred = by[(p["steps"], p["logical_batch"])]
        assert p["N"] == pred["N"] and p["sigma_bar"] == pytest.approx(pred["sigma_bar"], rel=1e-12)
        assert p["predicted_loss"] == pred["predicted_loss"] and _number(p["error_pct"])
        assert p["error_pct"] == pytest.approx(100 * (p["final_eval_loss"] - pred["predicted_loss"])
                                               / p["final_eval_loss"])
        lo, hi = pred["interval_95"]
        assert lo <= pred["predicted_loss"] <= hi and p["inside_interval_95"] == (lo <= p["final_eval_loss"] <= hi)
    for p in parts:
        assert 7.9 < p["epsilon"] <= 8.0 and _number(p["final_eval_loss"])


def test_extras_fsdp_step(proof):
    out, _ = proof
    rec = _read(out, "4_extras.json")
    fsdp = next(p for p in rec["parts"] if p["what"] == "fsdp2_world1")
    assert _number(fsdp["nodp"]["step_s"]) and _number(fsdp["bk"]["step_s"]) and _number(fsdp["time_ratio_bk_vs_nodp"])
    qlora = [p for p in rec["parts"] if p["what"] == "qlora_nf4"]
    if qlora:  # bitsandbytes importable here
        assert [p["mode"] for p in qlora] == ["nodp", "bk"] and all(_number(p["step_s"]) for p in qlora), qlora
    else:
        assert any("bitsandbytes" in s["why"] for s in rec["skipped"]), rec["skipped"]


def test_a_phase_past_the_deadline_is_skipped_and_says_why(tmp_path):
    """The deadline holds between phases: with none left, every phase is written as skipped, with the reason."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_proof

    ctx = {"clock": gpu_proof.Clock(0.0), "out": tmp_path, "cuda": False}
    rec = gpu_proof.run_phase(1, "engine", 100, lambda ph, ctx: pytest.fail("ran past the deadline"), ctx)
    assert rec["status"] == "skipped" and "left before the deadline" in rec["why"]
    assert _read(tmp_path, "1_engine.json") == json.loads(json.dumps(rec))


def test_a_phase_that_overruns_its_limit_is_stopped_and_keeps_its_parts(tmp_path):
    import time

    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_proof

    def slow(ph, ctx):
        ph.rec["parts"].append({"done": 1})
        time.sleep(30)

    ctx = {"clock": gpu_proof.Clock(100.0), "out": tmp_path, "cuda": False}
    rec = gpu_proof.run_phase(2, "recipe", 5.5, slow, ctx)
    assert rec["status"] == "stopped" and rec["parts"] == [{"done": 1}]  # SIGALRM ended the sleep


def test_random_init_builds_the_configs_model_without_weights(tmp_path):
    """``model.random_init``: a directory with only config.json and a tokenizer gives that model, random weights
    (what phase 2 runs the shipped 8B config on); quantized, it is refused with the fix."""
    import torch
    from transformers import LlamaConfig

    from dpllm.config import ModelConfig
    from dpllm.models import ModelError, byte_tokenizer, load_base

    LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2, vocab_size=300, max_position_embeddings=64).save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    assert not list(tmp_path.glob("*.safetensors"))
    cfg = ModelConfig(model_name_or_path=str(tmp_path), random_init=True, torch_dtype="bfloat16")
    torch.manual_seed(0)
    model, tok, source = load_base(cfg, 32)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.hidden_size == 32
    assert model.get_input_embeddings().weight.dtype == torch.bfloat16 and source["kind"] == "pretrained"
    assert model.get_input_embeddings().weight.float().std() > 0  # initialised, not empty
    with pytest.raises(ModelError, match="random_init with quantization=nf4"):
        load_base(ModelConfig(model_name_or_path=str(tmp_path), random_init=True, finetuning="lora",
                              quantization="nf4"), 32)
    with pytest.raises(OSError):  # without random_init: from_pretrained wants the weights
        load_base(ModelConfig(model_name_or_path=str(tmp_path)), 32)
