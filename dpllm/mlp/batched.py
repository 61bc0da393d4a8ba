"""Many independent MLP runs of one shape trained in lockstep: the same DP-SGD, a fraction of the overhead.

The studies train dozens of tiny Linear-ReLU-Linear models (0.3-4k parameters, batches of ~57). One step
of one run is ~1 ms of Python around microseconds of arithmetic (Opacus's hooks, the DP optimizer,
the sampler), so :func:`train_mlps` steps R runs of the same width, steps and learning rate together, as
one stacked tensor program, and keeps everything that makes a run private *per run*:

- each run's own Poisson sampler (:class:`dpllm.sampling.PoissonBatchSampler`) and its own noise generator,
  seeded as :func:`dpllm.mlp.train.train_mlp` seeds them, so each run draws exactly the batches and the
  noise it would draw alone (no stream is shared between runs);
- per-sample gradients of each run's own loss, each one clipped with the run's clipping function
  (:mod:`dpllm.privacy.clipping`), summed, plus N(0, σ_r²·S²) drawn per parameter in Opacus's order, divided
  by the plan's expected batch size (Opacus's ``loss_reduction="mean"``), then plain SGD;
- a non-private run takes the mean gradient of its batch, unclipped and noiseless, and skips empty batches;
- every private run's ε comes from the accountant for its own plan (:func:`dpllm.mlp.train.epsilons`).

Per-sample gradients of a Linear layer are outer products, g_i = δ_i ⊗ a_i, so ‖g_i‖² = ‖δ_i‖²·‖a_i‖² and
Σ w_i g_i = (w ⊙ δ)ᵀ a: norms and clipped sums are computed without materialising g_i (the ghost-norm
identity; Opacus's hooks materialise them). ``tests/test_mlp_batched.py`` checks the result against
:func:`~dpllm.mlp.train.train_mlp` (Opacus hooks) run by run, and the per-sample norms against torch.func.

Example:
    >>> from dpllm.mlp.data import load_dataset
    >>> from dpllm.mlp.train import MLPRun, plan_for
    >>> data = load_dataset("gaussian")
    >>> runs = [MLPRun(width=16, epochs=2, noise_multiplier=s, seed=1) for s in (1.0, 3.0)]
    >>> out = train_mlps(runs, data, plans=[plan_for(r, n_train=data.n_train) for r in runs])
    >>> [o.record["steps"] for o in out], out[0].record["trainer"]
    ([14, 14], 'batched')
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict
from typing import Optional, Sequence

import torch
from torch import nn

from dpllm.mlp.data import Split
from dpllm.mlp.train import MLPRun, TrainedMLP, epsilons, evaluate, make_mlp, num_parameters
from dpllm.privacy import clipping
from dpllm.privacy.plan import PrivacyPlan, batches_per_epoch
from dpllm.sampling import PoissonBatchSampler, stream_seed

# What must agree between runs stepped together (σ, seed, C, the clipping function and privacy may differ).
SHARED = ("width", "epochs", "lr", "batch_size")


def group_key(run: MLPRun) -> tuple:
    """Runs with equal keys can be trained together by :func:`train_mlps`."""
    return tuple(getattr(run, k) for k in SHARED)


def per_sample_grads(params: Sequence[torch.Tensor], x: torch.Tensor, y: torch.Tensor):
    """Per-sample loss-gradient factors of R stacked Linear-ReLU-Linear models on R padded batches.

    Args:
        params: ``(W1 [R,H,F], b1 [R,H], W2 [R,K,H], b2 [R,K])``.
        x: ``[R, B, F]``; y: ``[R, B]`` class indices.

    Returns:
        ``(d2, h, d1, x)``: the gradient of sample i's cross-entropy w.r.t. W2 is ``d2[:, i] ⊗ h[:, i]`` (b2:
        ``d2[:, i]``), w.r.t. W1 ``d1[:, i] ⊗ x[:, i]`` (b1: ``d1[:, i]``).
    """
    w1, b1, w2, b2 = params
    pre = torch.baddbmm(b1.unsqueeze(1), x, w1.transpose(1, 2))
    h = pre.clamp_min(0)
    logits = torch.baddbmm(b2.unsqueeze(1), h, w2.transpose(1, 2))
    d2 = torch.softmax(logits, dim=-1)
    d2.scatter_add_(2, y.unsqueeze(-1), torch.full_like(y, -1.0, dtype=d2.dtype).unsqueeze(-1))
    d1 = torch.bmm(d2, w2) * (pre > 0)
    return d2, h, d1, x


def padded_batches(batches: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's batch of each run as ``(idx, mask)``, both runs × the longest batch (at least 1): the record
    indices, zero-padded, and 1.0 where a position holds a record (an empty batch is all padding)."""
    size = max(1, max((len(b) for b in batches), default=0))
    idx = torch.zeros(len(batches), size, dtype=torch.long)
    mask = torch.zeros(len(batches), size)
    for r, b in enumerate(batches):
        if b:
            idx[r, :len(b)] = torch.tensor(b)
            mask[r, :len(b)] = 1.0
    return idx, mask


