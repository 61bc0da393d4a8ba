"""privacy.noise: banded through the entry points: the bk optimizer's noise, the recipe, its report and ledger,
the config's refusals and ``dpllm plan``. The math alone is in test_correlated_noise.py; SIGKILL + resume in
test_resume.py; two DDP processes in test_distributed.py."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from dpllm import ledger
from dpllm.config import ConfigError, parse_config
from dpllm.privacy import accounting
from dpllm.privacy.correlated.banded import BandMF

sys.path.insert(0, __import__("os").path.dirname(__file__))
from test_resume import RUN  # noqa: E402  the resume tests' tiny recipe run (seeded noise: runs are comparable)

SHORT = [*RUN[:RUN.index("--max_steps")], "--max_steps", "8", *RUN[RUN.index("--max_steps") + 2:]]


def test_bk_optimizer_adds_the_recurrence_of_its_own_draws():
    """LeanAccumulation draws z from its generator as for DP-SGD and adds x_t = (C⁻¹z)_t, parameter by parameter."""
    from opacus.optimizers.optimizer import _generate_noise

    from dpllm.privacy.bk.optimizer import LeanAccumulation

    lin = torch.nn.Linear(3, 2)
    strategy = BandMF.optimized(bands=3, steps=10)
    opt = LeanAccumulation(torch.optim.SGD(lin.parameters(), lr=0.0), noise_multiplier=0.7, max_grad_norm=2.0,
                           expected_batch_size=1, generator=torch.Generator().manual_seed(5))
    opt.recurrence = strategy.recurrence()
    got = []
    for _ in range(5):
        for p in opt.params:
            p.summed_grad = torch.zeros_like(p)
        opt.add_noise()
        got.append([p.grad.clone() for p in opt.params])
    g, mine = torch.Generator().manual_seed(5), strategy.recurrence()
    for step in got:
        for key, (p, noise) in enumerate(zip(opt.params, step)):
            want = mine.apply(key, _generate_noise(std=1.4, reference=p, generator=g))
            assert torch.allclose(noise, want, rtol=0, atol=1e-7)
        mine.end_step()
    assert opt.recurrence.step == 5 and len(opt.recurrence.history[0]) == 2
    assert not torch.allclose(got[1][0], got[0][0])


def _run(out, *extra):
    from dpllm.train import train

    return train(parse_config(["--output_dir", str(out), *SHORT, *extra]))


def test_a_banded_run_trains_reports_and_recomputes(tmp_path):
    _run(tmp_path / "banded", "--noise", "banded", "--bands", "4")
    out = tmp_path / "banded"
    r = json.loads((out / "privacy_report.json").read_text())
    c = r["correlated_noise"]
    assert (c["mechanism"], c["bands"], c["steps"], c["accounted_steps"]) == ("banded", 4, 8, 2)
    assert r["sample_rate"] == c["group_sample_rate"] == pytest.approx(4 / 15)  # q_b = b/⌈N/B⌉, N = 236, B = 16
    assert r["history"] == [[r["noise_multiplier"], r["sample_rate"], 2]]
    assert accounting.compute_epsilon_history(history=r["history"], delta=r["delta"],
                                              accountant=r["accountant"]) == pytest.approx(r["epsilon"], rel=1e-9)
    assert r["epsilon"] <= 8.0
    assert ledger.verify(out).ok
    # the past noise is secret: in the owner-only rng_state.pt under checkpoints/, never in the released checkpoint/
    saved = torch.load(out / "checkpoints" / "step-000008" / "rng_state.pt", weights_only=True)[0]
    assert len(saved["noise_recurrence"]["history"][0]) == 3
    assert (out / "checkpoints" / "step-000008" / "rng_state.pt").stat().st_mode & 0o077 == 0
    assert not any("rng" in p.name for p in (out / "checkpoint").iterdir())
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(row["loss"] == row["loss"] for row in rows if "loss" in row)  # finite: it trained
    from dpllm.privacy.report import PrivacyReport

    assert "4-banded correlated noise" in PrivacyReport.read(out).summary()
    from dpllm import compliance

    single = {i.name: i for i in compliance.check(out)}["single_epoch"]
    assert "= 2 (⌈8/4⌉ steps of its cyclic group) = 0.533 expected passes" in single.evidence
    from dpllm.export import model_card, release_report

    released = release_report(PrivacyReport.read(out))
    assert released.correlated_noise["accounted_steps"] == 2  # the bundle's report recomputes ε as the run's
    assert "4-banded matrix factorization" in model_card(released, lora=False, has_base=False)


def test_one_band_is_todays_dp_sgd_run_exactly(tmp_path, monkeypatch):
    """noise: banded with one band: the same batches and the same noise as independent noise, bit for bit."""
    from dpllm import resume

    # the seeded (test-only) noise is keyed by the config, which differs in privacy.noise: give both runs one key
    monkeypatch.setattr(resume, "config_key", lambda cfg: "one key")
    _run(tmp_path / "one", "--noise", "banded", "--bands", "1")
    _run(tmp_path / "dpsgd")
    a, b = (json.loads((tmp_path / n / "privacy_report.json").read_text()) for n in ("one", "dpsgd"))
    assert a["history"] == b["history"] and a["epsilon"] == b["epsilon"]
    assert a["correlated_noise"]["bands"] == 1 and "correlated_noise" not in b
    assert (tmp_path / "one" / "checkpoint" / "model.safetensors").read_bytes() == \
        (tmp_path / "dpsgd" / "checkpoint" / "model.safetensors").read_bytes()


@pytest.mark.parametrize("extra, words", [  # the reasons are checked in test_correlated_engines.py
    (("--grad_sample_mode", "ghost_fsdp"), "not built for grad_sample_mode=ghost_fsdp"),
    (("--noise_schedule", "linear"), "noise_schedule=linear with privacy.noise: banded"),
    (("--clipping", "quantile"), "clipping: quantile with privacy.noise: banded"),
    (("--privacy_unit", "user", "--user_column", "u", "--user_sampling", "record"), "user_sampling=record with"),
    (("--bands", "two"), "give 'auto' or a positive whole number"),
])
def test_unsupported_combinations_are_refused_in_one_line(tmp_path, extra, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        parse_config(["--output_dir", str(tmp_path / "x"), *SHORT, "--noise", "banded", *extra])


def test_independent_noise_refuses_bands_and_too_many_bands_are_refused_before_loading(tmp_path):
    with pytest.raises(ConfigError, match="needs privacy.noise=banded"):
        parse_config(["--output_dir", str(tmp_path / "x"), *SHORT, "--bands", "4"])
    from dpllm.privacy.accounting import PrivacyPlanError

    with pytest.raises(PrivacyPlanError, match="bands ≤ 8"):  # 8 steps
        _run(tmp_path / "y", "--noise", "banded", "--bands", "12")
    assert not (tmp_path / "y").exists()


def test_plan_compares_dp_sgd_with_the_bands_auto_picks(capsys):
    from dpllm.privacy.planning import cli_main

    assert cli_main(["--num-records", "10000", "--batch", "250", "--epochs", "10", "--target-epsilon", "3",
                     "--delta", "1e-5", "--noise", "banded", "--epsilons", "", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    c = plan["correlated_noise"]
    rows = {r["bands"]: r for r in c["rows"]}
    assert rows[1]["noise_multiplier"] == plan["target"]["noise_multiplier"]  # b = 1 is the DP-SGD plan
    assert c["bands"] == min(rows, key=lambda b: rows[b]["error"]) and c["bands"] > 1
    assert rows[c["bands"]]["error"] < 0.9 * rows[1]["error"]  # seen 12.37 against 14.57
    assert cli_main(["--num-records", "10000", "--batch", "250", "--epochs", "10", "--target-epsilon", "3",
                     "--delta", "1e-5", "--noise", "banded", "--bands", "4", "--epsilons", ""]) == 0
    out = capsys.readouterr().out
    assert "b = 4" in out and "← chosen" in out and "(1.00× DP-SGD)" in out


def test_the_accounted_history_is_the_reduction_of_every_step_taken():
    """The accountant hook counts every optimizer step at (σ, q_b); the history ε is read from holds ⌈n/b⌉ of
    them, over the whole run (a run split in two entries, e.g. by a resume, must not round up twice)."""
    from types import SimpleNamespace

    from dpllm.privacy.engine import PrivateTraining
    from dpllm.privacy.plan import PrivacyPlan

    plan = PrivacyPlan(num_records=100, sample_rate=0.4, steps=8, noise_multiplier=1.0, delta=1e-5,
                       accountant="rdp", expected_batch_size=10, prior_history=((2.0, 0.1, 5),),
                       noise={"mechanism": "banded", "bands": 4})
    engine = SimpleNamespace(accountant=SimpleNamespace(history=[(1.0, 0.4, 3), (1.0, 0.4, 5)]))
    private = PrivateTraining(model=None, optimizer=None, criterion=None, data_loader=None, engine=engine, plan=plan)
    assert private.history() == [(2.0, 0.1, 5), (1.0, 0.4, 2)] and private.steps_taken() == 8
    assert plan.stage_history(8) == [(1.0, 0.4, 2)] and plan.stage_history(5) == [(1.0, 0.4, 2)]
    assert plan.stage_history(4) == [(1.0, 0.4, 1)]
