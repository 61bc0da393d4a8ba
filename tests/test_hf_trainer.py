"""dpllm.hf.DPTrainer: one step equals our engine's step, unsafe Trainer options are refused, and the example
script's run is the same privacy run as recipes/finetune_llm.py with the same config."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback, TrainingArguments

from dpllm.config import ConfigError
from dpllm.hf import DPTrainer, PrivacyArguments
from tests.helpers import TEXTS, load_recipe, tiny_model

SAFE = dict(report_to="none", disable_tqdm=True, use_cpu=True)  # max_grad_norm left at HF's 1.0: ignored


def _args(out, **kw):
    return TrainingArguments(output_dir=str(out), **{**SAFE, **kw})


def _dataset(tok, texts, max_length=48):
    ds = Dataset.from_dict({"text": list(texts)})
    return ds.map(lambda b: tok(b["text"], truncation=True, max_length=max_length), batched=True)


class Seen(TrainerCallback):
    def __init__(self):
        self.logs, self.steps, self.began, self.ended = [], 0, False, False

    def on_train_begin(self, args, state, control, **kw):
        self.began = True

    def on_step_end(self, args, state, control, **kw):
        self.steps += 1

    def on_log(self, args, state, control, logs=None, **kw):
        self.logs.append(dict(logs))

    def on_train_end(self, args, state, control, **kw):
        self.ended = True


# ---- one DPTrainer step is our engine's step -------------------------------------------------------------

@pytest.mark.parametrize("finetuning", ["full", "lora"])
def test_one_step_equals_engine_step(tmp_path, finetuning):
    """Same sampled batch and noise → the same clipped, noised update as make_private's optimizer step.

    DPTrainer splits the Poisson batch into physical batches of 3; the reference does one pass over the
    whole batch, built by dpllm's own tokenizer path. SGD at lr=1 makes the update the noised mean gradient.
    """
    from dpllm.data import TokenizedRecords, make_collate
    from dpllm.distributed import World
    from dpllm.privacy.engine import make_private
    from dpllm.privacy.plan import plan_privacy
    from dpllm.privacy.randomness import privacy_generators
    from dpllm.resume import config_key
    from dpllm.train import forward_loss

    model, tok = tiny_model(finetuning=finetuning)
    reference = copy.deepcopy(model)
    texts = [f"{t} (record {i})" for i in range(4) for t in TEXTS]  # 24 distinct records
    seen = Seen()
    trainer = DPTrainer(
        model=model, args=_args(tmp_path / "run", max_steps=1, optim="sgd", learning_rate=1.0,
                                lr_scheduler_type="constant", per_device_train_batch_size=3, seed=3),
        privacy_args=PrivacyArguments(target_epsilon=None, noise_multiplier=0.7, logical_batch_size=8,
                                      reproducible_noise=True),
        train_dataset=_dataset(tok, texts), processing_class=tok, callbacks=[seen])
    out = trainer.train()

    cfg = trainer.dp_run.cfg
    plan = plan_privacy(num_records=len(texts), logical_batch_size=8, steps=1, target_epsilon=None,
                        delta=cfg.privacy.target_delta, accountant="prv", noise_multiplier=0.7)
    gens = privacy_generators(reproducible=True, seed=3, stage=config_key(cfg), world=World(), device="cpu")
    ds = TokenizedRecords(texts, tok, 48)
    # Noise is drawn parameter by parameter in the optimizer's order: the Trainer's groups (weight decay first)
    decay = set(trainer.get_decay_parameter_names(reference))
    named = [(n, p) for n, p in reference.named_parameters() if p.requires_grad]
    opt = torch.optim.SGD([{"params": [p for n, p in named if n in decay]},
                           {"params": [p for n, p in named if n not in decay]}], lr=1.0)
    collate = make_collate(tok.pad_token_id)
    private = make_private(model=reference.train(), optimizer=opt, dataset=ds, collate_fn=collate, cfg=cfg.privacy,
                           plan=plan, logical_batch_size=8, noise_generator=gens["noise"],
                           sampling_generator=gens["sampling"])
    ids = next(iter(private.sampler))
    assert ids, "the reproducible draw happens to be empty; pick another seed"
    before = {n: p.detach().clone() for n, p in reference.named_parameters() if p.requires_grad}
    loss = forward_loss(private.model, collate([ds[i] for i in ids]), private.criterion)
    loss.backward()
    private.optimizer.step()

    trained = dict(trainer.model.named_parameters())
    moved = 0.0
    for name, p in reference.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(trained[name].detach(), p.detach(), rtol=1e-5, atol=1e-6)
            moved = max(moved, float((p.detach() - before[name]).abs().max()))
    assert moved > 1e-3  # the step did something (noise σ·C/B ≈ 0.09 per coordinate)

    # the accountant and the callbacks saw the same single step; ε reaches on_log
    assert private.history() == trainer.dp_run.private.history() == [(0.7, 1 / 3, 1)]
    assert out.global_step == 1 and out.metrics["epsilon"] == pytest.approx(private.epsilon())
    assert seen.began and seen.ended and seen.steps == 1
    assert [log["epsilon"] for log in seen.logs if "epsilon" in log] == [pytest.approx(private.epsilon())]
    # the model handed back is the plain model: no Opacus wrapper or hooks, generate() works
    assert trainer.model is model and not hasattr(next(model.parameters()), "grad_sample")
    assert not any(h for m in model.modules() for h in m._forward_hooks.values() if "opacus" in repr(h))
    with torch.no_grad():
        # min_new_tokens: the step's noise is fresh, and a greedy decode may pick </s> early (clean-clone CI of
        # 6397eaa: 5 tokens, not 6); the three tokens are asked for, not left to the draw
        gen = trainer.model.generate(input_ids=torch.tensor([[5, 6, 7]]), max_new_tokens=3, min_new_tokens=3,
                                     do_sample=False)
    assert gen.shape == (1, 6)


# ---- refusals ----------------------------------------------------------------------------------------------

REFUSED_ARGS = [
    ({"gradient_accumulation_steps": 4}, "gradient_accumulation_steps=4"),
    ({"train_sampling_strategy": "group_by_length"}, "group_by_length"),
    ({"train_sampling_strategy": "sequential"}, "train_sampling_strategy='sequential'"),
    ({"dataloader_drop_last": True}, "dataloader_drop_last"),
    ({"label_smoothing_factor": 0.1}, "label_smoothing_factor"),
    ({"neftune_noise_alpha": 5.0}, "neftune_noise_alpha"),
    ({"torch_compile": True}, "torch_compile"),
    ({"auto_find_batch_size": True}, "auto_find_batch_size"),
    ({"load_best_model_at_end": True, "eval_strategy": "steps", "save_strategy": "steps"}, "load_best_model_at_end"),
]


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(finetuning="lora")


@pytest.mark.parametrize("kw,named", REFUSED_ARGS, ids=[n for _, n in REFUSED_ARGS])
def test_unsafe_training_arguments_are_refused(tmp_path, tiny, kw, named):
    model, tok = tiny
    args = TrainingArguments(output_dir=str(tmp_path / "run"), **{**SAFE, **kw})
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace("[", r"\[")) as err:
        DPTrainer(model=model, args=args, train_dataset=_dataset(tok, TEXTS), processing_class=tok)
    assert "DPTrainer" in str(err.value) and ";" in str(err.value)  # names the option, then the fix
    assert not (tmp_path / "run").exists()


def test_trainers_default_max_grad_norm_is_ignored_with_one_warning(tmp_path, tiny, caplog):
    """TrainingArguments.max_grad_norm defaults to 1.0; DPTrainer takes it without a refusal and says once why
    it is not applied (the step-equality test above runs with it at 1.0: no batch-level clip happens)."""
    model, tok = tiny
    assert TrainingArguments(output_dir=str(tmp_path / "x")).max_grad_norm == 1.0
    with caplog.at_level("WARNING", logger="dpllm.hf.arguments"):
        DPTrainer(model=model, args=_args(tmp_path / "run"), train_dataset=_dataset(tok, TEXTS), processing_class=tok)
    said = [r.getMessage() for r in caplog.records if "max_grad_norm" in r.getMessage()]
    assert len(said) == 1 and "ignores TrainingArguments max_grad_norm=1" in said[0]
    assert "per_sample_max_grad_norm=1" in said[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="dpllm.hf.arguments"):
        DPTrainer(model=model, args=_args(tmp_path / "run", max_grad_norm=0.0), train_dataset=_dataset(tok, TEXTS),
                  processing_class=tok)
    assert not [r for r in caplog.records if "max_grad_norm" in r.getMessage()]


def test_errors_name_what_a_trainer_user_sets(tmp_path, tiny):
    """A DPTrainer user passes fields and arguments, not command-line flags: the messages say which."""
    model, tok = tiny
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("something of mine")
    trainer = DPTrainer(model=model, args=_args(out, max_steps=1), train_dataset=_dataset(tok, TEXTS),
                        processing_class=tok)
    with pytest.raises(ConfigError) as err:
        trainer.train()
    assert "PrivacyArguments(overwrite_output_dir=True)" in str(err.value)
    assert "trainer.train(resume_from_checkpoint=True)" in str(err.value) and "--" not in str(err.value)
    trainer = DPTrainer(model=model, args=_args(out, max_steps=1), train_dataset=_dataset(tok, TEXTS),
                        processing_class=tok)
    with pytest.raises(ConfigError) as err:
        trainer.train(resume_from_checkpoint=True)  # a directory with files but no checkpoint
    assert "TrainingArguments(save_steps=N) writes them" in str(err.value) and "--" not in str(err.value)
    assert (out / "notes.txt").read_text() == "something of mine"


def test_unsafe_trainer_inputs_are_refused(tmp_path, tiny):
    from torch.utils.data import IterableDataset
    from transformers import DataCollatorForLanguageModeling, DataCollatorWithFlattening

    model, tok = tiny
    ds = _dataset(tok, TEXTS)

    def make(**kw):
        base = dict(model=model, args=_args(tmp_path / "run"), train_dataset=ds, processing_class=tok)
        return DPTrainer(**{**base, **kw})

    with pytest.raises(ConfigError, match="DataCollatorWithFlattening packs"):
        make(data_collator=DataCollatorWithFlattening())
    masked = DataCollatorForLanguageModeling(tok, mlm=False)
    masked.mlm = True  # the byte tokenizer has no mask token to build one with mlm=True directly
    with pytest.raises(ConfigError, match="mlm=True"):
        make(data_collator=masked)
    with pytest.raises(ConfigError, match="compute_loss_func"):
        make(compute_loss_func=lambda outputs, labels, num_items_in_batch=None: outputs.loss)

    class Stream(IterableDataset):
        def __iter__(self):
            return iter([])

    with pytest.raises(ConfigError, match="no length or random access"):
        make(train_dataset=Stream())
    with pytest.raises(ConfigError, match="privacy_unit='group'"):
        make(privacy_args=PrivacyArguments(privacy_unit="group"))
    packing_args = _args(tmp_path / "run")
    packing_args.packing = True  # TRL's SFTConfig(packing=True)
    with pytest.raises(ConfigError, match="packing"):
        make(args=packing_args)
    with pytest.raises(ConfigError, match="processing_class"):
        make(processing_class=None)
    make(data_collator=DataCollatorForLanguageModeling(tok, mlm=False))  # plain padding collators are fine

    # refused at train(), before anything is written
    blocks = Dataset.from_dict({"input_ids": [list(range(3, 19))] * 12})  # group_texts-style blocks
    with pytest.raises(ConfigError, match="looks like packed data"):
        make(train_dataset=blocks).train()
    with pytest.raises(ConfigError, match="resume_from_checkpoint"):
        make(args=_args(tmp_path / "run", resume_from_checkpoint="somewhere"))
    with pytest.raises(ConfigError, match=r"learning_rate=-0.001 must be > 0"):
        make(args=_args(tmp_path / "run", learning_rate=-1e-3))  # at construction, not in torch's optimizer
    with pytest.raises(ConfigError, match="save_strategy='best'"):
        make(args=_args(tmp_path / "run", save_strategy="best", metric_for_best_model="loss"))
    with pytest.raises(ConfigError, match="optim='adafactor'"):
        make(args=_args(tmp_path / "run", optim="adafactor")).train()

    class OwnLoss(DPTrainer):
        def compute_loss(self, model, inputs, **kw):
            return model(**inputs).loss

    with pytest.raises(ConfigError, match="overrides compute_loss"):
        OwnLoss(model=model, args=_args(tmp_path / "run"), train_dataset=ds, processing_class=tok).train()
    assert not any((tmp_path / "run").iterdir())  # the Trainer's constructor makes output_dir; nothing is in it


# ---- save_steps: resumable checkpoints, and train(resume_from_checkpoint=True) continues from them ----------

class StopAt(TrainerCallback):
    """Ctrl-C after optimizer step ``step`` (after its checkpoint, as a kill between steps would be)."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.step:
            raise KeyboardInterrupt


