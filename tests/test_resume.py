"""Crash safety: a run killed with SIGKILL and resumed is the uninterrupted run, step for step and bit for bit.

The accountant must count every step exactly once: the resumed run's report (steps, ε, history), its
ledger's ε at every checkpoint, and its final weights equal those of a run that never stopped.
"""

import json
import signal

import pytest
import torch

from dpllm import ledger
from dpllm.config import ConfigError, parse_config
from dpllm.train import train
from tests.helpers import forked_recipe, signal_when

RUN = ["--finetuning", "full", "--max_steps", "16", "--save_every", "2", "--logical_batch_size", "16",
       "--physical_batch_size", "8", "--max_length", "48", "--tiny_hidden_size", "32", "--tiny_num_heads", "2",
       "--max_records", "300", "--eval_every", "8", "--eval_max_records", "16", "--log_every", "4",
       "--progress", "false",
       # seeded noise (tests only): a resumed run is compared with a separate uninterrupted one, which with
       # secret noise would draw other noise; the resumed run restores its own generators either way
       "--reproducible_noise", "true",
       # the default accountant (PRV) at ε 2: nothing here depends on the accountant or ε's value, only on every
       # step being counted once (Opacus's RDP, which these runs used before, calibrated each in ~1 CPU-s)
       "--target_epsilon", "2"]


def run(out, *extra):
    return train(parse_config(["--output_dir", str(out), *RUN, *extra]))


