"""Correlated noise beyond bk at record level: Opacus's hooks and ghost optimizers (one process and DDP's rank rule),
user-level sampling (ULS), DPTrainer, the scaling sweep, and the one-line refusals of what the amplified reduction
does not cover (noise schedules, quantile clipping, ELS / record-level user sampling, sequence units)."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch
from opacus.optimizers import DistributedDPOptimizer, DPOptimizer, DPOptimizerFastGradientClipping
from opacus.optimizers.optimizer import _generate_noise

from dpllm.config import ConfigError, DataConfig, PrivacyConfig, RunConfig, correlated_problem, parse_config
from dpllm.privacy import accounting, correlated
from dpllm.privacy.correlated.banded import materialize
from dpllm.privacy.correlated.groups import CyclicPoissonBatchSampler, assign_groups
from dpllm.privacy.correlated.optimizer import correlated_class

sys.path.insert(0, __import__("os").path.dirname(__file__))
from test_correlated_runs import SHORT  # noqa: E402  the resume tests' tiny recipe run, 8 steps


def _optimizer(base, *, seed: int, bands: int = 0, steps: int = 6, mechanism: str = "banded"):
    """A Linear(3, 2)'s Opacus optimizer ``base``: as Opacus makes it (``bands=0``), or through the correlated class
    with the registry's recurrence (banded: ``bands`` bands; blt: 2 cyclic groups, 2 buffers)."""
    lin = torch.nn.Linear(3, 2)
    cls = correlated_class(base) if bands else base
    opt = cls(torch.optim.SGD(lin.parameters(), lr=0.0), noise_multiplier=0.7, max_grad_norm=2.0,
              expected_batch_size=1, generator=torch.Generator().manual_seed(seed))
    if bands:
        opt.recurrence = _noise(mechanism, bands, steps).recurrence()
    return opt


def _noise(mechanism: str, bands: int, steps: int):
    extra = {"buffers": 2} if mechanism == "blt" else {}
    return correlated.build(mechanism, bands, steps=steps, num_records=10 * bands, batch=10, **extra)


def _strategy_matrix(noise, steps: int) -> torch.Tensor:
    """C, the T×T strategy matrix the recurrence inverts, materialised."""
    c = noise.strategy.blt.matrix(steps) if noise.name == "blt" else materialize(noise.strategy.coefficients, steps)
    return torch.as_tensor(c, dtype=torch.float64)


# the state each recurrence keeps per parameter: banded its b−1 past draws, BLT its d buffers
KEPT = {"banded": "history", "blt": "buffers"}


def _noise_step(opt, sums=None) -> list[torch.Tensor]:
    for i, p in enumerate(opt.params):
        p.summed_grad = torch.zeros_like(p) if sums is None else sums[i].clone()
    opt.add_noise()
    return [p.grad.detach().clone() for p in opt.params]


@pytest.mark.parametrize("mechanism, bands", [("banded", 3), ("blt", 2)])
@pytest.mark.parametrize("base", [DPOptimizer, DPOptimizerFastGradientClipping], ids=["hooks", "ghost"])
def test_opacus_optimizers_add_c_inverse_of_their_own_draws(base, mechanism, bands):
    """Zero clipped sums: the noise of T steps, stacked, is X = C⁻¹Z with Z the generator's draws in Opacus's order
    (C the materialised strategy: 3-banded, or BLT over 2 groups with 2 buffers), i.e. C·X reconstructs the draws;
    and it is not the draws themselves."""
    T = 6
    opt = _optimizer(base, seed=5, bands=bands, steps=T, mechanism=mechanism)
    xs = [_noise_step(opt) for _ in range(T)]
    g = torch.Generator().manual_seed(5)
    zs = [[_generate_noise(std=1.4, reference=p, generator=g) for p in opt.params] for _ in range(T)]
    C = _strategy_matrix(_noise(mechanism, bands, T), T)
    for k in range(len(opt.params)):
        X = torch.stack([x[k].reshape(-1) for x in xs]).double()
        Z = torch.stack([z[k].reshape(-1) for z in zs]).double()
        assert torch.allclose(C @ X, Z, atol=1e-5)  # float32 noise (and buffers), float64 reconstruction
        assert not torch.allclose(X[1:], Z[1:], atol=1e-2)  # correlated: x_t ≠ z_t after the first step
    state = opt.recurrence.state_dict()
    assert state["step"] == T and len(state[KEPT[mechanism]][0]) == 2  # 3 bands: 2 past draws; BLT: 2 buffers


