"""The embedding-interface audit (mia.embedding): what the attacker can rebuild from embeddings, the attacks'
power on known signal and noise, the reference options, and the real command on a run directory."""

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dpllm.config import ModelConfig
from dpllm.models import build_tiny, byte_tokenizer
from mia.embedding import (
    EMBEDDING_ATTACKS,
    Embeddings,
    adapters_disabled,
    embed_ids,
    embed_records,
    make_lens,
    run_embedding_audit,
)
from mia.metrics import auc
from mia.signals import compute_signals

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ["def add(a, b):\n    return a + b", "The quick brown fox jumps over the lazy dog.",
         "import os\nprint(os.getcwd())", "Lists are mutable sequences, typically used to store items."]


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    tok = byte_tokenizer()
    return build_tiny(ModelConfig(model_name_or_path="tiny-llama"), tok, 64).eval(), tok


def test_prefix_queries_recover_each_positions_state(tiny):
    # What an API user can do: embed x_<=t and x_<t and difference them. It must equal position t's state, which is
    # what the audit reads from one forward pass instead of T queries.
    model, tok = tiny
    ids = tok(TEXTS[0])["input_ids"]
    with torch.no_grad():
        states = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0].double()
    prefixes = embed_ids(model, [ids[:t] for t in range(1, len(ids) + 1)], layer=-1)
    recovered = np.stack([prefixes[0]] + [(t + 1) * prefixes[t] - t * prefixes[t - 1] for t in range(1, len(ids))])
    assert np.abs(recovered - states.numpy()).max() < 1e-4


def test_prefix_lens_with_the_models_own_head_is_the_loss(tiny):
    # Through the target's own head at the last layer, the lens score is exactly minus the loss-attack's loss.
    model, tok = tiny
    emb = embed_records(model, tok, TEXTS, layer=-1, max_length=64, lens=make_lens(model, -1))
    loss = compute_signals(model, tok, TEXTS, max_length=64, progress=False).loss
    np.testing.assert_allclose(emb.lens, -loss, rtol=1e-5)
    # Below the last layer the lens adds the final norm, and the score is a different (finite) number.
    mid = embed_records(model, tok, TEXTS, layer=1, max_length=64, lens=make_lens(model, 1))
    assert np.isfinite(mid.lens).all() and np.abs(mid.lens + loss).max() > 1e-3


def test_an_embedding_does_not_depend_on_its_batch(tiny):
    model, tok = tiny
    alone = [embed_records(model, tok, [t], max_length=64).full[0] for t in TEXTS]
    together = embed_records(model, tok, TEXTS, max_length=64, batch_size=4).full
    np.testing.assert_allclose(np.stack(alone), together, atol=1e-5)


def test_layer_out_of_range_is_refused(tiny):
    model, tok = tiny
    with pytest.raises(ValueError, match="outside this model's hidden states 0..2"):
        embed_records(model, tok, TEXTS, layer=5, max_length=64)


def _synthetic(n, d, shift, seed):
    rng = np.random.default_rng(seed)
    labels = np.r_[np.ones(n), np.zeros(n)].astype(int)
    full = rng.normal(size=(2 * n, d))
    full[:n, 0] += shift
    half = rng.normal(size=(2 * n, d))
    return Embeddings(full=full, first=half, second=half + rng.normal(size=(2 * n, d))), labels


def test_classifier_finds_a_planted_signal_and_not_noise():
    fn = EMBEDDING_ATTACKS["classifier"].fn
    emb, labels = _synthetic(100, 32, shift=3.0, seed=0)
    s = fn(emb, None, labels, seed=0)
    assert auc(s[labels == 1], s[labels == 0]) > 0.9  # seen: 0.98
    # Pure noise: fitted in-sample, 33 features on 200 records would score well above chance; cross-fitted
    # out-of-fold scores must not.
    emb, labels = _synthetic(100, 32, shift=0.0, seed=1)
    s = fn(emb, None, labels, seed=0)
    assert 0.35 < auc(s[labels == 1], s[labels == 0]) < 0.65


