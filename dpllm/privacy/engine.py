"""Opacus wrapping for causal LMs: one place where model, optimizer and data become private.

:func:`make_private` turns a model, optimizer and record dataset into a :class:`PrivateTraining`:
Poisson sampling at the plan's rate q (:mod:`dpllm.privacy.plan`: Opacus is never left to derive its own q
from a loader length, which for 6.7% of batch counts k ≤ 10⁴ is not 1/k), noise calibrated to the target ε
with the same accountant that reports it, ghost clipping (or hooks, or book-keeping: :mod:`dpllm.privacy.bk`),
and the clipping function from
:mod:`dpllm.privacy.clipping`. Batches come from :class:`dpllm.sampling.PoissonBatchSampler`, whose
generator a resumable checkpoint saves, and which gives every process its share of the same global batch.
:func:`sequence_loss` is the only loss the trainer uses: one loss per record (mean over its real
tokens) so the per-sample unit is the record.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from dpllm.config import PrivacyConfig
from dpllm.privacy import accounting
from dpllm.privacy.correlated import accounted_steps
from dpllm.privacy.plan import PrivacyPlan

log = logging.getLogger(__name__)


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
    grad_sample_mode: str = ""  # the mode that ran: cfg.grad_sample_mode with "auto" resolved
    grad_sample_mode_reason: str = ""  # why that mode (dpllm.privacy.modes.choose_mode)
    quantile: Any = None  # clipping: quantile: its dpllm.privacy.quantile.QuantileClipping (C, the trajectory)
    recurrence: Any = None  # privacy.noise: banded or blt: the optimizer's noise recurrence (its state is secret)

    def history(self) -> list[tuple[float, float, int]]:
        """The accounted history after any prior stages: what the accountant recorded (Opacus's optimizer hook,
        one entry per (σ, q) run of optimizer steps); under b-banded noise n steps are the DP-SGD event's
        ⌈n/b⌉ (:mod:`dpllm.privacy.correlated`); under BLT n steps at the plan's (σ, q_b) are one Gaussian mechanism
        (:meth:`dpllm.privacy.plan.PrivacyPlan.stage_history`)."""
        b, runs = self.plan.bands, []
        if self.plan.gaussian:
            recorded = {(float(s), float(q)) for s, q, _ in self.engine.accountant.history}
            if recorded - {(float(self.plan.noise_multiplier), float(self.plan.sample_rate))}:
                raise RuntimeError(f"the accountant recorded steps at (σ, q) = {sorted(recorded)}, the BLT plan draws "
                                   f"at ({self.plan.noise_multiplier}, {self.plan.sample_rate}); a dpllm bug")
            return [tuple(h) for h in self.plan.prior_history] + self.plan.stage_history(self.steps_taken())
        if b == 1:
            return [tuple(h) for h in self.plan.prior_history] + [tuple(h) for h in self.engine.accountant.history]
        for s, q, n in self.engine.accountant.history:  # one run per (σ, q): ⌈·/b⌉ of a split run could count more
            if runs and runs[-1][:2] == (s, q):
                runs[-1] = (s, q, runs[-1][2] + n)
            else:
                runs.append((s, q, n))
        return [tuple(h) for h in self.plan.prior_history] + [
            (s, q, accounted_steps(n, b)) for s, q, n in runs]

    def set_users(self, users, *, reduction: str = "mean") -> None:
        """ULS: the user of each row of the next physical batch (the bk module or the hooks optimizer clips
        one mean gradient per user); split long records (``reduction="sum"``): each window's source record, whose
        windows' summed gradient is clipped once."""
        (self.model if self.grad_sample_mode == "bk" else self.optimizer).set_users(users, reduction=reduction)

    def set_segments(self, segments) -> None:
        """Packed rows (``data.packing``, :mod:`dpllm.packing`): each token's record (−1 padding) for the next
        backward pass, whose records bk then clips one by one. Only bk clips inside a row."""
        if self.grad_sample_mode != "bk":
            raise RuntimeError(f"packed rows need grad_sample_mode bk, not {self.grad_sample_mode}; a dpllm bug")
        self.model.set_segments(segments)

    def stand_in_row(self) -> None:
        """The next backward pass is the one masked row :func:`dpllm.train.forward_loss` runs for an empty share:
        ``clipping: quantile`` must not count it as a record under C (its centred bit would add ½, and an empty
        batch against one of one record would then move the count by 1, twice the sensitivity accounted)."""
        if self.quantile is not None:
            self.quantile.skip_next()

    def steps_taken(self) -> int:
        """Optimizer steps taken (the accountant hook counts every one)."""
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
    user_records: Optional[list[list[int]]] = None,
    physical_batch_size: Optional[int] = None,
    max_length: Optional[int] = None,
    noise=None,
    texts: Optional[list[str]] = None,
    group_key: int = 0,
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
        user_records: user-level sampling (:mod:`dpllm.privacy.user_level`): each user's dataset indices;
            users are Poisson-sampled at the plan's q and each user's mean gradient is clipped once (hooks or
            bk; :meth:`PrivateTraining.set_users` names the user of every row before each backward pass). The
            same machinery samples and clips a long record's windows as one unit (:mod:`dpllm.windows`: each
            record's window rows, ``set_users(..., reduction="sum")``).
        physical_batch_size: records per backward pass; ``grad_sample_mode: auto`` weighs hooks' per-sample
            gradient memory with it (:mod:`dpllm.privacy.modes`).
        max_length: the longest record the run may see (``data.max_length``): the independence check adds one
            record of that length to the first batch (:mod:`dpllm.privacy.independence`, step 4). None: it does
            not (a caller that does not know it).
        noise: correlated noise (:class:`dpllm.privacy.correlated.CorrelatedNoise`, the one the plan was made with):
            its cyclic sampler over ``texts`` (each row's record text, or under ``user_records`` each user's id;
            groups keyed by ``group_key``, public) and its noise recurrence in the optimizer (bk's, or Opacus's
            hooks/ghost one subclassed: :mod:`dpllm.privacy.correlated.optimizer`). None: DP-SGD.

    Returns:
        A :class:`PrivateTraining` whose ``sampler`` (and ``data_loader`` over it) never ends: one
        Poisson batch per step, so the caller stops at the planned step count.

    Raises:
        dpllm.models.ModelError: gradient checkpointing turned on in the model under a mode other than bk.
    """
    from opacus import PrivacyEngine

    from dpllm.models import check_checkpointing
    from dpllm.privacy import bk, clipping
    from dpllm.privacy.independence import guard_record_independence
    from dpllm.privacy.modes import choose_mode
    from dpllm.sampling import PoissonBatchSampler

    # Opacus's accountant only records the (σ, q, steps) history; dpllm computes ε from it with plan.accountant
    # (pld, a fallback Opacus does not have, records like rdp)
    engine = PrivacyEngine(accountant="rdp" if plan.accountant == "pld" else plan.accountant,
                           secure_mode=cfg.secure_mode)
    # Our own Poisson sampler over the whole dataset, never skipping a process's empty share (Opacus's
    # distributed sampler does, desynchronising step counts), with a generator whose state a resumable
    # checkpoint saves. Opacus never sees the loader (it would derive q from its length): the accountant
    # hook is attached with the plan's q below, so q has exactly one source.
    sampler = PoissonBatchSampler(num_samples=len(dataset), sample_rate=plan.sample_rate, rank=rank,
                                  world_size=world_size,
                                  generator=engine.secure_rng if cfg.secure_mode else sampling_generator)
    if noise is not None and noise.correlated:  # cyclic Poisson over the mechanism's groups (dpllm.privacy.correlated)
        units = len(user_records) if user_records is not None else len(dataset)
        if texts is None or len(texts) != units:
            raise ValueError(f"privacy.noise: {noise.name} needs one key per sampled unit to group them ("
                             f"{units} {'users' if user_records is not None else 'training rows'}, "
                             f"{'no' if texts is None else len(texts)} keys); a dpllm bug")
        if noise.sample_rate != plan.sample_rate or noise.bands != plan.bands:
            raise ValueError(f"the noise mechanism ({noise.bands} bands, q_b={noise.sample_rate}) is not the one the "
                             f"plan accounts ({plan.bands} bands, q={plan.sample_rate}); a dpllm bug")
        # ULS: the unit is a user, its group a keyed hash of its id (texts), and a sampled user brings its records
        sampler = noise.sampler(texts=texts, key=group_key, generator=sampler.generator, rank=rank,
                                world_size=world_size, unit_records=user_records)
    elif user_records is not None:  # ULS: the same draw over users (dpllm.privacy.user_level)
        from dpllm.privacy.user_level import UserPoissonBatchSampler

        sampler = UserPoissonBatchSampler(user_records=user_records, sample_rate=plan.sample_rate, rank=rank,
                                          world_size=world_size, generator=sampler.generator)
    # DataLoader's own generator only seeds worker processes; a private one keeps it off the global RNG.
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate_fn, generator=torch.Generator())
    criterion = nn.CrossEntropyLoss(ignore_index=-100)
    adaptive = cfg.clipping == "quantile"
    fn = clipping.get("flat" if adaptive else cfg.clipping)
    choice = choose_mode(cfg.grad_sample_mode, model, physical_batch_size=physical_batch_size,
                         per_user=user_records is not None)
    mode = choice.mode
    quantile = _quantile_clipping(cfg, plan, mode=mode) if adaptive else None
    log.info("privacy: grad_sample_mode=%s (%s)", mode, choice.reason)
    check_checkpointing(model, mode)  # read from the model, however checkpointing was turned on
    # every mode: the first batch is checked for records that reach each other (mixing rows, per-position layers)
    guard_record_independence(model, max_length=max_length)
    recurrence = noise.recurrence() if noise is not None else None
    if recurrence is not None and mode == "ghost_fsdp":  # config.correlated_problem says so before any loading
        raise ValueError(f"privacy.noise: {noise.name} is not built for grad_sample_mode=ghost_fsdp (Opacus's FSDP "
                         "optimizer); use bk under FSDP")
    if mode == "bk":  # book-keeping: one backward pass, Opacus's ghost-clipping optimizer adds the noise
        model, optimizer = bk.make_private_bk(
            engine=engine, model=model, optimizer=optimizer,
            clip_weights=quantile.weights if quantile else lambda n: fn.weights(n, cfg),
            noise_multiplier=plan.noise_multiplier, max_grad_norm=fn.sensitivity(cfg),
            expected_batch_size=plan.expected_batch_size, world_size=world_size, noise_generator=noise_generator,
            secure_mode=cfg.secure_mode, per_user=user_records is not None, quantile=quantile)
        criterion = None
        optimizer.recurrence = recurrence  # None: independent noise
    else:
        from dpllm.distributed import is_sharded, unsharded_parameters
        from dpllm.privacy.owners import guard_parameter_uses
        from dpllm.privacy.paths import guard_gradient_paths

        # a weight used outside its layer: refused at the first forward pass (under FSDP the forward pass uses
        # unsharded copies of the registered parameters: those are the ones watched)
        guard_parameter_uses(model, mode, parameters=unsharded_parameters(model) if is_sharded(model) else None)
        guard_gradient_paths(model, mode)  # any gradient around a layer's own call: refused on every step
        model, optimizer, criterion = _wrap_opacus(
            engine=engine, model=model, optimizer=optimizer, criterion=criterion, fn=fn, cfg=cfg, mode=mode,
            noise_multiplier=plan.noise_multiplier, expected_batch_size=plan.expected_batch_size / world_size,
            noise_generator=noise_generator, per_user=user_records is not None, quantile=quantile,
            recurrence=recurrence)
    optimizer.attach_step_hook(engine.accountant.get_optimizer_hook_fn(sample_rate=plan.sample_rate))
    # What Opacus's Poisson mode would also do: a second backward before a step is an error, not a sum.
    getattr(model, "forbid_grad_accumulation", lambda: None)()
    return PrivateTraining(model=model, optimizer=optimizer, criterion=criterion, data_loader=loader,
                           engine=engine, plan=plan, sampler=sampler, grad_sample_mode=mode,
                           grad_sample_mode_reason=choice.reason, quantile=quantile, recurrence=recurrence)


def count_noise_multiplier(cfg: PrivacyConfig, plan: PrivacyPlan) -> float:
    """σ_b of ``clipping: quantile``: the configured one, else m/20 for the expected (public) batch m = q·N."""
    from dpllm.privacy.quantile import DEFAULT_COUNT_NOISE_FRACTION

    if cfg.count_noise_multiplier is not None:
        return float(cfg.count_noise_multiplier)
    return plan.expected_batch_size / DEFAULT_COUNT_NOISE_FRACTION


def _quantile_clipping(cfg: PrivacyConfig, plan: PrivacyPlan, *, mode: str):
    """The adaptive C of ``clipping: quantile`` (:mod:`dpllm.privacy.quantile`), or one line saying what it does not
    cover yet. Covered: bk (one process, DDP, FSDP2), hooks and ghost (one process, DDP); across processes the count
    is summed and noised once, on rank 0; per-unit clipping (ULS users, split long records) counts one bit per unit.
    Under a noise schedule the optimizer's σ changes per step and σ_g is computed from each step's σ_t (σ_b is fixed:
    it must exceed every σ_t/2). Not covered: Opacus's ghost_fsdp."""
    from dpllm.privacy.quantile import QuantileClipping, check_count_noise

    if mode == "ghost_fsdp":
        raise ValueError("clipping: quantile is not yet supported with grad_sample_mode=ghost_fsdp")
    sigma_b = count_noise_multiplier(cfg, plan)
    check_count_noise(plan.largest_sigma(), sigma_b)
    return QuantileClipping(initial=cfg.max_grad_norm, target_quantile=cfg.target_quantile, lr=cfg.quantile_lr,
                            count_noise_multiplier=sigma_b, expected_batch_size=plan.expected_batch_size)


