"""One MLP training run, private or not, through the same privacy engine as the LLM trainer.

A private run goes plan → wrap → loop: :func:`plan_for` calls :func:`dpllm.privacy.plan.plan_privacy`
(σ given, or calibrated to a target ε), :func:`train_mlp` calls :func:`~dpllm.privacy.engine.make_private`
(Opacus per-sample gradients, Poisson sampling at q = 1/⌈N/B⌉, the clipping registry, Gaussian noise,
the accountant), then runs plain SGD steps. A non-private run is the same loop with the same Poisson
sampler and no clipping or noise, so a DP/non-DP gap is due to clipping and noise alone.

Correlated noise (``noise="banded"``, :mod:`dpllm.privacy.correlated`): :func:`plan_for` takes the mechanism from
the registry's ``build`` (σ calibrated for its event: DP-SGD's at the group rate q_b over ⌈T/b⌉ steps) and
:func:`train_mlp` hands it to ``make_private`` with each record's text (:func:`record_texts`, what its cyclic group is
a keyed hash of; the key is the run's seed): the engine's cyclic sampler and the bk optimizer's noise recurrence.
bk only, as for the LLM trainer; b = 1 is DP-SGD's run exactly. BLT is accounted as one Gaussian mechanism, which this
trainer's plan and record do not carry: ``noise="blt"`` is refused here (the LLM recipe and ``DPTrainer`` train it).

Speed (2-layer MLPs, ~0.2-1 ms a step): batches are gathered by indexing the full training tensors
with the index lists of the engine's own Poisson batch sampler, instead of iterating its DataLoader,
which fetches and collates records one by one (~20% of a step). The sampling is unchanged: the same
sampler, q and step count. ``grad_sample_mode="hooks"`` is the default because it is
~20% faster than ghost clipping here (ghost runs a second backward pass; it pays off only for large
layers).

Example:
    >>> from dpllm.mlp.data import load_dataset
    >>> run = MLPRun(width=16, epochs=2, noise_multiplier=1.0)
    >>> out = train_mlp(run, load_dataset("gaussian"), plan=plan_for(run, n_train=400))
    >>> out.record["steps"], round(out.record["sample_rate"], 4)
    (14, 0.1429)
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.data import TensorDataset

from dpllm.config import PrivacyConfig
from dpllm.mlp.data import Split
from dpllm.privacy import accounting
from dpllm.privacy.accounting import PRV_SKIP_ABOVE  # one threshold for the engine and the studies
from dpllm.privacy.engine import add_empty_share, make_private
from dpllm.privacy.plan import PrivacyPlan, batches_per_epoch, plan_privacy
from dpllm.sampling import PoissonBatchSampler, stream_seed


@dataclass(frozen=True)
class MLPRun:
    """Settings of one training run (recorded verbatim in ``results.json``).

    Attributes:
        width: hidden units of the Linear-ReLU-Linear MLP.
        epochs: passes over the data; steps = epochs · ⌈N / batch_size⌉.
        lr: SGD learning rate (no momentum, no weight decay).
        batch_size: expected (Poisson) batch size; q = 1 / ⌈N / batch_size⌉.
        seed: seeds initialisation, batch sampling and noise.
        private: DP-SGD through the engine, or the same loop without clipping and noise.
        noise_multiplier: σ; ``None`` calibrates σ to ``target_epsilon``.
        target_epsilon: ε to calibrate to (used only when ``noise_multiplier`` is ``None``).
        max_grad_norm: C of the clipping function.
        clipping: name in :mod:`dpllm.privacy.clipping` (flat, automatic, psac, psasc).
        clipping_r, clipping_s: r and s of automatic / psac / psasc.
        delta: δ of the guarantee.
        accountant: accountant used to plan (``prv``; see :data:`PRV_SKIP_ABOVE`).
        grad_sample_mode: ``hooks``, ``ghost`` or ``bk`` (correlated noise: any of them here; the lockstep
            :mod:`dpllm.mlp.batched` runs independent noise only).
        noise: ``independent`` (DP-SGD) or ``banded`` (:mod:`dpllm.privacy.correlated`).
        bands: ``banded``: b, or ``auto`` (calibrates against a target ε; needs ``target_epsilon``).
    """

    width: int = 64
    epochs: int = 20
    lr: float = 0.1
    batch_size: int = 64
    seed: int = 42
    private: bool = True
    noise_multiplier: Optional[float] = None
    target_epsilon: Optional[float] = None
    max_grad_norm: float = 1.0
    clipping: str = "flat"
    clipping_r: float = 0.1
    clipping_s: float = 1.0
    delta: float = 1e-5
    accountant: str = "prv"
    grad_sample_mode: str = "hooks"
    noise: str = "independent"
    bands: str = "auto"

    def privacy_config(self, accountant: Optional[str] = None) -> PrivacyConfig:
        if self.clipping == "quantile":  # its C, γ, η and σ_b would be missing from the MLP results
            raise ValueError("clipping: quantile is not yet supported with the MLP recipes; use the LLM recipe "
                             "(recipes/finetune_llm.py) or another clipping function")
        return PrivacyConfig(
            noise_multiplier=self.noise_multiplier, target_epsilon=self.target_epsilon,
            target_delta=self.delta, max_grad_norm=self.max_grad_norm, accountant=accountant or self.accountant,
            grad_sample_mode=self.grad_sample_mode, clipping=self.clipping, clipping_r=self.clipping_r,
            clipping_s=self.clipping_s, noise=self.noise, bands=str(self.bands),
        )

    def correlated_noise(self, *, n_train: int, accountant: Optional[str] = None):
        """The registry's mechanism for this run (:func:`dpllm.privacy.correlated.build`): sampler, recurrence, event.

        Raises:
            dpllm.privacy.accounting.PrivacyPlanError: an unknown mechanism or bad bands; ``blt`` (not built into
                this trainer) or ``bands: auto`` with a given σ.
        """
        from dpllm.privacy.accounting import PrivacyPlanError
        from dpllm.privacy.correlated import build

        if self.noise == "blt":  # the MLP plan and record do not carry BLT's Gaussian-mechanism accounting
            raise PrivacyPlanError("noise: blt is not built into the MLP trainer (dpllm.mlp.train); use noise: "
                                   "banded here, or train BLT with recipes/finetune_llm.py or DPTrainer")
        return build(self.noise, self.bands, steps=self.epochs * batches_per_epoch(n_train, self.batch_size),
                     num_records=n_train, batch=self.batch_size, target_epsilon=self.target_epsilon,
                     delta=self.delta, accountant=accountant or self.accountant,
                     noise_multiplier=self.noise_multiplier)


@dataclass
class TrainedMLP:
    """A finished run: the trained (unwrapped) model and its record for ``results.json``."""

    model: nn.Module
    record: dict


def make_mlp(n_features: int, width: int, n_classes: int) -> nn.Sequential:
    """Linear → ReLU → Linear, the two-layer MLP of the scaling-law and privacy-cliff papers."""
    return nn.Sequential(nn.Linear(n_features, width), nn.ReLU(), nn.Linear(width, n_classes))


def record_texts(x: torch.Tensor, y: torch.Tensor) -> list[str]:
    """Each record's own content (label and features, 9 significant digits) as text: what its cyclic group under
    correlated noise is a keyed hash of (:mod:`dpllm.privacy.correlated.groups`); no other record enters it."""
    return [f"{int(label)}:" + ",".join(f"{v:.9g}" for v in row) for row, label in zip(x.tolist(), y.tolist())]


def num_parameters(model: nn.Module) -> int:
    """All parameters of ``model`` (every MLP parameter trains; :func:`dpllm.models.count_parameters` splits)."""
    return sum(p.numel() for p in model.parameters())


def epsilons(*, noise_multiplier: float, sample_rate: float, steps: int, delta: float,
             cache: Optional[dict] = None) -> dict:
    """ε of a finished run under both Opacus accountants, via :func:`dpllm.privacy.accounting.compute_epsilon`.

    Args:
        noise_multiplier, sample_rate, steps, delta: the run's accountant history and δ.
        cache: optional dict memoising results across runs that share ``(σ, q, steps, δ)``
            (a PRV evaluation costs 0.1-2 s, the whole training run less).

    Returns:
        ``{"epsilon_prv": float | None, "epsilon_rdp": float, "prv_note": str | None}``;
        ``epsilon_prv`` is ``None`` only when the RDP ε exceeds :data:`PRV_SKIP_ABOVE`.
    """
    key = (float(noise_multiplier), float(sample_rate), int(steps), float(delta))
    if cache is not None and key in cache:
        return dict(cache[key])
    common = dict(noise_multiplier=noise_multiplier, sample_rate=sample_rate, steps=steps, delta=delta)
    rdp = accounting.compute_epsilon(**common, accountant="rdp")
    if rdp > PRV_SKIP_ABOVE:
        out = {"epsilon_prv": None, "epsilon_rdp": rdp,
               "prv_note": f"PRV not run: RDP ε = {rdp:.4g} > {PRV_SKIP_ABOVE:g} (PRV's domain blows up there)"}
    else:
        out = {"epsilon_prv": accounting.compute_epsilon(**common, accountant="prv"), "epsilon_rdp": rdp,
               "prv_note": None}
    if cache is not None:
        cache[key] = dict(out)
    return out


def plan_for(run: MLPRun, *, n_train: int, cache: Optional[dict] = None) -> PrivacyPlan:
    """The engine's privacy plan for ``run`` on ``n_train`` records (σ given or calibrated).

    Planning depends only on (σ or target ε, δ, q, steps), so plans are memoised in ``cache``. When σ
    is given and its RDP ε is above :data:`PRV_SKIP_ABOVE`, the plan is made with the RDP accountant, because
    ``plan_privacy`` evaluates ε with the planning accountant and PRV would spend a minute failing there.

    Raises:
        dpllm.privacy.accounting.PrivacyPlanError: δ ≥ 1/N or an unreachable target ε.
    """
    n_batches = batches_per_epoch(n_train, run.batch_size)
    steps = run.epochs * n_batches
    key = (run.noise_multiplier, run.target_epsilon, run.delta, run.accountant, n_train, n_batches, steps, run.noise,
           str(run.bands))
    plans = {} if cache is None else cache.setdefault("plans", {})
    if key not in plans:
        accountant = run.accountant
        noise = run.correlated_noise(n_train=n_train)
        if run.noise_multiplier is not None and accountant == "prv":
            rdp = accounting.compute_epsilon_history(history=[noise.event(run.noise_multiplier)], delta=run.delta,
                                                     accountant="rdp")
            if rdp > PRV_SKIP_ABOVE:
                accountant = "rdp"
        plans[key] = plan_privacy(num_records=n_train, logical_batch_size=run.batch_size, steps=steps,
                                  target_epsilon=run.target_epsilon, delta=run.delta, accountant=accountant,
                                  noise_multiplier=run.noise_multiplier, noise=noise)
    return plans[key]


@torch.no_grad()
def predict(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Logits of ``model`` on ``x`` (one batch: the data sets are small)."""
    was_training = model.training
    model.eval()
    out = model(x)
    model.train(was_training)
    return out


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """Mean cross-entropy (nats) and accuracy of ``model`` on ``(x, y)``."""
    logits = predict(model, x)
    return {"loss": float(nn.functional.cross_entropy(logits, y)),
            "accuracy": float((logits.argmax(dim=1) == y).float().mean())}


