"""Signals of a tiny random Llama: exact losses, padding invariance, Min-K%++ statistics."""

import numpy as np
import pytest
import torch
from transformers import ByT5Tokenizer, LlamaConfig, LlamaForCausalLM

from mia.audit import load_target
from mia.signals import compute_signals

TEXTS = ["hello world", "a", "the quick brown fox jumps over the lazy dog", "différentially privé",
         "x" * 40, "membership inference"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=384, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                      intermediate_size=64, max_position_embeddings=128)
    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(cfg).save_pretrained(path)
    ByT5Tokenizer().save_pretrained(path)
    model, tok = load_target(path)
    return path, model, tok


def test_loss_matches_hf_labels_loss(saved):
    _, model, tok = saved
    sig = compute_signals(model, tok, TEXTS, batch_size=3, progress=False)
    for i, text in enumerate(TEXTS):
        ids = torch.tensor([tok(text)["input_ids"]])
        with torch.no_grad():
            hf = model(input_ids=ids, labels=ids).loss.item()
        assert sig.loss[i] == pytest.approx(hf, abs=1e-5)
        assert sig.num_tokens[i] == ids.shape[1] - 1
        assert sig.token_logprobs[i].shape == (ids.shape[1] - 1,)


def test_padding_does_not_change_signals(saved):
    _, model, tok = saved
    batched = compute_signals(model, tok, TEXTS, batch_size=len(TEXTS), progress=False)
    for i, text in enumerate(TEXTS):
        alone = compute_signals(model, tok, [text], batch_size=1, progress=False)
        np.testing.assert_allclose(batched.token_logprobs[i], alone.token_logprobs[0], atol=1e-5)
        np.testing.assert_allclose(batched.token_mu[i], alone.token_mu[0], atol=1e-5)
        np.testing.assert_allclose(batched.token_sigma[i], alone.token_sigma[0], atol=1e-5)
    sub = batched.subset([2, 0])
    assert sub.loss.tolist() == [batched.loss[2], batched.loss[0]]


def test_mu_sigma_match_direct_computation(saved):
    _, model, tok = saved
    text = TEXTS[2]
    sig = compute_signals(model, tok, [text], progress=False)
    ids = torch.tensor([tok(text)["input_ids"]])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), -1).numpy()
    p = np.exp(logp)
    mu = (p * logp).sum(-1)
    sigma = np.sqrt((p * (logp - mu[:, None]) ** 2).sum(-1))  # the textbook form of the variance
    np.testing.assert_allclose(sig.token_mu[0], mu, atol=1e-5)
    np.testing.assert_allclose(sig.token_sigma[0], sigma, atol=1e-5)
    np.testing.assert_allclose(sig.token_logprobs[0], logp[np.arange(len(mu)), ids[0, 1:]], atol=1e-5)


def test_context_and_length_errors(saved):
    _, model, tok = saved
    long = "y" * 300  # 301 byte tokens > 128 positions
    with pytest.raises(ValueError, match="more than the model's context of 128.*max_length"):
        compute_signals(model, tok, [long], progress=False)
    sig = compute_signals(model, tok, [long], max_length=16, progress=False)
    assert sig.num_tokens[0] == 15
    with pytest.raises(ValueError, match="exceeds the model's context"):
        compute_signals(model, tok, ["ok"], max_length=512, progress=False)
    with pytest.raises(ValueError, match="at least 2"):
        compute_signals(model, tok, [""], progress=False)


def test_lora_model_and_missing_tokenizer(saved, tmp_path):
    path, model, tok = saved
    from peft import LoraConfig, get_peft_model

    base = LlamaForCausalLM.from_pretrained(path)
    lora = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    # LoRA's B matrices start at zero, so the adapter model scores exactly like its base.
    a = compute_signals(lora, tok, TEXTS[:3], progress=False)
    b = compute_signals(model, tok, TEXTS[:3], progress=False)
    np.testing.assert_allclose(a.loss, b.loss, atol=1e-6)
    lora.save_pretrained(tmp_path / "adapter")
    with pytest.raises(ValueError, match="no tokenizer.*save_pretrained"):
        load_target(tmp_path / "adapter")
    tok.save_pretrained(tmp_path / "adapter")
    loaded, _ = load_target(tmp_path / "adapter")
    c = compute_signals(loaded, tok, TEXTS[:3], progress=False)
    np.testing.assert_allclose(c.loss, b.loss, atol=1e-5)


def test_a_runs_own_record_shape_decides_what_is_scored(saved):
    """Issue 46 item 1 on the audit side: a plain-text run whose texts happen to be JSON prompt/completion strings
    trained on every token, so its audit must score every token (the run's shape, not a guess from the texts)."""
    import json

    from mia.audit import run_sft_format
    from mia.signals import sft_answer_masks

    _, model, tok = saved
    texts = [json.dumps({"prompt": f"question {i}?", "completion": f" answer number {i}"}) for i in range(4)]
    guessed = compute_signals(model, tok, texts, progress=False)  # files of bare records: guessed shape
    as_text = compute_signals(model, tok, texts, progress=False, record_format=None)
    plain = [len(tok(t)["input_ids"]) - 1 for t in texts]
    assert as_text.num_tokens.tolist() == plain
    assert all(g < p for g, p in zip(guessed.num_tokens.tolist(), plain))  # the guess scores answers only
    assert sft_answer_masks(tok, texts, max_length=512, record_format=None) is None
    assert sft_answer_masks(tok, texts, max_length=512) is not None
    assert run_sft_format(saved[0]) is None  # no splits.json: no SFT shape
