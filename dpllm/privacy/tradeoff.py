"""What any membership attack can reach against a run, from the run's own privacy curve.

A run's privacy report holds the mechanism as it ran: the ``(σ, q, steps)`` stages of Poisson-sampled
Gaussian noise (earlier stages and noise-schedule pieces included), and for user-level runs how a user's
records enter each step. From that history alone this module computes UPPER bounds on three numbers that
membership audits measure, for the strongest attack there is:

* the largest **TPR at FPR α** (α = 1% and 0.1%): the share of members an attack can find while wrongly
  flagging a share α of non-members;
* the largest **AUC** (the chance that an attack scores a member above a non-member; 0.5 is a coin flip).

**The argument.** Take one unit (a record, or a user) and fix everything else in the data. Any attack is a
test between P, the output distribution without the unit, and Q, with it (or the reverse: under add/remove
neighbours both directions are neighbours). For every ε ≥ 0 let δ(ε) be the larger of the two hockey-stick
divergences H_{e^ε}(Q‖P) and H_{e^ε}(P‖Q); the mechanism is then (ε, δ(ε))-DP for every ε at once. For a test
φ with false-positive rate α = E_P[φ] and power (TPR) t = E_Q[φ], the definition of H gives

* ``t ≤ e^ε α + δ(ε)``  (the test itself), and
* ``1 − α ≤ e^ε (1 − t) + δ(ε)``, i.e. ``t ≤ 1 − e^-ε (1 − α − δ(ε))``  (its complement, other direction).

Both hold for every ε, so ``t ≤ U(α) := min(1, min over ε of both lines)``; this is the f-DP trade-off curve
the (ε, δ(ε)) family implies (Dong, Roth & Su 2022, Prop. 2.12: exact for symmetric curves, as the Gaussian's
is). Taking the minimum over a finite grid of ε (ε = 0 included) drops some constraints, so the U computed
is ≥ the true one: still an upper bound. U is a minimum of non-decreasing affine functions of α, so it is
non-decreasing and concave. Every (FPR, TPR) point an attack reaches, at any threshold or with any
randomisation, lies under U; its ROC curve lies under U, and so its AUC = ∫ TPR d(FPR) ≤ ∫₀¹ U(α) dα.
:meth:`Curve.max_auc` integrates U by right-hand sums on a grid, which over-estimate the integral of a
non-decreasing function (by at most one grid step, 1/4000).

**Why conservative.** δ(ε) comes from dp-accounting's privacy-loss distribution (PLD) of the mechanism the run
composed: per stage, the Poisson-subsampled Gaussian (``from_gaussian_mechanism(σ, sampling_prob=q)``, what its
PLD accountant builds for ``PoissonSampledDpEvent(q, GaussianDpEvent(σ))``) self-composed over the steps; for
users of at most k records under record sampling, the mixture of Gaussians with J ~ Bin(k, q) records of the user
per step (:func:`dpllm.privacy.mixture.mixture_pld`, as :mod:`dpllm.privacy.user_level` accounts them). Its
**pessimistic** discretisation rounds every privacy loss up and puts truncated tail mass at +∞, so its δ(ε)
is ≥ the true δ(ε) for every ε. A larger δ raises both lines, so every bound here can only be too high, never
too low: an attack above it is impossible for a correct implementation of the mechanism (a bug), while an
attack below it proves nothing by itself.

**User-level runs** (:mod:`dpllm.privacy.user_level`; :func:`for_report` picks the events): under user-level
sampling (ULS) the history already counts users, so the curve above is the user's. Under ELS, and under record
sampling with ``max_records_per_user`` = k, a user is a group of at most k records and each step is the mixture
the user-level ε comes from (same PLD, same pessimistic rounding). Record sampling without a cap bounds nothing
about users (refused); a ULS history says nothing per record (refused).

**From the bound to an audit.** The bound is on the rates of the membership game: the audited members and
non-members come from one distribution and could each have been in or out (dpllm's split decides each
record's side on its own; under ``privacy_unit: user`` it splits whole users, so a record-level audit of such a
run tests users and is held to the user-level bound). An audit measures the rates on finitely many records;
:func:`check_audit` compares them through one-sided confidence bounds (see its docstring), so that sampling
noise alone does not make a correct run fail.

Example (one Gaussian step with σ = 1: the exact curve is TPR = Φ(Φ⁻¹(α) + 1), AUC = Φ(1/√2) = 0.760):
    >>> c = privacy_curve(history=[(1.0, 1.0, 1)])
    >>> round(c.max_auc(), 2), round(c.max_tpr(0.01), 3)
    (0.76, 0.092)
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

FPRS = (0.01, 0.001)  # the operating points audits report (besides AUC), as fractions
DISCRETIZATION = 1e-3  # the PLD's loss grid for record-level curves: < 0.1 s for 20,000 steps; coarser = looser
MIXTURE_DISCRETIZATION = 1e-2  # users of k > 1 records: dpllm.privacy.mixture's grid, as user_level's
EPSILON_POINTS = 1500  # the ε grid: a finer one only lowers (tightens) the bounds
AUC_POINTS = 4000  # intervals of the α grid for the AUC integral: over-estimate ≤ 1/AUC_POINTS
_N = NormalDist()


class TradeoffError(ValueError):
    """A report whose mechanism this module cannot bound (the message says why and what to do)."""


def tpr_key(fpr: float) -> str:
    """The name audits use for TPR at FPR ≤ ``fpr`` (``mia.metrics.tpr_key``), e.g. ``tpr@fpr=0.01``."""
    return f"tpr@fpr={fpr:g}"


@dataclass(frozen=True)
class Curve:
    """δ(ε) on a grid of ε ≥ 0 (ε = 0 first), and the bounds it implies (module docstring)."""

    epsilons: np.ndarray
    deltas: np.ndarray
    unit: str = "record"
    group_size: int = 1

    def max_tpr(self, fpr):
        """U(α): the largest TPR any attack can have at false-positive rate ``fpr`` (scalar or array).

        U is the minimum of 2·|ε grid| lines in α (the two per ε of the module docstring). Only the lines of their
        lower envelope can be that minimum, and at a given α only the envelope's line over α: each α is scored by
        that line and its two neighbours on the envelope (a breakpoint off by rounding cannot matter), in the same
        expressions as the lines' own, instead of by all 3,000 lines (4,000 α: 60 ms -> under 1 ms, after ~5 ms
        to find the envelope, once per curve). A minimum over fewer lines can only be higher, so U stays an upper
        bound; where the envelope is right (tests: everywhere on the grids they try), it is the same number as the
        minimum over all lines.
        """
        a = np.atleast_1d(np.asarray(fpr, dtype=np.float64))
        family, index, breaks = self._envelope
        e, d = np.exp(self.epsilons), self.deltas
        seg = np.searchsorted(breaks, a)
        best = np.full(a.shape, np.inf)
        for shift in (-1, 0, 1):
            k = np.clip(seg + shift, 0, len(index) - 1)
            i = index[k]
            line = np.where(family[k] == 0, d[i] + e[i] * a, 1.0 - (1.0 - d[i] - a) / e[i])
            best = np.minimum(best, line)
        out = np.clip(best, a, 1.0)
        return float(out[0]) if np.ndim(fpr) == 0 else out

    @functools.cached_property
    def _envelope(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The lower envelope of U's lines (convex-hull trick): for each of its lines in order of α, the family (0:
        ``δ + e^ε·α``, slope e^ε; 1: ``1 − e^-ε·(1 − α − δ)``, slope e^-ε) and index on the ε grid, and the α where
        each line hands over to the next."""
        e, d = np.exp(self.epsilons), self.deltas
        slope = np.concatenate([e, 1.0 / e]).tolist()
        icpt = np.concatenate([d, 1.0 - (1.0 - d) / e]).tolist()
        # a minimum of lines: the steepest is lowest far left, so the envelope meets them by falling slope
        order = sorted(range(len(slope)), key=lambda j: (-slope[j], icpt[j]))
        hull: list[int] = []
        for j in order:
            m, b = slope[j], icpt[j]
            if hull and slope[hull[-1]] == m:
                continue  # the same slope, an intercept as high or higher: never below the one kept
            while len(hull) >= 2:
                m1, b1, m2, b2 = slope[hull[-2]], icpt[hull[-2]], slope[hull[-1]], icpt[hull[-1]]
                # the middle line is lowest nowhere when it meets the first no left of where it meets the new one
                if (b2 - b1) * (m2 - m) >= (b - b2) * (m1 - m2):
                    hull.pop()
                else:
                    break
            hull.append(j)
        breaks = [(icpt[k] - icpt[j]) / (slope[j] - slope[k]) for j, k in zip(hull, hull[1:])]
        n = len(self.epsilons)
        idx = np.asarray(hull)
        return (idx >= n).astype(np.int8), idx % n, np.asarray(breaks, dtype=np.float64)

    def max_auc(self) -> float:
        """∫₀¹ U(α) dα, over-estimated by right-hand sums (U is non-decreasing)."""
        grid = np.linspace(0.0, 1.0, AUC_POINTS + 1)[1:]
        return float(min(1.0, self.max_tpr(grid).mean()))

    def bounds(self, fprs: Sequence[float] = FPRS) -> dict:
        """``{"auc", "tpr@fpr=0.01", "tpr@fpr=0.001", "unit", "group_size", "method"}``."""
        out = {"auc": round_up(self.max_auc())}
        out.update({tpr_key(b): round_up(self.max_tpr(b)) for b in fprs})
        out.update(unit=self.unit, group_size=self.group_size, method=METHOD)
        return out


