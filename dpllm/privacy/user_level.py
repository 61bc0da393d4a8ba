"""User-level DP: protect every record of one person, not one record (issue #13, docs/user_level.md).

Two ways to train, both behind :func:`dpllm.privacy.engine.make_private`:

- **ULS** (user-level sampling): every user joins each logical batch independently with probability
  q = 1/⌈U/B_u⌉ (:class:`UserPoissonBatchSampler`); a sampled user's gradient is the *mean* of its (at most
  k) records' per-sample gradients, clipped once to C (hooks: :class:`UserLevelDPOptimizer`; bk: per-user
  norms with the cross terms between a user's records, :class:`dpllm.privacy.bk.layers.Units`); the noise σ·C is
  calibrated on the user count. The accountant's ε is then directly the user-level ε: the unit of
  sampling and of sensitivity is the user.
- **ELS** (example-level sampling): record-level DP-SGD on the data capped at k records per user. A user
  is then a group of at most k records. Its user-level ε is computed *tightly* (:func:`mixture_epsilon`):
  in each step J ~ Bin(k, q) of the user's records are sampled, and the worst case adds J·C along one
  direction, so one step is dominated by the mixture of Gaussians Σⱼ P(J = j)·N(j·C, σ²C²) against
  N(0, σ²C²) (Ganesh 2024, "Tight group-level DP guarantees for DP-SGD with sampling via mixture of
  Gaussians mechanisms"; vector to scalar by Choquette-Choo et al. 2023, Cor. 4.7). Google's
  ``dp-accounting`` composes its privacy loss distribution (pessimistic discretisation: an upper bound; the
  step's PLD is built by :func:`dpllm.privacy.mixture.mixture_pld`, dp-accounting's construction made faster).
  σ is calibrated with it to the user-level target (:func:`calibrate_mixture`). The textbook
  (ε, δ) group-privacy conversion (k·ε_r, k·e^{(k−1)ε_r}·δ_r) (Dwork & Roth 2014; Vadhan 2017, Lemma 2.2)
  is also rigorous but looser: 1.0–1.3× the mixture's ε in our tests, and unbounded for large k·ε_r,
  where the mixture stays finite. The ``record`` sampling reports its user-level ε the same way.
  k is always the declared cap ``max_records_per_user``, never the largest user found in the data: the
  neighbour adds or removes one user, who may hold up to k records whatever this dataset's users hold. ELS
  without a cap is refused; ``record`` without one reports an unbounded user-level ε (:data:`UNCAPPED`).

Contribution bounding (:func:`cap_users`) keeps at most k records of each user, chosen by a keyed hash under
one secret key (so one user's choice never depends on another's records), and counts the users trimmed.

Example (one record per user: the mixture is the subsampled Gaussian itself):
    >>> round(mixture_epsilon(history=[(1.0, 0.1, 10)], delta=1e-5, group_size=1), 1)
    2.9
    >>> round(mixture_epsilon(history=[(1.0, 0.1, 10)], delta=1e-5, group_size=3), 1)  # a user of 3 records
    9.8
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Callable, Iterator, Optional, Sequence

import torch
from opacus.optimizers import DistributedDPOptimizer, DPOptimizer
from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed

from dpllm.privacy.accounting import AccountantUnavailable, PrivacyPlanError, pld_rounding_margin, smallest_noise
from dpllm.privacy.clipping import QuantileNoiseMixin
from dpllm.privacy.mixture import mixture_pld
from dpllm.sampling import PoissonBatchSampler

GROUP_PRIVACY = ("tight group privacy of at most k records under Poisson sampling: each step a mixture of "
                 "Gaussians N(J·C, σ²C²), J ~ Bin(k, q), against N(0, σ²C²) (Ganesh 2024), composed by "
                 "dp-accounting's PLD accountant with pessimistic discretisation")
UNCAPPED = ("no max_records_per_user: a user may hold any number of records, so no user-level ε follows from the "
            "record-level one (user_epsilon = null, unbounded); set max_records_per_user to bound it")
ULS_UNIT = "user-level sampling: the accountant's unit is the user (one clipped mean gradient per sampled user)"


# ---- group privacy (ELS, record) ------------------------------------------------------------------------

def mixture_epsilon(*, history, delta: float, group_size: int, rounding_margin: bool = True) -> float:
    """User-level ε at ``delta`` of record-level DP-SGD ``history`` ``[(σ, q, steps), ...]`` for users of at
    most ``group_size`` records: the tight mixture-of-Gaussians accounting (see the module docstring).

    Deterministic in its arguments (the report and the ledger store them), so anyone can recompute it.
    ``inf`` when the privacy loss is unbounded at this δ. Read at δ less the composition's float rounding
    (:func:`dpllm.privacy.accounting.pld_rounding_margin`); ``rounding_margin=False``: at δ, as before 2026-11-25.
    """
    k = int(group_size)
    if k < 1:
        raise ValueError(f"group_size={group_size} must be ≥ 1")
    try:  # ε read at δ - margin: an upper bound despite the rounding
        margin = pld_rounding_margin(history, delta) if rounding_margin else 0.0
    except AccountantUnavailable as err:
        raise PrivacyPlanError(f"user-level accounting cannot run: {err}; raise target_delta or train fewer "
                               "steps") from None
    composed = None
    for sigma, q, steps in history:
        if int(steps) <= 0:
            continue
        if float(sigma) <= 0:
            return math.inf
        pld = mixture_pld(sigma=float(sigma), sample_rate=float(q), group_size=k).self_compose(int(steps))
        composed = pld if composed is None else composed.compose(pld)
    if composed is None:
        return 0.0
    return float(composed.get_epsilon_for_delta(delta - margin))


def calibrate_mixture(*, target_epsilon: float, delta: float, sample_rate: float, steps: int, group_size: int,
                      epsilon_tolerance: float = 0.01) -> float:
    """Smallest σ (to ``epsilon_tolerance`` of the target, relative) whose :func:`mixture_epsilon` over
    ``steps`` steps at ``sample_rate`` is ≤ ``target_epsilon`` for users of ``group_size`` records
    (:func:`dpllm.privacy.accounting.smallest_noise`, the search the record-level calibration uses).

    Raises:
        PrivacyPlanError: the target cannot be met with σ ≤ 1e4.
    """
    def eps(sigma: float) -> float:
        return mixture_epsilon(history=[(sigma, sample_rate, steps)], delta=delta, group_size=group_size)

    return smallest_noise(eps, target_epsilon, epsilon_tolerance=epsilon_tolerance * target_epsilon, max_sigma=1e4,
                          unreachable=lambda: PrivacyPlanError(
                              f"user-level ε={target_epsilon} at δ={delta:g} cannot be met for users of {group_size} "
                              f"records with q={sample_rate:.4g} over {steps} steps; raise target_epsilon, lower "
                              "max_records_per_user, or train fewer steps / a smaller batch"))


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


def cap_users(ids: Sequence[int], users: Sequence[str], k: Optional[int], generator: torch.Generator,
              texts: Optional[Sequence[str]] = None) -> dict:
    """Keep at most ``k`` records of each user, chosen at random, one user at a time.

    One secret key is drawn from ``generator`` (the same single draw whatever the data); each user then keeps
    its ``k`` records with the smallest keyed hash of (user, text) under that key. A user's choice depends on
    that user's records alone, so adding or removing a record (or a user) changes no other user's records.

    Args:
        ids: record ids of the training users.
        users: user of every record (indexed by record id).
        k: cap; None keeps every record.
        generator: secretly seeded (:mod:`dpllm.privacy.randomness`), the same on every process.
        texts: text of every record (indexed by record id); without it a record is known by its id (which
            moves when the file changes).

    Returns:
        ``{"kept": sorted record ids, "by_user": {user: kept ids}, "users": U, "users_trimmed": ...,
        "records_dropped": ..., "largest_user": records of the largest user before the cap}``.
    """
    import hashlib

    key = b""
    if k is not None:
        key = int(torch.randint(0, 2 ** 62, (1,), generator=generator).item()).to_bytes(8, "big")

    def draw(i: int) -> bytes:
        content = f"{users[i]}\0{texts[i] if texts is not None else i}"
        return hashlib.blake2b(content.encode("utf-8"), digest_size=16, key=b"dpllm:user_cap:" + key).digest()

    by_user = group_by_user(sorted(ids), users)
    kept: dict[str, list[int]] = {}
    trimmed = dropped = 0
    for user in sorted(by_user):
        rec = by_user[user]
        if k is not None and len(rec) > k:
            trimmed += 1
            dropped += len(rec) - k
            rec = sorted(sorted(rec, key=draw)[:k])
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

def per_user_gradients(grad_sample: torch.Tensor, inverse: torch.Tensor, counts: torch.Tensor, *,
                       reduction: str = "mean") -> torch.Tensor:
    """Mean (``reduction="sum"``: sum) of the per-record rows of ``grad_sample`` over each user (``inverse``:
    row → user slot)."""
    out = torch.zeros((len(counts), *grad_sample.shape[1:]), dtype=grad_sample.dtype, device=grad_sample.device)
    out.index_add_(0, inverse, grad_sample)
    if reduction == "sum":
        return out
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
        self.reduction = "mean"

    def set_users(self, users: Sequence[int], *, reduction: str = "mean") -> None:
        """The user (any integer id) of each row of the next physical batch; ``reduction="sum"`` clips the sum
        of a unit's rows instead of their mean (the windows of one long record, :mod:`dpllm.windows`)."""
        self.row_users = torch.as_tensor(list(users), dtype=torch.long)
        self.reduction = reduction

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
        user_grads = [per_user_gradients(g, inverse, counts, reduction=self.reduction) for g in self.grad_samples]
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