def test_save_steps_writes_resumable_checkpoints_and_resume_continues(tmp_path):
    texts = [f"{t} (record {i})" for i in range(4) for t in TEXTS]

    def run(out, *, callbacks=(), resume=None):
        model, tok = tiny_model(finetuning="lora")  # the same initial model every time (seeded)
        trainer = DPTrainer(model=model, args=_args(out, max_steps=4, save_steps=2, per_device_train_batch_size=4,
                                                    seed=3),
                            privacy_args=PrivacyArguments(target_epsilon=None, noise_multiplier=0.8, accountant="rdp",
                                                          logical_batch_size=8, reproducible_noise=True),
                            train_dataset=_dataset(tok, texts), processing_class=tok, callbacks=list(callbacks))
        return trainer, trainer.train(resume_from_checkpoint=resume)

    out_dir = tmp_path / "run"  # both runs in the same place: the records' path is part of the seeded stream
    whole, _ = run(out_dir)
    assert sorted(p.name for p in (out_dir / "checkpoints").glob("step-*")) == ["step-000002", "step-000004"]
    out_dir.rename(tmp_path / "whole")
    with pytest.raises(KeyboardInterrupt, match="at step 3 of 4; the last resumable checkpoint is .*step-000002"):
        run(out_dir, callbacks=[StopAt(3)])
    assert (out_dir / "checkpoints" / "latest").read_text().strip() == "step-000002"
    resumed, out = run(out_dir, resume=True)
    assert out.global_step == 4 and resumed.dp_run.start_step == 2
    mine, theirs = dict(resumed.model.named_parameters()), dict(whole.model.named_parameters())
    for name, p in theirs.items():  # same batches and noise as the uninterrupted run
        torch.testing.assert_close(mine[name].detach(), p.detach())
    assert resumed.privacy_report.history == whole.privacy_report.history == [[0.8, 1 / 3, 4]]

    # the script re-run once more (a job restarted after it had finished): nothing runs, no callback fires, and
    # trainer.model is the finished run's final model
    seen = Seen()
    again, out = run(out_dir, callbacks=[seen], resume=True)
    assert out.global_step == 4 and out.metrics["epsilon"] == resumed.privacy_report.epsilon
    assert not seen.began and not seen.ended and seen.steps == 0
    final = dict(again.model.named_parameters())
    for name, p in mine.items():
        torch.testing.assert_close(final[name].detach(), p.detach())  # saved and loaded, not recomputed


