"""QLoRA runs end to end on a tiny Llama quantized to NF4 (bitsandbytes' CPU path), 2 steps each: the recipe's
report equals an unquantized run's, and export, ``mia audit`` and ``dpllm synthesize`` load the run with its base
quantized as in training; SFT records, user-level sampling and DPTrainer train it too."""

import json

import pytest
import torch

pytest.importorskip("bitsandbytes")

from dpllm.config import parse_config  # noqa: E402
from dpllm.privacy.report import PrivacyReport  # noqa: E402
from dpllm.train import train  # noqa: E402
from tests.helpers import load_recipe  # noqa: E402

FAST = ["--max_steps", "2", "--logical_batch_size", "16", "--physical_batch_size", "8", "--max_length", "48",
        "--tiny_hidden_size", "32", "--tiny_num_heads", "2", "--eval_every", "0", "--eval_max_records", "8",
        "--progress", "false", "--max_records", "80", "--target_epsilon", "8", "--num_generations", "1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("qlora")
    recipe = load_recipe("finetune_llm")
    config = "recipes/configs/tiny/llama_lora_cpu.yaml"
    for name, q in (("nf4", "nf4"), ("plain", "none")):
        recipe.main(["--config", config, "--output_dir", str(base / name), "--quantization", q, *FAST])
    return base


def test_the_report_is_an_unquantized_runs_but_for_the_base(runs):
    q, plain = PrivacyReport.read(runs / "nf4").to_dict(), PrivacyReport.read(runs / "plain").to_dict()
    assert q["epsilon"] == plain["epsilon"] and 0 < q["epsilon"] <= 8
    assert q["grad_sample_mode"] == plain["grad_sample_mode"] == "bk"
    differ = {"stages", "base_model", "model_adjustments", "versions"}
    assert {k: v for k, v in q.items() if k not in differ} == {k: v for k, v in plain.items() if k not in differ}
    assert [s["history"] for s in q["stages"]] == [s["history"] for s in plain["stages"]]
    assert q["base_model"] == {**plain["base_model"], "quantization": "nf4"}
    assert [a for a in q["model_adjustments"] if "bitsandbytes (nf4)" not in a] == plain["model_adjustments"]
    ckpt = runs / "nf4" / "checkpoint"
    assert json.loads((ckpt / "base_quantization.json").read_text())["bnb_4bit_quant_type"] == "nf4"


def _loss(model, tok):
    ids = torch.tensor([tok("Poisson sampling includes each record.")["input_ids"]])
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss)


def test_the_checkpoint_loads_with_its_base_quantized_and_merges_exactly(runs):
    import bitsandbytes as bnb

    from dpllm.checkpoint import load_model

    model, tok = load_model(runs / "nf4")
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
    merged, _ = load_model(runs / "nf4", merge=True)  # into the dequantized base: a plain float32 model
    assert not any(type(m).__module__.startswith("bitsandbytes") for m in merged.modules())
    # the same function (float32 rounding of W·x + B·A·x against (W + B·A)·x), not the 4-bit re-rounding of a merge
    assert _loss(merged, tok) == pytest.approx(_loss(model, tok), abs=1e-4)