@pytest.mark.parametrize("base", [DPOptimizer, DPOptimizerFastGradientClipping], ids=["hooks", "ghost"])
def test_one_band_is_opacus_noise_bit_for_bit(base):
    """b = 1 through the correlated class: the same sums plus the same draws as Opacus's own optimizer."""
    torch.manual_seed(0)
    sums = [torch.randn(2, 3), torch.randn(2)]
    mine, theirs = _optimizer(base, seed=9, bands=1), _optimizer(base, seed=9)
    for _ in range(3):
        for a, b in zip(_noise_step(mine, sums), _noise_step(theirs, sums)):
            assert torch.equal(a, b)


@pytest.mark.parametrize("mechanism", ["banded", "blt"])
def test_under_ddp_rank_0_noises_and_keeps_the_recurrence_and_other_ranks_add_nothing(tmp_path, mechanism):
    """Opacus's DDP rule, kept: the noise once, on rank 0 (whose recurrence advances and keeps its state); another
    rank passes its sum through untouched and never advances or fills a recurrence (the all-reduce then carries
    rank 0's x_t alone)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        sums = [torch.ones(2, 3), torch.ones(2)]
        opt = _optimizer(DistributedDPOptimizer, seed=3, bands=2, mechanism=mechanism)
        assert isinstance(opt, DistributedDPOptimizer)
        opt.rank = 1
        assert all(torch.equal(a, s) for a, s in zip(_noise_step(opt, sums), sums))
        state = opt.recurrence.state_dict()
        assert state["step"] == 0 and not state[KEPT[mechanism]]
        opt.rank = 0
        noised = _noise_step(opt, sums)
        state = opt.recurrence.state_dict()
        assert state["step"] == 1 and len(state[KEPT[mechanism]]) == 2  # both parameters' state
        assert not any(torch.equal(a, s) for a, s in zip(noised, sums))
    finally:
        dist.destroy_process_group()


def test_correlated_class_refuses_what_it_does_not_cover():
    from dpllm.privacy.clipping import QuantileDPOptimizer

    with pytest.raises(ValueError, match="does not cover QuantileDPOptimizer"):
        correlated_class(QuantileDPOptimizer)
    with pytest.raises(ValueError, match="needs an Opacus DPOptimizer class"):
        correlated_class(torch.optim.SGD)
    assert correlated_class(DPOptimizer) is correlated_class(DPOptimizer)


# ---- the recipe on hooks and ghost -------------------------------------------------------------------------------

def _run(out, *extra):
    from dpllm.train import train

    return train(parse_config(["--output_dir", str(out), *SHORT, *extra]))


def test_one_band_on_hooks_is_todays_dp_sgd_run_exactly(tmp_path, monkeypatch):
    """grad_sample_mode=hooks, noise: banded with one band: the same batches, noise and weights as DP-SGD."""
    from dpllm import resume

    monkeypatch.setattr(resume, "config_key", lambda cfg: "one key")  # one seeded noise stream for both configs
    cheap = ("--grad_sample_mode", "hooks", "--max_steps", "4", "--save_every", "0", "--eval_every", "0")
    _run(tmp_path / "one", *cheap, "--noise", "banded", "--bands", "1")
    _run(tmp_path / "dpsgd", *cheap)
    a, b = (json.loads((tmp_path / n / "privacy_report.json").read_text()) for n in ("one", "dpsgd"))
    assert a["grad_sample_mode"] == b["grad_sample_mode"] == "hooks"
    assert a["history"] == b["history"] and a["epsilon"] == b["epsilon"] and a["correlated_noise"]["bands"] == 1
    assert (tmp_path / "one" / "checkpoint" / "model.safetensors").read_bytes() == \
        (tmp_path / "dpsgd" / "checkpoint" / "model.safetensors").read_bytes()


def test_a_banded_ghost_run_trains_and_reports_the_reduction(tmp_path):
    _run(tmp_path / "ghost", "--grad_sample_mode", "ghost", "--noise", "banded", "--bands", "3", "--max_steps", "5",
         "--save_every", "5", "--eval_every", "0")
    r = json.loads((tmp_path / "ghost" / "privacy_report.json").read_text())
    c = r["correlated_noise"]
    assert r["grad_sample_mode"] == "ghost" and (c["mechanism"], c["bands"], c["accounted_steps"]) == ("banded", 3, 2)
    assert r["history"] == [[r["noise_multiplier"], pytest.approx(3 / 15), 2]]
    assert accounting.compute_epsilon_history(history=r["history"], delta=r["delta"],
                                              accountant=r["accountant"]) == pytest.approx(r["epsilon"], rel=1e-9)
    saved = torch.load(tmp_path / "ghost" / "checkpoints" / "step-000005" / "rng_state.pt", weights_only=True)[0]
    assert len(saved["noise_recurrence"]["history"][0]) == 2  # the secret past noise, resumable
    from dpllm import ledger

    assert ledger.verify(tmp_path / "ghost").ok


# ---- user-level sampling -----------------------------------------------------------------------------------------

def test_cyclic_user_sampler_draws_whole_users_of_the_groups_turn():
    """ULS under b groups: users (not records) are grouped by a keyed hash of their id; at step t only users of group
    t mod b join, each with all of its records, contiguous; with one band the draws are UserPoissonBatchSampler's."""
    from dpllm.privacy.user_level import UserPoissonBatchSampler

    users = [f"user{u}" for u in range(30)]
    records = [[3 * u, 3 * u + 1, 3 * u + 2] for u in range(30)]
    groups = assign_groups(users, bands=3, key=7)  # each a keyed hash of the user's id alone
    s = CyclicPoissonBatchSampler(groups=groups, bands=3, sample_rate=0.6, generator=torch.Generator().manual_seed(1),
                                  unit_records=records)
    it = iter(s)
    for t in range(9):
        batch = next(it)
        drawn = sorted({s.user_of[i] for i in batch})
        assert all(groups[u] == t % 3 for u in drawn)
        assert batch == [i for u in drawn for i in records[u]]
    one = CyclicPoissonBatchSampler(groups=[0] * 30, bands=1, sample_rate=0.3, unit_records=records,
                                    generator=torch.Generator().manual_seed(2), rank=1, world_size=2)
    plain = UserPoissonBatchSampler(user_records=records, sample_rate=0.3, generator=torch.Generator().manual_seed(2),
                                    rank=1, world_size=2)
    a, b = iter(one), iter(plain)
    assert [next(a) for _ in range(5)] == [next(b) for _ in range(5)]