METHOD = ("upper bounds for any attack: the trade-off curve of the run's (σ, q, steps) history from dp-accounting's "
          "pessimistic privacy-loss distribution, TPR ≤ min over ε of (e^ε·FPR + δ(ε), 1 − e^-ε·(1 − FPR − δ(ε))), "
          "AUC ≤ its integral (dpllm.privacy.tradeoff)")


def round_up(x: float, digits: int = 4) -> float:
    """``x`` rounded up to ``digits`` decimals (a bound stays a bound when it is printed)."""
    return min(1.0, math.ceil(x * 10 ** digits - 1e-9) / 10 ** digits)


def _composed(history, group_size: int, grid: float):
    """The composed PLD of ``history`` for a unit of ``group_size`` records: ``None`` for a stage without noise
    (no bound), ``False`` when nothing was released about the unit."""
    from dp_accounting.pld import privacy_loss_distribution

    from dpllm.privacy.mixture import mixture_pld

    stages = [(float(sigma), float(q), int(steps)) for sigma, q, steps in history if int(steps) > 0 and float(q) > 0]
    if any(sigma <= 0 for sigma, _, _ in stages):
        return None
    if not stages:
        return False
    composed = None
    for sigma, q, steps in stages:  # the events the run composed, as dp-accounting's PLD accountant builds them
        if group_size == 1:
            step = privacy_loss_distribution.from_gaussian_mechanism(
                sigma, sampling_prob=q, value_discretization_interval=grid)
        else:  # J ~ Bin(k, q) of the user's records in the step: the mixture of Gaussians, as user_level's
            step = mixture_pld(sigma=sigma, sample_rate=q, group_size=group_size, discretization=grid)
        pld = step.self_compose(steps)
        composed = pld if composed is None else composed.compose(pld)
    return composed