def rows(run_dir):
    return [{k: v for k, v in json.loads(x).items() if k != "elapsed_s"}
            for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def ledger_eps(run_dir):
    return {e["step"]: e["epsilon"] for e in ledger.read(run_dir) if e["kind"] == "checkpoint"}


def kill_mid_run(killed, *extra, after="step-000004"):
    """Run the recipe into ``killed`` in a process of its own and SIGKILL it once checkpoint ``after`` is the latest.

    The process is forked from a server that imported torch, transformers and opacus once for the three cases
    (:func:`tests.helpers.forked_recipe`), not started afresh: the kill is what is tested, not the start-up."""
    stderr = killed.parent / f"{killed.name}.stderr"
    proc = forked_recipe(["--output_dir", str(killed), *RUN, *extra], stderr)
    latest = killed / "checkpoints" / "latest"
    # the pointer, not the directory: a kill between the rename and the pointer update resumes from step 2
    signal_when(proc, stderr, lambda: latest.is_file() and latest.read_text().strip() >= after, signal.SIGKILL,
                within=300, what=f"no checkpoint {after}")
    assert proc.exitcode == -signal.SIGKILL
    assert not (killed / "privacy_report.json").exists()  # it really died mid-way


# new-token canaries grow the vocabulary before training: the resumed run must grow it the same way
# a noise schedule's σ is a function of the step: the resumed run must continue it where the killed one stopped
# banded noise: the recurrence's past noise and the cyclic group's turn must continue where the killed run stopped
# (beside the canaries: one launch pair checks both)
@pytest.mark.parametrize("extra", [(), ("--num_canaries", "50", "--canary_design", "new_token", "--noise", "banded",
                                        "--bands", "4"),
                                   ("--noise_schedule", "linear", "--noise_schedule_pieces", "4")],
                         ids=["plain", "new_token_canaries_banded_noise", "noise_schedule"])
def test_sigkill_then_resume_equals_uninterrupted(tmp_path, extra):
    killed = tmp_path / "killed"
    kill_mid_run(killed, *extra)

    resumed = run(killed, "--resume_from", "latest", *extra)
    whole = run(tmp_path / "whole", *extra)
    assert resumed["resumed_from_step"] >= 4 and whole["resumed_from_step"] is None

    r1, r2 = (json.loads((d / "privacy_report.json").read_text()) for d in (killed, tmp_path / "whole"))
    assert r1["steps"] == r2["steps"] == 16
    pieces = (r1["noise_schedule"]["pieces_sigma_steps"] if "noise_schedule" in r1 else
              [[r1["noise_multiplier"], 16 if "correlated_noise" not in r1 else 4]])  # banded: ⌈16/4⌉ accounted
    assert len(pieces) == (4 if "noise_schedule" in r1 else 1)
    assert r1["epsilon"] == r2["epsilon"] and r1["history"] == r2["history"] == [[s, r1["sample_rate"], n]
                                                                                 for s, n in pieces]
    # the ledger saw every checkpoint's ε exactly as the uninterrupted run did: no step counted twice or skipped
    assert ledger_eps(killed) == ledger_eps(tmp_path / "whole")
    assert [e["kind"] for e in ledger.read(killed)].count("resume") == 1
    assert ledger.verify(killed).ok, ledger.verify(killed).message
    # RNG state (sampler, noise, torch/numpy/python) restored exactly: same metrics, bit-identical weights
    assert rows(killed) == rows(tmp_path / "whole")
    assert resumed["tokens_seen"] == whole["tokens_seen"]
    a = (killed / "checkpoint" / "model.safetensors").read_bytes()
    assert a == (tmp_path / "whole" / "checkpoint" / "model.safetensors").read_bytes()
    assert sorted(p.name for p in (killed / "checkpoints").glob("step-*")) == ["step-000014", "step-000016"]


@pytest.mark.parametrize("private", [True, False])
def test_crash_while_writing_a_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch, private):
    import dpllm.resume as R

    out = tmp_path / "run"
    extra = ["--max_steps", "6"] + ([] if private else ["--privacy.enabled", "false"])
    real_save = torch.save

    def failing_save(obj, path, *a, **kw):
        if ".step-000004." in str(path):  # inside the temp dir of the step-4 checkpoint
            raise OSError("disk full (injected)")
        return real_save(obj, path, *a, **kw)

    monkeypatch.setattr(R.torch, "save", failing_save)
    with pytest.raises(OSError, match="injected"):
        run(out, *extra)
    monkeypatch.setattr(R.torch, "save", real_save)
    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step-000002"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-000002"]  # no half-written step 4
    lines = ledger.read(out)
    assert [e["kind"] for e in lines] == ["stage", "checkpoint"]
    assert lines[-1]["checkpoint_sha256"] == ledger.dir_sha256(ckpts / "step-000002")  # untouched
    (ckpts / ".step-000004.abc.tmp").mkdir()  # what a SIGKILL mid-write would leave behind

    run(out, *extra, "--resume_from", "latest")
    assert not (ckpts / ".step-000004.abc.tmp").exists()
    assert ledger.verify(out).ok, ledger.verify(out).message
    run(tmp_path / "whole", *extra)
    a = (out / "checkpoint" / "model.safetensors").read_bytes()
    assert a == (tmp_path / "whole" / "checkpoint" / "model.safetensors").read_bytes()


def test_resume_refuses_another_config(tmp_path):
    out = tmp_path / "run"
    run(out, "--max_steps", "4")
    with pytest.raises(ConfigError, match=r"differs in train.learning_rate \(0.001 → 0.002\)"):
        run(out, "--max_steps", "4", "--resume_from", "latest", "--learning_rate", "0.002")
    with pytest.raises(ConfigError, match="not a checkpoint of output_dir"):
        run(tmp_path / "elsewhere", "--max_steps", "4", "--resume_from", str(out / "checkpoints" / "step-000004"))
    with pytest.raises(ConfigError, match="contradict"):
        run(out, "--max_steps", "4", "--resume_from", "latest", "--overwrite_output_dir", "true")


def test_resume_latest_without_checkpoints(tmp_path):
    out = tmp_path / "run"
    summary = run(out, "--max_steps", "2", "--save_every", "0", "--resume_from", "latest")  # nothing yet: fresh
    assert summary["steps"] == 2 and not (out / "checkpoints").exists()
    with pytest.raises(ConfigError, match="no resumable checkpoint"):
        run(out, "--max_steps", "2", "--save_every", "0", "--resume_from", "latest")


