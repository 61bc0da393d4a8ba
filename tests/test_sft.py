"""Instruction and chat fine-tuning (dpllm.sft): record shapes, rendering, answer-only labels, and the privacy
path: a prompt token's own prediction adds exactly nothing to the clipped gradient (ghost, bk, hooks), and ε and
the report equal those of a plain-text run with the same N, batch, steps and σ."""

import copy
import json
import logging
import os
import re

import pytest
import torch

from dpllm import sft
from dpllm.config import DataConfig, PrivacyConfig, parse_config
from dpllm.data import DataError, load_records_and_users, make_splits
from dpllm.privacy.engine import make_private
from dpllm.privacy.plan import PrivacyPlan
from dpllm.train import forward_loss, train
from tests.helpers import tiny_model

CHATS = [
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is DP?"},
     {"role": "assistant", "content": "A bound on what one record can change."}],
    [{"role": "user", "content": "Name a sampler."}, {"role": "assistant", "content": "Poisson."},
     {"role": "user", "content": "Why?"}, {"role": "assistant", "content": "Its amplification is tight."}],
    [{"role": "user", "content": "What does clipping do?"}, {"role": "assistant", "content": "Bounds a gradient."}],
    [{"role": "user", "content": "def f(x): return x + 1 -- what is f(2)?"}, {"role": "assistant", "content": "3"}],
]


def chat_records():
    return [sft.canonical({"messages": m}, "messages", where="test") for m in CHATS]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---- shapes and files -------------------------------------------------------------------------------------

def test_every_file_kind_reads_the_same_records(tmp_path):
    import datasets

    rows = [{"prompt": f"Q{i}: what is {i} + {i}?", "completion": f" {2 * i}", "user": f"u{i % 3}"} for i in range(12)]
    ds = datasets.Dataset.from_list(rows)
    paths = {"jsonl": write_jsonl(tmp_path / "d.jsonl", rows), "csv": tmp_path / "d.csv",
             "parquet": tmp_path / "d.parquet", "disk": tmp_path / "saved"}
    ds.to_csv(str(paths["csv"]))
    ds.to_parquet(str(paths["parquet"]))
    ds.save_to_disk(str(paths["disk"]))
    got = {k: load_records_and_users(DataConfig(dataset=str(p), min_chars=1, privacy_unit="user"))
           for k, p in paths.items()}
    first = got["jsonl"]
    assert len(first[0]) == 12 and sft.format_of(first[0]) == "prompt_completion"
    assert json.loads(first[0][3]) == {"prompt": "Q3: what is 3 + 3?", "completion": " 6"}
    assert first[1][:3] == ["u0", "u1", "u2"]
    for k, v in got.items():
        assert v == first, k


def test_messages_jsonl_and_csv_cells(tmp_path):
    recs = load_records_and_users(DataConfig(dataset=str(write_jsonl(tmp_path / "c.jsonl",
                                                                     [{"messages": m} for m in CHATS]))))[0]
    assert recs == chat_records() and sft.format_of(recs) == "messages"
    import datasets

    datasets.Dataset.from_list([{"messages": json.dumps(m)} for m in CHATS]).to_csv(str(tmp_path / "c.csv"))
    assert load_records_and_users(DataConfig(dataset=str(tmp_path / "c.csv")))[0] == recs