def privacy_curve(*, history, group_size: int = 1, unit: str = "record",
                  discretization: float | None = None) -> Curve:
    """The (ε, δ(ε)) curve of a DP-SGD history, from dp-accounting's pessimistic PLD.

    Args:
        history: ``[(σ, q, steps), ...]``, earlier stages first (a privacy report's ``history``).
        group_size: 1 for the accountant's own unit; k > 1 for a user of at most k records under record-level
            sampling (ELS, or ``user_sampling: record`` with a cap): the mixture-of-Gaussians step.
        unit: What one protected unit is (``record`` or ``user``), carried into the bounds.
        discretization: The PLD's loss grid (default :data:`DISCRETIZATION`, or :data:`MIXTURE_DISCRETIZATION`
            for k > 1); coarser is faster and looser, never lower.

    Returns:
        A :class:`Curve`; a history with a stage of σ = 0 gives δ = 1 everywhere (every bound 1).

    Raises:
        TradeoffError: ``group_size`` below 1.
    """
    k = int(group_size)
    if k < 1:
        raise TradeoffError(f"group_size={group_size} must be ≥ 1")
    stages = tuple((float(sigma), float(q), int(steps)) for sigma, q, steps in history)
    return _curve(stages, k, unit, discretization or (DISCRETIZATION if k == 1 else MIXTURE_DISCRETIZATION))


