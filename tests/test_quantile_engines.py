"""clipping: quantile beyond one bk/hooks/ghost process: DPTrainer, FSDP2 and multi-process Opacus modes (the count
summed over processes, noised once), and the refusals that stay (with their reasons)."""

from __future__ import annotations

import json

import pytest

from tests.helpers import TEXTS, tiny_model

# ---- DPTrainer ---------------------------------------------------------------------------------------------

def test_dptrainer_runs_quantile_clipping_resumes_its_c_and_reports_it(tmp_path, capsys):
    from datasets import Dataset
    from transformers import TrainerCallback, TrainingArguments

    from dpllm import ledger
    from dpllm.compliance import cli_main
    from dpllm.hf import DPTrainer, PrivacyArguments
    from dpllm.privacy.quantile import gradient_noise_multiplier

    texts = [f"{t} (record {i})" for i in range(4) for t in TEXTS]

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 3:
                raise KeyboardInterrupt

    def run(out, *, callbacks=(), resume=None):
        model, tok = tiny_model(finetuning="lora")
        ds = Dataset.from_dict({"text": texts}).map(lambda b: tok(b["text"], truncation=True, max_length=48),
                                                    batched=True)
        args = TrainingArguments(output_dir=str(out), report_to="none", disable_tqdm=True, use_cpu=True, max_steps=4,
                                 save_steps=2, per_device_train_batch_size=4, seed=3)
        privacy = PrivacyArguments(target_epsilon=None, noise_multiplier=0.8, accountant="rdp", logical_batch_size=8,
                                   reproducible_noise=True, clipping="quantile", per_sample_max_grad_norm=0.01,
                                   target_quantile=0.7, quantile_lr=0.3, count_noise_multiplier=1.5)
        trainer = DPTrainer(model=model, args=args, privacy_args=privacy, train_dataset=ds, processing_class=tok,
                            callbacks=list(callbacks))
        return trainer, trainer.train(resume_from_checkpoint=resume)

    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        run(out, callbacks=[StopAt()])
    saved = json.loads((out / "checkpoints" / "step-000002" / "trainer_state.json").read_text())["clipping"]
    assert saved["steps"] == 2 and saved["clip"] > 0.01  # every norm is far above 0.01: C grew
    resumed, result = run(out, resume=True)
    a = resumed.privacy_report.adaptive_clipping
    lines = [json.loads(x) for x in (out / "privacy_ledger.jsonl").read_text().splitlines()]
    resumes = [e for e in lines if e["kind"] == "resume"]
    # the resumed run continued from the saved C and step count, not from per_sample_max_grad_norm
    assert len(resumes) == 1 and resumes[0]["adaptive_clipping"]["final_max_grad_norm"] == saved["clip"]
    assert resumes[0]["adaptive_clipping"]["steps"] == 2
    assert a["steps"] == 4 and a["final_max_grad_norm"] > saved["clip"]
    sigma = resumed.privacy_report.noise_multiplier
    assert sigma == 0.8 and resumed.privacy_report.history == [[0.8, 1 / 3, 4]]
    assert a["target_quantile"] == 0.7 and a["quantile_lr"] == 0.3 and a["count_noise_multiplier"] == 1.5
    assert a["initial_max_grad_norm"] == 0.01
    assert a["gradient_noise_multiplier"] == pytest.approx(gradient_noise_multiplier(0.8, 1.5))
    assert result.metrics["epsilon"] == resumed.privacy_report.epsilon
    verified = ledger.verify(out)  # ε recomputed from the history on every ledger line
    assert verified.ok, verified.message
    final = lines[-1]
    assert final["kind"] == "final" and final["adaptive_clipping"] == a
    capsys.readouterr()
    assert cli_main([str(out)]) == 0
    printed = capsys.readouterr().out
    line = [x for x in printed.splitlines() if x.startswith("clipping: C adapted")]
    assert len(line) == 1 and "0.7 quantile" in line[0] and "σ = 0.8, the σ accounted" in line[0]