# ---- the example script vs recipes/finetune_llm.py -----------------------------------------------------------

PRIVACY_FIELDS = ("enabled", "num_records", "steps", "logical_batch_size", "physical_batch_size", "epsilon", "delta",
                  "accountant", "target_epsilon", "noise_multiplier", "sample_rate", "expected_batch_size",
                  "max_grad_norm", "clipping", "sensitivity", "grad_sample_mode", "poisson_sampling", "noise_secret",
                  "history", "privacy_unit")


def test_example_script_report_equals_finetune_llm(tmp_path, capsys):
    """Same data, batches, steps and ε target through both entry points → the same q, steps, σ and ε; the
    example's run directory verifies, exports, and gives the audit its members and held-out records."""
    from dpllm import ledger
    from dpllm.data import load_split_texts
    from dpllm.export import export
    from dpllm.privacy.report import PrivacyReport

    common = ["--max_records", "120", "--max_steps", "3", "--logical_batch_size", "32", "--target_epsilon", "4"]
    load_recipe("finetune_llm").main([
        "--config", "recipes/configs/tiny/llama_lora_cpu.yaml", "--dataset", "pydoc", *common,
        "--physical_batch_size", "16", "--output_dir", str(tmp_path / "dpllm"), "--eval_every", "0",
        "--eval_max_records", "8", "--progress", "false"])
    result = load_recipe("hf_trainer_example").main([
        *common, "--per_device_train_batch_size", "16", "--learning_rate", "5e-3",
        "--output_dir", str(tmp_path / "hf"), "--report_to", "none", "--disable_tqdm", "true", "--use_cpu", "true"])
    printed = capsys.readouterr().out

    ours, hf = PrivacyReport.read(tmp_path / "dpllm"), PrivacyReport.read(tmp_path / "hf")
    assert {k: getattr(hf, k) for k in PRIVACY_FIELDS} == {k: getattr(ours, k) for k in PRIVACY_FIELDS}
    # 120 records, each held out by its own keyed hash at 0.2: both entry points train on the same ~96
    assert hf.num_records == len(load_split_texts(tmp_path / "dpllm", "train")) and 70 < hf.num_records < 115
    assert hf.steps == 3 and hf.epsilon <= 4
    assert result["metrics"]["epsilon"] == pytest.approx(ours.epsilon)
    assert len(result["dp"]) == len(result["base"]) == 3 and "base:" in printed and "DP:" in printed

    run = tmp_path / "hf"
    assert ledger.verify(run).ok
    assert sorted(load_split_texts(run, "train")) == sorted(load_split_texts(tmp_path / "dpllm", "train"))
    assert sorted(load_split_texts(run, "heldout")) == sorted(load_split_texts(tmp_path / "dpllm", "heldout"))
    bundle = export(run, tmp_path / "release")
    assert (bundle / "adapter_model.safetensors").is_file() and (bundle / "base_model").is_dir()
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train_rows = [m for m in metrics if m["split"] == "train"]
    assert [m["step"] for m in train_rows] == [3]  # logging_steps=500 (HF's default) > steps: the last step only
    assert train_rows[-1]["epsilon"] == pytest.approx(hf.epsilon)


