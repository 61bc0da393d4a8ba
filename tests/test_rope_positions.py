"""Rotary embeddings that switch their frequencies on the batch's longest position are refused (issue 46, item 3).

transformers' ``longrope`` (Phi-3-128k) picks the long factors for every row of a batch once one row reaches
``original_max_position_embeddings``; ``dynamic`` recomputes every row's frequencies past the cached context.
One long record then changes every other record's forward pass, and so their clipped gradients. Before: trained,
with the first-batch independence check passing (its batch held short records only). Now: refused before the run
by the model's config (:mod:`dpllm.privacy.positions`) and, whatever the cause, by the independence check's probe
with a record at ``max_length`` (:mod:`dpllm.privacy.independence`, step 4).
"""

import doctest

import pytest
import torch

from dpllm.config import ModelConfig, PrivacyConfig
from dpllm.data import make_collate
from dpllm.models import prepare_model
from dpllm.privacy.engine import PrivacyPlan, make_private
from dpllm.privacy.paths import UnclippableModel
from dpllm.privacy.positions import check_rope_per_record

C, V, ORIGINAL, CONTEXT, LONG = 1e-3, 64, 16, 64, 48
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0 ** i for i in range(8)],
            "original_max_position_embeddings": ORIGINAL}
STATIC = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": ORIGINAL},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    # the fix the refusal names: the long factors for every length
    "longrope with one set of factors": {**LONGROPE, "short_factor": LONGROPE["long_factor"]},
}


def _llama(rope: dict, *, lora: bool = True, init: float = 0.2):
    """A tiny Llama (head_dim 16: 8 rotary frequencies) with the given rope parameters, the same weights each call.

    ``initializer_range=0.2``: attention as peaked as a trained model's. At transformers' default 0.02 the
    attention is nearly uniform and the rotation barely matters (the longrope switch moved the clipped sum by
    1.006 C there, 2.00 C here).
    """
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, max_position_embeddings=CONTEXT, tie_word_embeddings=False,
                         initializer_range=init, rope_parameters={"rope_theta": 10000.0, **rope})
    model = AutoModelForCausalLM.from_config(config)
    if lora:
        model, _ = prepare_model(model, ModelConfig(model_name_or_path="tiny", finetuning="lora", lora_r=4), dp=True)
        with torch.no_grad():  # LoRA's B starts at zero, which leaves A without a gradient
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05)
    return model


def _records(copies: int = 1):
    g = torch.Generator().manual_seed(1)
    short = [torch.randint(1, V, (n,), generator=g) for n in (8, 10, 12, 9, 11, 7, 12, 10) * copies]
    return short, torch.randint(1, V, (LONG,), generator=g)


def _private(model, *, max_length=None):
    plan = PrivacyPlan(num_records=100, sample_rate=0.01, steps=1, noise_multiplier=0.0, delta=1e-5,
                       accountant="rdp", expected_batch_size=1)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    return make_private(model=model, optimizer=opt, dataset=list(range(100)), collate_fn=lambda b: b,
                        cfg=PrivacyConfig(grad_sample_mode="bk", max_grad_norm=C), plan=plan, logical_batch_size=1,
                        max_length=max_length)


def _update(rope: dict, records, *, max_length=None, init: float = 0.2) -> torch.Tensor:
    """One bk step (σ = 0, learning rate 1, expected batch 1): the clipped sum of ``records``' gradients."""
    from dpllm.train import forward_loss

    model = _llama(rope, init=init)
    before = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    pt = _private(model, max_length=max_length)
    forward_loss(pt.model, make_collate(0)(records), pt.criterion).backward()
    pt.optimizer.step()
    return torch.cat([(b - p.detach()).flatten() for b, p in zip(before, [p for p in model.parameters()
                                                                           if p.requires_grad])])


def _sensitivity(rope: dict, *, copies: int = 1, **kw) -> float:
    """How far one long record moves the clipped sum of 8 × ``copies`` short ones, in units of C (bound: 1)."""
    short, long = _records(copies)
    return float((_update(rope, short + [long], **kw) - _update(rope, short, **kw)).norm()) / C


def test_one_long_record_moved_the_other_records_clipped_gradients_through_longrope():
    """The failure as the old code trained it (the independence check without a record at max_length passes):
    2.00 × C measured, against the bound of 1. The same records under the default rope: within the bound."""
    assert _sensitivity(LONGROPE) > 1.9
    # the long record's own clipped gradient (norm ≤ C) and nothing else; 1e-3: float rounding of the other
    # records' gradients across padded lengths (their outputs moved by 0 in float32 on CPU)
    assert _sensitivity(STATIC["default"]) <= 1 + 1e-3


def test_longrope_with_max_length_past_its_original_context_is_refused_before_the_run():
    model = _llama(LONGROPE)
    with pytest.raises(UnclippableModel, match=r"rope_type longrope\) switches every row to its long factors.*"
                                               r"max_length=48 beyond original_max_position_embeddings=16.*"
                                               r"lower max_length to ≤ 16"):
        check_rope_per_record(model, max_length=LONG)
    check_rope_per_record(model, max_length=ORIGINAL)  # the short factors in every batch
    # one set of factors: the switch changes nothing
    check_rope_per_record(_llama(STATIC["longrope with one set of factors"], lora=False), max_length=LONG)