def uls_run_by_turns(tmp_path, mode, monkeypatch, *, steps, **noise):
    """test_user_level's ULS run with correlated noise over 2 groups, checking that every step sampled whole users
    of the group whose turn it was (the engine must not sample records, nor another group's users)."""
    from test_user_level import _run as user_run

    drawn = []  # (sampler, batch) of every step
    plain_iter = CyclicPoissonBatchSampler.__iter__

    def spy(self):
        for batch in plain_iter(self):
            drawn.append((self, batch))
            yield batch

    monkeypatch.setattr(CyclicPoissonBatchSampler, "__iter__", spy)
    run = user_run(tmp_path, "uls", mode, bands=2, max_steps=steps, **noise)
    assert len(drawn) >= steps and sum(len(b) for _, b in drawn) > 0
    for t, (sampler, batch) in enumerate(drawn):
        assert sampler.unit_records is not None and all(int(sampler.groups[sampler.user_of[i]]) == t % 2 for i in batch)
    return run


def uls_plan(report, steps: int, *noise: str) -> dict:
    """``dpllm plan --unit user --sampling uls --json``'s correlated-noise section for the plan ``report``'s run had."""
    import contextlib
    import io

    from dpllm.privacy.planning import cli_main

    u, buf = report.user_level, io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli_main(["--unit", "user", "--sampling", "uls", "--num-users", str(u["num_users"]),
                         "--records-per-user", "4", "--num-records", str(report.num_records), "--users-per-batch",
                         str(u["users_per_batch"]), "--batch", "16", "--steps", str(steps), "--delta", "1e-3",
                         "--target-epsilon", "8", "--accountant", report.accountant, *noise, "--epsilons", "",
                         "--json"]) == 0
    return json.loads(buf.getvalue())["correlated_noise"]