def test_bad_shapes_get_one_line_errors(tmp_path):
    both = write_jsonl(tmp_path / "both.jsonl", [{"messages": CHATS[0], "prompt": "a", "completion": "b"}])
    with pytest.raises(DataError, match="set data_format"):
        load_records_and_users(DataConfig(dataset=str(both)))
    text = write_jsonl(tmp_path / "t.jsonl", [{"text": "x" * 40}])
    with pytest.raises(DataError, match=r"data_format=messages needs the column\(s\) \['messages'\]"):
        load_records_and_users(DataConfig(dataset=str(text), data_format="messages"))
    no_answer = write_jsonl(tmp_path / "n.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(DataError, match="record 1 has no assistant turn"):
        load_records_and_users(DataConfig(dataset=str(no_answer)))
    bad_role = write_jsonl(tmp_path / "r.jsonl", [{"messages": [{"role": "bot", "content": "hi"}]}])
    with pytest.raises(DataError, match="role in"):
        load_records_and_users(DataConfig(dataset=str(bad_role)))


def test_builtin_stdlib_qa():
    recs, users = load_records_and_users(DataConfig(dataset="stdlib_qa", privacy_unit="user"))
    assert len(recs) > 500 and len(set(users)) > 50 and sft.format_of(recs) == "messages"
    msgs = {json.loads(r)["messages"][0]["content"]: json.loads(r)["messages"][1]["content"] for r in recs}
    assert msgs["What does textwrap.dedent(text) do?"].startswith("Remove any common leading whitespace")


def test_stdlib_qa_is_the_same_records_in_every_process():
    """A default's repr can name an address or live state (``<object object at 0x7f...>``, logging.shutdown's list
    of handlers); in a record's text it changed the keyed hash, so max_records and the split chose other records
    in another process (a resumed run, a CI worker). Another process, other imports, another hash seed: the same."""
    import hashlib
    import subprocess
    import sys
    from pathlib import Path

    from dpllm.sft.records import stdlib_qa_rows

    rows = stdlib_qa_rows()
    digest = hashlib.sha256(json.dumps(rows).encode()).hexdigest()
    child = ("import hashlib, json\nfrom dpllm.sft.records import stdlib_qa_rows\n"
             "print(hashlib.sha256(json.dumps(stdlib_qa_rows()).encode()).hexdigest())")
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "12345"}, cwd=Path(__file__).parents[1])
    assert out.stdout.strip() == digest
    assert not any(re.search(r"0x[0-9a-f]{6,}", r["messages"][0]["content"]) for r in rows)


# ---- rendering and labels ---------------------------------------------------------------------------------

def test_answer_only_labels_cover_exactly_the_assistant_turns():
    tok = sft.load_tokenizer(parse_config([]).model)  # the tiny byte tokenizer: the built-in template
    sft.prepare_tokenizer(tok, None, needed=True)
    assert tok.chat_template == sft.SIMPLE_TEMPLATE
    rec = sft.parse(chat_records()[1])
    enc = sft.encode(rec, tok, max_length=512)
    ids, labels = enc["input_ids"], enc["labels"]
    answer = labels != -100
    # the labelled tokens decode to the two answers, each closed by the end-of-text token
    runs, cur = [], []
    for i, a in zip(ids.tolist(), answer.tolist()):
        if a:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    runs += [cur] if cur else []
    assert [tok.decode(r) for r in runs] == ["Poisson.</s>", "Its amplification is tight.</s>"]
    assert tok.decode(ids) == tok.apply_chat_template(CHATS[1], tokenize=False)
    whole = sft.encode(rec, tok, max_length=512, loss_on="all")
    assert torch.equal(whole["labels"], ids) and torch.equal(whole["input_ids"], ids)


def test_plain_prompt_completion_gets_eos_on_the_answer():
    tok = sft.load_tokenizer(parse_config([]).model)
    enc = sft.encode({"prompt": "2+2=", "completion": "4"}, tok, max_length=64)
    assert tok.decode(enc["input_ids"]) == "2+2=4</s>"
    assert enc["labels"].tolist() == [-100] * 4 + tok("4")["input_ids"]  # "4" then </s>


def test_a_tokenizer_without_template_is_refused_by_name(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")),
                                  eos_token="[UNK]")
    sft.prepare_tokenizer(tok, None, needed=False)  # plain prompt/completion strings need no template
    with pytest.raises(DataError, match="set data.chat_template"):
        sft.prepare_tokenizer(tok, None, needed=True)
    # through the recipe: refused while reading the data, before any model is loaded (the folder has none)
    tok.save_pretrained(tmp_path / "model")
    data = write_jsonl(tmp_path / "c.jsonl", [{"messages": m} for m in CHATS])
    with pytest.raises(DataError, match=r"has no chat template .* set data.chat_template"):
        train(parse_config(["--dataset", str(data), "--model_name_or_path", str(tmp_path / "model"),
                            "--output_dir", str(tmp_path / "run")]))
    assert not (tmp_path / "run").exists()
    sft.prepare_tokenizer(tok, "simple", needed=True)
    assert tok.chat_template == sft.SIMPLE_TEMPLATE