class UserLevelQuantileDPOptimizer(QuantileNoiseMixin, UserLevelOptimizerMixin, DPOptimizer):
    """ULS with ``clipping: quantile``: one mean gradient per unit clipped at the current C, whose centred bit enters
    the count (:class:`dpllm.privacy.clipping.QuantileNoiseMixin` noises both)."""


class UserLevelQuantileDistributedDPOptimizer(QuantileNoiseMixin, UserLevelOptimizerMixin, DistributedDPOptimizer):
    """:class:`UserLevelQuantileDPOptimizer` under DDP: the count summed over processes, noised once on rank 0."""

    distributed = True


def optimizer_class(base: type, *, quantile: bool = False) -> type:
    """The ULS subclass of Opacus's hooks-mode optimizer class ``base`` (with ``quantile``, the one that also noises
    ``clipping: quantile``'s count: one centred bit per unit, ½ per unit as per record).

    Raises:
        PrivacyPlanError: ``base`` is not a hooks-mode optimizer (Opacus's ghost clipping has no per-sample
            rows; bk clips per user in :class:`dpllm.privacy.bk.BookKeepingModule` instead).
    """
    from opacus.optimizers import DPOptimizerFastGradientClipping

    if not issubclass(base, DPOptimizerFastGradientClipping):
        if issubclass(base, DistributedDPOptimizer):
            return UserLevelQuantileDistributedDPOptimizer if quantile else UserLevelDistributedDPOptimizer
        if issubclass(base, DPOptimizer):
            return UserLevelQuantileDPOptimizer if quantile else UserLevelDPOptimizer
    raise PrivacyPlanError(f"user-level sampling needs grad_sample_mode: bk or hooks, but this model runs Opacus's "
                           f"{base.__name__} (ghost clipping cannot sum a user's records before clipping); set "
                           "grad_sample_mode: hooks, or freeze the layers bk cannot handle")