def per_sample_norms(d2, h, d1, x) -> torch.Tensor:
    """‖g_i‖ over all four parameters, ``[R, B]``: Σ over layers of ‖δ‖²(‖a‖² + 1) (weight and bias)."""
    sq = (d2 * d2).sum(-1) * ((h * h).sum(-1) + 1) + (d1 * d1).sum(-1) * ((x * x).sum(-1) + 1)
    return sq.sqrt()


def weighted_sums(weights: torch.Tensor, d2, h, d1, x) -> list[torch.Tensor]:
    """Σ_i w_i g_i per parameter (W1, b1, W2, b2), each ``[R, *shape]``; ``weights`` is ``[R, B]``."""
    wd2, wd1 = d2 * weights.unsqueeze(-1), d1 * weights.unsqueeze(-1)
    return [torch.bmm(wd1.transpose(1, 2), x), wd1.sum(1), torch.bmm(wd2.transpose(1, 2), h), wd2.sum(1)]


def train_mlps(runs: Sequence[MLPRun], data: Split, *, plans: Sequence[Optional[PrivacyPlan]],
               eps_cache: Optional[dict] = None) -> list[TrainedMLP]:
    """Train ``runs`` (same width, epochs, lr and batch size) together; one :class:`TrainedMLP` per run.

    Args:
        runs: the runs; private ones need their plan.
        data: the split (the whole ``x_train`` is the private data set).
        plans: :func:`dpllm.mlp.train.plan_for` of each run (None for a non-private run).
        eps_cache: memo for :func:`dpllm.mlp.train.epsilons`.

    Returns:
        Records shaped like :func:`dpllm.mlp.train.train_mlp`'s, with ``"trainer": "batched"``.

    Raises:
        ValueError: runs that differ in :data:`SHARED`, a private run without a matching plan, or clipping
            settings that a run's clipping function refuses.
    """
    start = time.perf_counter()
    if not runs:
        return []
    correlated = sorted({r.noise for r in runs} - {"independent"})
    if correlated:  # cyclic groups and a noise recurrence per run: train_mlp (the engine, bk) has them
        raise ValueError(f"noise={correlated[0]!r} is not in the lockstep trainer; train those runs one at a time "
                         "with dpllm.mlp.train.train_mlp (grad_sample_mode='bk')")
    if len({group_key(r) for r in runs}) != 1:
        raise ValueError(f"runs trained together must share {', '.join(SHARED)}")
    x_all, y_all = data.x_train, data.y_train
    n, n_batches = data.n_train, batches_per_epoch(data.n_train, runs[0].batch_size)
    steps, q = runs[0].epochs * n_batches, 1.0 / n_batches
    models, samplers, noises, cfgs = [], [], [], []
    for run, plan in zip(runs, plans):
        if run.private and (plan is None or plan.num_records != n or plan.steps != steps):
            raise ValueError(f"private run needs plan_for(run, n_train={n}) (steps={steps}); got {plan}")
        torch.manual_seed(run.seed)  # initialisation, as train_mlp does
        models.append(make_mlp(data.n_features, run.width, data.n_classes))
        sampling = torch.Generator().manual_seed(stream_seed(run.seed, "mlp:sampling"))
        noises.append(torch.Generator().manual_seed(stream_seed(run.seed, "mlp:noise")))
        samplers.append(iter(PoissonBatchSampler(num_samples=n, sample_rate=q if not run.private
                                                 else plan.sample_rate, generator=sampling)))
        cfgs.append(run.privacy_config(plan.accountant if plan else None))
    fns = [clipping.get(run.clipping) for run in runs]
    for fn, cfg in zip(fns, cfgs):
        fn.sensitivity(cfg)  # refuses bad r / s before any step
    r_count = len(runs)
    params = [torch.stack([list(m.parameters())[i].detach() for m in models]).clone() for i in range(4)]
    private = torch.tensor([run.private for run in runs])
    noise_std = [float(plan.noise_multiplier) * fn.sensitivity(cfg) if run.private else 0.0
                 for run, plan, fn, cfg in zip(runs, plans, fns, cfgs)]
    expected = [plan.expected_batch_size if run.private else 1.0 for run, plan in zip(runs, plans)]
    lrs = torch.tensor([run.lr for run in runs])
    private_rows = [r for r, run in enumerate(runs) if run.private]
    expected_rows = torch.tensor([float(expected[r]) for r in private_rows])
    same_fn = len({(fn.name, cfg.max_grad_norm, cfg.clipping_r, cfg.clipping_s) for fn, cfg in zip(fns, cfgs)}) == 1

    with torch.no_grad():
        for _ in range(steps):
            idx, mask = padded_batches([next(s) for s in samplers])
            factors = per_sample_grads(params, x_all[idx], y_all[idx])
            norms = per_sample_norms(*factors)
            if same_fn:
                weights = fns[0].weights(norms, cfgs[0])
            else:
                weights = torch.stack([fn.weights(norms[r], cfg) for r, (fn, cfg) in enumerate(zip(fns, cfgs))])
            counts = mask.sum(1)
            # Private: clipped weights; non-private: 1/|B| (the batch mean), nothing for an empty batch.
            weights = torch.where(private.unsqueeze(1), weights, 1.0 / counts.clamp_min(1).unsqueeze(1)) * mask
            sums = weighted_sums(weights, *factors)
            if private_rows:
                # Opacus's add_noise: from each run's own generator, one draw per parameter in order.
                draws = [[torch.normal(0.0, noise_std[r], size=p.shape[1:], generator=noises[r]) for p in sums]
                         for r in private_rows]
                for i, p in enumerate(sums):
                    p[private_rows] = (p[private_rows] + torch.stack([d[i] for d in draws])) / expected_rows.view(
                        -1, *([1] * (p.dim() - 1)))
            step = lrs * (private | (counts > 0))  # a non-private run skips an empty batch
            for p, g in zip(params, sums):
                p -= step.view(-1, *([1] * (p.dim() - 1))) * g

    out = []
    for r, (run, plan, model) in enumerate(zip(runs, plans, models)):
        with torch.no_grad():
            for p, stacked in zip(model.parameters(), params):
                p.copy_(stacked[r])
        out.append(TrainedMLP(model=model, record=_record(run, plan, model, data, steps, q, fns[r], cfgs[r],
                                                          eps_cache)))
    wall = round((time.perf_counter() - start) / r_count, 4)
    for o in out:
        o.record["wall_s"] = wall  # the batch's time, shared equally
    return out