def test_export_audit_and_synthesize_load_the_quantized_run(runs, tmp_path):
    from dpllm.checkpoint import load_model
    from dpllm.export import export
    from dpllm.synthetic import synthesize
    from mia.__main__ import main as mia_main

    out = export(runs / "nf4", tmp_path / "bundle")
    names = {p.name for p in out.iterdir()}
    assert {"adapter_model.safetensors", "base_model", "base_quantization.json", "privacy_report.json"} <= names
    card = (out / "README.md").read_text()
    assert "## Quantized base (QLoRA)" in card and 'bnb_4bit_quant_type="nf4"' in card
    # the card's snippet, run as written, gives the model dpllm's loader gives
    snippet = card.split("## Quantized base (QLoRA)")[1].split("```python\n")[1].split("```")[0]
    scope: dict = {}
    exec(snippet.replace("THIS_DIR", str(out)), scope)
    ref, tok = load_model(runs / "nf4")
    # (train mode: in eval mode bitsandbytes 0.50 repacks 4-bit weights for AVX512-BF16 CPUs, which fails on layers
    # narrower than its block of 64, as this tiny model's; dpllm's loader turns that path off: models.one_cpu_path)
    assert _loss(scope["model"].train(), tok) == pytest.approx(_loss(ref, tok), abs=1e-6)
    assert mia_main(["audit", "--checkpoint", str(runs / "nf4"), "--attacks", "loss", "--n-bootstrap", "10",
                     "--no-progress"]) == 0
    assert json.loads((runs / "nf4" / "audit" / "mia_report.json").read_text())["attacks"]["loss"]["auc"] is not None
    synthesize(runs / "nf4", num=2, out=tmp_path / "s.jsonl", max_new_tokens=8, batch_size=2, progress=False)
    assert len((tmp_path / "s.jsonl").read_text().splitlines()) == 2


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("kind", ["sft", "user", "blt"])
def test_sft_records_and_user_level_runs_train_qlora(tmp_path, kind):
    """... and correlated noise: banded under ULS with hooks, BLT at record level under bk."""
    if kind == "blt":
        rows = [{"text": f"Record {i} is about topic {i % 7} and number {3 * i}."} for i in range(60)]
        extra = ["--noise", "blt", "--bands", "2", "--buffers", "1"]
    elif kind == "sft":
        rows = [{"messages": [{"role": "user", "content": f"What is {i} times 3?"},
                              {"role": "assistant", "content": f"{3 * i}."}]} for i in range(40)]
        extra = ["--max_length", "96"]
    else:  # user-level sampling (ULS): one clipped mean gradient per user, Opacus hooks mode for a change
        rows = [{"text": f"User {i % 10} wrote record {i} about topic {i % 7}.", "user": f"u{i % 10}"}
                for i in range(60)]
        extra = ["--privacy_unit", "user", "--user_sampling", "uls", "--grad_sample_mode", "hooks",
                 "--max_records_per_user", "4", "--logical_batch_size", "8", "--physical_batch_size", "8",
                 "--noise", "banded", "--bands", "2"]
    data = _jsonl(tmp_path / "d.jsonl", rows)
    summary = train(parse_config(["--dataset", data, "--output_dir", str(tmp_path / "run"), "--quantization", "nf4",
                                  "--min_chars", "1", *FAST, *extra]))
    report = PrivacyReport.read(summary["run_dir"])
    assert report.base_model["quantization"] == "nf4" and 0 < report.epsilon <= 8
    assert report.grad_sample_mode == ("hooks" if kind == "user" else "bk")
    if kind == "user":  # two cyclic groups of users: DP-SGD's event at q_b over ⌈2/2⌉ = 1 step
        assert report.privacy_unit == "user" and report.correlated_noise["mechanism"] == "banded"
        assert report.correlated_noise["accounted_steps"] == 1 and report.history[0][2] == 1
    if kind == "blt":  # one Gaussian mechanism over the whole run, no sampling credited
        assert report.correlated_noise["mechanism"] == "blt" and report.correlated_noise["buffers"] == 1
        assert report.history[0][1:] == [1.0, 1] and not report.poisson_sampling


