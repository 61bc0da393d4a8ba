"""How the noise is made: independent (DP-SGD) or correlated across steps (banded MF, or BLT).

One registry key per mechanism (:data:`MECHANISMS`) and one function, :func:`build`, that returns the three
things that must go together as one :class:`CorrelatedNoise`: how records are sampled, how the noise of a
step is made, and the DP-SGD event whose privacy the run has. The optimizer only asks it for the noise
recurrence; the plan only asks it for the event; so a sampler and an accounting that do not belong
together cannot be combined.

The accounting argument (BandMF, b bands, T steps; Choquette-Choo et al. 2023, arXiv 2306.08153, Thm 1):

1. Records are split into b groups by a keyed hash of each record's own text (:mod:`.groups`); at step t
   only group t mod b is sampled, each of its records with probability q_b = b·q (q = 1/⌈N/B⌉, so the
   expected batch stays ≈ B). A record can therefore join only steps that are b apart, at most ⌈T/b⌉ of them.
2. The noise is x = C⁻¹z with C b-banded and every column norm ≤ 1 (:mod:`.banded`): the columns of two
   steps b apart have disjoint supports.
3. Under that participation, the released ``G + C⁻¹Z`` is post-processing of ``CG + Z``, and Thm 1 shows that
   it is as private as DP-SGD with the same σ, sampling rate q_b and ⌈T/b⌉ steps. That event goes to the
   project's PRV/PLD/RDP accountants unchanged (jax_privacy's ``amplified_bandmf_event`` is the same
   reduction). b = 1 is DP-SGD: q_1 = q, ⌈T/1⌉ = T.

BLT (:mod:`.blt`) has no proven amplification: the same cyclic groups are used (b of them, ``bands: auto`` picks b
from ⌈N/B⌉, ⌈N/B⌉/2, ... by the least prefix-sum error), each record of group t mod b joins step t with probability
q_b = b·q (1 when b = ⌈N/B⌉: the whole group; never credited), the noisy sum is divided by the fixed public batch
q·N (the plan's expected batch, never the realised one), and the whole run is accounted as ONE Gaussian mechanism
``(σ/sens(C, b, ⌈n/b⌉), q = 1, 1 step)`` after n steps (:func:`gaussian_history`; sens of the steps actually run, so
a run stopped early spends less and a run past the planned T is not under-reported). :attr:`CorrelatedNoise.
accounting` says which of the two events a mechanism has; :class:`dpllm.privacy.plan.PrivacyPlan` reads it, so a BLT
run can never be accounted as amplified DP-SGD, and :meth:`CorrelatedNoise.sampler` gives BLT the cyclic sampler
whatever b.

Example:
    >>> n = build("banded", 2, steps=10, num_records=100, batch=10, noise_multiplier=1.0)
    >>> n.bands, n.sample_rate, n.event(1.0)
    (2, 0.2, (1.0, 0.2, 5))
    >>> build("independent", "auto", steps=10, num_records=100, batch=10).event(1.0)
    (1.0, 0.1, 10)
    >>> n = build("blt", 10, steps=20, num_records=100, buffers=1, batch=10)
    >>> n.accounting, n.event(n.sensitivity)  # one Gaussian mechanism: σ/sens, q = 1, one step
    ('gaussian_mechanism', (1.0, 1.0, 1))
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

from dpllm.privacy import accounting
from dpllm.privacy.accounting import PrivacyPlanError
from dpllm.privacy.correlated import blt as blt_math
from dpllm.privacy.correlated.banded import BandMF
from dpllm.privacy.correlated.base import Independent, NoiseRecurrence, Strategy

log = logging.getLogger(__name__)

MECHANISMS = {"independent": Independent, "banded": BandMF, "blt": blt_math.BLTStrategy}
# how each mechanism's run is accounted: amplified DP-SGD (the reduction below) or one Gaussian mechanism (BLT)
AMPLIFIED, GAUSSIAN = "amplified_dpsgd", "gaussian_mechanism"
ACCOUNTING = {"independent": AMPLIFIED, "banded": AMPLIFIED, "blt": GAUSSIAN}
# BLT buffers: auto tries 1 … this many (each buffer keeps one model-sized tensor per parameter)
AUTO_MAX_BUFFERS = 5
BLT_REDUCTION = ("BLT over b cyclic groups (each record joins at most ceil(n/b) of the n steps run, b apart; the "
                 "within-group draw is not credited; the noisy sum is divided by the fixed expected batch) = one "
                 "Gaussian mechanism with sensitivity sens(C, b, ceil(n/b)): accounted as (σ/sens, q = 1, 1 step), no "
                 "amplification (McMahan et al. 2024, arXiv 2408.08868; dpllm.privacy.correlated.blt)")
# bands: auto tries 1, 2, 4, ... up to this many (each band keeps one more model-sized tensor per parameter)
AUTO_MAX_BANDS = 32
REDUCTION = ("b-banded MF with cyclic Poisson sampling over b groups = DP-SGD with the same σ, the group's sampling "
             "rate q_b and ceil(T/b) steps (Choquette-Choo et al. 2023, arXiv 2306.08153, Thm 1)")


def accounted_steps(steps: int, bands: int) -> int:
    """⌈steps/bands⌉: the most steps one record can join under cyclic sampling over ``bands`` groups."""
    return -(-int(steps) // int(bands))


@dataclass(frozen=True)
class CorrelatedNoise:
    """A noise mechanism for one run: its strategy, the group sampling rate and the accounted event.

    Attributes:
        strategy: the strategy matrix (:class:`.base.Independent` or :class:`.banded.BandMF`).
        sample_rate: q_b, each record's inclusion probability at a step of its group (q for DP-SGD).
        steps: T, the optimizer steps of the run.
        choice: ``bands: auto``'s comparison, one row per number of bands tried (empty otherwise).
    """

    strategy: Strategy
    sample_rate: float
    steps: int
    choice: tuple = field(default_factory=tuple)

    @property
    def name(self) -> str:
        return self.strategy.name

    @property
    def bands(self) -> int:
        """b: the cyclic groups (the bands of BandMF; BLT's min-separation)."""
        return self.strategy.min_separation

    @property
    def correlated(self) -> bool:
        return self.name != "independent"

    @property
    def accounting(self) -> str:
        """:data:`AMPLIFIED` (DP-SGD's event at q_b over ⌈T/b⌉ steps) or :data:`GAUSSIAN` (BLT: one mechanism)."""
        return ACCOUNTING[self.name]

    @property
    def sensitivity(self) -> float:
        """sens(C, b, ⌈T/b⌉) of the strategy (1 for DP-SGD and BandMF, whose strategies are normalised)."""
        return self.strategy.sensitivity(self.steps) if self.accounting == GAUSSIAN else 1.0

    def event(self, noise_multiplier: float, steps: Optional[int] = None) -> tuple[float, float, int]:
        """This mechanism's accounted ``(σ, q, steps)`` entry after ``steps`` (default: all) at draw std σ·C.

        Amplified mechanisms: the DP-SGD event ``(σ, q_b, ⌈steps/b⌉)``. BLT: one Gaussian mechanism
        ``(σ/sens(steps), 1.0, 1)`` (:func:`.blt.history_entry`); nothing amplifies it.
        """
        done = self.steps if steps is None else steps
        if self.accounting == GAUSSIAN:
            return gaussian_history(self._blt_fields(), noise_multiplier=float(noise_multiplier), steps=done)[0]
        return (float(noise_multiplier), self.sample_rate, accounted_steps(done, self.bands))

    def calibrate(self, *, target_epsilon: float, delta: float, accountant: str = "prv", prior_history=()) -> float:
        """The draw's σ (std of z in units of C) that meets ``target_epsilon`` with this mechanism's event."""
        if self.accounting == GAUSSIAN:  # σ/sens of one step at q = 1; the draw is sens times that
            return gaussian_draw_sigma(self._blt_fields(), _calibrate(
                target_epsilon=target_epsilon, delta=delta, sample_rate=1.0, steps=1, accountant=accountant,
                prior_history=prior_history))
        return _calibrate(target_epsilon=target_epsilon, delta=delta, sample_rate=self.sample_rate,
                          steps=accounted_steps(self.steps, self.bands), accountant=accountant,
                          prior_history=prior_history)

    def _blt_fields(self) -> dict:
        """What :func:`gaussian_history` reads of :meth:`to_json` (without computing the rest)."""
        blt = self.strategy.blt
        return {"theta": blt.theta.tolist(), "omega": blt.omega.tolist(), "min_separation": self.bands,
                "steps": self.steps}

    def sampler(self, *, texts: Sequence[str], key: int, generator, rank: int = 0, world_size: int = 1,
                unit_records: Optional[Sequence[Sequence[int]]] = None):
        """The batch sampler: cyclic Poisson over ``bands`` groups of ``texts`` (plain Poisson for one band).

        ``unit_records`` (user-level sampling): the unit is a user, ``texts`` are the users' ids (one per unit, the
        group a keyed hash of the id) and a sampled user yields its records
        (:class:`.groups.CyclicPoissonBatchSampler`).
        """
        from dpllm.privacy.correlated.groups import CyclicPoissonBatchSampler, assign_groups  # torch: not for plan
        from dpllm.sampling import PoissonBatchSampler

        if unit_records is not None:  # one band included: the draws of plain user-level Poisson sampling
            return CyclicPoissonBatchSampler(groups=assign_groups(texts, bands=self.bands, key=key), bands=self.bands,
                                             sample_rate=self.sample_rate, generator=generator, rank=rank,
                                             world_size=world_size, unit_records=unit_records)
        if self.bands == 1 and self.accounting == AMPLIFIED:  # BLT: the cyclic sampler its accounting names, always
            return PoissonBatchSampler(num_samples=len(texts), sample_rate=self.sample_rate, generator=generator,
                                       rank=rank, world_size=world_size)
        return CyclicPoissonBatchSampler(groups=assign_groups(texts, bands=self.bands, key=key), bands=self.bands,
                                         sample_rate=self.sample_rate, generator=generator, rank=rank,
                                         world_size=world_size)

    def recurrence(self) -> Optional[NoiseRecurrence]:
        """A fresh noise recurrence for the optimizer (None for independent noise: the draw is the noise).

        The optimizer's draws are fresh and used once: banded noise is computed in them, and so is BLT's
        (``reuse_draws``: no model-sized copy per step, scripts/bench_correlated_step.py)."""
        if not self.correlated:
            return None
        if isinstance(self.strategy, blt_math.BLTStrategy):
            return self.strategy.recurrence(reuse_draws=True)
        return self.strategy.recurrence()

    def to_json(self) -> dict:
        """What the plan, the report and the ledger record (and a resume must find unchanged)."""
        if self.accounting == GAUSSIAN:  # "bands" = "groups" = b, as the plan and the report read banded noise's
            out = {**self.strategy.to_json(), "bands": self.bands, "groups": self.bands,
                   "group_sample_rate": self.sample_rate, "group_sample_rate_credited": False, "accounting": GAUSSIAN,
                   "reduction": BLT_REDUCTION}
        else:
            out = {**self.strategy.to_json(), "group_sample_rate": self.sample_rate, "steps": self.steps,
                   "accounted_steps": accounted_steps(self.steps, self.bands),
                   "prefix_sum_rmse": self.strategy.prefix_sum_rmse(self.steps), "reduction": REDUCTION}
        if self.choice:
            out["auto"] = [dict(row) for row in self.choice]
        return out


@functools.lru_cache(maxsize=256)
def _sensitivity(theta: tuple, omega: tuple, min_separation: int, steps: int) -> float:
    strategy = blt_math.BLTStrategy(blt_math.BLT(theta, omega), steps=steps, min_separation=min_separation)
    return strategy.sensitivity(steps)  # k = ⌈steps/b⌉, not capped at the planned run's


def gaussian_history(noise: dict, *, noise_multiplier: float, steps: int) -> list[tuple[float, float, int]]:
    """BLT's accounted entries after ``steps`` steps of a run whose plan records ``noise`` (:meth:`CorrelatedNoise.
    to_json`) at draw std ``noise_multiplier``·C: none before the first step, then the one Gaussian mechanism
    ``(σ/sens(C, b, ⌈steps/b⌉), 1.0, 1)`` of the steps actually run (:func:`.blt.history_entry`).

    The first ``steps`` releases depend on C's leading steps×steps block alone (C is lower-triangular), whose
    sensitivity under b-min-separation is sens(C, b, ⌈steps/b⌉): less for a run stopped early, and for a run past
    the T the strategy was optimised for the larger k of the steps run (never the planned T's).
    """
    if steps <= 0:
        return []
    sens = _sensitivity(tuple(noise["theta"]), tuple(noise["omega"]), int(noise["min_separation"]), int(steps))
    return [(float(noise_multiplier) / sens, 1.0, 1)]


def gaussian_draw_sigma(noise: dict, unit_sigma: float) -> float:
    """The draw's σ (std of z in units of C) whose BLT run over the planned steps is one Gaussian mechanism of noise
    multiplier ``unit_sigma`` (= 1/μ, calibrated at q = 1 over one step): sens·``unit_sigma``, rounded up until the
    accounted σ/sens is not below ``unit_sigma`` (so float rounding never spends more than the calibration)."""
    steps = int(noise["steps"])
    draw = unit_sigma * _sensitivity(tuple(noise["theta"]), tuple(noise["omega"]), int(noise["min_separation"]),
                                     steps)
    while gaussian_history(noise, noise_multiplier=draw, steps=steps)[0][0] < unit_sigma:
        draw = math.nextafter(draw, math.inf)
    return draw


def parse_bands(bands: Union[str, int]) -> Optional[int]:
    """``"auto"`` → None; a positive integer (or its text) → that integer.

    Raises:
        PrivacyPlanError: anything else.
    """
    if isinstance(bands, str) and bands.strip().lower() == "auto":
        return None
    try:
        b = int(str(bands).strip())
    except ValueError:
        b = 0
    if b < 1 or str(b) != str(bands).strip():
        raise PrivacyPlanError(f"privacy.bands={bands!r}: give 'auto' or a positive whole number of bands")
    return b


def _calibrate(*, target_epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str,
               prior_history) -> float:
    """σ for the target; the plan's fallback chain where an accountant cannot run."""
    return accounting.first_that_runs(accountant, lambda acc: accounting.calibrate_noise(
        target_epsilon=target_epsilon, delta=delta, sample_rate=sample_rate, steps=steps, accountant=acc,
        prior_history=list(prior_history)))


def auto_candidates(*, steps: int, batches_per_epoch: int) -> list[int]:
    """1, 2, 4, ... up to min(T, ⌈N/B⌉, :data:`AUTO_MAX_BANDS`)."""
    top = min(steps, batches_per_epoch, AUTO_MAX_BANDS)
    return [2 ** i for i in range(int(math.log2(top)) + 1)] if top >= 1 else [1]


def compare_bands(candidates: Sequence[int], *, steps: int, num_records: int, batch: int, target_epsilon: float,
                  delta: float, accountant: str = "prv", prior_history=()) -> list[dict]:
    """For each number of bands b: σ(b) calibrated to the target for (q_b, ⌈T/b⌉), the optimised strategy's
    prefix-sum RMSE (noise std 1) and their product, the expected error in units of the clipping norm."""
    k = math.ceil(num_records / batch)
    rows = []
    for b in candidates:
        q_b = b / k
        sigma = _calibrate(target_epsilon=target_epsilon, delta=delta, sample_rate=q_b,
                           steps=accounted_steps(steps, b), accountant=accountant, prior_history=prior_history)
        rmse = (Independent() if b == 1 else BandMF.optimized(bands=b, steps=steps)).prefix_sum_rmse(steps)
        rows.append({"bands": b, "noise_multiplier": sigma, "prefix_sum_rmse": rmse, "error": sigma * rmse})
    return rows


def parse_buffers(buffers: Union[str, int]) -> Optional[int]:
    """``"auto"`` → None; 1 … :data:`.blt.MAX_BUFFERS` (or its text) → that integer.

    Raises:
        PrivacyPlanError: anything else.
    """
    if isinstance(buffers, str) and buffers.strip().lower() == "auto":
        return None
    text = str(buffers).strip()
    if not (text.isdigit() and 1 <= int(text) <= blt_math.MAX_BUFFERS):
        raise PrivacyPlanError(f"privacy.buffers={buffers!r}: give 'auto' or a whole number of BLT buffers from 1 "
                               f"to {blt_math.MAX_BUFFERS}")
    return int(text)


def blt_candidates(batches_per_epoch: int) -> list[int]:
    """BLT's groups b for ``bands: auto``: ⌈N/B⌉, ⌈N/B⌉/2, /4, /8 (≥ 1). More groups cannot keep the batch at B."""
    return sorted({max(1, batches_per_epoch // 2 ** i) for i in range(4)}, reverse=True)


def blt_strategy(*, steps: int, groups: int, buffers: Optional[int]) -> blt_math.BLTStrategy:
    """The optimised BLT for ``groups`` cyclic groups (min-separation b): ``buffers`` or ``choose_blt``'s."""
    if buffers is None:
        return blt_math.choose_blt(steps, groups, max_buffers=AUTO_MAX_BUFFERS)
    return blt_math.optimize_blt(steps, buffers, groups)


def compare_blt(candidates: Sequence[int], *, steps: int, buffers: Optional[int]) -> list[dict]:
    """For each number of groups b: the optimised BLT, its sensitivity and prefix-sum RMSE of the normalised
    strategy C/sens (noise std 1). At a target ε the run is one Gaussian mechanism with μ(ε, δ) fixed, so the
    normalised σ = 1/μ is the same for every b and the least RMSE is the least error."""
    rows = []
    for b in candidates:
        s = blt_strategy(steps=steps, groups=b, buffers=buffers)
        rows.append({"bands": b, "buffers": s.blt.buffers, "sensitivity": s.sensitivity(steps),
                     "prefix_sum_rmse": s.prefix_sum_rmse(steps)})
    return rows


def _build_blt(bands: Optional[int], *, steps: int, k: int, buffers: Union[str, int]) -> CorrelatedNoise:
    d = parse_buffers(buffers)
    if bands is not None and bands > k:
        raise PrivacyPlanError(
            f"privacy.bands={bands} > ⌈N/B⌉ = {k}: BLT's {bands} groups would each hold fewer records than a batch; "
            f"use bands ≤ {k} (the number of groups; auto picks from {blt_candidates(k)})")
    rows = compare_blt(blt_candidates(k) if bands is None else [bands], steps=steps, buffers=d)
    best = min(rows, key=lambda r: r["prefix_sum_rmse"])
    strategy = blt_strategy(steps=steps, groups=best["bands"], buffers=d)
    return CorrelatedNoise(strategy=strategy, sample_rate=best["bands"] / k, steps=steps,
                           choice=tuple(rows) if bands is None else ())


def build(noise: str, bands: Union[str, int], *, steps: int, num_records: int, batch: int,
          target_epsilon: Optional[float] = None, delta: Optional[float] = None, accountant: str = "prv",
          noise_multiplier: Optional[float] = None, prior_history=(), buffers: Union[str, int] = "auto"
          ) -> CorrelatedNoise:
    """The noise mechanism of a run of ``steps`` steps over ``num_records`` records at logical batch ``batch``.

    Args:
        noise: a key of :data:`MECHANISMS`.
        bands: ``"auto"`` or b. ``banded`` with ``auto`` picks the b of 1, 2, 4, ... (≤ ⌈N/B⌉, ≤ T, ≤
            :data:`AUTO_MAX_BANDS`) with the least σ(b)·RMSE(b), σ(b) calibrated to ``target_epsilon``.
            ``blt``: b is the number of cyclic groups (the min-separation); ``auto`` picks the b of
            :func:`blt_candidates` with the least prefix-sum RMSE at a fixed μ (which does not depend on ε).
        target_epsilon, delta, accountant, prior_history: what ``auto`` calibrates with.
        noise_multiplier: a given σ (``auto`` then cannot trade σ against error, and is refused).
        buffers: ``blt`` only: ``"auto"`` (the fewest of 1 … :data:`AUTO_MAX_BUFFERS` after which one more buys
            < 1%) or d.

    Raises:
        PrivacyPlanError: an unknown mechanism, bad bands, b > ⌈N/B⌉ (q_b would exceed 1) or b > T.
    """
    if noise not in MECHANISMS:
        raise PrivacyPlanError(f"privacy.noise={noise!r}; choose one of {', '.join(MECHANISMS)}")
    k = math.ceil(num_records / batch)
    b = parse_bands(bands)
    if noise != "blt" and str(buffers).strip().lower() != "auto":
        raise PrivacyPlanError(f"privacy.buffers={buffers} needs privacy.noise=blt")
    if noise == "blt":
        return _build_blt(b, steps=steps, k=k, buffers=buffers)
    if noise == "independent":
        if b not in (None, 1):
            raise PrivacyPlanError(f"privacy.bands={bands} needs privacy.noise=banded (independent noise has 1 band)")
        return CorrelatedNoise(strategy=Independent(), sample_rate=1.0 / k, steps=steps)
    choice: tuple = ()
    if b is None:
        if target_epsilon is None or noise_multiplier is not None:
            raise PrivacyPlanError("privacy.bands=auto trades σ against the correlated noise's error at a target ε: "
                                   "set target_epsilon and leave noise_multiplier unset, or give bands as a number")
        rows = compare_bands(auto_candidates(steps=steps, batches_per_epoch=k), steps=steps, num_records=num_records,
                             batch=batch, target_epsilon=target_epsilon, delta=delta, accountant=accountant,
                             prior_history=prior_history)
        b = min(rows, key=lambda r: r["error"])["bands"]
        choice = tuple(rows)
        log.info("privacy plan: bands=auto picked b=%d (σ·RMSE %s)", b,
                 ", ".join(f"b={r['bands']}: {r['error']:.4g}" for r in rows))
    if b > k:
        raise PrivacyPlanError(
            f"privacy.bands={b} > ⌈N/B⌉ = {k} batches per epoch ({num_records:,} records at logical batch {batch:,}): "
            f"each of the {b} groups would need a sampling rate b·B/N > 1; use bands ≤ {k}, a smaller logical batch "
            "or more records")
    if b > steps:
        raise PrivacyPlanError(f"privacy.bands={b} > the run's {steps} steps; use bands ≤ {steps}")
    strategy = Independent() if b == 1 and choice else BandMF.optimized(bands=b, steps=steps)
    if isinstance(strategy, Independent):  # auto chose 1 band: DP-SGD itself, said so in the plan
        return CorrelatedNoise(strategy=strategy, sample_rate=1.0 / k, steps=steps, choice=choice)
    return CorrelatedNoise(strategy=strategy, sample_rate=b / k, steps=steps, choice=choice)