def _record(run: MLPRun, plan: Optional[PrivacyPlan], model: nn.Module, data: Split, steps: int, q: float, fn,
            cfg, eps_cache: Optional[dict]) -> dict:
    """The same record :func:`dpllm.mlp.train.train_mlp` writes, ε from the run's own plan and accountant."""
    record = {
        "config": asdict(run), "dataset": data.name, "n_train": data.n_train, "n_params": num_parameters(model),
        "steps": steps, "sample_rate": q, "expected_batch_size": data.n_train * q, "trainer": "batched",
        "noise_multiplier": 0.0, "max_grad_norm": None, "sensitivity": None, "delta": None,
        "accountant_planned": None, "epsilon_prv": None, "epsilon_rdp": None, "prv_note": None,
    }
    if run.private:
        record.update(noise_multiplier=plan.noise_multiplier, max_grad_norm=run.max_grad_norm,
                      sensitivity=float(fn.sensitivity(cfg)), delta=plan.delta, accountant_planned=plan.accountant,
                      **epsilons(noise_multiplier=plan.noise_multiplier, sample_rate=plan.sample_rate,
                                 steps=steps, delta=plan.delta, cache=eps_cache))
    record["metrics"] = {
        **{f"test_{k}": v for k, v in evaluate(model, data.x_test, data.y_test).items()},
        **{f"train_{k}": v for k, v in evaluate(model, data.x_train, data.y_train).items()},
    }
    if not math.isfinite(record["metrics"]["train_loss"]):
        raise RuntimeError(f"training diverged (train loss {record['metrics']['train_loss']}); lower lr={run.lr}")
    return record