def test_dptrainer_trains_a_quantized_model_with_adapters(tmp_path):
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import TrainingArguments

    from dpllm.checkpoint import load_model
    from dpllm.config import ModelConfig
    from dpllm.hf import DPTrainer, PrivacyArguments
    from dpllm.models import load_base

    model, tok, _ = load_base(ModelConfig(quantization="nf4", tiny_hidden_size=32, tiny_num_heads=2), 64)
    model = get_peft_model(prepare_model_for_kbit_training(model, use_gradient_checkpointing=False),
                           LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))
    texts = [f"Record {i}: the quick brown fox number {i}." for i in range(40)]
    enc = [tok(t) for t in texts]
    train_ds = Dataset.from_dict({"input_ids": [e["input_ids"] for e in enc[:32]], "text": texts[:32]})
    eval_ds = Dataset.from_dict({"input_ids": [e["input_ids"] for e in enc[32:]], "text": texts[32:]})
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), max_grad_norm=0.0, report_to="none", disable_tqdm=True,
                             use_cpu=True, max_steps=2, per_device_train_batch_size=4, learning_rate=1e-3)
    trainer = DPTrainer(model=model, args=args, train_dataset=train_ds, eval_dataset=eval_ds, processing_class=tok,
                        privacy_args=PrivacyArguments(target_epsilon=8, logical_batch_size=8))
    out = trainer.train()
    assert 0 < out.metrics["epsilon"] <= 8
    assert trainer.privacy_report.base_model.get("quantization") == "nf4"
    assert "quantization: nf4" in (tmp_path / "hf" / "config.yaml").read_text()
    reloaded, _ = load_model(tmp_path / "hf")
    assert _loss(reloaded, tok) == pytest.approx(_loss(trainer.model.eval(), tok), abs=1e-6)


def test_a_locally_saved_model_is_quantized_while_loading_and_named_by_the_card(tmp_path):
    """A saved tiny Llama loaded as any pretrained model: quantized while loading, no base_model/ copy written, the
    adapter names the base's directory and the exported card loads that base quantized."""
    from dpllm.checkpoint import load_model
    from dpllm.config import ModelConfig
    from dpllm.export import export
    from dpllm.models import build_tiny, byte_tokenizer

    tok = byte_tokenizer()
    torch.manual_seed(0)
    build_tiny(ModelConfig(tiny_hidden_size=32, tiny_num_heads=2), tok, 64).save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    run = tmp_path / "run"
    train(parse_config(["--model_name_or_path", str(tmp_path / "base"), "--output_dir", str(run),
                        "--quantization", "nf4", "--dataset", "pydoc", *FAST]))
    report = PrivacyReport.read(run)
    assert report.base_model == {"kind": "pretrained", "path": str((tmp_path / "base").resolve()),
                                 "quantization": "nf4"}
    assert not (run / "checkpoint" / "base_model").exists()
    model, _ = load_model(run)
    assert type(model.base_model.model.model.layers[0].mlp.up_proj.base_layer).__name__ == "Linear4bit"
    card = (export(run, tmp_path / "bundle") / "README.md").read_text()
    assert 'from_pretrained("base", quantization_config=BitsAndBytesConfig(load_in_4bit=True' in card


def test_the_memory_estimate_counts_the_4bit_base_as_bitsandbytes_stores_it():
    """scripts/qlora_memory.py's 4-bit term against the bytes of a quantized model's weights and constants."""
    import importlib.util
    import os

    import bitsandbytes as bnb

    from dpllm.config import ModelConfig
    from dpllm.models import load_base

    spec = importlib.util.spec_from_file_location("qlora_memory", os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "qlora_memory.py"))
    mem = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mem)
    h, i = 256, 1024
    model, _, _ = load_base(ModelConfig(quantization="nf4", tiny_hidden_size=h, tiny_intermediate_size=i,
                                        tiny_num_heads=4, tiny_num_layers=2), 64)
    stored = 0
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            qs = m.weight.quant_state
            stored += m.weight.numel() * m.weight.element_size() + qs.absmax.numel() * qs.absmax.element_size()
            stored += qs.state2.absmax.numel() * qs.state2.absmax.element_size()
    est = mem.estimate(hidden=h, intermediate=i, layers=2, heads=4, kv_heads=4, vocab=384, tied=False, batch=1, seq=64)
    assert est["base (4-bit)"] == pytest.approx(stored, rel=0.02)