def test_a_phi3_128k_style_config_is_refused_by_both_checks():
    """Phi-3-mini-128k's config.json form: ``rope_scaling`` of type longrope, the original context at the top."""
    from transformers import AutoModelForCausalLM, Phi3Config

    from dpllm.models import position_ids_for
    from dpllm.privacy.independence import check_record_independence

    torch.manual_seed(0)
    config = Phi3Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=2, max_position_embeddings=CONTEXT,
                        original_max_position_embeddings=ORIGINAL,
                        rope_scaling={"type": "longrope", "short_factor": LONGROPE["short_factor"],
                                      "long_factor": LONGROPE["long_factor"]},
                        initializer_range=0.2, pad_token_id=0, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(UnclippableModel, match=r"model.rotary_emb \(rope_type longrope\).*lower max_length to ≤ 16"):
        check_rope_per_record(model, max_length=LONG)
    batch = make_collate(0)(_records()[0][:3])
    kwargs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
              "position_ids": position_ids_for(batch["input_ids"])}
    with pytest.raises(UnclippableModel, match="one record of max_length=48 tokens joins their batch"):
        check_record_independence(model, (), kwargs, max_length=LONG)
    check_record_independence(model, (), kwargs, max_length=ORIGINAL)  # short factors in every batch: passes


def test_dynamic_ntk_past_its_cached_context_is_refused():
    model = _llama({"rope_type": "dynamic", "factor": 2.0}, lora=False)
    check_rope_per_record(model, max_length=CONTEXT)  # never grows: the frequencies of construction
    with pytest.raises(UnclippableModel, match=r"rope_type dynamic\) recomputes every row's frequencies.*"
                                               r"max_length=65.*lower max_length to ≤ 64"):
        check_rope_per_record(model, max_length=CONTEXT + 1)


def test_the_independence_check_probes_with_a_record_at_max_length():
    """The first batch holds short records only; the check adds one of max_length and sees the others move."""
    short, _ = _records()
    with pytest.raises(UnclippableModel, match="change when one record of max_length=48 tokens joins their batch"):
        _update(LONGROPE, short, max_length=LONG)


@pytest.mark.parametrize("kind", ["linear", "llama3", "longrope with one set of factors"])
def test_static_rope_types_pass_both_checks_and_keep_records_apart(kind):
    rope = STATIC[kind]
    check_rope_per_record(_llama(rope, lora=False), max_length=CONTEXT)
    # the probe at max_length passes, and one long record moves the clipped sum by its own gradient only
    assert _sensitivity(rope, max_length=LONG) <= 1 + 1e-3


def _byte_llama(tok):
    """The longrope Llama with the byte tokenizer's vocabulary (the commands' tokenizer for tiny models)."""
    from transformers import AutoModelForCausalLM

    config = _llama(LONGROPE, lora=False).config
    config.vocab_size, config.pad_token_id = len(tok), tok.pad_token_id
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def test_the_recipe_refuses_such_a_model_before_writing_anything(tmp_path, monkeypatch, capsys):
    """``dpllm train`` (the recipe's command) on a longrope model with max_length past the original context: one
    line saying what to change, exit 2, no run directory."""
    import json

    import dpllm.train
    from dpllm.models import byte_tokenizer
    from tests.helpers import load_recipe

    tok = byte_tokenizer()
    monkeypatch.setattr(dpllm.train, "load_base", lambda cfg, max_length, **kw: (
        _byte_llama(tok), tok, {"kind": "tiny", "name": "tiny-llama"}))
    data, out = tmp_path / "train.jsonl", tmp_path / "run"
    data.write_text("".join(json.dumps({"text": f"record {i} talks about something {i * 7}"}) + "\n"
                            for i in range(40)))
    code = load_recipe("finetune_llm").cli(["--dataset", str(data), "--output_dir", str(out), "--max_length", "32",
                                           "--finetuning", "lora", "--max_steps", "1", "--progress", "false"])
    err = capsys.readouterr().err
    assert code == 2 and "rope_type longrope" in err and "lower max_length to ≤ 16" in err, err[-2000:]
    assert not out.exists()


def test_dptrainer_refuses_such_a_model_before_writing_anything(tmp_path):
    """A user's own Trainer script (``DPTrainer``): max_length is the longest row, 32 here, past the original 16."""
    from datasets import Dataset
    from transformers import TrainingArguments

    from dpllm.hf import DPTrainer, PrivacyArguments
    from dpllm.models import byte_tokenizer

    tok = byte_tokenizer()
    model = _byte_llama(tok)
    data = Dataset.from_dict({"text": [f"record {i} talks about something {i * 7}" for i in range(16)]})
    data = data.map(lambda b: tok(b["text"], truncation=True, max_length=32), batched=True)
    out = tmp_path / "run"
    trainer = DPTrainer(model=model, args=TrainingArguments(str(out), max_steps=1, report_to="none",
                                                            disable_tqdm=True, use_cpu=True,
                                                            per_device_train_batch_size=4),
                        privacy_args=PrivacyArguments(target_epsilon=8.0, logical_batch_size=8),
                        train_dataset=data, processing_class=tok)
    with pytest.raises(UnclippableModel, match=r"rope_type longrope.*max_length=32.*lower max_length to ≤ 16"):
        trainer.train()
    assert not (out / "privacy_report.json").exists() and not (out / "config.yaml").exists()


def test_doctests():
    from dpllm.privacy import positions

    assert doctest.testmod(positions).failed == 0