@pytest.mark.parametrize("mode", ["bk", "hooks"])
def test_a_banded_uls_run_is_accounted_as_user_level_dp_sgd_at_q_b_over_ceil_t_over_b(tmp_path, mode, monkeypatch):
    """ULS + banded: the unit grouped and sampled is the user; the report's user-level ε is DP-SGD's at
    q_b = b/⌈U/B_u⌉ over ⌈T/b⌉ steps, σ as `dpllm plan --unit user --sampling uls --noise banded` plans it."""
    from dpllm.privacy.planning import cli_main
    from dpllm.privacy.report import PrivacyReport

    run = uls_run_by_turns(tmp_path, mode, monkeypatch, steps=5, noise="banded")
    r = PrivacyReport.read(run)
    u, c = r.user_level, r.correlated_noise
    assert r.privacy_unit == "user" and r.grad_sample_mode == mode and (c["bands"], c["accounted_steps"]) == (2, 3)
    k = -(-u["num_users"] // u["users_per_batch"])
    assert r.sample_rate == pytest.approx(2 / k) and r.history == [[r.noise_multiplier, r.sample_rate, 3]]
    assert r.epsilon == pytest.approx(accounting.compute_epsilon_history(
        history=[(r.noise_multiplier, 2 / k, 3)], delta=1e-3, accountant=r.accountant), rel=1e-9)
    assert r.epsilon <= 8.0
    from dpllm import ledger
    from dpllm.export import correlated_note

    assert ledger.verify(run).ok

    assert "the users were split into 2 groups by a keyed hash of each user's id" in correlated_note(r)
    trained = json.loads((run / "splits.json").read_text())["train"]
    assert len(trained) == r.num_records
    rows = {row["bands"]: row for row in uls_plan(r, 5, "--noise", "banded", "--bands", "2")["rows"]}
    assert rows[2]["noise_multiplier"] == pytest.approx(r.noise_multiplier, rel=1e-9)
    assert cli_main(["--unit", "user", "--sampling", "els", "--num-users", "100", "--records-per-user", "4",
                     "--batch", "16", "--steps", "5", "--delta", "1e-3", "--target-epsilon", "8", "--noise",
                     "banded"]) == 2  # refused before any calibration


# ---- DPTrainer ----------------------------------------------------------------------------------------------------

def test_dptrainer_runs_banded_noise_with_the_recipes_plan(tmp_path):
    """PrivacyArguments(noise="banded", bands=2): the run's σ, q and ε are those the recipe's plan (correlated.build,
    then plan_privacy) gives for the same N, B and T, and the report names the mechanism."""
    from dpllm.privacy.plan import plan_privacy
    from tests.helpers import tiny_dptrainer

    trainer = tiny_dptrainer(tmp_path / "run", noise="banded", bands="2", reproducible_noise=True)
    metrics = trainer.train().metrics
    noise = correlated.build("banded", "2", steps=4, num_records=24, batch=8)
    plan = plan_privacy(num_records=24, logical_batch_size=8, steps=4, target_epsilon=8.0, delta=1e-3,
                        accountant="rdp", noise=noise)
    assert (metrics["noise_multiplier"], metrics["sample_rate"]) == (plan.noise_multiplier, plan.sample_rate)
    assert plan.sample_rate == pytest.approx(2 / 3) and metrics["epsilon"] == pytest.approx(plan.epsilon(), rel=1e-9)
    report = trainer.privacy_report
    assert report.correlated_noise["mechanism"] == "banded" and report.correlated_noise["accounted_steps"] == 2
    assert report.history == [[plan.noise_multiplier, plan.sample_rate, 2]]
    assert "2-banded correlated noise" in report.summary()
    with pytest.raises(ConfigError, match="proved for one σ at every step"):  # the recipe's refusals, at construction
        tiny_dptrainer(tmp_path / "x", noise="banded", noise_schedule="linear")


# ---- what the reduction does not cover: one line each, saying why -------------------------------------------------

@pytest.mark.parametrize("privacy, data, words", [
    (dict(noise_schedule="linear"), {}, "proved for one σ at every step"),
    (dict(clipping="quantile"), {}, "needs one clip norm at every step"),
    (dict(user_sampling="els"), dict(privacy_unit="user", max_records_per_user=4),
     "user_sampling=els with privacy.noise: banded: records are put in cyclic groups one by one"),
    (dict(user_sampling="record"), dict(privacy_unit="user"), "user joins more than ceil(T/b) steps"),
    (dict(), dict(privacy_unit="sequence"), "blocks, which can sit in different cyclic groups"),
    (dict(grad_sample_mode="ghost_fsdp"), {}, "not built for grad_sample_mode=ghost_fsdp"),
    (dict(), dict(long_records="split", max_windows=2), "not yet supported with long_records=split"),
])
def test_combinations_outside_the_reduction_are_refused_with_the_reason(privacy, data, words):
    cfg = RunConfig(privacy=PrivacyConfig(noise="banded", bands="2", **privacy), data=DataConfig(**data))
    assert words in correlated_problem(cfg)
    ok = RunConfig(privacy=PrivacyConfig(noise="banded", bands="2", grad_sample_mode="hooks"),
                   data=DataConfig(privacy_unit="user"))
    assert correlated_problem(ok) is None  # hooks + ULS + constant σ + flat clipping: covered


def test_the_recipe_refuses_a_schedule_before_loading(tmp_path):
    with pytest.raises(ConfigError, match="noise_schedule=linear with privacy.noise: banded"):
        parse_config(["--output_dir", str(tmp_path / "x"), *SHORT, "--noise", "banded", "--noise_schedule", "linear"])


# ---- the sweep ----------------------------------------------------------------------------------------------------

def test_sweep_passes_the_noise_to_every_private_run_and_refuses_a_sigma_bar_fit(tmp_path):
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "recipes"))
    import scaling_sweep

    doc = {"base": {"privacy": {"target_delta": 1e-5}}, "sweep": {"max_steps": [4], "epsilons": [8.0, None]},
           "fit": {"form": "noise_batch"}}
    with pytest.raises(ConfigError, match="fit form noise_batch reads σ̄"):
        scaling_sweep.with_noise(json.loads(json.dumps(doc)), noise="banded", bands="2", form=None)
    scaling_sweep.with_noise(doc, noise="banded", bands="2", form=None, fit=False)  # no fit: nothing to refuse
    cfgs = dict(scaling_sweep.expand(doc, quick=False))
    private, public = cfgs["size0_steps4_eps8_seed0"], cfgs["size0_steps4_nodp_seed0"]
    assert (private["privacy"]["noise"], private["privacy"]["bands"], private["privacy"]["enabled"]) == \
        ("banded", "2", True)
    assert public["privacy"]["enabled"] is False
    parse_config(["--output_dir", str(tmp_path / "x"), *SHORT, "--noise", "banded", "--bands", "2"])


def test_runs_table_row_names_the_noise(tmp_path):
    """The one sweep run: a tiny config through scaling_sweep.main, --noise banded --bands 2, no fit."""
    import yaml

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "recipes"))
    import scaling_sweep

    base = {"model": {"model_name_or_path": "tiny-llama", "finetuning": "full", "tiny_hidden_size": 32,
                      "tiny_num_heads": 2, "tiny_num_layers": 1},
            "data": {"max_records": 300, "max_length": 48},
            "train": {"logical_batch_size": 16, "physical_batch_size": 8, "eval_every": 0, "eval_max_records": 16,
                      "log_every": 4, "progress": False},
            "privacy": {"accountant": "rdp", "reproducible_noise": True}}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"base": base, "sweep": {"max_steps": [4], "epsilons": [8.0]}}))
    scaling_sweep.main(["--config", str(path), "--output_dir", str(tmp_path / "sweep"), "--noise", "banded",
                        "--bands", "2", "--no_fit"])
    row = json.loads((tmp_path / "sweep" / "runs.jsonl").read_text().splitlines()[0])
    assert (row["noise"], row["bands"]) == ("banded", 2) and row["sample_rate"] == pytest.approx(2 / 15)
    assert np.isfinite(row["final_eval_loss"])
