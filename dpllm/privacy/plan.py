"""The privacy plan: q, steps and σ computed in one place, before any model is loaded.

Everything that needs the sampling rate or the step count gets it from here: the trainer, the Opacus
wrapping (which must not derive its own q), ``dpllm plan``, the report and the ledger. The trainer asserts
at the end of training that the accountant's history is exactly the plan.

- An epoch is ``k = ⌈N/B⌉`` Poisson batches and each record joins each batch with probability
  ``q = 1/k`` (≤ B/N, so the expected batch is at most B).
- ``epochs`` gives ``ceil(epochs · k)`` steps; otherwise ``max_steps`` steps.

Example:
    >>> batches_per_epoch(1000, 64), sample_rate_for(1000, 64), steps_for(num_records=1000, batch=64, epochs=1.5)
    (16, 0.0625, 24)
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

from dpllm.privacy import accounting
from dpllm.privacy.accounting import PrivacyPlanError
from dpllm.privacy.correlated import GAUSSIAN, accounted_steps, gaussian_draw_sigma, gaussian_history

log = logging.getLogger(__name__)

# σ/B above this leaves no usable signal: the noise added to the *averaged* clipped gradient then has a
# per-coordinate standard deviation σ·C/B of at least a tenth of the largest possible norm C of the whole
# averaged gradient, spread over every one of the model's coordinates. Seen: ε = 0.01 on the demo gives
# σ/B = 8 and training only adds noise. ε = 8 there gives σ/B ≈ 0.008.
NOISE_BATCH_WARN = 0.1


def check_finite_positive(name: str, value: Optional[float]) -> None:
    """Refuse NaN, ±inf, zero and negative values with a message that names the value.

    Raises:
        PrivacyPlanError: ``value`` is not a finite positive number.
    """
    if value is None:
        return
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise PrivacyPlanError(f"{name}={value} must be positive and finite"
                               + ("; for a run without DP set privacy.enabled=false" if name == "target_epsilon"
                                  and value == math.inf else ""))


def noise_batch_warning(sigma: float, batch: float) -> Optional[str]:
    """The warning for σ/B above :data:`NOISE_BATCH_WARN` (None below it).

    Args:
        sigma: the noise multiplier σ.
        batch: the batch the run really has: the expected batch q·N (:func:`expected_batch`), not the
            configured logical batch, which q = 1/⌈N/B⌉ can cut (to N when B > N).
    """
    if sigma / batch <= NOISE_BATCH_WARN:
        return None
    return (f"noise leaves little signal: σ/B = {sigma:.4g}/{batch:.4g} = {sigma / batch:.3g} > {NOISE_BATCH_WARN} "
            "(B = q·N, the expected batch; per-coordinate noise σ·C/B on the averaged gradient is over a tenth of "
            "its largest possible norm C); raise target_epsilon, the logical batch or the number of records")


def passes_warning(sample_rate: float, steps: int) -> Optional[str]:
    """The single-epoch policy's warning: more than one expected pass (q × steps > 1) over the private records.

    Not a refusal: several epochs are often worth their ε, but the practitioners' checklist asks that they be
    a decision, so the log, the report's warnings and ``dpllm report --compliance`` say it.
    """
    passes = sample_rate * steps
    if passes <= 1 + 1e-9:
        return None
    return (f"{passes:.3g} expected passes over the private records (q × steps = {sample_rate:.4g} × {steps:,}): each "
            "pass adds to ε, and the single-epoch policy (dpllm report --compliance) is not met; more records or "
            "fewer steps keep to one pass")


def capped_batch_warning(num_records: int, batch: int) -> Optional[str]:
    """The warning for a logical batch B ≥ N: every step then uses every record (q = 1); None for B < N.

    Such a run is legal (full-batch DP-GD) and its ε is exact, but it is rarely what was meant: sampling
    amplifies nothing, an epoch is one step, and with a handful of records the model learns only noise.
    """
    if batch < num_records or num_records < 1:
        return None
    return (f"logical_batch_size={batch:,} ≥ the {num_records:,} private training record(s): every step trains on "
            f"all of them (q = 1, expected batch {num_records:,}, not {batch:,}), so sampling gives no privacy "
            "amplification and an epoch is one step; use more records or a logical_batch_size below N")


def expected_batch(num_records: int, batch: int) -> float:
    """q·N = N/⌈N/B⌉: the records an optimizer step averages over, on average (≤ B, and ≤ N)."""
    return num_records * sample_rate_for(num_records, batch)


def batches_per_epoch(num_records: int, batch: int) -> int:
    """k = ⌈N/B⌉ Poisson batches make one expected pass over the data."""
    if num_records < 1:
        raise PrivacyPlanError(f"num_records={num_records}: the private dataset is empty")
    if batch < 1:
        raise PrivacyPlanError(f"batch={batch} must be positive")
    return math.ceil(num_records / batch)


def sample_rate_for(num_records: int, batch: int) -> float:
    """q = 1/⌈N/B⌉: the inclusion probability of every record in every Poisson batch."""
    return 1.0 / batches_per_epoch(num_records, batch)


def steps_for(*, num_records: int, batch: int, epochs: Optional[float] = None, steps: Optional[int] = None) -> int:
    """Optimizer steps: ``steps`` if given, else ``ceil(epochs · ⌈N/B⌉)``.

    Raises:
        PrivacyPlanError: neither or both given, or a non-positive value.
    """
    if (epochs is None) == (steps is None):
        raise PrivacyPlanError("give exactly one of epochs or steps")
    if steps is not None:
        if steps <= 0:
            raise PrivacyPlanError(f"steps={steps} must be positive")
        return int(steps)
    if not (math.isfinite(epochs) and epochs > 0):
        raise PrivacyPlanError(f"epochs={epochs} must be positive (and finite)")
    return max(1, math.ceil(epochs * batches_per_epoch(num_records, batch)))


@dataclass(frozen=True)
class PrivacyPlan:
    """Everything the accountant needs, decided before the model is loaded.

    ``history`` (earlier stages that trained on the same records, then this stage) is what the
    accountant must hold at the end of training, entry for entry.
    """

    num_records: int
    sample_rate: float
    steps: int
    noise_multiplier: float
    delta: float
    accountant: str
    expected_batch_size: int
    prior_history: tuple = field(default_factory=tuple)
    warnings: tuple = field(default_factory=tuple)
    # A non-constant noise schedule (dpllm.privacy.schedule.NoiseSchedule.to_json()); noise_multiplier is then σ₀,
    # the first piece's σ. None: one σ for every step.
    schedule: Optional[dict] = None
    # Correlated noise (dpllm.privacy.correlated.CorrelatedNoise.to_json()): mechanism, bands b, coefficients, ...;
    # sample_rate is then the group's rate q_b and the accounted event is (σ, q_b, ⌈steps/b⌉). None: DP-SGD.
    # BLT ("accounting": "gaussian_mechanism"): noise_multiplier is the draw's σ and the accounted event is one
    # Gaussian mechanism (σ/sens(C, b, ⌈steps/b⌉), 1.0, 1) (dpllm.privacy.correlated.gaussian_history).
    noise: Optional[dict] = None

    @property
    def bands(self) -> int:
        """b: the cyclic groups of correlated noise (1: every record may join every step)."""
        return int(self.noise["bands"]) if self.noise else 1

    @property
    def gaussian(self) -> bool:
        """BLT: the run is one Gaussian mechanism (never amplified DP-SGD: :mod:`dpllm.privacy.correlated`)."""
        return bool(self.noise) and self.noise.get("accounting") == GAUSSIAN

    def _schedule(self):
        from dpllm.privacy.schedule import NoiseSchedule

        return NoiseSchedule(**self.schedule) if self.schedule else NoiseSchedule()

    def stage_history(self, steps: Optional[int] = None) -> list[tuple[float, float, int]]:
        """This stage's ``(σ, q, steps)`` entries after ``steps`` steps (default: all): one per schedule piece."""
        done = self.steps if steps is None else steps
        if self.gaussian:  # BLT: one Gaussian mechanism with the sensitivity of the steps run
            return gaussian_history(self.noise, noise_multiplier=self.noise_multiplier, steps=done)
        if not self.schedule:  # banded: the DP-SGD event of the reduction (dpllm.privacy.correlated)
            return [(self.noise_multiplier, self.sample_rate, accounted_steps(done, self.bands))]
        return self._schedule().history(self.noise_multiplier, self.sample_rate, self.steps, done=done)

    def sigma_at(self, step: int) -> float:
        """σ of the optimizer step with 0-based index ``step``."""
        if not self.schedule:
            return self.noise_multiplier
        return self._schedule().sigma_at(self.noise_multiplier, self.steps, step=step)

    @property
    def history(self) -> list[tuple[float, float, int]]:
        return [tuple(h) for h in self.prior_history] + self.stage_history()

    def largest_sigma(self) -> float:
        """The largest σ of this stage's steps (σ₀ for a constant σ or a falling schedule)."""
        return max(s for s, _, _ in self.stage_history())

    def epsilon(self, steps: Optional[int] = None) -> float:
        """ε after ``steps`` steps of this stage (default: all of them), earlier stages composed."""
        return accounting.compute_epsilon_history(
            history=[tuple(h) for h in self.prior_history] + self.stage_history(steps),
            delta=self.delta, accountant=self.accountant)

    def to_json(self) -> dict:
        """The fields a resumed run must find unchanged (``trainer_state.json``)."""
        out = {"noise_multiplier": self.noise_multiplier, "sample_rate": self.sample_rate, "steps": self.steps,
               "delta": self.delta, "accountant": self.accountant,
               "prior_history": [list(h) for h in self.prior_history]}
        if self.schedule:
            out["schedule"] = dict(self.schedule)
        if self.noise:
            out["noise"] = dict(self.noise)
        return out


