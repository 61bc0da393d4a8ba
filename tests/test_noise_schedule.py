"""Noise schedules (dpllm.privacy.schedule): shapes, the history they give, and calibration against an
independent composition of their pieces."""

import doctest
import json

import pytest

from dpllm.privacy import accounting, schedule
from dpllm.privacy.schedule import NoiseSchedule, ScheduleError

Q, STEPS, DELTA = 0.05, 200, 1e-5


def test_doctests():
    assert doctest.testmod(schedule).failed == 0


def test_shapes():
    assert NoiseSchedule().multipliers() == [1.0]
    assert NoiseSchedule(kind="linear", end=0.2, pieces=5).multipliers() == pytest.approx([1, 0.8, 0.6, 0.4, 0.2])
    assert NoiseSchedule(kind="exponential", end=0.25, pieces=3).multipliers() == pytest.approx([1, 0.5, 0.25])
    s = NoiseSchedule(kind="linear", end=0.5, pieces=4)
    assert sum(s.lengths(203)) == 203 and s.lengths(203) == [51, 51, 51, 50]
    # The history of the first `done` steps is what the accountant holds mid-run (what a resume restores).
    full = s.history(1.0, Q, 203)
    for done in (1, 51, 52, 150, 203):
        part = s.history(1.0, Q, 203, done=done)
        assert sum(n for _, _, n in part) == done and part[:-1] == full[:len(part) - 1]
    assert [s.sigma_at(1.0, 203, step=i) for i in (0, 50, 51, 202)] == pytest.approx([1, 1, 5 / 6, 0.5])


@pytest.mark.parametrize("kwargs, message", [
    (dict(kind="cosine"), "choose one of constant, linear, exponential"),
    (dict(kind="linear", end=0.0), "noise_schedule_end=0.0"),
    (dict(kind="linear", pieces=1), "noise_schedule_pieces=1"),
])
def test_bad_schedules_are_refused(kwargs, message):
    with pytest.raises(ScheduleError, match=message):
        NoiseSchedule(**kwargs)


def test_too_few_steps_for_the_pieces():
    with pytest.raises(ScheduleError, match="at least 10 steps"):
        schedule.calibrate(NoiseSchedule(kind="linear", pieces=10), target_epsilon=8, delta=DELTA, sample_rate=Q,
                           steps=5, accountant="rdp")


def _independent_epsilon(history, accountant):
    # Opacus's accountant fed the pieces directly: no dpllm code between the schedule and the number.
    from opacus.accountants import create_accountant

    acc = create_accountant(mechanism=accountant)
    acc.history = list(history)
    return acc.get_epsilon(delta=DELTA)


@pytest.mark.parametrize("kind, end", [("linear", 0.5), ("exponential", 0.3), ("linear", 1.5)])
def test_calibrated_schedule_meets_the_target_by_independent_composition(kind, end):
    s = NoiseSchedule(kind=kind, end=end, pieces=4)
    # ε = 2 rather than 4: larger σ, whose RDP orders Opacus computes ~2x faster; the same 0.5% window
    sigma0 = schedule.calibrate(s, target_epsilon=2.0, delta=DELTA, sample_rate=Q, steps=STEPS, accountant="rdp")
    history = s.history(sigma0, Q, STEPS)
    assert len(history) == 4 and [h[0] for h in history] == pytest.approx([sigma0 * m for m in s.multipliers()])
    eps = _independent_epsilon(history, "rdp")
    assert eps <= 2.0 and eps > 2.0 - 0.01  # at the target, never over (tolerance 0.005 of the search)
    # Calibrated, not just safe: 1% less noise would miss the target.
    assert _independent_epsilon(s.history(sigma0 * 0.99, Q, STEPS), "rdp") > 2.0


def test_schedule_after_an_earlier_stage_and_under_prv():
    s = NoiseSchedule(kind="linear", end=0.5, pieces=3)
    prior = [(2.0, 0.1, 50)]
    sigma0 = schedule.calibrate(s, target_epsilon=6.0, delta=DELTA, sample_rate=Q, steps=60, accountant="prv",
                                prior_history=prior)
    eps = _independent_epsilon(prior + s.history(sigma0, Q, 60), "prv")
    assert 5.9 < eps <= 6.0 + 1e-9
    with pytest.raises(accounting.PrivacyPlanError, match="already spent"):
        schedule.calibrate(s, target_epsilon=0.1, delta=DELTA, sample_rate=Q, steps=60, accountant="prv",
                           prior_history=prior)


