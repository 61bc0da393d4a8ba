"""clipping: quantile (dpllm.privacy.quantile): the pair (sum, count) is one Gaussian mechanism of the planned σ,
the sensitivity is as argued, it reduces to flat clipping, C converges to the target quantile, and bk noises both."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dpllm.privacy import clipping
from dpllm.privacy.accounting import PrivacyPlanError
from dpllm.privacy.quantile import (
    QuantileClipping,
    centred_count,
    check_count_noise,
    gradient_noise_multiplier,
    next_clip,
    noised_fraction,
    smallest_count_noise,
)


@pytest.mark.parametrize("sigma,sigma_b", [(0.6, 1.0), (1.0, 0.51), (1.3, 12.8), (4.0, 2.1)])
def test_gradient_and_count_noise_combine_to_the_planned_sigma(sigma, sigma_b):
    sigma_g = gradient_noise_multiplier(sigma, sigma_b)
    assert sigma_g > sigma  # the gradient pays for the count
    # unit-noise sensitivity of (sum / σ_g·C, count / σ_b) with |Δsum| = C, |Δcount| = ½: exactly 1/σ
    assert math.hypot(1 / sigma_g, 0.5 / sigma_b) == pytest.approx(1 / sigma, rel=1e-12)


@pytest.mark.parametrize("sigma_b", [0.5, 0.4, 0.0, -1.0, float("nan")])
def test_plan_refuses_a_count_noise_at_or_below_half_sigma(sigma_b):
    with pytest.raises(PrivacyPlanError, match=r"count_noise_multiplier=.* σ_b > σ/2 = 0.5\b.*raise"):
        check_count_noise(1.0, sigma_b)
    with pytest.raises(PrivacyPlanError, match="above 0.5"):
        gradient_noise_multiplier(1.0, sigma_b)
    assert smallest_count_noise(2.0) == 1.0


def test_one_record_moves_the_sum_by_at_most_c_and_the_centred_count_by_exactly_half():
    gen = torch.Generator().manual_seed(0)
    clip = 1.3
    base = torch.randn(40, 7, generator=gen, dtype=torch.float64) * torch.rand(40, 1, generator=gen,
                                                                                 dtype=torch.float64) * 3

    def release(grads):
        q = QuantileClipping(initial=clip, target_quantile=0.5, lr=0.2, count_noise_multiplier=2.0,
                             expected_batch_size=40)
        w = q.weights(grads.norm(dim=1))
        return (w[:, None] * grads).sum(0), q.count

    s0, k0 = release(base)
    extra = torch.randn(7, dtype=torch.float64, generator=gen)
    # the added record below, at and above C, and huge; removing a record is the same pair read backwards
    for norm in (1e-3, 0.7, clip, 1.31, 50.0, 1e6):
        record = extra / extra.norm() * norm
        s1, k1 = release(torch.cat([base, record[None]]))
        assert (s1 - s0).norm() <= clip * (1 + 1e-12)
        assert abs(k1 - k0) == 0.5
        # the worst case is attained: a record above C moves the sum by exactly C
        if norm > clip:
            assert (s1 - s0).norm() == pytest.approx(clip, rel=1e-12)
    sigma, sigma_b = 1.1, 0.9
    sigma_g = gradient_noise_multiplier(sigma, sigma_b)
    assert math.hypot(clip / (sigma_g * clip), 0.5 / sigma_b) <= 1 / sigma + 1e-12


def test_infinite_count_noise_or_zero_lr_is_flat_clipping_at_fixed_c():
    assert gradient_noise_multiplier(1.7, math.inf) == pytest.approx(1.7, rel=1e-15)  # σ_g = σ
    assert gradient_noise_multiplier(1.7, 1e8) == pytest.approx(1.7, rel=1e-12)
    q = QuantileClipping(initial=0.8, target_quantile=0.5, lr=0.0, count_noise_multiplier=1e8,
                         expected_batch_size=16)
    norms = torch.tensor([1e-4, 0.3, 0.8, 0.81, 5.0, 80.0], dtype=torch.float64)
    flat = clipping.get("flat").weights(norms, type("C", (), {"max_grad_norm": 0.8})())
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        torch.testing.assert_close(q.weights(norms), flat, rtol=2e-6, atol=0)  # flat's own ε in C/(n + 1e-6)
        q.release(float(torch.randn((), generator=gen, dtype=torch.float64)) * 1e8)
        assert q.clip == 0.8


def test_counts_and_update_rule_are_the_documented_formulas():
    assert centred_count(torch.tensor([0.5, 1.0, 1.5, 2.0]), 1.0) == 0.0  # two at or under C, two above
    assert centred_count(torch.tensor([0.5, 0.6, 0.7]), 1.0) == 1.5
    assert noised_fraction(1.5, 0.5, expected_batch_size=4) == 1.0  # divided by the expected, not the realised 3
    assert next_clip(2.0, 0.9, 0.5, 0.2) == pytest.approx(2.0 * math.exp(-0.08))
    assert next_clip(2.0, 0.1, 0.5, 0.2) == pytest.approx(2.0 * math.exp(0.08))


@pytest.mark.parametrize("gamma", [0.5, 0.9])
def test_c_converges_to_the_target_quantile_of_lognormal_norms(gamma):
    # norms ~ lognormal(μ = 0, s = 1): the γ-quantile is exp(s·Φ⁻¹(γ)) (1 for the median, 3.602 for 0.9).
    # Poisson batches of expected size m = 256, the default σ_b = m/20, η = 0.2, from C = 0.05 (far below).
    gen = torch.Generator().manual_seed(5)
    m, steps = 256, 600
    want = math.exp(math.sqrt(2) * torch.erfinv(torch.tensor(2 * gamma - 1.0, dtype=torch.float64)).item())
    q = QuantileClipping(initial=0.05, target_quantile=gamma, lr=0.2, count_noise_multiplier=m / 20,
                         expected_batch_size=m)
    late = []
    for step in range(steps):
        size = int(torch.poisson(torch.tensor(float(m)), generator=gen))
        q.weights(torch.randn(size, generator=gen, dtype=torch.float64).exp())
        q.release(float(torch.randn((), generator=gen, dtype=torch.float64)) * q.count_noise_multiplier)
        if step >= steps // 2:
            late.append(q.clip)
    mean_late = sum(late) / len(late)
    # Stated tolerance: the mean of C over the last 300 steps within 5% of the true quantile, and every late C
    # within 25% (C's own step-to-step noise at η = 0.2 is a few per cent per step around the target).
    assert mean_late == pytest.approx(want, rel=0.05)
    assert all(abs(c / want - 1) < 0.25 for c in late)
    assert q.steps == steps


def test_bk_optimizer_noises_the_sum_at_sigma_g_c_and_the_accountant_records_sigma():
    from opacus import PrivacyEngine

    from dpllm.privacy.bk import make_private_bk

    torch.manual_seed(0)
    net = nn.Linear(400, 50, bias=False)
    engine = PrivacyEngine(accountant="prv")
    sigma, sigma_b, clip, m = 1.0, 0.55, 2.0, 8.0  # σ_b near its bound 0.5: σ_g = 2.40, far from σ
    q = QuantileClipping(initial=clip, target_quantile=0.5, lr=0.2, count_noise_multiplier=sigma_b,
                         expected_batch_size=m)
    model, opt = make_private_bk(engine=engine, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.0),
                                 clip_weights=q.weights, noise_multiplier=sigma, max_grad_norm=clip,
                                 expected_batch_size=m, noise_generator=torch.Generator().manual_seed(3),
                                 quantile=q)
    opt.attach_step_hook(engine.accountant.get_optimizer_hook_fn(sample_rate=0.1))
    x = torch.randn(6, 400)
    (model(x) * 0).sum().backward()  # zero gradients: p.grad after the step is the noise alone, over m
    norms = model.last_norms
    assert norms.shape == (6,) and float(norms.max()) == 0.0
    assert q.count == 3.0  # six records at or under C, centred
    opt.step()
    sigma_g = gradient_noise_multiplier(sigma, sigma_b)
    got = float(net.weight.grad.std()) * m  # scale_grad divides by the expected batch
    assert got == pytest.approx(sigma_g * clip, rel=0.03)  # 20,000 draws: the std's own error is ~0.5%
    assert engine.accountant.history == [(sigma, 0.1, 1)]  # the pair's σ, never σ_g
    assert q.steps == 1 and q.clip != clip  # C moved after the step


def _run(out, *extra):
    from dpllm.config import parse_config
    from dpllm.train import train

    return train(parse_config([
        "--output_dir", str(out), "--finetuning", "full", "--max_steps", "4", "--save_every", "2",
        "--logical_batch_size", "16", "--physical_batch_size", "8", "--max_length", "32", "--tiny_hidden_size", "32",
        "--tiny_num_heads", "2", "--max_records", "120", "--eval_every", "0", "--eval_max_records", "8",
        "--progress", "false", "--reproducible_noise", "true",  # PRV: Opacus's RDP calibrates σ < 1 in seconds
        "--clipping", "quantile", "--max_grad_norm", "0.05", *extra]))


def test_recipe_trains_with_quantile_clipping_resumes_with_its_c_and_reports_it(tmp_path, monkeypatch):
    import json

    import dpllm.resume as R
    from dpllm.privacy.report import PrivacyReport

    real_save = torch.save

    def failing_save(obj, path, *a, **kw):
        if ".step-000004." in str(path):
            raise OSError("disk full (injected)")
        return real_save(obj, path, *a, **kw)

    out = tmp_path / "run"
    monkeypatch.setattr(R.torch, "save", failing_save)
    with pytest.raises(OSError, match="injected"):
        _run(out)
    monkeypatch.setattr(R.torch, "save", real_save)
    saved = json.loads((out / "checkpoints" / "step-000002" / "trainer_state.json").read_text())["clipping"]
    assert saved["steps"] == 2 and saved["clip"] != 0.05  # C after two steps is part of the resumable state
    _run(out, "--resume_from", "latest")
    r1 = json.loads((out / "privacy_report.json").read_text())
    a1 = r1["adaptive_clipping"]
    ledger_lines = [json.loads(x) for x in (out / "privacy_ledger.jsonl").read_text().splitlines()]
    resumed = [e for e in ledger_lines if e["kind"] == "resume"]
    # the resumed run continued from its saved C and step count, not from max_grad_norm
    assert len(resumed) == 1 and resumed[0]["adaptive_clipping"]["final_max_grad_norm"] == saved["clip"]
    assert resumed[0]["adaptive_clipping"]["steps"] == 2 and a1["steps"] == 4
    sigma, m = r1["noise_multiplier"], r1["expected_batch_size"]
    assert a1["initial_max_grad_norm"] == 0.05 and a1["target_quantile"] == 0.5 and a1["quantile_lr"] == 0.2
    assert a1["count_noise_multiplier"] == pytest.approx(m / 20)
    assert a1["gradient_noise_multiplier"] == pytest.approx(gradient_noise_multiplier(sigma, m / 20))
    # every record's norm is far above 0.05 at the start (b̃ near 0): C grows, by at most e^(0.2·(γ − b̃)) a step
    assert a1["final_max_grad_norm"] > saved["clip"] > 0.05
    assert r1["history"] == [[sigma, r1["sample_rate"], 4]] and r1["sensitivity"] is None
    line = [x for x in PrivacyReport.from_dict(r1).details() if x.startswith("clipping:")]
    assert len(line) == 1 and "0.5 quantile" in line[0] and f"σ = {sigma:.4g}, the σ accounted" in line[0]
    assert ledger_lines[-1]["kind"] == "final"
    assert ledger_lines[-1]["adaptive_clipping"]["final_max_grad_norm"] == a1["final_max_grad_norm"]
    # what leaves the run: the release bundle's report and the model card's metadata carry it (public values)
    from dpllm import hub
    from dpllm.export import release_report

    released = release_report(PrivacyReport.from_dict(r1))
    assert released.adaptive_clipping == a1 and hub.dp_metadata(released)["adaptive_clipping"] == a1


def test_uncovered_paths_are_refused_in_one_line_before_anything_is_written(tmp_path):
    from dpllm.config import ConfigError
    from dpllm.privacy.accounting import PrivacyPlanError

    with pytest.raises(ConfigError, match="clipping: quantile is not yet supported with grad_sample_mode=ghost_fsdp"):
        _run(tmp_path / "refused", "--grad_sample_mode", "ghost_fsdp")
    with pytest.raises(PrivacyPlanError, match=r"count_noise_multiplier=0.01 is too small .* σ_b > σ/2"):
        _run(tmp_path / "refused", "--count_noise_multiplier", "0.01")
    assert not (tmp_path / "refused").exists()


def test_dptrainer_takes_quantile_clipping_and_checks_its_numbers(tmp_path):
    from transformers import TrainingArguments

    from dpllm.config import ConfigError
    from dpllm.hf.arguments import PrivacyArguments, refuse_unsafe

    args = TrainingArguments(output_dir=str(tmp_path / "run"), max_grad_norm=0.0, report_to=[])
    refuse_unsafe(args, PrivacyArguments(clipping="quantile"))  # runs (tests/test_quantile_engines.py)
    p = PrivacyArguments(clipping="quantile", target_quantile=0.9, quantile_lr=0.1, count_noise_multiplier=3.0)
    c = p.privacy_config()
    assert (c.clipping, c.target_quantile, c.quantile_lr, c.count_noise_multiplier) == ("quantile", 0.9, 0.1, 3.0)
    with pytest.raises(ConfigError, match="DPTrainer: target_quantile=1.5"):
        refuse_unsafe(args, PrivacyArguments(clipping="quantile", target_quantile=1.5))
    assert not (tmp_path / "run").exists()


def test_an_empty_batchs_stand_in_row_is_not_counted(tmp_path, monkeypatch):
    # At logical batch 1 over ~100 records a Poisson batch is empty with probability ≈ e⁻¹; the trainer then runs
    # one masked row of zero gradient. Counted, its centred bit (+½) would let an empty batch and a batch of one
    # record differ by 1 in the count, twice the ½ the noise split accounts for.
    import dpllm.train as T
    from dpllm.privacy import quantile

    pending, steps = [], []  # rows of each training forward pass; (rows, count) of each step
    real_forward, real_release = T.forward_loss, quantile.QuantileClipping.release_noised

    def forward(model, batch, *a, **kw):
        if torch.is_grad_enabled():  # training, not evaluation
            pending.append(int(batch["input_ids"].shape[0]))
        return real_forward(model, batch, *a, **kw)

    def release(self, noised):
        steps.append((list(pending), self.count))
        pending.clear()
        return real_release(self, noised)

    monkeypatch.setattr(T, "forward_loss", forward)
    monkeypatch.setattr(quantile.QuantileClipping, "release_noised", release)
    _run(tmp_path / "run", "--logical_batch_size", "1", "--physical_batch_size", "1", "--max_steps", "8",
         "--save_every", "0", "--count_noise_multiplier", "5")
    assert len(steps) == 8
    assert [0] in [r for r, _ in steps]  # an empty step happened (fixed seed: reproducible_noise)
    for passes, count in steps:
        records = sum(passes)  # a stand-in row is one pass of 0 records
        assert abs(count) <= records / 2 and (count - records / 2) % 1 == 0  # each record ±½, nothing else
        if records == 0:
            assert count == 0.0


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_hooks_and_ghost_noise_the_sum_at_sigma_g_c_and_adapt_c(mode):
    from opacus import PrivacyEngine

    from dpllm.config import PrivacyConfig
    from dpllm.privacy.engine import _wrap_opacus

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(400, 50, bias=False))
    engine = PrivacyEngine(accountant="prv")
    sigma, sigma_b, clip, m = 1.0, 0.55, 2.0, 8.0
    q = QuantileClipping(initial=clip, target_quantile=0.5, lr=0.2, count_noise_multiplier=sigma_b,
                         expected_batch_size=m)
    model, opt, criterion = _wrap_opacus(
        engine=engine, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.0), criterion=nn.MSELoss(),
        fn=clipping.get("flat"), cfg=PrivacyConfig(max_grad_norm=clip, clipping="quantile"), mode=mode,
        noise_multiplier=sigma, expected_batch_size=m, noise_generator=torch.Generator().manual_seed(3), quantile=q)
    opt.attach_step_hook(engine.accountant.get_optimizer_hook_fn(sample_rate=0.1))
    out = model(torch.randn(6, 400))
    target = out.detach().clone()  # zero loss and zero gradients: p.grad after the step is the noise alone
    out, target = out.sum(1), target.sum(1)  # one loss per record
    loss = criterion(out, target) if criterion is not None else nn.functional.mse_loss(out, target)
    loss.backward()  # hooks clip (and count) in opt.step(), ghost in this backward
    counts = []
    real_release = q.release_noised
    q.release_noised = lambda noised: counts.append(q.count) or real_release(noised)
    opt.step()
    assert counts == [3.0]  # six records of norm 0 ≤ C, centred
    got = float(net[0].weight.grad.std()) * m
    assert got == pytest.approx(gradient_noise_multiplier(sigma, sigma_b) * clip, rel=0.03)
    assert engine.accountant.history == [(sigma, 0.1, 1)]
    assert q.steps == 1 and q.clip < clip  # b̃ ≈ 1 > γ: C shrank


def test_recipe_runs_quantile_clipping_under_hooks_and_ghost(tmp_path):
    import json

    for mode in ("hooks", "ghost"):
        _run(tmp_path / mode, "--grad_sample_mode", mode, "--save_every", "0")
        report = json.loads((tmp_path / mode / "privacy_report.json").read_text())
        a = report["adaptive_clipping"]
        assert report["grad_sample_mode"] == mode and a["steps"] == 4 and a["final_max_grad_norm"] > 0.05
        assert report["history"] == [[report["noise_multiplier"], report["sample_rate"], 4]]


def test_the_mlp_recipes_refuse_quantile_clipping():
    from dpllm.mlp.train import MLPRun

    with pytest.raises(ValueError, match="clipping: quantile is not yet supported with the MLP recipes"):
        MLPRun(clipping="quantile").privacy_config()
    assert MLPRun(clipping="flat").privacy_config().clipping == "flat"