def plan_privacy(*, num_records: int, logical_batch_size: int, steps: int, target_epsilon: Optional[float],
                 delta: float, accountant: str, noise_multiplier: Optional[float] = None,
                 prior_history: Optional[list] = None, data_notes: Sequence[str] = (),
                 schedule=None, noise=None) -> PrivacyPlan:
    """Check δ and ε, pick or check σ, and return the plan. Cheap: run it before loading any model.

    Args:
        num_records: N, records of this stage's private training set.
        logical_batch_size: B; q = 1/⌈N/B⌉.
        steps: optimizer steps of this stage.
        target_epsilon: calibrate σ to this ε (composed after ``prior_history``); None with a given σ.
        delta: δ; must be < 1/N.
        accountant: ``prv``, ``rdp`` or ``gdp``. If it cannot run for this plan (PRV: memory, or float
            precision at very many steps) the whole plan uses ``accounting.FALLBACK[accountant]`` instead: the
            returned plan's ``accountant`` says which, and its ``warnings`` say why.
        noise_multiplier: use this σ instead of calibrating (its ε must not exceed ``target_epsilon``).
        prior_history: ``(σ, q, steps)`` of earlier stages that trained on some of these records.
        data_notes: what loading the data changed that the reader of the report should know (records
            removed as duplicates, ...); recorded first among the plan's warnings.
        schedule: a :class:`dpllm.privacy.schedule.NoiseSchedule`; a non-constant one calibrates σ₀ (its first
            piece's σ; ``noise_multiplier`` gives σ₀ instead) so that the whole schedule meets the target.
        noise: a correlated mechanism (:func:`dpllm.privacy.correlated.build`); σ is then calibrated for its event,
            the group's rate q_b over ⌈steps/b⌉ steps (None or independent noise: q over ``steps``).

    Raises:
        PrivacyPlanError: δ ≥ 1/N, a non-finite ε or δ, an unreachable ε, or a given σ over the target.
    """
    check_finite_positive("target_epsilon", target_epsilon)
    check_finite_positive("target_delta", delta)
    check_finite_positive("noise_multiplier", noise_multiplier)
    accounting.check_delta(delta, num_records)
    accounting.check_accountant(accountant)
    if target_epsilon is None and noise_multiplier is None:
        raise PrivacyPlanError("set target_epsilon (calibrates the noise) or noise_multiplier")
    prior = tuple(tuple(h) for h in (prior_history or []))
    q = sample_rate_for(num_records, logical_batch_size)
    scheduled = schedule is not None and not schedule.is_constant
    if scheduled:
        schedule.lengths(steps)  # refuses fewer steps than pieces, before any accounting
    # banded noise or BLT, or bands: auto's comparison that chose DP-SGD (kept so the report says why)
    correlated = noise.to_json() if noise is not None and (noise.correlated or noise.choice) else None
    if correlated is not None:
        if scheduled:
            raise PrivacyPlanError("a noise schedule with correlated noise is not yet supported (issue 45)")
        q = noise.sample_rate
    notes: list[str] = []  # PRV, then PLD, then RDP (accounting.FALLBACK): the first that runs does the whole plan

    def switched(note: str) -> None:
        log.warning("privacy plan: %s", note)
        notes.append(note)

    return accounting.first_that_runs(
        accountant, lambda acc: _plan_with(acc, num_records=num_records, batch=logical_batch_size, q=q, steps=steps,
                                           target_epsilon=target_epsilon, delta=delta,
                                           noise_multiplier=noise_multiplier, prior=prior, notes=tuple(notes),
                                           data_notes=data_notes, schedule=schedule if scheduled else None,
                                           noise=correlated),
        on_switch=switched)