def _wrap_opacus(*, engine, model: nn.Module, optimizer: torch.optim.Optimizer, criterion, fn, cfg: PrivacyConfig,
                 mode: str, noise_multiplier: float, expected_batch_size: float,
                 noise_generator: Optional[torch.Generator], per_user: bool = False, quantile=None,
                 recurrence=None):
    """Opacus's grad-sample module, DP optimizer and (ghost) criterion, built from its public classes.

    This is what ``PrivacyEngine.make_private`` does for an already-sampling loader, except that the classes
    come from :func:`dpllm.privacy.clipping.opacus_classes`, so a clipping function other than flat is
    Opacus's class subclassed, not a patched instance; ``make_private`` itself takes no custom classes.
    The loader needs no wrapping: our sampler already draws from the secure generator under secure mode.
    ``recurrence`` (correlated noise): the optimizer class is subclassed once more so that its noise is the
    recurrence's map of the same draws (:func:`dpllm.privacy.correlated.optimizer.correlated_class`).

    Returns:
        ``(model, optimizer, criterion)``; criterion is None outside ghost clipping.
    """
    from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dpllm.privacy import clipping

    if noise_generator is not None and cfg.secure_mode:
        raise ValueError("Passing seed is prohibited in secure mode")  # Opacus's own check and words
    model_parameters = set(model.parameters())
    if any(p not in model_parameters for group in optimizer.param_groups for p in group["params"]):
        raise ValueError("Module parameters are different than optimizer Parameters")
    engine.validate(module=model, optimizer=None, data_loader=None)
    module_cls, module_kwargs, optimizer_cls, optimizer_kwargs = clipping.opacus_classes(
        fn, cfg, grad_sample_mode=mode, distributed=isinstance(model, (DPDDP, DDP, FSDPModule)), quantile=quantile)
    if per_user:  # ULS: Opacus's optimizer subclassed to clip one mean gradient per user (user_level)
        from dpllm.privacy.user_level import optimizer_class

        optimizer_cls = optimizer_class(optimizer_cls, quantile=quantile is not None)
        optimizer_kwargs = {"clip_weights": quantile.weights if quantile is not None else lambda n: fn.weights(n, cfg)}
    if recurrence is not None:  # correlated noise: the same draws, mapped by the mechanism's recurrence
        from dpllm.privacy.correlated.optimizer import correlated_class

        optimizer_cls = correlated_class(optimizer_cls)
    ghost = "ghost" in mode
    sensitivity = fn.sensitivity(cfg)
    # Ghost modules take max_grad_norm for Opacus's flat coefficient; hooks modules clip in the optimizer.
    model = module_cls(model, batch_first=True, loss_reduction="mean", **module_kwargs,
                       **({"max_grad_norm": sensitivity} if ghost else {}))
    optimizer = optimizer_cls(optimizer, noise_multiplier=noise_multiplier, max_grad_norm=sensitivity,
                              expected_batch_size=expected_batch_size, loss_reduction="mean",
                              generator=engine.secure_rng if cfg.secure_mode else noise_generator,
                              secure_mode=cfg.secure_mode, **optimizer_kwargs)
    if quantile is not None:
        optimizer.quantile = quantile
    if recurrence is not None:
        optimizer.recurrence = recurrence
    criterion = DPLossFastGradientClipping(model, optimizer, criterion, "mean") if ghost else None
    return model, optimizer, criterion


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

