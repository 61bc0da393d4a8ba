"""User-level DP: protect every record of one person, not one record (issue #13, docs/user_level.md).

Two ways to train, both behind :func:`dpllm.privacy.engine.make_private`:

- **ULS** (user-level sampling): every user joins each logical batch independently with probability
  q = 1/⌈U/B_u⌉ (:class:`UserPoissonBatchSampler`); a sampled user's gradient is the *mean* of its (at most
  k) records' per-sample gradients, clipped once to C (hooks: :class:`UserLevelDPOptimizer`; bk: per-user
  norms with the cross terms between a user's records, :class:`dpllm.privacy.bk.layers.Units`); the noise σ·C is
  calibrated on the user count. The accountant's ε is then directly the user-level ε: the unit of
  sampling and of sensitivity is the user.
- **ELS** (example-level sampling): record-level DP-SGD on the data capped at k records per user. A user
  is then a group of at most k records, and the user-level guarantee comes from *group privacy*
  (:func:`group_epsilon`): if every record-level run is (ε_r, δ_r)-DP, every group of k records is
  (k·ε_r, k·e^{(k−1)ε_r}·δ_r)-DP (Dwork & Roth 2014 / Vadhan 2017, Lemma 2.2, by induction over the
  k neighbouring datasets on the path). To meet a user-level target (ε, δ), σ is calibrated on the
  record level to ε_r = ε/k at δ_r = δ/(k·e^{(k−1)ε/k}) (:func:`record_targets`).

Contribution bounding (:func:`cap_users`) keeps at most k records of each user, chosen by a generator
seeded with secret randomness, and counts the users trimmed.

Example (group privacy: k = 1 is the record level itself):
    >>> group_epsilon(record_epsilon=2.0, record_delta=1e-6, group_size=1)
    (2.0, 1e-06)
    >>> eps, delta = group_epsilon(record_epsilon=1.0, record_delta=1e-8, group_size=3)
    >>> eps, round(delta / 1e-8, 4)  # 3·e^{2}
    (3.0, 22.1672)
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Callable, Iterator, Optional, Sequence

import torch
from opacus.optimizers import DistributedDPOptimizer, DPOptimizer
from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed

from dpllm.privacy.accounting import PrivacyPlanError, compute_epsilon_history
from dpllm.sampling import PoissonBatchSampler

GROUP_PRIVACY = ("(ε,δ) group privacy: record-level (ε_r, δ_r) gives (k·ε_r, k·e^{(k−1)·ε_r}·δ_r) for a user of "
                 "at most k records (Dwork & Roth 2014; Vadhan 2017, Lemma 2.2)")
ULS_UNIT = "user-level sampling: the accountant's unit is the user (one clipped mean gradient per sampled user)"


# ---- group privacy (ELS) ----------------------------------------------------------------------------------

def group_epsilon(*, record_epsilon: float, record_delta: float, group_size: int) -> tuple[float, float]:
    """(ε, δ) for groups of ``group_size`` records from a record-level (ε_r, δ_r) guarantee.

    Returns:
        ``(k·ε_r, k·e^{(k−1)·ε_r}·δ_r)``; ``δ`` may exceed 1 (no guarantee) for large k·ε_r.
    """
    k = int(group_size)
    if k < 1:
        raise ValueError(f"group_size={group_size} must be ≥ 1")
    if k == 1:
        return float(record_epsilon), float(record_delta)
    return k * record_epsilon, k * math.exp(min((k - 1) * record_epsilon, 700.0)) * record_delta


def record_targets(*, target_epsilon: float, delta: float, group_size: int) -> tuple[float, float]:
    """Record-level (ε_r, δ_r) whose group-privacy conversion is exactly the user-level (ε, δ).

    >>> record_targets(target_epsilon=8.0, delta=1e-5, group_size=1)
    (8.0, 1e-05)
    """
    k = int(group_size)
    eps_r = target_epsilon / k
    return eps_r, delta / (k * math.exp((k - 1) * eps_r))


def els_user_epsilon(*, history, record_delta: float, group_size: int, accountant: str) -> tuple[float, float]:
    """User-level (ε, δ) of an ELS run: the accountant's record-level ε at ``record_delta``, grouped.

    Deterministic in its arguments (the report and the ledger store them), so anyone can recompute it.
    """
    eps_r = compute_epsilon_history(history=history, delta=record_delta, accountant=accountant)
    return group_epsilon(record_epsilon=eps_r, record_delta=record_delta, group_size=group_size)


def user_epsilon_at_delta(*, history, delta: float, group_size: int, accountant: str,
                          tolerance: float = 1e-3) -> float:
    """Smallest user-level ε (at user-level ``delta``) group privacy proves for a record-level run.

    Solves for the least ε_r with ε_acc(δ_r(ε_r)) ≤ ε_r, where δ_r(ε_r) = δ / (k·e^{(k−1)ε_r}) and ε_acc
    is the accountant's record-level ε: the map is increasing, so iterating it from 0 climbs to the least
    fixed point; the returned k·ε_r is checked to satisfy the condition. Used to report record-level runs
    honestly at the user level (``user_sampling: record``). Returns ``inf`` when δ_r
    would underflow (no meaningful guarantee).
    """
    k = int(group_size)
    if k == 1:
        return compute_epsilon_history(history=history, delta=delta, accountant=accountant)

    def f(eps_r: float) -> float:
        log_d = math.log(delta) - math.log(k) - (k - 1) * eps_r
        if log_d < math.log(1e-300):
            return math.inf
        return compute_epsilon_history(history=history, delta=math.exp(log_d), accountant=accountant)

    eps = f(0.0)
    for _ in range(200):
        if not math.isfinite(eps):
            return math.inf
        nxt = f(eps)
        if nxt - eps <= tolerance * max(1.0, eps):
            candidate = nxt + tolerance * max(1.0, nxt)
            if f(candidate) <= candidate:
                return k * candidate
        eps = nxt
    return math.inf


# ---- contribution bounding -----------------------------------------------------------------------------

def cap_generator(*, reproducible: bool, seed: int, stage: str, world) -> torch.Generator:
    """The generator that picks which k records each user keeps: secret (OS entropy, broadcast from rank 0
    so every process keeps the same records), or derived from ``seed`` under ``reproducible_noise``."""
    from dpllm.distributed import broadcast_object
    from dpllm.privacy.randomness import secret_seed
    from dpllm.sampling import stream_seed

    if reproducible:
        value = stream_seed(seed, f"{stage}:user_cap")
    else:
        value = broadcast_object(secret_seed() if world.is_main else None, world)
    return torch.Generator().manual_seed(value)


def group_by_user(ids: Sequence[int], users: Sequence[str]) -> dict[str, list[int]]:
    """Record ids of ``ids`` grouped by their user (``users[i]``), in first-seen order."""
    out: dict[str, list[int]] = defaultdict(list)
    for i in ids:
        out[users[i]].append(i)
    return dict(out)


def cap_users(ids: Sequence[int], users: Sequence[str], k: Optional[int], generator: torch.Generator) -> dict:
    """Keep at most ``k`` records of each user, chosen uniformly at random by ``generator``.

    Args:
        ids: record ids of the training users.
        users: user of every record (indexed by record id).
        k: cap; None keeps every record.
        generator: secretly seeded (:mod:`dpllm.privacy.randomness`), the same on every process.

    Returns:
        ``{"kept": sorted record ids, "by_user": {user: kept ids}, "users": U, "users_trimmed": ...,
        "records_dropped": ..., "largest_user": records of the largest user before the cap}``.
    """
    by_user = group_by_user(sorted(ids), users)
    kept: dict[str, list[int]] = {}
    trimmed = dropped = 0
    for user in sorted(by_user):
        rec = by_user[user]
        if k is not None and len(rec) > k:
            order = torch.randperm(len(rec), generator=generator).tolist()[:k]
            trimmed += 1
            dropped += len(rec) - k
            rec = sorted(rec[j] for j in order)
        kept[user] = rec
    return {"kept": sorted(i for r in kept.values() for i in r), "by_user": kept, "users": len(kept),
            "users_trimmed": trimmed, "users_dropped": 0, "records_dropped": dropped,
            "largest_user": max((len(r) for r in by_user.values()), default=0),
            "largest_kept": max((len(r) for r in kept.values()), default=0)}


# ---- ULS: sampling users ----------------------------------------------------------------------------------

class UserPoissonBatchSampler(PoissonBatchSampler):
    """Poisson sampling of users; yields this process's share of the records of the sampled users.

    Every user joins each logical batch independently with probability q (the draw is over users: the
    parent's mask has one entry per user). All processes draw the same global mask; process r keeps the
    users whose index ≡ r (mod W), so a user's records always land on one process together. Records come
    out grouped by user (a user's records are contiguous), which :func:`whole_user_batches` relies on.

    Args:
        user_records: for each user (index u), the dataset indices of its records.
        sample_rate: q, the inclusion probability of every user.
        generator, rank, world_size: as for :class:`dpllm.sampling.PoissonBatchSampler`.
    """

    def __init__(self, *, user_records: Sequence[Sequence[int]], sample_rate: float, generator: torch.Generator,
                 rank: int = 0, world_size: int = 1):
        super().__init__(num_samples=len(user_records), sample_rate=sample_rate, generator=generator, rank=rank,
                         world_size=world_size)
        self.user_records = [list(r) for r in user_records]
        self.user_of = {i: u for u, recs in enumerate(self.user_records) for i in recs}

    def __iter__(self) -> Iterator[list[int]]:
        for users in super().__iter__():  # the parent's mask is over users; its share rule keeps u ≡ rank
            yield [i for u in users for i in self.user_records[u]]


def whole_user_batches(ids: Sequence[int], user_of: dict, size: int) -> list[list[int]]:
    """Split ``ids`` (grouped by user) into physical batches of ≤ ``size`` records, never splitting a user.

    Raises:
        ValueError: a user has more than ``size`` records (the caller validates this earlier).
    """
    parts: list[list[int]] = []
    current: list[int] = []
    for user, recs in _runs(ids, user_of):
        if len(recs) > size:
            raise ValueError(f"user {user} has {len(recs)} records > physical_batch_size={size}")
        if len(current) + len(recs) > size:
            parts.append(current)
            current = []
        current += recs
    if current or not parts:
        parts.append(current)
    return parts


def _runs(ids: Sequence[int], user_of: dict):
    run: list[int] = []
    for i in ids:
        if run and user_of[i] != user_of[run[0]]:
            yield user_of[run[0]], run
            run = []
        run.append(i)
    if run:
        yield user_of[run[0]], run


# ---- ULS: one clipped gradient per user -----------------------------------------------------------------

def per_user_gradients(grad_sample: torch.Tensor, inverse: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Mean of the per-record rows of ``grad_sample`` over each user (``inverse``: row → user slot)."""
    out = torch.zeros((len(counts), *grad_sample.shape[1:]), dtype=grad_sample.dtype, device=grad_sample.device)
    out.index_add_(0, inverse, grad_sample)
    return out / counts.to(out.dtype).view(-1, *([1] * (grad_sample.dim() - 1)))


class UserLevelOptimizerMixin:
    """Hooks-mode clipping per user: rows of Opacus's ``grad_sample`` averaged by user, then clipped once.

    Before each backward pass the trainer calls :meth:`set_users` with the user of every row of the
    physical batch. A user's records must all be in the same physical batch (:func:`whole_user_batches`),
    so each user's clipped mean gradient, of norm ≤ C, enters the sum exactly once per step; noise
    σ·C and the division by the expected number of users are Opacus's own.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *,
                 clip_weights: Optional[Callable[[torch.Tensor], torch.Tensor]] = None, **kwargs):
        super().__init__(optimizer, **kwargs)
        self.clip_weights = clip_weights
        self.row_users: Optional[torch.Tensor] = None

    def set_users(self, users: Sequence[int]) -> None:
        """The user (any integer id) of each row of the next physical batch."""
        self.row_users = torch.as_tensor(list(users), dtype=torch.long)

    def _weights(self, norms: torch.Tensor) -> torch.Tensor:
        if self.clip_weights is not None:
            return self.clip_weights(norms)
        return (self.max_grad_norm / (norms + 1e-6)).clamp(max=1.0)

    def clip_and_accumulate(self) -> None:
        from dpllm.privacy.clipping import per_sample_norms

        rows = len(self.grad_samples[0])
        if self.row_users is None or len(self.row_users) != rows:
            raise RuntimeError(f"user-level clipping got {rows} rows but set_users() gave "
                               f"{None if self.row_users is None else len(self.row_users)} users; a dpllm bug")
        device = self.grad_samples[0].device
        _, inverse = torch.unique(self.row_users, return_inverse=True)
        inverse = inverse.to(device)
        counts = torch.bincount(inverse) if rows else torch.zeros(0, dtype=torch.long, device=device)
        user_grads = [per_user_gradients(g, inverse, counts) for g in self.grad_samples]
        if rows == 0:
            weights = torch.zeros((0,), device=device)
        else:
            weights = self._weights(per_sample_norms(user_grads))
        for p, g in zip(self.params, user_grads):
            _check_processed_flag(p.grad_sample)
            grad = torch.einsum("i,i...", weights.to(g.device, p.dtype), g.to(p.dtype))
            p.summed_grad = grad if p.summed_grad is None else p.summed_grad + grad
            _mark_as_processed(p.grad_sample)
        self.row_users = None


class UserLevelDPOptimizer(UserLevelOptimizerMixin, DPOptimizer):
    """Opacus's ``DPOptimizer`` clipping one mean gradient per user (ULS)."""


class UserLevelDistributedDPOptimizer(UserLevelOptimizerMixin, DistributedDPOptimizer):
    """Opacus's ``DistributedDPOptimizer`` (DDP) clipping one mean gradient per user (ULS)."""


def optimizer_class(base: type) -> type:
    """The ULS subclass of Opacus's hooks-mode optimizer class ``base``.

    Raises:
        PrivacyPlanError: ``base`` is not a hooks-mode optimizer (Opacus's ghost clipping has no per-sample
            rows; bk clips per user in :class:`dpllm.privacy.bk.BookKeepingModule` instead).
    """
    from opacus.optimizers import DPOptimizerFastGradientClipping

    if not issubclass(base, DPOptimizerFastGradientClipping):
        if issubclass(base, DistributedDPOptimizer):
            return UserLevelDistributedDPOptimizer
        if issubclass(base, DPOptimizer):
            return UserLevelDPOptimizer
    raise PrivacyPlanError(f"user-level sampling needs grad_sample_mode: bk or hooks, but this model runs Opacus's "
                           f"{base.__name__} (ghost clipping cannot sum a user's records before clipping); set "
                           "grad_sample_mode: hooks, or freeze the layers bk cannot handle")
