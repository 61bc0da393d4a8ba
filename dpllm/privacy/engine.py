"""Opacus wrapping for causal LMs: one place where model, optimizer and data become private.

:func:`make_private` turns a model, optimizer and record dataset into a :class:`PrivateTraining`:
Poisson sampling at rate q = 1/len(loader) (Opacus's own definition), noise calibrated to the target ε
with the same accountant that reports it, ghost clipping (or hooks), and the clipping function from
:mod:`dpllm.privacy.clipping`. Batches come from :class:`dpllm.sampling.PoissonBatchSampler`, whose
generator a checkpoint saves, and which gives every process its share of the same global batch.
:func:`sequence_loss` is the only loss the trainer uses: one loss per record (mean over its real
tokens) so the per-sample unit is the record.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from dpllm.config import PrivacyConfig
from dpllm.privacy import accounting
from dpllm.privacy.accounting import PrivacyPlanError

log = logging.getLogger(__name__)


@dataclass
class PrivacyPlan:
    """Everything the accountant needs, decided before any training step."""

    num_records: int
    sample_rate: float
    steps: int
    noise_multiplier: float
    delta: float
    accountant: str
    expected_batch_size: int
    prior_history: list = field(default_factory=list)

    def epsilon(self, steps: Optional[int] = None) -> float:
        steps = self.steps if steps is None else steps
        return accounting.compute_epsilon_history(
            history=self.prior_history + [(self.noise_multiplier, self.sample_rate, steps)],
            delta=self.delta,
            accountant=self.accountant,
        )


def plan_privacy(
    cfg: PrivacyConfig,
    *,
    num_records: int,
    num_batches_per_epoch: int,
    steps: int,
    prior_history: Optional[list] = None,
) -> PrivacyPlan:
    """Check δ, pick or check the noise multiplier, and return the plan; all before training starts.

    Raises:
        PrivacyPlanError: δ ≥ 1/N, an unreachable target ε, or a given noise multiplier whose ε exceeds
            the target.
    """
    accounting.check_delta(cfg.target_delta, num_records)
    accounting.check_accountant(cfg.accountant)
    prior = list(prior_history or [])
    q = 1.0 / num_batches_per_epoch  # Opacus's DPDataLoader samples each record with this probability
    if cfg.noise_multiplier is None:
        sigma = accounting.calibrate_noise(
            target_epsilon=cfg.target_epsilon, delta=cfg.target_delta, sample_rate=q, steps=steps,
            accountant=cfg.accountant, prior_history=prior,
        )
    else:
        sigma = float(cfg.noise_multiplier)
    plan = PrivacyPlan(
        num_records=num_records, sample_rate=q, steps=steps, noise_multiplier=sigma, delta=cfg.target_delta,
        accountant=cfg.accountant, expected_batch_size=int(num_records * q), prior_history=prior,
    )
    eps = plan.epsilon()
    if cfg.target_epsilon is not None and eps > cfg.target_epsilon:
        raise PrivacyPlanError(
            f"noise_multiplier={sigma:g} over {steps:,} steps at sample rate {q:.4g} gives ε={eps:.3f} > "
            f"target_epsilon={cfg.target_epsilon}; raise noise_multiplier, lower steps, or unset it to calibrate"
        )
    return plan


def sequence_loss(logits: torch.Tensor, labels: torch.Tensor, criterion: Optional[Callable] = None):
    """Mean over records of each record's mean next-token loss; padding (label -100) never counts.

    With Opacus ghost clipping, ``criterion`` is the wrapped criterion from ``make_private`` and
    ``shape=`` makes it reduce per sequence, so each record is one sample. Without it, the same
    per-record reduction is done here (hooks mode and non-private training).
    """
    shift_logits = logits[:, :-1, :].contiguous()
    shift_labels = labels[:, 1:].contiguous()
    B, T, V = shift_logits.shape
    flat_logits, flat_labels = shift_logits.reshape(-1, V).float(), shift_labels.reshape(-1)
    if criterion is not None:
        return criterion(flat_logits, flat_labels, shape=(B, T, V))
    per_token = nn.functional.cross_entropy(flat_logits, flat_labels, reduction="none", ignore_index=-100)
    per_token = per_token.view(B, T)
    counts = (shift_labels != -100).sum(dim=1).clamp(min=1)
    return (per_token.sum(dim=1) / counts).mean()


@dataclass
class PrivateTraining:
    model: nn.Module
    optimizer: Any
    criterion: Optional[Callable]
    data_loader: DataLoader
    engine: Any
    plan: PrivacyPlan
    sampler: Any = None  # dpllm.sampling.PoissonBatchSampler: its generator is part of a resumable checkpoint

    def history(self) -> list[tuple[float, float, int]]:
        """Steps the accountant actually recorded (Opacus's optimizer hook), after any prior stages."""
        return self.plan.prior_history + [tuple(h) for h in self.engine.accountant.history]

    def steps_taken(self) -> int:
        return sum(int(h[2]) for h in self.engine.accountant.history)

    def epsilon(self) -> float:
        return accounting.compute_epsilon_history(
            history=self.history(), delta=self.plan.delta, accountant=self.plan.accountant
        )


def make_private(
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    dataset: Dataset,
    collate_fn: Callable,
    cfg: PrivacyConfig,
    plan: PrivacyPlan,
    logical_batch_size: int,
    noise_generator: Optional[torch.Generator] = None,
    sampling_generator: Optional[torch.Generator] = None,
    rank: int = 0,
    world_size: int = 1,
) -> PrivateTraining:
    """Wrap with Opacus: Poisson sampling, per-sample clipping (ghost or hooks), Gaussian noise.

    Args:
        model: the model, already wrapped for distributed training if any (see :mod:`dpllm.distributed`).
        noise_generator: source of the Gaussian noise (None: torch's global generator; refused by Opacus
            under ``secure_mode``). Must differ between processes under FSDP, where each adds noise to
            its own shard.
        sampling_generator: source of the Poisson draws, in the same state on every process (None:
            torch's global generator; under ``secure_mode`` Opacus's secure generator).
        rank, world_size: this process's share of each global batch.

    Returns:
        A :class:`PrivateTraining` whose ``sampler`` (and ``data_loader`` over it) never ends: one
        Poisson batch per step, so the caller stops at the planned step count.
    """
    from opacus import PrivacyEngine

    from dpllm.privacy import clipping
    from dpllm.sampling import PoissonBatchSampler

    engine = PrivacyEngine(accountant=plan.accountant, secure_mode=cfg.secure_mode)
    loader = DataLoader(dataset, batch_size=logical_batch_size, shuffle=False, collate_fn=collate_fn)
    if abs(1.0 / len(loader) - plan.sample_rate) > 1e-12:
        raise PrivacyPlanError("sample rate changed between planning and wrapping; this is a dpllm bug")
    criterion = nn.CrossEntropyLoss(ignore_index=-100)
    fn = clipping.get(cfg.clipping)
    out = engine.make_private(
        module=model,
        optimizer=optimizer,
        criterion=criterion,
        data_loader=loader,
        noise_multiplier=plan.noise_multiplier,
        max_grad_norm=fn.sensitivity(cfg),
        poisson_sampling=True,
        grad_sample_mode=cfg.grad_sample_mode,
        noise_generator=noise_generator,
    )
    if "ghost" in cfg.grad_sample_mode:
        model, optimizer, criterion, loader = out
    else:
        (model, optimizer, loader), criterion = out, None
    clipping.install(fn, cfg, model=model, optimizer=optimizer)
    # Opacus derived q and the expected batch size from its own loader (1/len, per process); keep those
    # and swap in a sampler that yields the same global batches on any number of processes, never skips
    # a process's empty share (Opacus's distributed sampler does, desynchronising step counts), and has
    # a generator whose state a checkpoint can save.
    sampler = PoissonBatchSampler(num_samples=len(dataset), sample_rate=plan.sample_rate, rank=rank,
                                  world_size=world_size,
                                  generator=engine.secure_rng if cfg.secure_mode else sampling_generator)
    # DataLoader's own generator only seeds worker processes; a private one keeps it off the global RNG.
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate_fn, generator=torch.Generator())
    return PrivateTraining(model=model, optimizer=optimizer, criterion=criterion, data_loader=loader,
                           engine=engine, plan=plan, sampler=sampler)


def add_empty_share(optimizer) -> None:
    """Give ``optimizer`` a zero clipped-gradient sum for a physical batch with no records.

    A Poisson draw can leave a process's share of a logical batch empty (and, rarely, the whole batch).
    Instead of a forward and backward pass on zero rows, the per-sample state Opacus expects is set to
    "no samples"; ``optimizer.step()`` then adds the noise, counts the step in the accountant and joins
    the gradient all-reduce like every other process. (:func:`dpllm.train.forward_loss` instead runs
    one fully masked record, which also keeps FSDP's forward/backward collectives in step.)
    """
    from opacus.optimizers import DPOptimizerFastGradientClipping

    for p in optimizer.params:
        if isinstance(optimizer, DPOptimizerFastGradientClipping):
            p.grad = torch.zeros_like(p)  # ghost clipping sums clipped gradients from p.grad
        else:
            p.grad_sample = torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device)


def steps_for(cfg_epochs: Optional[float], max_steps: Optional[int], batches_per_epoch: int) -> int:
    if cfg_epochs is not None:
        return max(1, math.ceil(cfg_epochs * batches_per_epoch))
    return int(max_steps)