def train_mlp(run: MLPRun, data: Split, *, plan: Optional[PrivacyPlan] = None,
              eps_cache: Optional[dict] = None) -> TrainedMLP:
    """Train one MLP on ``data.x_train`` and evaluate it on both splits.

    Args:
        run: the run's settings.
        data: the split (the whole ``x_train`` is the private data set).
        plan: the engine's plan (:func:`plan_for`); required when ``run.private``.
        eps_cache: memo for :func:`epsilons`.

    Returns:
        The unwrapped model and a record with the config, σ, C, q, steps, δ, ε(PRV), ε(RDP), metrics
        and wall time.

    Raises:
        ValueError: a private run without a plan, or a plan made for another data set size.
        RuntimeError: the engine's accountant recorded a history other than the planned one.
    """
    start = time.perf_counter()
    x, y = data.x_train, data.y_train
    n, n_batches = data.n_train, batches_per_epoch(data.n_train, run.batch_size)
    steps = run.epochs * n_batches
    torch.manual_seed(run.seed)  # initialisation
    # Separate streams for batches and noise: runs with the same seed see the same batches whatever σ,
    # C or the clipping function, so comparisons between them are paired.
    sampling = torch.Generator().manual_seed(stream_seed(run.seed, "mlp:sampling"))
    noise = torch.Generator().manual_seed(stream_seed(run.seed, "mlp:noise"))
    model = make_mlp(data.n_features, run.width, data.n_classes)
    n_params = num_parameters(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=run.lr)
    criterion = nn.CrossEntropyLoss()
    private = None
    if run.private:
        if plan is None or plan.num_records != n or plan.steps != steps:
            raise ValueError(f"private run needs plan_for(run, n_train={n}) (steps={steps}); got {plan}")
        correlated = None
        if run.noise != "independent":  # the registry's mechanism with the b the plan accounts (auto's choice)
            from dpllm.privacy.correlated import build

            correlated = build(run.noise, plan.bands, steps=steps, num_records=n, batch=run.batch_size)
        private = make_private(model=model, optimizer=optimizer, dataset=TensorDataset(x, y), collate_fn=None,
                               cfg=run.privacy_config(plan.accountant), plan=plan, logical_batch_size=run.batch_size,
                               noise_generator=noise, sampling_generator=sampling, noise=correlated,
                               texts=record_texts(x, y) if correlated is not None else None, group_key=run.seed)
        wrapped, optimizer = private.model, private.optimizer
        criterion = private.criterion or criterion  # ghost mode hands back its own criterion
        sampler = private.data_loader.batch_sampler
    else:
        wrapped = model
        sampler = PoissonBatchSampler(num_samples=n, sample_rate=1.0 / n_batches, generator=sampling)
    wrapped.train()
    batches = iter(sampler)  # endless: one Poisson draw per step
    for _ in range(steps):
        idx = next(batches)
        optimizer.zero_grad(set_to_none=True)
        if not idx:  # an empty Poisson batch (probability (1-q)^N, ~1e-25 here)
            if private is not None:
                add_empty_share(optimizer)  # still a DP step: noise is added and the accountant counts it
                optimizer.step()
            continue
        loss = criterion(wrapped(x[idx]), y[idx])
        loss.backward()
        optimizer.step()

    record: dict[str, Any] = {
        "config": asdict(run), "dataset": data.name, "n_train": n, "n_params": n_params,
        "steps": steps, "sample_rate": 1.0 / n_batches, "expected_batch_size": n / n_batches,
        "noise_multiplier": 0.0, "max_grad_norm": None, "sensitivity": None, "delta": None,
        "accountant_planned": None, "epsilon_prv": None, "epsilon_rdp": None, "prv_note": None,
    }
    if private is not None:
        history = private.history()
        want = plan.stage_history()  # banded: (σ, q_b, ⌈T/b⌉), the reduction's DP-SGD event
        if len(history) != 1 or history[0][2] != want[0][2] or any(
                not math.isclose(a, b, rel_tol=1e-12) for a, b in zip(history[0][:2], want[0][:2])):
            raise RuntimeError(f"the accountant recorded {history}, the plan said {want}")
        record.update(noise_multiplier=plan.noise_multiplier, max_grad_norm=run.max_grad_norm,
                      sensitivity=float(optimizer.max_grad_norm), delta=plan.delta,
                      accountant_planned=plan.accountant,
                      **epsilons(noise_multiplier=want[0][0], sample_rate=want[0][1], steps=want[0][2],
                                 delta=plan.delta, cache=eps_cache))
        if plan.noise:  # the group rate and the accounted steps the ε above is for
            record.update(sample_rate=plan.sample_rate, accounted_steps=want[0][2], noise=dict(plan.noise))
    record["metrics"] = {
        **{f"test_{k}": v for k, v in evaluate(model, data.x_test, data.y_test).items()},
        **{f"train_{k}": v for k, v in evaluate(model, x, y).items()},
    }
    if not math.isfinite(record["metrics"]["train_loss"]):
        raise RuntimeError(f"training diverged (train loss {record['metrics']['train_loss']}); lower lr={run.lr}")
    record["wall_s"] = round(time.perf_counter() - start, 4)
    return TrainedMLP(model=model, record=record)