def _plan_with(accountant: str, *, num_records: int, batch: int, q: float, steps: int,
               target_epsilon: Optional[float], delta: float, noise_multiplier: Optional[float], prior: tuple,
               notes: tuple = (), data_notes: Sequence[str] = (), schedule=None,
               noise: Optional[dict] = None) -> PrivacyPlan:
    """:func:`plan_privacy` with one accountant from start to end (raises AccountantUnavailable if it cannot run)."""
    bands = int(noise["bands"]) if noise else 1
    # banded: the DP-SGD event of the reduction; BLT: the participations of a record, at most; steps otherwise
    accounted = accounted_steps(steps, bands)
    gaussian = bool(noise) and noise.get("accounting") == GAUSSIAN
    if noise_multiplier is None and gaussian:  # BLT: σ/sens of one Gaussian step at q = 1; the draw is sens times that
        log.info("calibrating σ for ε=%g: BLT over %d steps as one Gaussian mechanism with the %s accountant",
                 target_epsilon, steps, accountant)
        sigma = gaussian_draw_sigma(noise, accounting.calibrate_noise(
            target_epsilon=target_epsilon, delta=delta, sample_rate=1.0, steps=1, accountant=accountant,
            prior_history=list(prior)))
    elif noise_multiplier is None:
        log.info("calibrating σ for ε=%g over %d steps at q=%.4g with the %s accountant%s", target_epsilon, accounted,
                 q, accountant, f" ({schedule.kind} noise schedule)" if schedule else "")
        if schedule:
            from dpllm.privacy.schedule import calibrate

            sigma = calibrate(schedule, target_epsilon=target_epsilon, delta=delta, sample_rate=q, steps=steps,
                              accountant=accountant, prior_history=list(prior))
        else:
            sigma = accounting.calibrate_noise(target_epsilon=target_epsilon, delta=delta, sample_rate=q,
                                               steps=accounted, accountant=accountant, prior_history=list(prior),
                                               progress=lambda line: log.info("privacy plan: %s", line))
    else:
        sigma = float(noise_multiplier)
    expected = int(num_records * sample_rate_for(num_records, batch))  # banded too: ≈ N/b records at q_b = b·q
    # The batch warning reads the noisiest piece of a schedule.
    noisiest = sigma * (max(schedule.multipliers()) if schedule else 1.0)
    data_notes = tuple(data_notes) + tuple(w for w in (capped_batch_warning(num_records, batch),
                                                        passes_warning(q, accounted),
                                                        noise_batch_warning(noisiest,
                                                                            expected_batch(num_records, batch)))
                                           if w)
    notes = tuple(notes) + data_notes
    plan = PrivacyPlan(num_records=num_records, sample_rate=q, steps=steps, noise_multiplier=sigma, delta=delta,
                       accountant=accountant, expected_batch_size=expected, prior_history=prior,
                       warnings=notes, schedule=schedule.to_json() if schedule else None, noise=noise)
    eps = accounting.compute_epsilon_history(history=plan.history, delta=delta, accountant=accountant, strict=True)
    if target_epsilon is not None and eps > target_epsilon:
        raise PrivacyPlanError(
            f"noise_multiplier={sigma:g}{' (σ₀ of the schedule)' if schedule else ''} over "
            + (f"{steps:,} steps of BLT noise over {bands} cyclic groups (one Gaussian mechanism, μ = sens/σ = "
               f"{1 / plan.stage_history()[0][0]:.4g})" if gaussian else
               f"{accounted:,} {'accounted steps of ' + str(bands) + '-banded noise' if noise else 'steps'} at "
               f"sample rate {q:.4g}")
            + f" gives ε={eps:.3f} > "
            f"target_epsilon={target_epsilon}; raise noise_multiplier, lower steps, or unset it to calibrate")
    for note in data_notes:
        log.warning("privacy plan: %s", note)
    return plan