@functools.lru_cache(maxsize=64)
def _curve(history: tuple, k: int, unit: str, grid: float) -> Curve:
    """:func:`privacy_curve` of a normalised history, computed once per process: a curve takes ~0.2-0.5 s (1,500 δ(ε)
    read-outs of the composed PLD), and an export, its compliance check, a synthetic data card and an audit each ask
    for the same run's curve. Its arrays are read-only, so no caller can change what the next one gets."""
    pld = _composed(history, k, grid)
    if pld is None:
        return _frozen(np.zeros(1), np.ones(1), unit, k)
    if pld is False:  # nothing private was released about the unit: δ(0) = 0
        return _frozen(np.zeros(1), np.zeros(1), unit, k)
    # Lines with e^ε above 1/α stop mattering at α; the AUC grid starts at 1/AUC_POINTS and the tails are tiny.
    top = pld.get_epsilon_for_delta(1e-12)
    top = min(top if math.isfinite(top) else 40.0, 40.0)
    eps = np.linspace(0.0, max(top, 1e-3), EPSILON_POINTS)
    deltas = _deltas(pld, eps)
    # plus what float64 rounding of the composition may have taken off δ (dpllm.privacy.accounting.PLD_ROUNDING)
    deltas += ROUNDING * sum(int(t) for _, q, t in history if int(t) > 0 and float(q) > 0) * sys.float_info.epsilon
    return _frozen(eps, np.clip(deltas, 0.0, 1.0), unit, k)


def _deltas(pld, eps: np.ndarray) -> np.ndarray:
    """δ(ε) of ``pld`` at every point of the ascending grid ``eps``, never below dp-accounting's single read-outs.

    dp-accounting reads many ε in one pass over the losses (0.12-0.17 s for 1,500 ε of a 20,000-32,000-point PLD,
    where one read-out per ε took 0.8-1.3 s): δ(ε) = m∞ + U(ε) − e^ε·L(ε), from running sums over the losses above
    ε of the probabilities (U) and of probability·e^-loss (L), with e^ε·L ≤ U ≤ 1. A running sum of n non-negative
    terms is off by at most n·u of itself (u = 2⁻⁵³), so that δ by at most (2n + 4)·u: added here (7e-12 at n =
    32,000; seen, the two agree to 1e-14 relative). The single read-out sums non-negative terms directly.
    """
    out = np.asarray(pld.get_delta_for_epsilon(eps), dtype=np.float64)
    pmfs = [pld._pmf_remove] + ([] if pld._symmetric else [pld._pmf_add])
    n = max(p.to_dense_pmf()._probs.size for p in pmfs)
    return out + (2 * n + 4) * (sys.float_info.epsilon / 2)


def _frozen(epsilons: np.ndarray, deltas: np.ndarray, unit: str, k: int) -> Curve:
    epsilons.flags.writeable = deltas.flags.writeable = False
    return Curve(epsilons, deltas, unit, k)


# dp-accounting's FFT composition of T steps rounds δ by about T·2⁻⁵²; the curve's δ is raised by this many times
# that (the same margin as :data:`dpllm.privacy.accounting.PLD_ROUNDING`, a layer above: tests keep them equal).
ROUNDING = 4.0