def test_training_follows_the_schedule_and_reports_it(tmp_path):
    from dpllm import ledger
    from dpllm.config import parse_config
    from dpllm.train import train

    out = tmp_path / "run"
    train(parse_config(["--output_dir", str(out), "--max_steps", "8", "--logical_batch_size", "16",
                        "--physical_batch_size", "16", "--max_length", "32", "--tiny_hidden_size", "32",
                        "--max_records", "120", "--eval_every", "0", "--progress", "false", "--accountant", "rdp",
                        "--target_epsilon", "1", "--noise_schedule", "exponential", "--noise_schedule_end", "0.25",
                        "--noise_schedule_pieces", "3"]))
    report = json.loads((out / "privacy_report.json").read_text())
    sigma0, q = report["noise_multiplier"], report["sample_rate"]
    # The accountant recorded the σ the optimizer noised with at every step: the schedule's three pieces.
    assert report["history"] == [[sigma0, q, 3], [sigma0 * 0.5, q, 3], [sigma0 * 0.25, q, 2]]
    assert report["noise_schedule"]["kind"] == "exponential"
    eps = _independent_epsilon([tuple(h) for h in report["history"]], "rdp")
    # ε = 1 rather than 4: a larger σ, whose RDP Opacus computes 2-3x faster; the same 0.5% window
    assert report["epsilon"] == pytest.approx(eps, rel=1e-9) and 0.995 < eps <= 1.0
    assert ledger.verify(out).ok
    assert "exponential schedule" in json.dumps(report) or "exponential" in report["noise_schedule"]["kind"]


def test_bad_schedule_option_is_refused_before_loading(tmp_path):
    from dpllm.config import ConfigError, parse_config, validate

    with pytest.raises(ConfigError, match="noise_schedule_pieces=1"):
        validate(parse_config(["--output_dir", str(tmp_path), "--noise_schedule", "linear",
                               "--noise_schedule_pieces", "1"]))


@pytest.mark.slow
def test_study_quick_mode(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "recipes/noise_schedule_study.py", "--output_dir", str(tmp_path), "--quick",
                        "--repeats", "1"], capture_output=True, text=True, cwd=root, timeout=1800)
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads((tmp_path / "results.json").read_text())
    assert len(data["table"]) == 4 and all(r["epsilon"] <= 8.0 for r in data["table"])
    assert (tmp_path / "noise_schedule.png").stat().st_size > 1000


def test_dpllm_plan_and_the_trainer_plan_a_schedule_alike():
    from dpllm.privacy.plan import plan_privacy
    from dpllm.privacy.planning import cli_main, plan_table

    s = NoiseSchedule(kind="linear", end=0.5, pieces=4)
    table = plan_table(num_records=4000, batch=200, delta=1e-5, target_epsilon=4.0, steps=60, accountant="rdp",
                       epsilons=[], schedule=s)
    trainer = plan_privacy(num_records=4000, logical_batch_size=200, steps=60, target_epsilon=4.0, delta=1e-5,
                           accountant="rdp", schedule=s)
    assert table["target"]["noise_multiplier"] == trainer.noise_multiplier
    assert table["target"]["pieces"] == [list(h) for h in trainer.history]
    assert table["target"]["epsilon"] == pytest.approx(trainer.epsilon()) and trainer.epsilon() <= 4.0
    assert cli_main(["--num-records", "4000", "--batch", "200", "--steps", "60", "--delta", "1e-5",
                     "--target-epsilon", "4", "--accountant", "rdp", "--noise-schedule", "linear",
                     "--schedule-pieces", "4", "--epsilons", ""]) == 0


def test_dptrainer_follows_a_schedule(tmp_path):
    from datasets import Dataset
    from transformers import TrainingArguments

    from dpllm.hf import DPTrainer, PrivacyArguments
    from tests.helpers import TEXTS, tiny_model

    model, tok = tiny_model("tiny-llama", "lora", dp=False)
    texts = [f"record {i}: " + TEXTS[i % len(TEXTS)][: 10 + i] for i in range(40)]
    train = Dataset.from_list([{"text": t, **tok(t, truncation=True, max_length=32)} for t in texts])
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), report_to="none", disable_tqdm=True, use_cpu=True,
                             max_steps=6, per_device_train_batch_size=8, learning_rate=1e-3)
    trainer = DPTrainer(model=model, args=args, train_dataset=train, processing_class=tok,
                        privacy_args=PrivacyArguments(target_epsilon=1.0, logical_batch_size=8, accountant="rdp",
                                                      noise_schedule="linear", noise_schedule_pieces=3))
    trainer.train()
    report = trainer.privacy_report
    s0, q = report.noise_multiplier, report.sample_rate
    assert [list(h) for h in report.history] == [[s0, q, 2], [s0 * 0.75, q, 2], [s0 * 0.5, q, 2]]
    assert 0.995 < report.epsilon <= 1.0 and report.noise_schedule["kind"] == "linear"
