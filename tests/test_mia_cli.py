"""End-to-end: overfit a tiny Llama, audit it with ``python -m mia``, audit canaries, bad inputs."""

import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import ByT5Tokenizer, LlamaConfig, LlamaForCausalLM

from mia import audit
from mia.__main__ import main

ROOT = Path(__file__).resolve().parents[1]
ALPHABET = list("abcdefghijklmnopqrstuvwxyz ")


def _random_texts(rng, n, length=24):
    return ["".join(rng.choice(ALPHABET, length)) for _ in range(n)]


@pytest.fixture(scope="module")
def overfit(tmp_path_factory):
    """A tiny Llama trained (no DP) on 8 members and the included half of 40 canaries."""
    rng = np.random.default_rng(0)
    members, nonmembers = _random_texts(rng, 8), _random_texts(rng, 8)
    canaries = _random_texts(rng, 40, length=16)
    included = rng.permutation(np.arange(40) < 20)  # 20 in, 20 out, in random positions
    train = members + [c for c, i in zip(canaries, included) if i]

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=384, hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                      intermediate_size=128, max_position_embeddings=128)
    model, tok = LlamaForCausalLM(cfg), ByT5Tokenizer()
    batch = tok(train, padding=True, return_tensors="pt")
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(80):  # full batch; memorises the 28 short strings: at step 80 the members' mean loss is 0.29 (the
        # non-members' 11.2), every included canary's ≤ 0.78 and every other's ≥ 8.6 (at 150 steps: 0.06, 15.3)
        loss = model(**batch, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()

    run = tmp_path_factory.mktemp("run")
    ckpt = run / "checkpoint"
    model.save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    (run / "canaries.json").write_text(json.dumps(
        {"canaries": [{"text": c, "included": bool(i)} for c, i in zip(canaries, included)],
         "seed": 0}))
    (run / "m.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in members))
    (run / "n.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in nonmembers))
    return types.SimpleNamespace(run=run, ckpt=ckpt, members=members, nonmembers=nonmembers,
                                 final_loss=loss.item())


def test_audit_cli_end_to_end(overfit, capsys):
    """`python -m mia audit` through its entry point (``mia.__main__.main``) in this process: a process of its own
    adds only start-up; tests/test_audit_pipeline.py and test_rough_edges.py run the command as a process."""
    from mia.__main__ import main
    from tests.helpers import in_process

    out = overfit.run / "audit"
    argv = ["audit", "--checkpoint", str(overfit.ckpt), "--members", str(overfit.run / "m.jsonl"), "--nonmembers",
            str(overfit.run / "n.jsonl"), "--attacks", "loss,zlib,mink,minkpp", "--out", str(out), "--n-bootstrap",
            "200", "--no-progress"]
    proc = in_process(main, argv, capsys)
    assert proc.returncode == 0, proc.stderr
    for name in ("mia_report.json", "mia_report.md", "mia_roc.png", "mia_scores.json"):
        assert (out / name).is_file()
    report = json.loads((out / "mia_report.json").read_text())
    assert set(report["attacks"]) == {"loss", "zlib", "mink", "minkpp"}
    assert report["attacks"]["loss"]["auc"] > 0.9
    assert report["attacks"]["loss"]["loss_gap"] > 0
    assert "| loss |" in (out / "mia_report.md").read_text()


def _write_privacy(run, epsilon):
    (run / "privacy_report.json").write_text(json.dumps({"epsilon": epsilon, "delta": 1e-5, "enabled": True,
                                                         "num_records": 100, "steps": 10}))


@pytest.fixture
def no_dpllm_loader(monkeypatch):
    # Exercise mia's own loader even once dpllm.checkpoint exists.
    monkeypatch.setitem(sys.modules, "dpllm.checkpoint", None)


def test_canaries_flag_a_privacy_bug(overfit, no_dpllm_loader, capsys):
    _write_privacy(overfit.run, 0.1)  # a claim the memorised canaries clearly refute
    code = main(["canaries", "--run", str(overfit.run), "--no-progress"])
    assert code == 1
    assert "PRIVACY BUG" in capsys.readouterr().err
    rep = json.loads((overfit.run / "audit" / "canary_report.json").read_text())
    assert rep["privacy_bug"] and rep["one_run"]["epsilon_lower"] > 0.1
    assert rep["m"] == 40 and rep["n_included"] == 20
    assert (overfit.run / "audit" / "canary_report.md").is_file()


def test_canaries_consistent_with_a_loose_epsilon(overfit, no_dpllm_loader):
    _write_privacy(overfit.run, 50.0)
    assert main(["canaries", "--run", str(overfit.run), "--no-progress",
                 "--out", str(overfit.run / "audit2")]) == 0
    rep = json.loads((overfit.run / "audit2" / "canary_report.json").read_text())
    assert rep["verdict"] == "consistent" and 0 < rep["epsilon_lower"] < 50


def test_run_directory_audit(overfit, no_dpllm_loader, monkeypatch):
    (overfit.run / "splits.json").write_text(json.dumps({"max_length": 64, "train": [], "heldout": []}))
    fake = types.ModuleType("dpllm.data")
    fake.load_split_texts = lambda run_dir, split: {"train": overfit.members,
                                                    "heldout": overfit.nonmembers}[split]
    monkeypatch.setitem(sys.modules, "dpllm.data", fake)
    try:
        assert main(["audit", "--checkpoint", str(overfit.run), "--attacks", "loss",
                     "--n-bootstrap", "0", "--no-progress"]) == 0
    finally:
        (overfit.run / "splits.json").unlink()
    rep = json.loads((overfit.run / "audit" / "mia_report.json").read_text())
    assert rep["max_length"] == 64 and rep["attacks"]["loss"]["auc"] > 0.9


def test_bad_inputs(overfit, tmp_path, capsys):
    m, n = overfit.run / "m.jsonl", overfit.run / "n.jsonl"
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    base = ["audit", "--checkpoint", str(overfit.ckpt), "--out", str(tmp_path / "o"), "--no-progress"]

    def fails(argv, pattern):
        assert main(base + argv) == 2
        assert pattern in capsys.readouterr().err

    fails(["--members", str(empty), "--nonmembers", str(n)], "need members and non-members")
    fails(["--members", str(m), "--nonmembers", str(m)], "both members and non-members")
    fails(["--members", str(m), "--nonmembers", str(n), "--attacks", "loss,ref"], "--reference")
    fails(["--members", str(m), "--nonmembers", str(n), "--attacks", "loss,nope"], "unknown attack 'nope'")
    fails(["--members", str(m), "--nonmembers", str(n), "--text-column", "body"], "--text-column")
    fails([], "not a run directory")

    no_tok = tmp_path / "no_tok"
    LlamaForCausalLM(LlamaConfig.from_pretrained(overfit.ckpt)).save_pretrained(no_tok)
    with pytest.raises(ValueError, match="has no tokenizer"):
        audit.load_target(no_tok)
    model, tok = audit.load_target(overfit.ckpt)
    with pytest.raises(ValueError, match="context of 128"):
        audit.run_audit(model, tok, ["z" * 200], ["q" * 10], attacks="loss", progress=False)
    with pytest.raises(ValueError, match="needs a reference model"):
        audit.run_audit(model, tok, ["abc"], ["def"], attacks=["ref"], progress=False)
    with pytest.raises(ValueError, match="canaries.json"):
        audit.read_canaries(tmp_path)
    # new-token canaries audited with a tokenizer that never had their tokens (another checkpoint)
    from dpllm.canaries import make

    (tmp_path / "canaries.json").write_text(json.dumps({"canaries": make(4, design="new_token")}))
    with pytest.raises(ValueError, match="4 of the run's 4 new-token canaries"):
        audit.check_canary_vocabulary(tmp_path, tok)
    tok.add_tokens([c["text"][1:] for c in make(4, design="new_token")], special_tokens=True)
    audit.check_canary_vocabulary(tmp_path, tok)