def for_report(report, *, unit: str | None = None) -> Curve:
    """The curve of the mechanism a privacy report describes (a run's or a released one), for ``unit``.

    Args:
        report: A :class:`dpllm.privacy.report.PrivacyReport` (its ``history`` and ``user_level``).
        unit: ``record`` or ``user``; default the report's ``privacy_unit``. A run with users (any
            ``user_level``) splits whole users, so its record-level audits are held to ``user``.

    Raises:
        TradeoffError: a non-private run; a report with steps but no history; ``user`` for a run without users,
            or under record sampling without ``max_records_per_user`` (a user may hold any number of records:
            nothing is bounded); ``record`` for user-level sampling (ULS), whose history counts users.
    """
    if not report.enabled:
        raise TradeoffError("the run was trained without DP: no attack is bounded")
    history = [tuple(h) for h in report.history]
    if not history and report.steps:
        raise TradeoffError(f"the privacy report counts {report.steps} steps but holds no (σ, q, steps) history to "
                            "bound them with (a report from before dpllm recorded it)")
    user = report.user_level or {}
    unit = unit or report.privacy_unit
    sampling = user.get("sampling")
    if unit == "sequence" and report.privacy_unit == "sequence":  # declared blocks: record-level over the blocks
        return privacy_curve(history=history, unit="record")
    if unit == "record":
        if sampling == "uls":
            raise TradeoffError("this run sampled users (user_sampling: uls), so its accounting is per user; ask for "
                                "unit='user'")
        return privacy_curve(history=history, unit="record")
    if unit != "user":
        raise TradeoffError(f"unit={unit!r}; use 'record' or 'user'")
    if not user:
        raise TradeoffError("unit='user' needs a run with privacy_unit: user (this one has no users)")
    if sampling == "uls":
        return privacy_curve(history=history, unit="user")
    k = user.get("max_records_per_user")
    if not k:
        raise TradeoffError("no max_records_per_user: a user may hold any number of records, so no attack on users is "
                            "bounded; set max_records_per_user")
    return privacy_curve(history=history, group_size=int(k), unit="user")


def unit_words(report, data_format: str | None = None) -> tuple[str, str]:
    """(singular, plural) for one protected unit in plain language."""
    if report.privacy_unit == "user":
        return "person (user)", "people (users)"
    if report.privacy_unit == "sequence":
        return "sequence (a block of tokens)", "sequences (blocks of tokens)"
    if data_format in ("messages", "prompt_completion"):
        return "conversation", "conversations"
    if data_format == "text":
        return "text", "texts"
    return "record", "records"


def plain_reading(bounds: Mapping, *, plural: str = "records") -> str:
    """The bounds in words a non-specialist reads (``bounds`` from :meth:`Curve.bounds`).

    Example:
        >>> print(plain_reading({"auc": 0.62, "tpr@fpr=0.01": 0.0272, "tpr@fpr=0.001": 0.0028}))
        An attacker who wrongly flags 1% of the records that were not in the training data as members can find at \
most 2.72% of the records that were; at 0.1% wrongly flagged, at most 0.28%. No attack ranks a training record above \
an outside one more often than 62.0% of the time (50% is a coin flip).
    """
    def pct(x: float) -> str:
        return f"{100 * x:.3g}%" if x < 0.9995 else "100%"

    tprs = sorted(((float(k.split("=", 1)[1]), v) for k, v in bounds.items() if k.startswith("tpr@fpr=")),
                  reverse=True)
    if not tprs:
        raise TradeoffError("bounds has no tpr@fpr=… entry")
    (a0, t0), rest = tprs[0], tprs[1:]
    single = plural.removesuffix("s")
    if plural.startswith("people"):
        single = "person"
    text = (f"An attacker who wrongly flags {pct(a0)} of the {plural} that were not in the training data as members "
            f"can find at most {pct(t0)} of the {plural} that were")
    text += "".join(f"; at {pct(a)} wrongly flagged, at most {pct(t)}" for a, t in rest) + "."
    auc = float(bounds["auc"])
    if auc >= 0.9995:
        return text + " Over all thresholds together the guarantee rules out nothing: an attack's AUC may reach 1."
    return (text + f" No attack ranks a training {single} above an outside one more often than {100 * auc:.1f}% of "
            "the time (50% is a coin flip).")