def test_staged_run_survives_a_crash(tmp_path, monkeypatch):
    import dpllm.resume as R
    from dpllm.privacy.accounting import compute_epsilon_history

    run(tmp_path / "stage1", "--max_steps", "3", "--save_every", "0", "--target_epsilon", "3")
    stage2 = ["--model_name_or_path", str(tmp_path / "stage1"), "--finetuning", "lora", "--max_steps", "4",
              "--target_epsilon", "5"]
    real_save = torch.save
    monkeypatch.setattr(R.torch, "save", lambda obj, path, *a, **kw: (_ for _ in ()).throw(OSError("injected"))
                        if ".step-000004." in str(path) else real_save(obj, path, *a, **kw))
    with pytest.raises(OSError, match="injected"):
        run(tmp_path / "stage2", *stage2)
    monkeypatch.setattr(R.torch, "save", real_save)
    run(tmp_path / "stage2", *stage2, "--resume_from", "latest")
    report = json.loads((tmp_path / "stage2" / "privacy_report.json").read_text())
    assert len(report["stages"]) == 2 and [h[2] for h in report["history"]] == [3, 4]
    assert 3.0 < report["epsilon"] <= 5.0
    assert report["epsilon"] == pytest.approx(compute_epsilon_history(history=report["history"], delta=1e-5,
                                                                      accountant="prv"))
    result = ledger.verify(tmp_path / "stage2")
    assert result.ok and "previous stage" in result.message, result.message


def _overwrite(path, offset, data):
    with open(path, "r+b") as fh:
        fh.seek(offset if offset >= 0 else path.stat().st_size + offset)
        fh.write(data)


