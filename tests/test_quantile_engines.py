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


# ---- units other than a record: a user (ULS), a long record over its windows; ELS; QLoRA -----------------------

UNIT_RUNS = {
    "uls_hooks": ["--privacy_unit", "user", "--max_records_per_user", "4", "--user_sampling", "uls",
                  "--grad_sample_mode", "hooks"],
    "uls_bk": ["--privacy_unit", "user", "--max_records_per_user", "4", "--user_sampling", "uls",
               "--grad_sample_mode", "bk"],
    "split_bk": ["--long_records", "split", "--max_windows", "4", "--grad_sample_mode", "bk", "--max_length", "16"],
}


@pytest.mark.parametrize("kind", list(UNIT_RUNS))
def test_a_unit_of_several_rows_enters_the_count_once(tmp_path, monkeypatch, kind):
    """A user (ULS: one clipped mean gradient per user) or a long record split into windows (one clipped sum over
    its windows) is one unit: its gradient is clipped once at C, so its centred bit must enter the count once, not
    once per row; one unit then moves the sum by ≤ C and the count by ½, as a record does (the pair's argument in
    dpllm.privacy.quantile holds per unit). Counted per row, a unit of k rows would move the count by k/2."""
    from dpllm.config import parse_config
    from dpllm.privacy import quantile
    from dpllm.privacy.engine import PrivateTraining
    from dpllm.privacy.report import PrivacyReport
    from dpllm.train import train

    rows, units, counted, released = [], [], [], []
    real_set, real_weights, real_release = (PrivateTraining.set_users, quantile.QuantileClipping.weights,
                                            quantile.QuantileClipping.release_noised)

    def set_users(self, users, **kw):
        if list(users) != [-1]:  # -1: an empty share's stand-in row, not counted (skip_next)
            rows.append(len(users))
            units.append(len(set(users)))
        return real_set(self, users, **kw)

    def weights(self, norms):
        if not self._skip:
            counted.append(norms.numel())
        return real_weights(self, norms)

    def release(self, noised):
        released.append((self.count, sum(counted)))
        return real_release(self, noised)

    monkeypatch.setattr(PrivateTraining, "set_users", set_users)
    monkeypatch.setattr(quantile.QuantileClipping, "weights", weights)
    monkeypatch.setattr(quantile.QuantileClipping, "release_noised", release)
    out = tmp_path / kind
    train(parse_config([
        "--model_name_or_path", "tiny-llama", "--finetuning", "full", "--tiny_hidden_size", "32",
        "--tiny_num_layers", "1", "--max_records", "300", "--max_length", "32", "--max_steps", "3",
        "--logical_batch_size", "16", "--physical_batch_size", "8", "--eval_every", "0", "--eval_max_records", "8",
        "--target_delta", "1e-3", "--output_dir", str(out), "--progress", "false", "--reproducible_noise", "true",
        "--clipping", "quantile", "--max_grad_norm", "0.05", *UNIT_RUNS[kind]]))
    assert counted == units and sum(rows) > sum(units)  # one bit per unit, and some unit had several rows
    before = 0
    for count, seen in released:  # each step's count: ±½ per unit, nothing else
        assert abs(count) <= (seen - before) / 2 and (count - (seen - before) / 2) % 1 == 0
        before = seen
    report = PrivacyReport.read(out)
    a = report.adaptive_clipping
    assert a["steps"] == 3 and a["final_max_grad_norm"] != 0.05 and report.history[0][2] == 3
    if kind.startswith("uls"):  # the count's m is the expected number of users per batch, the unit sampled
        assert report.user_level is not None and report.expected_batch_size < 16
    assert a["count_noise_multiplier"] == pytest.approx(report.expected_batch_size / 20)