# ---- comparing an audit with the bounds ------------------------------------------------------------------

def _cp_upper(k: int, n: int, a: float) -> float:
    """Clopper-Pearson one-sided upper confidence bound (level 1 − a) of a rate seen k times in n."""
    from scipy.stats import beta

    return 1.0 if k >= n else float(beta.ppf(1 - a, k + 1, n - k))


def _cp_lower(k: int, n: int, a: float) -> float:
    from scipy.stats import beta

    return 0.0 if k <= 0 else float(beta.ppf(a, k, n - k + 1))


def check_audit(attacks: Mapping[str, Mapping], curve: Curve, *, fprs: Sequence[float] = FPRS,
                confidence: float = 0.95) -> dict:
    """Compare an audit's measured AUC and TPR@FPR with the curve's bounds, beyond sampling error.

    Each attack's metrics (``mia.metrics.evaluate``: ``auc``, ``tpr@fpr=b``, ``n_members``, ``n_nonmembers``)
    give one-sided lower confidence bounds, and a measured value *exceeds* its bound when even that lower end is
    above it. All comparisons together hold at ``confidence`` (Bonferroni over attacks and metrics):

    * AUC: Hoeffding's inequality for the two-sample U-statistic (no assumption on the scores):
      ``AUC ≥ AUC_measured − sqrt(ln(1/a) / (2·min(m, n)))``;
    * TPR at FPR ≤ b: the audit's threshold is set by the non-member scores alone, so the members above it are
      Binomial(m, TPR) and the non-members above it at most ⌊b·n⌋ of n: Clopper-Pearson gives TPR ≥ t_lo and
      FPR ≤ f_hi (half the level each), and a correct mechanism needs t_lo ≤ U(f_hi) (U is non-decreasing).

    Both treat the audited records as independent draws, the usual reading of a membership audit (one model scores
    them all, so they are not strictly independent; :mod:`mia.fdp` is the rigorous one-run analysis, for canaries
    trained on by independent coins). A false "exceeds" is a false alarm, never a weaker guarantee.

    Returns:
        ``{"bounds": curve.bounds(), "exceeded": [(attack, metric, measured, allowed)], "per_attack": {attack:
        {metric: {"measured", "bound", "lower", "exceeds"}}}, "confidence"}``.
    """
    bounds = curve.bounds(fprs)
    tests = max(1, len(attacks) * (1 + len(fprs)))
    a = (1.0 - confidence) / tests
    per, exceeded = {}, []
    for name, r in attacks.items():
        m, n = int(r.get("n_members") or 0), int(r.get("n_nonmembers") or 0)
        rows = {}
        if m and n and r.get("auc") is not None:
            lower = float(r["auc"]) - math.sqrt(math.log(1 / a) / (2 * min(m, n)))
            rows["auc"] = {"measured": float(r["auc"]), "bound": bounds["auc"], "lower": lower,
                           "exceeds": lower > bounds["auc"]}
        for b in fprs:
            key = tpr_key(b)
            if not (m and n) or r.get(key) is None:
                continue
            t_lo = _cp_lower(round(float(r[key]) * m), m, a / 2)
            f_hi = _cp_upper(math.floor(b * n + 1e-9), n, a / 2)
            allowed = float(curve.max_tpr(f_hi))
            rows[key] = {"measured": float(r[key]), "bound": bounds[key], "lower": t_lo, "fpr_upper": f_hi,
                         "allowed_at_fpr_upper": allowed, "exceeds": t_lo > allowed}
        for metric, row in rows.items():
            if row["exceeds"]:
                exceeded.append((name, metric, row["measured"], row.get("allowed_at_fpr_upper", row["bound"])))
        per[name] = rows
    return {"bounds": bounds, "exceeded": exceeded, "per_attack": per, "confidence": confidence}