def test_a_damaged_checkpoint_is_refused_in_one_line_naming_an_intact_earlier_one(tmp_path, capsys, monkeypatch):
    """A damaged safetensors header, or tensor bytes changed in place (which would load and end in a NaN loss),
    is refused before anything of the checkpoint is read: one line names the checkpoint, the file, and the newest
    earlier checkpoint that is intact (or says none is left)."""
    from dpllm import resume
    from tests.helpers import load_recipe

    out = tmp_path / "run"
    run(out, "--max_steps", "4")
    (out / "run_summary.json").unlink()  # as if killed after its last checkpoint: a resume would load it
    two, four = out / "checkpoints" / "step-000002", out / "checkpoints" / "step-000004"
    _overwrite(four / "model.safetensors", 8, b"\xff" * 8)  # the JSON header's first bytes
    capsys.readouterr()
    code = load_recipe("finetune_llm").cli(["--output_dir", str(out), *RUN, "--max_steps", "4",
                                            "--resume_from", "latest"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.strip() == (f"error: cannot resume from {four}: it was damaged after it was written (model.safetensors "
                           "does not match the sha256 recorded when the checkpoint was written); resume from the "
                           f"earlier intact checkpoint {two} instead (--resume_from {two})")

    def never(*args, **kwargs):
        raise AssertionError("a damaged checkpoint was read")

    monkeypatch.setattr(resume, "load", never)
    _overwrite(two / "model.safetensors", -4, b"\x00\x00\xc0\x7f")  # a float32 NaN in place of the last weight
    with pytest.raises(ConfigError, match=rf"^cannot resume from {two}: .*model.safetensors does not match.*; "
                                          "no earlier intact checkpoint is left; start over with "
                                          "--overwrite_output_dir true$"):
        run(out, "--max_steps", "4", "--resume_from", str(two))


def test_a_checkpoint_from_before_checksums_is_checked_against_its_ledger_line(tmp_path, monkeypatch):
    """Checkpoints written before sha256sums.json existed are checked against the ledger's checkpoint_sha256."""
    from dpllm import checksums

    out = tmp_path / "run"
    monkeypatch.setattr(checksums, "write", lambda directory: None)
    run(out, "--max_steps", "2")
    (out / "run_summary.json").unlink()
    ckpt = out / "checkpoints" / "step-000002"
    assert not checksums.has_sums(ckpt)
    _overwrite(ckpt / "optimizer.pt", -8, b"\x00" * 8)
    with pytest.raises(ConfigError, match=r"damaged after it was written \(its files do not match the "
                                          r"checkpoint_sha256 of its line in privacy_ledger.jsonl\); no earlier"):
        run(out, "--max_steps", "2", "--resume_from", "latest")


def test_a_damaged_checkpoint_names_the_fix_a_dptrainer_user_types(tmp_path):
    """Under DPTrainer the advice is its own argument, not the recipe's flag; a damaged earlier checkpoint is
    skipped for the newest intact one."""
    from dpllm import checksums, resume
    from dpllm.config import TRAINER_OPTIONS

    steps = [tmp_path / "checkpoints" / f"step-00000{i}" for i in (2, 4, 6)]
    for ckpt in steps:
        ckpt.mkdir(parents=True)
        (ckpt / "trainer_state.json").write_text("{}")
        (ckpt / "optimizer.pt").write_bytes(b"state")
        checksums.write(ckpt)
    (steps[2] / "optimizer.pt").unlink()
    (steps[1] / "optimizer.pt").write_bytes(b"stale")
    with pytest.raises(ConfigError) as err:
        resume.check_intact(steps[2], tmp_path, names=TRAINER_OPTIONS)
    assert str(err.value) == (f"cannot resume from {steps[2]}: it was damaged after it was written (optimizer.pt is "
                              f"missing); resume from the earlier intact checkpoint {steps[0]} instead "
                              f"(trainer.train(resume_from_checkpoint='{steps[0]}'))")


def test_a_seeded_resume_on_another_process_count_draws_no_noise_again(tmp_path, monkeypatch):
    """Issue 46, item 7c: under reproducible_noise a resume on another number of processes restores no noise
    state and keeps the generator it made, which was seeded as the fresh run's rank 0: it drew that rank's noise
    of step 1 on again. Now no noise draw after the resume equals one drawn before it.

    The checkpoint is written by one process and read as if two had written it (``rng_for_process`` sees two
    states), the path a 2 → 1 resume takes. Draws are compared to a tolerance: a repeated draw is the same
    generator state and so equal to the last bit; two streams differ by O(σC) in every coordinate."""
    import dpllm.resume as R

    draws = []
    real_normal, real_save, real_rng = torch.normal, torch.save, R.rng_for_process

    def spy(*args, generator=None, **kw):
        out = real_normal(*args, generator=generator, **kw)
        if generator is not None:  # Opacus's noise (the DP optimizers pass the run's noise generator)
            draws.append(out.detach().flatten().clone())
        return out

    monkeypatch.setattr(torch, "normal", spy)
    monkeypatch.setattr(R.torch, "save", lambda obj, path, *a, **kw: (_ for _ in ()).throw(OSError("injected"))
                        if ".step-000004." in str(path) else real_save(obj, path, *a, **kw))
    out, extra = tmp_path / "run", ["--max_steps", "6"]
    with pytest.raises(OSError, match="injected"):
        run(out, *extra)  # steps 1-4 drew noise; the latest checkpoint is step 2's
    before, draws[:] = list(draws), []
    monkeypatch.setattr(R.torch, "save", real_save)
    monkeypatch.setattr(R, "rng_for_process", lambda saved, world: real_rng(saved + saved[:1], world))
    assert run(out, *extra, "--resume_from", "latest")["resumed_from_step"] == 2
    after = list(draws)
    assert len(before) == len(after) and before  # 4 steps each, one draw per trainable tensor
    repeated = [(i, j) for i, a in enumerate(after) for j, b in enumerate(before)
                if a.shape == b.shape and torch.allclose(a, b)]
    assert repeated == []
