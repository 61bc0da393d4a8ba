"""grad_sample_mode: auto (the default): the engine chosen per model with its reason, in the log and the report;
user-level sampling and a BERT-style decoder under full fine-tuning train with the defaults."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from dpllm.config import PrivacyConfig, parse_config
from dpllm.privacy import modes
from dpllm.privacy.modes import choose_mode
from tests.helpers import tiny_model


class Odd(nn.Module):  # a trainable layer with no book-keeping rule
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return x * self.scale


def test_defaults_are_auto_everywhere():
    from dpllm.hf import PrivacyArguments

    assert PrivacyConfig().grad_sample_mode == "auto" == PrivacyArguments().grad_sample_mode
    assert PrivacyArguments().privacy_config().grad_sample_mode == "auto"
    cfg = parse_config(["--privacy_unit", "user"])  # ULS with every other default: accepted
    assert (cfg.privacy.user_sampling, cfg.privacy.grad_sample_mode) == ("uls", "auto")


def test_auto_picks_bk_hooks_or_ghost_with_a_reason(monkeypatch):
    model, _ = tiny_model("tiny-llama", "full")
    c = choose_mode("auto", model, physical_batch_size=8)
    assert c.mode == "bk" and "every trainable layer" in c.reason
    assert choose_mode("ghost", model) == modes.ModeChoice("ghost", "set by grad_sample_mode: ghost")

    assert modes.device_memory(torch.device("cpu")) > 2**30  # this machine's RAM
    net = nn.Sequential(nn.Linear(8, 8), Odd())
    c = choose_mode("auto", net, physical_batch_size=4)
    assert c.mode == "hooks" and "1 (Odd)" in c.reason and "faster than ghost" in c.reason
    # 4 records × 80 parameters × 4 bytes = 1280 B of per-sample gradients against a 4 KiB device: > 1/4
    monkeypatch.setattr(modes, "device_memory", lambda device: 4096)
    c = choose_mode("auto", net, physical_batch_size=4)
    assert c.mode == "ghost" and "would take" in c.reason
    assert choose_mode("auto", net, physical_batch_size=3).mode == "hooks"  # 960 B ≤ 1024 B
    # user-level sampling needs per-sample gradients whatever they cost: never ghost
    c = choose_mode("auto", net, physical_batch_size=4, per_user=True)
    assert c.mode == "hooks" and "user-level" in c.reason


def test_under_fsdp_auto_is_bk_or_a_refusal_naming_ghost_fsdp():
    """Under FSDP2 Opacus's hooks and ghost cannot run; auto never falls back to ghost_fsdp (two backward passes,
    and the engine the unclipped-path guard covers least): a layer without a bk rule is refused, before any work."""
    from dpllm.config import ConfigError

    model, _ = tiny_model("tiny-llama", "full")
    c = choose_mode("auto", model, sharded=True)
    assert c.mode == "bk" and "FSDP" in c.reason
    with pytest.raises(ConfigError, match=r"no book-keeping rule for 1 \(Odd\).*grad_sample_mode: ghost_fsdp"):
        choose_mode("auto", nn.Sequential(nn.Linear(8, 8), Odd()), sharded=True)
    assert choose_mode("ghost_fsdp", nn.Sequential(Odd()), sharded=True).mode == "ghost_fsdp"  # asked by name


USER_RUN = ["--model_name_or_path", "tiny-llama", "--finetuning", "full", "--tiny_hidden_size", "32",
            "--tiny_num_layers", "1", "--max_records", "200", "--max_length", "32", "--privacy_unit", "user",
            "--max_records_per_user", "4", "--max_steps", "2", "--logical_batch_size", "16",
            "--physical_batch_size", "8", "--eval_every", "0", "--eval_max_records", "8", "--target_delta", "1e-3",
            "--progress", "false"]


def test_user_level_sampling_trains_with_the_defaults(tmp_path, caplog):
    """privacy_unit: user and nothing else: ULS under auto → bk; the log and the report say which and why."""
    from dpllm.privacy.report import PrivacyReport
    from dpllm.train import train

    with caplog.at_level(logging.INFO, logger="dpllm.privacy.engine"):
        train(parse_config([*USER_RUN, "--output_dir", str(tmp_path / "run")]))
    report = PrivacyReport.read(tmp_path / "run")
    assert report.privacy_unit == "user" and report.user_level["sampling"] == "uls"
    assert report.grad_sample_mode == "bk" and "book-keeping rule" in report.grad_sample_mode_reason
    assert 0 < report.epsilon <= 8
    assert any("grad_sample_mode=bk (auto: every trainable layer" in r.getMessage() for r in caplog.records)


def _tiny_bert_decoder(path):
    from transformers import BertConfig, BertLMHeadModel

    from dpllm.models import byte_tokenizer

    tok = byte_tokenizer()
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=64, is_decoder=True, pad_token_id=tok.pad_token_id)
    model = BertLMHeadModel(cfg)
    assert model.cls.predictions.decoder.bias is model.cls.predictions.bias  # the tie that broke DP training
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model


def test_bert_style_decoder_full_finetuning_trains_under_every_mode(tmp_path):
    """A BERT decoder's prediction head ties its bias to ``predictions.bias``: Opacus (hooks and ghost) failed
    with a meta-device error and bk refused it. Untied, the default (bk) trains, and so do hooks and ghost."""
    from transformers import AutoModelForCausalLM

    from dpllm.checkpoint import unwrap
    from dpllm.config import ModelConfig
    from dpllm.data import make_collate
    from dpllm.models import byte_tokenizer, prepare_model
    from dpllm.privacy.engine import make_private
    from dpllm.privacy.plan import PrivacyPlan
    from dpllm.privacy.report import PrivacyReport
    from dpllm.train import forward_loss, train
    from tests.helpers import TEXTS, batch_of

    base = _tiny_bert_decoder(tmp_path / "bert")
    out = tmp_path / "run"
    train(parse_config(["--model_name_or_path", str(tmp_path / "bert"), "--finetuning", "full", "--max_records",
                        "120", "--max_length", "32", "--max_steps", "2", "--logical_batch_size", "16",
                        "--physical_batch_size", "8", "--eval_every", "0", "--eval_max_records", "8", "--progress",
                        "false", "--output_dir", str(out)]))
    report = PrivacyReport.read(out)
    assert report.grad_sample_mode == "bk" and any("untied" in a for a in report.model_adjustments)
    trained = AutoModelForCausalLM.from_pretrained(out / "checkpoint")
    head = trained.cls.predictions
    assert head.decoder.bias is not head.bias  # saved untied, loaded untied
    assert not torch.equal(head.decoder.bias, base.cls.predictions.decoder.bias)  # the bias trained
    assert torch.equal(head.bias, base.cls.predictions.bias)  # its frozen former twin did not

    tok = byte_tokenizer()
    for mode in ("hooks", "ghost"):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "bert")
        model, _ = prepare_model(model, ModelConfig(finetuning="full"), dp=True)
        model.train()
        plan = PrivacyPlan(num_records=6, sample_rate=0.5, steps=1, noise_multiplier=0.0, delta=1e-5,
                           accountant="rdp", expected_batch_size=3)
        params = [p for p in model.parameters() if p.requires_grad]
        private = make_private(model=model, optimizer=torch.optim.SGD(params, lr=0.1), dataset=list(range(6)),
                               collate_fn=make_collate(tok.pad_token_id), plan=plan, logical_batch_size=3,
                               cfg=PrivacyConfig(grad_sample_mode=mode))
        assert private.grad_sample_mode == mode
        before = unwrap(private.model).cls.predictions.decoder.bias.detach().clone()
        loss = forward_loss(private.model, batch_of(tok, TEXTS[:3], max_length=32), private.criterion)
        loss.backward()
        private.optimizer.step()
        assert not torch.equal(unwrap(private.model).cls.predictions.decoder.bias, before), mode


def test_a_tied_head_is_kept_for_bk_and_untied_for_opacus(tmp_path):
    """GPT-2 ties lm_head to wte: bk (auto) trains the tie as it is; Opacus modes get the untied copy."""
    from dpllm.privacy.report import PrivacyReport
    from dpllm.train import train

    run = ["--model_name_or_path", "tiny-gpt2", "--finetuning", "full", "--tiny_hidden_size", "32",
           "--tiny_num_layers", "1", "--max_records", "60", "--max_length", "24", "--max_steps", "1",
           "--logical_batch_size", "8", "--physical_batch_size", "8", "--eval_every", "0", "--eval_max_records",
           "4", "--progress", "false"]
    for mode, untied in (("auto", False), ("hooks", True)):
        train(parse_config([*run, "--grad_sample_mode", mode, "--output_dir", str(tmp_path / mode)]))
        report = PrivacyReport.read(tmp_path / mode)
        assert report.grad_sample_mode == ("bk" if mode == "auto" else mode)
        assert any("untied output embedding" in a for a in report.model_adjustments) == untied
