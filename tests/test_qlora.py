"""QLoRA under DP: a tiny Llama quantized by bitsandbytes (NF4 4-bit, on the CPU fallback path), LoRA adapters
trained privately.

- The adapters' private sums (bk, Opacus hooks and ghost, noise 0) equal Σᵢ w(‖gᵢ‖)·gᵢ computed record by record
  on the same quantized model (NF4; bk also FP4 and int8), to the tolerance of the unquantized comparison in
  test_clipping_equivalence.py (rtol 1e-4: float32, a record alone versus padded in a batch; in training
  bitsandbytes' CPU path dequantizes the weights to float32 and multiplies in float32, so quantization adds no
  batch dependence).
- ε and the privacy report equal an unquantized run's with the same configuration.
- A trainable adapter used outside its own layer is still refused, in every mode.
- Full fine-tuning of a quantized base, and quantization without bitsandbytes, are refused before anything loads.
"""

import copy
import json

import pytest
import torch

pytest.importorskip("bitsandbytes")

from dpllm.config import ConfigError, ModelConfig, PrivacyConfig, parse_config  # noqa: E402
from dpllm.models import ModelError, load_base, prepare_model, quantization_of  # noqa: E402
from dpllm.privacy import clipping  # noqa: E402
from dpllm.privacy.engine import PrivacyPlan, make_private  # noqa: E402
from dpllm.train import forward_loss  # noqa: E402
from tests.helpers import TEXTS, batch_of  # noqa: E402
from tests.test_clipping_equivalence import explicit_per_sample_grads, private_sum  # noqa: E402


def qlora_model(quantization: str = "nf4", *, seed: int = 0):
    torch.manual_seed(seed)
    cfg = ModelConfig(model_name_or_path="tiny-llama", finetuning="lora", quantization=quantization,
                      tiny_hidden_size=32, tiny_num_layers=2, tiny_num_heads=2, tiny_intermediate_size=64,
                      tiny_max_positions=128, lora_r=4)
    model, tok, _ = load_base(cfg, 64)
    model, _ = prepare_model(model, cfg, dp=True)
    with torch.no_grad():  # LoRA B starts at zero, which makes A's gradient zero: perturb so every adapter gets signal
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model.train(), tok


def test_the_base_is_quantized_and_frozen_and_only_the_adapters_train():
    import bitsandbytes as bnb

    model, _ = qlora_model()
    assert quantization_of(model) == "nf4"
    quantized = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(quantized) == 2 * 7  # q k v o gate up down in each of 2 layers
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_A" in n or "lora_B" in n for n in trainable)
    # the frozen 4-bit layers are no engine's concern: bk has a rule for every trainable layer, so auto picks it
    from dpllm.privacy.bk import unsupported_layers
    from dpllm.privacy.modes import choose_mode

    assert unsupported_layers(model) == [] and choose_mode("auto", model).mode == "bk"


@pytest.mark.parametrize("mode, quantization", [("bk", "nf4"), ("hooks", "nf4"), ("ghost", "nf4"), ("bk", "fp4"),
                                                ("bk", "int8")])
def test_adapter_private_sum_matches_explicit_per_record_clipping(mode, quantization):
    model, tok = qlora_model(quantization)
    batch = batch_of(tok)
    per_sample = explicit_per_sample_grads(copy.deepcopy(model), batch)
    norms = torch.stack([torch.sqrt(sum((g ** 2).sum() for g in gs)) for gs in per_sample])
    cfg = PrivacyConfig(max_grad_norm=float(norms.median()), grad_sample_mode=mode)  # some records clipped, some not
    weights = clipping.get("flat").weights(norms, cfg)
    assert (weights < 1).any() and (weights >= 1 - 1e-6).any()
    expected = [sum(w * gs[j] for w, gs in zip(weights, per_sample)) for j in range(len(per_sample[0]))]
    got = private_sum(model, tok, batch, cfg)
    assert len(got) == len(expected) == 2 * 7 * 2  # every adapter A and B, nothing of the base
    for g, e in zip(got, expected):
        assert torch.allclose(g, e, rtol=1e-4, atol=1e-6), (g - e).abs().max()


