"""dpllm.mlp.batched: runs stepped together train exactly as each would alone through Opacus (train_mlp)."""

from __future__ import annotations

import pytest
import torch

from dpllm.mlp.batched import per_sample_grads, per_sample_norms, train_mlps, weighted_sums
from dpllm.mlp.data import load_dataset
from dpllm.mlp.train import MLPRun, plan_for, train_mlp


@pytest.fixture(scope="module")
def data():
    return load_dataset("gaussian")


def close_models(a, b, atol=1e-6):
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters())) <= atol


@pytest.mark.parametrize("clipping", ["flat", "psasc"])
def test_each_run_equals_its_unbatched_opacus_run(data, clipping):
    runs = [MLPRun(width=16, epochs=3, lr=0.1, seed=seed, private=sigma is not None, noise_multiplier=sigma,
                   max_grad_norm=0.5, clipping=clipping, clipping_s=0.5)
            for sigma in (None, 0.8, 3.0) for seed in (1, 2)]
    plans = [plan_for(r, n_train=data.n_train) if r.private else None for r in runs]
    together = train_mlps(runs, data, plans=plans)
    for run, plan, got in zip(runs, plans, together):
        alone = train_mlp(run, data, plan=plan)
        assert close_models(got.model, alone.model), run
        for key in ("steps", "sample_rate", "noise_multiplier", "sensitivity", "delta", "accountant_planned",
                    "epsilon_prv", "epsilon_rdp", "n_params"):
            assert got.record[key] == alone.record[key], key
        assert got.record["metrics"]["test_loss"] == pytest.approx(alone.record["metrics"]["test_loss"], abs=1e-5)
    assert together[2].record["epsilon_prv"] > together[4].record["epsilon_prv"] > 0  # σ 0.8 spends more than 3


def test_a_run_does_not_depend_on_its_neighbours(data, monkeypatch):
    """Batches, noise and clipping stay per run: the same run trained beside others or alone draws the same
    batches and the same noise, and ends with the same weights up to float rounding.

    Beside others, the run's rows are padded to the largest batch of the step and its sums are computed inside
    stacked tensors, so the matrix kernels reduce in another order (and pick other code paths on other CPUs):
    bitwise equality is not what the design promises. Weights here are below 1 in magnitude and float32's
    rounding (6e-8 relative) over 14 steps stays orders of magnitude below 1e-5, while a neighbour's batch or
    noise leaking into the run moves weights by more than 1e-3 (the last assertion).
    """
    import dpllm.mlp.batched as batched

    drawn: list = []  # (generator id, batch) of every Poisson draw and (generator id, std, shape) of every noise draw
    real_sampler, real_normal = batched.PoissonBatchSampler, torch.normal

    class Spy(real_sampler):
        def __iter__(self):
            for b in super().__iter__():
                drawn.append(("batch", self.generator.initial_seed(), tuple(b)))
                yield b

    def normal(mean, std, *, size, generator):
        drawn.append(("noise", generator.initial_seed(), float(std), tuple(size)))
        return real_normal(mean, std, size=size, generator=generator)

    monkeypatch.setattr(batched, "PoissonBatchSampler", Spy)
    monkeypatch.setattr(torch, "normal", normal)
    a = MLPRun(width=16, epochs=2, lr=0.1, seed=7, noise_multiplier=1.0)
    others = [MLPRun(width=16, epochs=2, lr=0.1, seed=8, noise_multiplier=0.5), MLPRun(width=16, epochs=2, lr=0.1,
                                                                                        seed=9, private=False)]
    plan = lambda r: plan_for(r, n_train=data.n_train) if r.private else None  # noqa: E731
    alone = train_mlps([a], data, plans=[plan(a)])[0]
    seeds_a = {d[1] for d in drawn}
    draws_alone, drawn[:] = list(drawn), []
    beside = train_mlps([others[0], a, others[1]], data, plans=[plan(r) for r in (others[0], a, others[1])])
    draws_beside = [d for d in drawn if d[1] in seeds_a]
    assert draws_alone and draws_beside == draws_alone  # the same batches and the same noise draws, in order
    assert sum(d[0] == "noise" for d in draws_alone) > 0 and sum(d[0] == "batch" for d in draws_alone) >= 14
    assert close_models(alone.model, beside[1].model, atol=1e-5)
    assert not close_models(beside[0].model, beside[1].model, atol=1e-3)


def test_per_sample_norms_and_sums_equal_torch_func(data):
    torch.manual_seed(0)
    r, b, f, h, k = 3, 5, data.n_features, 8, data.n_classes
    params = [torch.randn(r, h, f), torch.randn(r, h), torch.randn(r, k, h), torch.randn(r, k)]
    x = data.x_train[:r * b].view(r, b, f)
    y = data.y_train[:r * b].view(r, b)

    def loss(w1, b1, w2, b2, xi, yi):
        hid = torch.relu(xi @ w1.T + b1)
        return torch.nn.functional.cross_entropy((hid @ w2.T + b2)[None], yi[None])

    per_sample = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1, 2, 3)), in_dims=(None,) * 4 + (0, 0))
    factors = per_sample_grads(params, x, y)
    norms = per_sample_norms(*factors)
    weights = torch.rand(r, b)
    sums = weighted_sums(weights, *factors)
    for i in range(r):
        grads = per_sample(*(p[i] for p in params), x[i], y[i])
        want = torch.sqrt(sum(g.reshape(b, -1).pow(2).sum(1) for g in grads))
        torch.testing.assert_close(norms[i], want)
        for got, g in zip(sums, grads):
            torch.testing.assert_close(got[i], torch.einsum("i,i...->...", weights[i], g))


def test_runs_of_different_shapes_are_refused(data):
    runs = [MLPRun(width=16, epochs=2, noise_multiplier=1.0), MLPRun(width=32, epochs=2, noise_multiplier=1.0)]
    with pytest.raises(ValueError, match="must share width"):
        train_mlps(runs, data, plans=[plan_for(r, n_train=data.n_train) for r in runs])