def test_els_and_qlora_run_quantile_clipping(tmp_path):
    """ELS samples records of the k-capped data and accounts a user as a group: each record's (clipped gradient,
    centred bit) moves the unit-noise pair by ≤ 1/σ, so a user's k records move it by ≤ k/σ, the shift the group
    accounting already assumes for the gradient alone. QLoRA trains LoRA adapters over a quantized base with bk:
    C adapts over the adapters' norms as without quantization."""
    from dpllm.config import parse_config
    from dpllm.privacy.report import PrivacyReport
    from dpllm.train import train

    common = ["--model_name_or_path", "tiny-llama", "--tiny_hidden_size", "32", "--tiny_num_layers", "1",
              "--max_records", "200", "--max_length", "32", "--max_steps", "2", "--logical_batch_size", "16",
              "--physical_batch_size", "8", "--eval_every", "0", "--eval_max_records", "8", "--target_delta", "1e-3",
              "--progress", "false", "--clipping", "quantile", "--max_grad_norm", "0.05"]
    train(parse_config([*common, "--finetuning", "full", "--output_dir", str(tmp_path / "els"), "--privacy_unit",
                        "user", "--max_records_per_user", "4", "--user_sampling", "els",
                        "--grad_sample_mode", "bk", "--noise_multiplier", "1.0"]))  # given σ: no mixture search
    els = PrivacyReport.read(tmp_path / "els")
    assert els.user_level is not None and els.adaptive_clipping["steps"] == 2
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        return
    train(parse_config([*common, "--finetuning", "lora", "--quantization", "nf4",
                        "--output_dir", str(tmp_path / "qlora")]))
    q = PrivacyReport.read(tmp_path / "qlora")
    assert q.grad_sample_mode == "bk" and q.adaptive_clipping["steps"] == 2
    assert q.adaptive_clipping["final_max_grad_norm"] > 0.05  # every adapter norm far above 0.05: C grew


# ---- a noise schedule: each step's pair split from that step's σ_t -------------------------------------------

def test_a_noise_schedule_splits_each_steps_sigma_and_refuses_a_count_noise_below_the_largest(tmp_path, monkeypatch):
    """Under a schedule the optimizer's σ changes per step (the trainer sets it; the accountant records it): the
    gradient's σ_g must follow that step's σ_t, or a step with a small σ_t would spend more than its σ_t. σ_b stays
    fixed and must exceed the largest σ_t/2 (σ₀ for a falling schedule), which the plan checks before loading."""
    from dpllm.config import parse_config
    from dpllm.privacy import quantile
    from dpllm.privacy.accounting import PrivacyPlanError
    from dpllm.privacy.report import PrivacyReport
    from dpllm.train import train

    split = []
    real = quantile.QuantileClipping.gradient_noise_multiplier
    monkeypatch.setattr(quantile.QuantileClipping, "gradient_noise_multiplier",
                        lambda self, sigma: split.append(sigma) or real(self, sigma))
    args = ["--model_name_or_path", "tiny-llama", "--finetuning", "full", "--tiny_hidden_size", "32",
            "--tiny_num_layers", "1", "--max_records", "120", "--max_length", "32", "--max_steps", "4",
            "--logical_batch_size", "16", "--physical_batch_size", "16", "--eval_every", "0", "--eval_max_records",
            "8", "--progress", "false", "--clipping", "quantile", "--max_grad_norm", "0.05", "--accountant", "rdp",
            "--noise_schedule", "linear", "--noise_schedule_end", "0.5", "--noise_schedule_pieces", "2",
            "--noise_multiplier", "1.6", "--count_noise_multiplier", "0.9"]
    train(parse_config([*args, "--output_dir", str(tmp_path / "run")]))
    report = PrivacyReport.read(tmp_path / "run")
    pieces = [tuple(h) for h in report.history]
    assert [s for s, _, _ in pieces] == [1.6, 0.8] and [t for _, _, t in pieces] == [2, 2]
    assert split == [1.6, 1.6, 0.8, 0.8]  # each step's σ_g from the σ_t the accountant recorded for it
    a = report.adaptive_clipping
    assert a["gradient_noise_multipliers"] == pytest.approx([quantile.gradient_noise_multiplier(s, 0.9)
                                                             for s in (1.6, 0.8)])
    assert a["gradient_noise_multiplier"] == a["gradient_noise_multipliers"][0] and a["steps"] == 4
    line = [x for x in report.details() if x.startswith("clipping:")][0]
    assert "following the schedule" in line and "that step's σ, the σ accounted" in line
    # σ_b = 0.7 exceeds the last piece's σ/2 = 0.4 but not σ₀/2 = 0.8: refused before anything is written
    with pytest.raises(PrivacyPlanError, match=r"count_noise_multiplier=0.7 is too small .* σ=1.6"):
        train(parse_config([*args[:-1], "0.7", "--output_dir", str(tmp_path / "refused")]))
    assert not (tmp_path / "refused").exists()