@pytest.mark.slow
def test_example_script_under_accelerate_launch(tmp_path):
    """`accelerate launch --multi_gpu --num_processes 2` (gloo on CPU): one run directory, both processes in it."""
    import os
    import socket
    import subprocess
    import sys

    from dpllm import ledger

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    cmd = [accelerate, "launch", "--main_process_port", str(port), "--multi_gpu", "--num_processes", "2",
           os.path.join(root, "recipes", "hf_trainer_example.py"), "--output_dir", str(tmp_path / "run"),
           "--max_steps", "2", "--per_device_train_batch_size", "8", "--logical_batch_size",
           "32", "--max_records", "120", "--report_to", "none", "--disable_tqdm", "true", "--use_cpu", "true"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=root)
    assert res.returncode == 0, res.stderr[-4000:]
    assert json.loads((tmp_path / "run" / "run_summary.json").read_text())["world_size"] == 2
    assert ledger.verify(tmp_path / "run").ok


class Everything(TrainerCallback):
    """Whatever a report_to integration would upload: every on_log and on_evaluate payload."""

    def __init__(self):
        self.seen, self.evaluations = [], []

    def on_log(self, args, state, control, logs=None, **kw):
        self.seen.append(dict(logs or {}))

    def on_evaluate(self, args, state, control, metrics=None, **kw):
        self.seen.append(dict(metrics or {}))
        self.evaluations.append(dict(metrics or {}))


