"""Noise schedules: σ that changes over training, spent so that the whole schedule meets the target ε.

A schedule is piecewise constant: training's ``steps`` are cut into ``pieces`` runs of (nearly) equal length, and
piece ``i`` uses ``σ_i = σ₀ · m_i`` with the shape's multipliers ``m_0 = 1, …, m_{k-1} = end``:

=============  ===========================================  ===============================================
kind           multiplier of piece i (of k)                 typical use
=============  ===========================================  ===============================================
``constant``   1                                            the default; one piece
``linear``     1 + (end − 1) · i / (k − 1)                  σ falls (end < 1) or rises (end > 1) linearly
``exponential`` end^(i / (k − 1))                            geometric decay; with k = 2–4 pieces, step decay
=============  ===========================================  ===============================================

Why piecewise constant: the accountants compose a history of ``(σ, q, steps)`` entries, and the PRV accountant's
cost grows with the number of distinct entries, so a schedule of k pieces costs k entries, not one per step. The
history the trainer's accountant records (Opacus merges consecutive steps of equal σ) is exactly the schedule's
pieces, so the report, the ledger's recomputation and ``dpllm plan`` account the same history.

Calibration: σ₀ is the smallest value of 4 significant figures whose whole schedule, composed after any
earlier stages' history, has ε ≤ target under the *same* accountant that reports ε (:func:`calibrate`). ε is
decreasing in σ₀ because every piece's σ scales with it.

Example:
    >>> s = NoiseSchedule(kind="linear", end=0.5, pieces=3)
    >>> s.multipliers()
    [1.0, 0.75, 0.5]
    >>> s.lengths(10)
    [4, 3, 3]
    >>> s.history(2.0, 0.1, 10)
    [(2.0, 0.1, 4), (1.5, 0.1, 3), (1.0, 0.1, 3)]
    >>> s.history(2.0, 0.1, 10, done=5)  # what the accountant holds after 5 of the 10 steps
    [(2.0, 0.1, 4), (1.5, 0.1, 1)]
    >>> s.sigma_at(2.0, 10, step=5)     # σ of the 6th step (0-based step 5)
    1.5
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

from dpllm.config import NOISE_SCHEDULES, ConfigError, schedule_problem
from dpllm.privacy.accounting import PrivacyPlanError

KINDS = NOISE_SCHEDULES


class ScheduleError(PrivacyPlanError):
    """A schedule that cannot be built; the message names the option to change."""


@dataclass(frozen=True)
class NoiseSchedule:
    """The shape of σ over training (scaled by σ₀).

    Attributes:
        kind: ``constant``, ``linear`` or ``exponential``.
        end: Multiplier of the last piece (σ_last / σ₀); ignored for ``constant``.
        pieces: Number of constant pieces (≥ 2 for a non-constant kind).
    """

    kind: str = "constant"
    end: float = 0.5
    pieces: int = 10

    def __post_init__(self):
        problem = schedule_problem(self.kind, self.end, self.pieces)  # the rule dpllm.config.validate applies
        if problem:
            raise ScheduleError(problem)

    @property
    def is_constant(self) -> bool:
        return self.kind == "constant" or self.end == 1.0

    def multipliers(self) -> list[float]:
        """σ_i / σ₀ for each piece."""
        if self.kind == "constant":
            return [1.0]
        k = int(self.pieces)
        if self.kind == "linear":
            return [1.0 + (self.end - 1.0) * i / (k - 1) for i in range(k)]
        return [float(self.end ** (i / (k - 1))) for i in range(k)]

    def lengths(self, steps: int) -> list[int]:
        """Steps in each piece: as equal as possible, earlier pieces one longer; pieces of 0 steps dropped.

        Raises:
            ScheduleError: Fewer steps than pieces.
        """
        k = len(self.multipliers())
        if steps < k:
            raise ScheduleError(f"a {self.kind} schedule of {k} pieces needs at least {k} steps (the run has "
                                f"{steps}); lower privacy.noise_schedule_pieces or train longer")
        base, extra = divmod(int(steps), k)
        return [base + (1 if i < extra else 0) for i in range(k)]

    def history(self, sigma0: float, sample_rate: float, steps: int, *, done: Optional[int] = None) -> list[tuple]:
        """The ``(σ, q, steps)`` entries of the first ``done`` steps (all ``steps`` by default), pieces merged."""
        done = steps if done is None else int(done)
        out: list[tuple] = []
        for m, n in zip(self.multipliers(), self.lengths(steps)):
            take = min(n, done)
            if take <= 0:
                break
            sigma = float(sigma0) * m
            if out and out[-1][0] == sigma:
                out[-1] = (sigma, float(sample_rate), out[-1][2] + take)
            else:
                out.append((sigma, float(sample_rate), take))
            done -= take
        return out

    def sigma_at(self, sigma0: float, steps: int, *, step: int) -> float:
        """σ of the optimizer step with 0-based index ``step``."""
        end = 0
        for m, n in zip(self.multipliers(), self.lengths(steps)):
            end += n
            if step < end:
                return float(sigma0) * m
        raise ScheduleError(f"step {step} is past the schedule's {steps} steps")

    def to_json(self) -> dict:
        return {"kind": self.kind, "end": self.end, "pieces": int(self.pieces)}

    def describe(self, sigma0: float, sample_rate: float, steps: int) -> str:
        """One line: the pieces as σ × steps."""
        return ", ".join(f"σ = {s:.4g} × {n} steps" for s, _, n in self.history(sigma0, sample_rate, steps))


def calibrate(schedule: NoiseSchedule, *, target_epsilon: float, delta: float, sample_rate: float, steps: int,
              accountant: str, prior_history: Iterable[tuple] = ()) -> float:
    """Smallest σ₀ whose whole schedule (after ``prior_history``) has ε ≤ ``target_epsilon`` under ``accountant``.

    Raises:
        dpllm.privacy.accounting.PrivacyPlanError: The target cannot be met (σ₀ above the accountant's limit),
            or earlier stages already spent it.
        ScheduleError: Fewer steps than pieces.
    """
    from dpllm.privacy import accounting

    prior = [tuple(h) for h in prior_history]
    schedule.lengths(steps)  # refuse too few steps before any accounting
    if schedule.is_constant:
        return accounting.calibrate_noise(target_epsilon=target_epsilon, delta=delta, sample_rate=sample_rate,
                                          steps=steps, accountant=accountant, prior_history=prior)
    # strict: when PRV cannot run, the planner redoes the whole plan with its fallback (never a mix of accountants).
    if prior and accounting.compute_epsilon_history(history=prior, delta=delta, accountant=accountant,
                                                    strict=True) >= target_epsilon:
        raise accounting.PrivacyPlanError(
            f"earlier stages already spent ε ≥ target_epsilon={target_epsilon}; raise the target")

    def eps(sigma0: float) -> float:
        return accounting.compute_epsilon_history(history=prior + schedule.history(sigma0, sample_rate, steps),
                                                  delta=delta, accountant=accountant, strict=True)

    def unreachable() -> Exception:
        return accounting.PrivacyPlanError(
            f"target_epsilon={target_epsilon} cannot be met by the {schedule.kind} schedule over {steps:,} steps "
            f"at sampling rate {sample_rate:.4g}; raise the target or use a constant schedule")

    # The same grid as a constant σ's calibration: the smallest σ₀ of SIGMA_DIGITS significant figures that meets it
    # (RDP: searched with the fast series, each grid point decided by Opacus's ε, as accounting.calibrate_noise does).
    rdp = accounting.rdp_stand_in(lambda s0: prior + schedule.history(s0, sample_rate, steps), delta)
    if accountant == "rdp":
        return accounting.smallest_smooth_noise(eps, target_epsilon, digits=accounting.SIGMA_DIGITS,
                                                unreachable=unreachable, start=1.0, stand_in=rdp)
    # PRV, PLD (0.05-0.5 s per σ₀): false position from where the RDP bound meets the target (milliseconds a σ₀)
    try:
        start = accounting.smallest_noise(rdp, target_epsilon, epsilon_tolerance=1e-3 * target_epsilon,
                                          unreachable=unreachable)
    except accounting.PrivacyPlanError:  # the looser bound needs σ₀ above the limit: the search decides from there
        start = accounting.MAX_NOISE_MULTIPLIER
    return accounting.smallest_smooth_noise(eps, target_epsilon, digits=accounting.SIGMA_DIGITS,
                                            unreachable=unreachable, start=start)


def noise_schedule(p) -> NoiseSchedule:
    """The :class:`NoiseSchedule` a config's privacy section (``dpllm.config.PrivacyConfig``) asks for.

    Raises:
        ConfigError: An unknown kind, a non-positive end or fewer than 2 pieces.
    """
    try:
        return NoiseSchedule(kind=p.noise_schedule, end=p.noise_schedule_end, pieces=p.noise_schedule_pieces)
    except ScheduleError as err:
        raise ConfigError(str(err)) from None