def test_cut_off_answers_are_reported_and_dropped(caplog):
    tok = sft.load_tokenizer(parse_config([]).model)
    long_prompt = sft.canonical({"prompt": "x" * 80, "completion": "yes"}, "prompt_completion", where="t")
    short = sft.canonical({"prompt": "q", "completion": "yes"}, "prompt_completion", where="t")
    records = [long_prompt, short, short.replace("yes", "no"), long_prompt.replace("yes", "no"), short + " "]
    splits = make_splits(records, DataConfig(heldout_fraction=0.2))
    with caplog.at_level(logging.WARNING, logger="dpllm.sft"):
        dropped = sft.drop_cut_answers(records, splits, tok, max_length=60)
    assert dropped == [0, 3] and "lose their whole answer to max_length=60" in caplog.text
    assert not {0, 3} & set(splits.train + splits.heldout) and sorted(splits.train + splits.heldout) == [1, 2, 4]
    with pytest.raises(DataError, match="no answer token within max_length"):
        sft.SFTRecords([long_prompt], tok, max_length=60)


# ---- the private gradient ---------------------------------------------------------------------------------

def explicit_answer_grads(model, items):
    """Each record's gradient of the mean loss over its answer positions, from the unmasked per-token losses."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads, prompt_grad_norms = [], []
    for it in items:
        ids = it["input_ids"][None]
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids),
                       position_ids=torch.arange(ids.shape[1])[None]).logits
        per_token = torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:], reduction="none")
        answer = it["labels"][1:] != -100
        model.zero_grad()
        per_token[answer].mean().backward(retain_graph=True)
        grads.append([p.grad.detach().clone() for p in params])
        model.zero_grad()
        per_token[~answer][-1].backward()  # a prompt token's own prediction: a real gradient, kept out
        prompt_grad_norms.append(float(torch.sqrt(sum((p.grad ** 2).sum() for p in params))))
    return grads, prompt_grad_norms


@pytest.mark.parametrize("mode", ["ghost", "bk", "hooks"])
def test_prompt_tokens_add_nothing_to_the_clipped_sum(mode):
    model, tok = tiny_model("tiny-llama", "full")
    sft.prepare_tokenizer(tok, None, needed=True)
    train_ds, _, collate = sft.make_datasets(chat_records(), [], tok, DataConfig(max_length=128))
    items = [train_ds[i] for i in range(len(train_ds))]
    per_record, prompt_norms = explicit_answer_grads(copy.deepcopy(model), items)
    assert min(prompt_norms) > 1e-3  # the masked predictions do have gradients: the test can fail
    norms = torch.stack([torch.sqrt(sum((g ** 2).sum() for g in gs)) for gs in per_record])
    cfg = PrivacyConfig(max_grad_norm=float(norms.median()), grad_sample_mode=mode)
    weights = torch.clamp(cfg.max_grad_norm / norms, max=1.0)
    expected = [sum(w * gs[j] for w, gs in zip(weights, per_record)) for j in range(len(per_record[0]))]

    n = len(train_ds)
    plan = PrivacyPlan(num_records=n, sample_rate=1.0, steps=1, noise_multiplier=0.0, delta=1e-5, accountant="rdp",
                       expected_batch_size=n)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    pt = make_private(model=model, optimizer=opt, dataset=train_ds, collate_fn=collate, cfg=cfg, plan=plan,
                      logical_batch_size=n)
    assert pt.grad_sample_mode == mode
    pt.optimizer.zero_grad()
    forward_loss(pt.model, collate(items), pt.criterion).backward()  # padded together, prompts masked
    pt.optimizer.pre_step()
    got = [p.grad.detach().clone() * n for p in pt.optimizer.params]
    for g, e in zip(got, expected):
        assert torch.allclose(g, e, rtol=1e-4, atol=1e-6), (g - e).abs().max()


# ---- end to end -------------------------------------------------------------------------------------------

def _run(tmp_path, name, dataset, *extra):
    return train(parse_config([
        "--dataset", str(dataset), "--output_dir", str(tmp_path / name), "--max_steps", "3",
        "--logical_batch_size", "8", "--physical_batch_size", "4", "--noise_multiplier", "1.1",
        "--finetuning", "lora", "--max_length", "96", "--min_chars", "1",
        "--eval_every", "0", "--progress", "false", "--tiny_hidden_size", "32", "--reproducible_noise", "true",
        "--num_generations", "2", "--eval_max_records", "8", *extra]))


def test_sft_run_has_the_epsilon_and_report_of_a_text_run(tmp_path, caplog):
    from dpllm.privacy.report import PrivacyReport

    caplog.set_level(logging.INFO, logger="dpllm.train")

    chats = [[{"role": "user", "content": f"What is {i} times 3?"}, {"role": "assistant", "content": f"{3 * i}."}]
             for i in range(40)]
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in chats])
    text = write_jsonl(tmp_path / "text.jsonl", [{"text": f"{i} times 3 is {3 * i}."} for i in range(40)])
    # each record's split is a keyed hash of its text, so the two files hold out different numbers of records
    # under one key: take the first key that gives both the same number of training records (same N, same q)
    def n_train(path, seed):
        cfg = DataConfig(dataset=str(path), min_chars=1, split_seed=seed)
        return len(make_splits(load_records_and_users(cfg)[0], cfg).train)

    seed = next(k for k in range(200) if n_train(chat, k) == n_train(text, k))
    s_chat, s_text = (_run(tmp_path, "chat", chat, "--split_seed", str(seed)),
                      _run(tmp_path, "text", text, "--split_seed", str(seed)))
    r_chat, r_text = PrivacyReport.read(s_chat["run_dir"]).to_dict(), PrivacyReport.read(s_text["run_dir"]).to_dict()
    assert r_chat["epsilon"] == r_text["epsilon"] and 0 < r_chat["epsilon"] < 100
    differ = {"stages", "base_model", "versions", "data"}  # which data and where (data: its token counts)
    assert {k: v for k, v in r_chat.items() if k not in differ} == {k: v for k, v in r_text.items() if k not in differ}
    splits = json.loads((tmp_path / "chat" / "splits.json").read_text())
    assert splits["sft"] == {"format": "messages", "loss_on": "answer", "dropped_no_answer": []}
    # the detected shape and the held-out loss reach the operator's console, labelled private (issue 32 item 4)
    assert "[private] data format: messages records, loss on answer tokens" in caplog.text
    assert "[private] data format: plain text, loss on all tokens" in caplog.text
    assert "[private] eval step 3: held-out loss" in caplog.text
    gens = [json.loads(x) for x in (tmp_path / "chat" / "generations.jsonl").read_text().splitlines()]
    assert len(gens) == 2 and gens[0]["prompt"].endswith("<|assistant|>\n") and "generated" in gens[0]
    from dpllm.checkpoint import load_model

    assert load_model(tmp_path / "chat" / "checkpoint")[1].chat_template == sft.SIMPLE_TEMPLATE


def test_sft_canaries_are_answers_and_audits_score_the_answer(tmp_path):
    """One DP run on chat data with canaries: ``mia audit`` and ``mia canaries`` score answer tokens only."""
    from mia.__main__ import main as mia_main
    from mia.audit import canary_audit, load_run_model
    from mia.signals import compute_signals

    chats = [[{"role": "user", "content": f"What is {i} times 3?"}, {"role": "assistant", "content": f"{3 * i}."}]
             for i in range(40)]
    _run(tmp_path, "chat", write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in chats]),
         "--num_canaries", "4", "--canary_design", "rare")
    run = tmp_path / "chat"
    canaries = json.loads((run / "canaries.json").read_text())["canaries"]
    model, tok = load_run_model(run)
    rep = canary_audit(run, model, tok, max_length=96, progress=False)
    assert rep["m"] == 4 and "given the prefix as prompt" in rep["scored"]
    # the score is the answer's (the secret's) mean log-probability, computed here by hand
    c = canaries[0]
    enc = sft.encode(sft.parse(sft.canary_record(c, "messages")), tok, max_length=96)
    ids = enc["input_ids"][None]
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), -1)
    answer = enc["labels"][1:] != -100
    by_hand = logp.gather(-1, ids[0, 1:, None])[:, 0][answer]
    assert answer.sum() == len(tok(c["text"][len(c["prefix"]):], add_special_tokens=False)["input_ids"]) + 1  # + </s>
    assert rep["scores"][0] == pytest.approx(float(by_hand.mean()), abs=1e-4)
    # mia audit: every signal covers the answer tokens only
    record = sft.canonical({"messages": chats[0]}, "messages", where="t")
    sig = compute_signals(model, tok, [record], max_length=96, progress=False)
    assert sig.num_tokens[0] == len(tok("0.", add_special_tokens=False)["input_ids"]) + 1
    assert mia_main(["audit", "--checkpoint", str(run), "--attacks", "loss,mink", "--n-bootstrap", "10",
                     "--no-progress"]) == 0
    audit = json.loads((run / "audit" / "mia_report.json").read_text())
    assert audit["n_members"] == 32 and audit["attacks"]["loss"]["auc"] is not None


def test_dptrainer_trains_on_a_messages_dataset(tmp_path):
    """A TRL-style user: an untokenized ``messages`` dataset straight into DPTrainer."""
    from datasets import Dataset
    from transformers import TrainingArguments

    from dpllm.hf import DPTrainer, PrivacyArguments
    from dpllm.sft import SFTArguments

    model, tok = tiny_model("tiny-llama", "full", dp=False)
    chats = [[{"role": "user", "content": f"What is {i} plus {i}?"}, {"role": "assistant", "content": f"{2 * i}."}]
             for i in range(30)]
    chats.append([{"role": "user", "content": "x" * 200}, {"role": "assistant", "content": "cut off"}])
    train_ds = Dataset.from_list([{"messages": m} for m in chats[:24] + chats[30:]])
    eval_ds = Dataset.from_list([{"messages": m} for m in chats[24:30]])
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), max_grad_norm=0.0, report_to="none", disable_tqdm=True,
                             use_cpu=True, max_steps=2, per_device_train_batch_size=4, learning_rate=1e-3)
    trainer = DPTrainer(model=model, args=args, train_dataset=train_ds, eval_dataset=eval_ds, processing_class=tok,
                        privacy_args=PrivacyArguments(noise_multiplier=1.0, logical_batch_size=8, accountant="rdp",
                                                      reproducible_noise=True),
                        sft_args=SFTArguments(max_length=96, num_generations=1))
    out = trainer.train()
    # The answer-only held-out loss stays in the private run directory (never in the returned metrics).
    summary = json.loads((tmp_path / "hf" / "run_summary.json").read_text())
    assert 0 < out.metrics["epsilon"] < 100 and "eval_loss" not in out.metrics and summary["final_eval_loss"] > 0
    assert trainer.privacy_report.num_records == 24  # the cut-off record was dropped before the plan
    records = [json.loads(x)["text"] for x in (tmp_path / "hf" / "records.jsonl").read_text().splitlines()]
    assert sft.format_of(records) == "messages" and len(records) == 30
    # audits and synthesis render and score the records as chats, as a config-driven SFT run's do
    from mia.audit import run_sft_format

    splits = json.loads((tmp_path / "hf" / "splits.json").read_text())
    assert splits["sft"]["format"] == "messages" and splits["sft"]["loss_on"] == "answer"
    assert run_sft_format(tmp_path / "hf") == "messages"
    assert len((tmp_path / "hf" / "generations.jsonl").read_text().splitlines()) == 1
    train_rows = trainer.dp_run.train_rows
    assert all((r["labels"][:10] == -100).all() for r in train_rows.items)  # "<|user|>\nWhat" is never a label


def test_sft_study_quick(tmp_path):
    """recipes/sft_study.py end to end in quick mode: base, DP and non-DP answer perplexity, AUC, generations."""
    from tests.helpers import load_recipe

    res = load_recipe("sft_study").main(["--quick", "--output_dir", str(tmp_path / "runs"),
                                         "--results", str(tmp_path / "res")])
    assert res["dp"]["epsilon"] <= 8.0 + 1e-6 and res["dp"]["steps"] == 2
    assert res["base"]["answer_ppl"] > 1 and res["dp"]["answer_ppl"] > 1 and res["no_dp"]["answer_ppl"] > 1
    assert 0 <= res["dp"]["loss_attack"]["auc"] <= 1 and len(res["generations"]["dp"]) == 1
    saved = json.loads((tmp_path / "res" / "result.json").read_text())
    assert saved["dp"]["answer_ppl"] == res["dp"]["answer_ppl"]
    assert "| + SFT with DP |" in (tmp_path / "res" / "README.md").read_text()


def test_mia_reads_chat_jsonl_as_records(tmp_path):
    from mia.audit import read_texts

    path = write_jsonl(tmp_path / "m.jsonl",
                       [{"messages": m} for m in CHATS[:2]] + [{"prompt": "a", "completion": "b"}])
    texts = read_texts(path)
    assert texts[:2] == chat_records()[:2] and json.loads(texts[2]) == {"prompt": "a", "completion": "b"}


def test_user_level_chat_run(tmp_path):
    """privacy_unit=user on chat records: a user's conversations stay whole records, the unit is the user."""
    from dpllm.privacy.report import PrivacyReport

    rows = [{"messages": [{"role": "user", "content": f"What is {i} times 3?"},
                          {"role": "assistant", "content": f"{3 * i}."}], "user": f"u{i % 20}"} for i in range(60)]
    _run(tmp_path, "users", write_jsonl(tmp_path / "u.jsonl", rows), "--privacy_unit", "user",
         "--grad_sample_mode", "bk", "--max_records_per_user", "2", "--num_generations", "0")
    report = PrivacyReport.read(tmp_path / "users").to_dict()
    splits = json.loads((tmp_path / "users" / "splits.json").read_text())
    assert report["privacy_unit"] == "user" and report["user_level"]["num_users"] == len(splits["users"]["train"])
    assert splits["sft"]["format"] == "messages" and len(splits["train"]) == 2 * len(splits["users"]["train"])
    assert not (tmp_path / "users" / "generations.jsonl").exists()


def test_held_out_prompts_and_references_stay_in_the_run_directory(tmp_path, caplog, capsys):
    """Held-out prompts and reference answers are private records (issue 49, item 5): generations.jsonl holds
    them, the console gets one [private] line naming the file and none of their text."""
    from dpllm import rundir

    model, tok = tiny_model()
    held_out = {"prompt": "Patient 4711 reports chest pain since", "completion": " Tuesday; her ECG was normal."}
    caplog.set_level(logging.DEBUG)
    rundir.write_generations(tmp_path, model, tok, [json.dumps(held_out)])
    shown = caplog.text + "".join(capsys.readouterr())
    row = json.loads((tmp_path / "generations.jsonl").read_text())
    assert row["prompt"] == held_out["prompt"] and row["reference"] == held_out["completion"]
    assert "4711" not in shown and "ECG" not in shown
    assert caplog.messages == [f"[private] greedy answers to 1 held-out prompt(s), beside their references: "
                               f"{tmp_path / 'generations.jsonl'}"]