def test_held_out_losses_stay_in_the_private_run_directory(tmp_path, caplog, capsys):
    """Held-out records are private and their losses un-noised (issue #21, item 5): callbacks, the returned
    metrics and the export carry none of them, nor the held-out count (issue #32, item 4); metrics.jsonl keeps them,
    and the operator's console shows them on lines labelled [private] only."""
    import logging

    from dpllm.export import export

    model, tok = tiny_model()
    texts = [f"{t} (record {i})" for i in range(4) for t in TEXTS]
    cb = Everything()
    caplog.set_level(logging.INFO)
    trainer = DPTrainer(model=model, args=_args(tmp_path / "run", max_steps=2, eval_strategy="steps", eval_steps=1,
                                                logging_steps=1, per_device_train_batch_size=8),
                        privacy_args=PrivacyArguments(target_epsilon=8, logical_batch_size=8),
                        train_dataset=_dataset(tok, texts[:16]), eval_dataset=_dataset(tok, texts[16:]),
                        processing_class=tok, callbacks=[cb])
    out = trainer.train()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["split"] == "eval"]
    assert [r["step"] for r in evals] == [0, 1, 2] and all(r["loss"] > 0 for r in evals)
    bundle = export(tmp_path / "run", tmp_path / "bundle")
    private = {v for r in evals for v in (r["loss"], r["ppl"])}
    # callbacks learn that each evaluation happened, nothing computed from the 8 held-out records
    assert any("epsilon" in s for s in cb.seen) and cb.evaluations == [{}, {}, {}]
    for payload in cb.seen + [out.metrics]:  # what callbacks and the caller's metrics logging would upload
        assert not {k for k in payload if k.startswith("eval_")}, payload
        assert 8 not in payload.values() and not private & {v for v in payload.values() if isinstance(v, float)}
    console = (caplog.text + "".join(capsys.readouterr())).splitlines()
    labelled = "\n".join(line for line in console if "[private]" in line)
    assert "[private] data format: token rows, loss on all tokens" in labelled
    text = "\n".join(line for line in console if "[private]" not in line)
    text += "".join(p.read_text(errors="ignore") for p in bundle.iterdir() if not p.name.endswith(".safetensors"))
    for r in evals:  # the console's [private] lines show them; nothing else does, at full or printed precision
        assert f"held-out loss {r['loss']:.4f} nats/token" in labelled and "on 8 records" in labelled
        for shown in (repr(r["loss"]), repr(r["ppl"]), f"{r['loss']:.4f}"):
            assert shown not in text, shown
    # The training loss (un-noised, on sampled members) reaches callbacks and the result only when asked for.
    assert not any("loss" in s for s in cb.seen) and out.training_loss is None and "train_loss" not in out.metrics
    cb2 = Everything()
    trainer = DPTrainer(model=tiny_model()[0], args=_args(tmp_path / "run2", max_steps=1, logging_steps=1,
                                                          per_device_train_batch_size=8),
                        privacy_args=PrivacyArguments(target_epsilon=8, logical_batch_size=8, log_train_loss=True),
                        train_dataset=_dataset(tok, texts[:16]), processing_class=tok, callbacks=[cb2])
    out = trainer.train()
    assert any(s.get("loss", 0) > 0 for s in cb2.seen) and out.training_loss > 0