def test_halves_scores_self_similarity():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(4, 8))
    emb = Embeddings(full=a, first=a, second=np.vstack([a[:2], -a[2:]]))
    s = EMBEDDING_ATTACKS["halves"].fn(emb, None, None, seed=0)
    np.testing.assert_allclose(s, [1, 1, -1, -1])


def test_base_reference_of_a_lora_model_is_its_base(tiny):
    from peft import LoraConfig, get_peft_model

    model, tok = tiny
    before = embed_records(model, tok, TEXTS, max_length=64).full
    peft = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                            init_lora_weights=False)).eval()
    with adapters_disabled(peft):
        base = embed_records(peft, tok, TEXTS, max_length=64).full
    adapted = embed_records(peft, tok, TEXTS, max_length=64).full
    np.testing.assert_allclose(base, before, atol=1e-6)
    assert np.abs(adapted - before).max() > 1e-3
    with pytest.raises(ValueError, match="needs a LoRA"):
        with adapters_disabled(model):
            pass


def test_reference_attacks_need_a_reference(tiny):
    model, tok = tiny
    with pytest.raises(ValueError, match="need a reference model"):
        run_embedding_audit(model, tok, TEXTS[:2], TEXTS[2:], attacks="halves,prefix_lens", progress=False)
    with pytest.raises(ValueError, match="unknown embedding attack"):
        run_embedding_audit(model, tok, TEXTS[:2], TEXTS[2:], attacks="loss", progress=False)


def _mia(capsys, *args):
    """``python -m mia audit ...`` through its entry point, in this process (tests.helpers.in_process)."""
    from mia.__main__ import main
    from tests.helpers import in_process

    return in_process(main, ["audit", *args], capsys)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    from tests.helpers import load_recipe

    out = tmp_path_factory.mktemp("emb") / "run"
    assert load_recipe("finetune_llm").cli(["--max_records", "60", "--max_length", "32", "--tiny_hidden_size", "32",
                                            "--logical_batch_size", "16", "--physical_batch_size", "16", "--max_steps",
                                            "3", "--eval_every", "0", "--progress", "false", "--target_epsilon", "8",
                                            "--output_dir", str(out)]) == 0
    return out


def test_embedding_audit_command_on_a_lora_run(lora_run, capsys):
    r = _mia(capsys, "--checkpoint", str(lora_run), "--interface", "embedding", "--reference", "base", "--layer", "-1",
             "--n-bootstrap", "50", "--no-progress")
    assert r.returncode == 0, r.stderr[-2000:]
    out = lora_run / "audit"
    rep = json.loads((out / "embedding_report.json").read_text())
    assert rep["interface"] == "embedding" and rep["layer"] == 2 and rep["reference"].startswith("base")
    assert set(rep["attacks"]) == set(EMBEDDING_ATTACKS)
    # A DP run's report carries its (ε, δ), which the ROC plot draws as the bound.
    assert rep["dp_bound"]["epsilon"] == pytest.approx(8.0, abs=0.01)
    assert (out / "embedding_roc.png").stat().st_size > 1000
    scores = json.loads((out / "embedding_scores.json").read_text())
    assert len(scores["halves"]["members"]) == rep["n_members"]


@pytest.mark.parametrize("args, message", [
    (["--reference", "base", "--attacks", "halves,nope"], "unknown embedding attack"),
    (["--attacks", "prefix_lens"], "need a reference model"),
    (["--unit", "user"], "drop --interface embedding"),
])
def test_embedding_audit_command_refuses(lora_run, args, message, capsys):
    r = _mia(capsys, "--checkpoint", str(lora_run), "--interface", "embedding", "--no-progress", *args)
    assert r.returncode == 2 and message in r.stderr, r.stderr[-2000:]