class _AdapterReusedOutside(torch.nn.Module):
    """The QLoRA model, plus a use of one adapter's weight outside its layer (a tied view, as in
    test_gradient_paths.py): that gradient would escape per-record clipping."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        # held, not registered: the parameter belongs to its LoRA layer only, as in a view made before training
        self.__dict__["a"] = model.base_model.model.model.layers[0].self_attn.q_proj.lora_A.default.weight

    def forward(self, input_ids, **kw):
        out = self.model(input_ids=input_ids, **kw)
        extra = self.model.get_input_embeddings()(input_ids) @ self.a.T  # (B, T, r)
        return type(out)(logits=out.logits + 0.1 * extra.sum(-1, keepdim=True))


@pytest.mark.parametrize("mode", ["bk", "hooks", "ghost"])
def test_an_adapter_used_outside_its_layer_is_refused(mode):
    from dpllm.data import TokenizedRecords, make_collate

    model, tok = qlora_model()
    wrapped = _AdapterReusedOutside(model).train()
    dataset = TokenizedRecords(TEXTS, tok, 48)
    n = len(dataset)
    plan = PrivacyPlan(num_records=n, sample_rate=1.0, steps=1, noise_multiplier=0.0, delta=1e-5, accountant="rdp",
                       expected_batch_size=n)
    opt = torch.optim.SGD([p for p in wrapped.parameters() if p.requires_grad], lr=0.1)
    pt = make_private(model=wrapped, optimizer=opt, dataset=dataset, collate_fn=make_collate(tok.pad_token_id),
                      cfg=PrivacyConfig(max_grad_norm=1.0, grad_sample_mode=mode), plan=plan, logical_batch_size=n)
    before = [p.detach().clone() for p in opt.param_groups[0]["params"]] if hasattr(opt, "param_groups") else []
    with pytest.raises(RuntimeError, match="outside its own layer|outside its own layer's forward call"):
        forward_loss(pt.model, batch_of(tok), pt.criterion).backward()
    assert all(torch.equal(p, b) for p, b in zip(opt.param_groups[0]["params"], before))


def test_full_fine_tuning_of_a_quantized_base_is_refused_before_loading():
    with pytest.raises(ConfigError, match="use finetuning: lora"):
        parse_config(["--finetuning", "full", "--quantization", "nf4"])
    with pytest.raises(ConfigError, match="quantization='nf3' is not supported"):
        parse_config(["--quantization", "nf3"])
    model, _ = qlora_model()  # a quantized model handed over directly (DPTrainer, a script) is refused too
    with pytest.raises(ModelError, match="cannot be fine-tuned in full"):
        prepare_model(model.unload(), ModelConfig(finetuning="full"), dp=True)


def test_without_bitsandbytes_the_message_names_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    with pytest.raises(ConfigError, match=r"pip install 'dpllm\[qlora\]'") as err:
        parse_config(["--quantization", "nf4"])
    assert "\n" not in str(err.value)
    parse_config(["--quantization", "none"])  # nothing asked, nothing needed


def test_peft_default_preparation_with_reentrant_checkpointing_clips_exactly_under_bk():
    """``prepare_model_for_kbit_training(model)`` as peft users call it turns on reentrant gradient checkpointing and
    makes the embeddings' output require gradients: bk still clips each record once (its callback ends the
    outermost backward pass), equal to per-record clipping; Opacus's modes refuse it (tests/test_bk_checkpointing)."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    from dpllm.models import activation_checkpointing

    torch.manual_seed(0)
    base, tok, _ = load_base(ModelConfig(quantization="nf4", tiny_hidden_size=32, tiny_num_heads=2,
                                         tiny_intermediate_size=64), 64)
    model = get_peft_model(prepare_model_for_kbit_training(base), LoraConfig(r=4, target_modules="all-linear",
                                                                             task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    model.train()
    assert activation_checkpointing(model) == "reentrant"
    batch = batch_of(tok)
    per_sample = explicit_per_sample_grads(copy.deepcopy(model), batch)
    norms = torch.stack([torch.sqrt(sum((g ** 2).sum() for g in gs)) for gs in per_sample])
    cfg = PrivacyConfig(max_grad_norm=float(norms.median()), grad_sample_mode="bk")
    weights = clipping.get("flat").weights(norms, cfg)
    expected = [sum(w * gs[j] for w, gs in zip(weights, per_sample)) for j in range(len(per_sample[0]))]
    for g, e in zip(private_sum(model, tok, batch, cfg), expected):
        assert torch.allclose(g, e, rtol=1e-4, atol=1e-6), (g - e).abs().max()
    with pytest.raises(ModelError, match="reentrant gradient checkpointing"):
        private_sum(model, tok, batch, PrivacyConfig(grad_sample_mode="hooks"))


def test_a_run_saved_before_the_quantization_option_resumes_with_the_same_config_and_key(tmp_path):
    import yaml

    from dpllm import resume

    cfg = parse_config([])
    old = cfg.to_dict()
    for key in resume.ADDED_LATER:  # a checkpoint written before model.quantization and every later option existed
        section, name = key.split(".", 1)
        del old[section][name]
    (tmp_path / "dpllm_config.yaml").write_text(yaml.safe_dump(old))
    resume.check_config(tmp_path, cfg)  # no difference
    with pytest.raises(ConfigError, match=r"model.quantization \('none' → 'nf4'\)"):
        resume.check_config(tmp_path, parse_config(["--quantization", "nf4"]))
    import hashlib

    legacy = {k: v for k, v in resume._flat(old).items() if k.split(".", 1)[1] not in resume.NOT_COMPARED}
    assert (resume.config_key(cfg)
            == hashlib.sha256(json.dumps(legacy, sort_keys=True, default=str).encode()).hexdigest())
