"""Plan with a fitted law: tokens or parameters for a target loss, compute-optimal (N, D).

Targets are losses in nats; a perplexity target is ``loss = ln(ppl)`` (:func:`loss_from_ppl`).
Compute is ``C = 6·N·D`` FLOPs (forward + backward, dense transformer). For ``dp_noise`` the noise term
``C·σ̄^γ`` is held at the given σ̄: the planning answers "with this noise per example, how big and how
long?", which is how an ε group's runs were made. (At a fixed ε, σ̄ itself depends on steps and batch:
re-run ``dpllm plan`` for the chosen D to check the noise you will actually get.)

Example:
    >>> fit = FitResult(form="chinchilla", params={"E": 1.7, "A": 400.0, "alpha": 0.34, "B": 410.0,
    ...                 "beta": 0.28}, ci={}, r2=1.0, n_points=0, n_runs=0)
    >>> d = tokens_for_target(fit, target_loss=2.5, n=1e8)
    >>> round(float(fit.predict(N=1e8, D=d)), 6)
    2.5
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Mapping

from dpllm.scaling.fit import JOINT, FitResult
from dpllm.scaling.forms import ScalingError
from dpllm.scaling.runs import NON_PRIVATE, parse_epsilon

FLOPS_PER_PARAM_TOKEN = 6.0  # ≈2 forward + 4 backward FLOPs per parameter per token


class UnreachableTargetError(ScalingError):
    """The target loss is at or below what the fitted law can ever reach."""


class OutsideFitError(ScalingError):
    """A plan needs inputs (N, D, S, σ̄) outside the range the law was fitted on."""


class DegenerateFitError(ScalingError):
    """The fit is degenerate (terms not identified, zero-width intervals, poor R²): it cannot plan."""


class ExtrapolationWarning(UserWarning):
    """A plan was allowed outside the fitted range (``extrapolate > 1``) or from a degenerate fit (``force``)."""


_WHAT = {"N": "parameters N", "D": "tokens D", "S": "steps S", "sigma_bar": "noise-batch ratio σ̄"}


def check_fit_usable(fit: FitResult, *, force: bool = False) -> None:
    """Refuse a degenerate fit (``fit.degenerate`` non-empty); with ``force`` warn loudly instead.

    Raises:
        DegenerateFitError: the reasons, and how to get a usable fit.
    """
    if not fit.degenerate:
        return
    msg = (f"the {fit.form} fit [{fit.label}] is degenerate: " + "; ".join(fit.degenerate)
           + ". Plans from it are numbers, not predictions; add runs over a wider range (more sizes, longer "
             "runs) and refit")
    if not force:
        raise DegenerateFitError(msg + " (or pass --force to plan anyway)")
    warnings.warn(msg, ExtrapolationWarning, stacklevel=2)


def check_in_domain(fit: FitResult, *, extrapolate: float = 1.0, **values: float) -> None:
    """Refuse inputs outside the fitted range ``fit.domain``; allow up to ``extrapolate``× beyond it, loudly.

    Args:
        fit: the fit (its ``domain`` is ``{input: [min, max]}``; an input without one is not checked).
        extrapolate: how far beyond the fitted range (a factor ≥ 1) a value may lie; 1 refuses anything out.
        values: ``N=..., D=..., S=..., sigma_bar=...`` (σ̄ = 0, non-private, is always in range).

    Raises:
        OutsideFitError: a value beyond ``extrapolate``× the range, naming the range.
    """
    if not extrapolate >= 1:
        raise ScalingError(f"extrapolate={extrapolate} must be a factor ≥ 1")
    for name, v in values.items():
        if name not in fit.domain or v is None or (name == "sigma_bar" and v == 0):
            continue
        lo, hi = fit.domain[name]
        if lo <= v <= hi:
            continue
        rng = f"{_WHAT.get(name, name)} = {v:.3g} is outside the fitted range [{lo:.3g}, {hi:.3g}]"
        if not (lo / extrapolate <= v <= hi * extrapolate):
            raise OutsideFitError(f"{rng}: the law was not fitted there, so its answer is a guess; plan inside the "
                                  f"range, add runs that cover {v:.3g}, or allow it with --extrapolate "
                                  f"{max(v / hi, lo / v):.2g}")
        warnings.warn(f"EXTRAPOLATING: {rng} (allowed by extrapolate={extrapolate:g})", ExtrapolationWarning,
                      stacklevel=2)


def loss_from_ppl(ppl: float) -> float:
    """Perplexity → loss in nats. Raises ScalingError unless ``ppl > 1``."""
    if not (ppl > 1 and math.isfinite(ppl)):
        raise ScalingError(f"target perplexity {ppl} must be a finite number > 1")
    return math.log(ppl)


def _terms(fit: FitResult, sigma_bar: float | None) -> tuple[float, Mapping[str, float]]:
    """The constant part of the law (E plus the noise term) and the parameters."""
    p = fit.params
    if fit.form == "power_law":
        if not p["alpha"] > 1e-6:
            raise ScalingError(f"fitted alpha={p['alpha']:.3g} is at its bound 0: the runs show no gain along "
                               f"N, so the fit cannot plan; add runs over a wider range of N")
        return p["L_inf"], p
    floor = p["E"]
    if fit.form == "dp_noise":
        if sigma_bar is None or not (sigma_bar >= 0):
            raise ScalingError("dp_noise plans need sigma_bar (noise multiplier / logical batch) ≥ 0; pass "
                               "--sigma-bar, or --epsilon for a group whose runs share one σ̄")
        floor += p["C"] * sigma_bar ** p["gamma"] if sigma_bar > 0 else 0.0
    elif fit.form == "noise_batch":
        raise ScalingError("a noise_batch fit plans model size, batch and steps at a privacy budget: use "
                           "`dpllm scaling plan --fit FIT --records N --epsilon E --delta D --compute C` "
                           "(dpllm.scaling.dp_plan)")
    elif fit.form != "chinchilla":
        raise ScalingError(f"planning does not know form {fit.form!r}")
    for name in ("alpha", "beta"):
        if not p[name] > 1e-6:  # a flat direction: "more N (or D)" never helps, every solve divides by it
            raise ScalingError(f"fitted {name}={p[name]:.3g} is at its bound 0: the runs show no gain along "
                               f"{'N' if name == 'alpha' else 'D'}, so the fit cannot plan; add runs over a "
                               f"wider range")
    return floor, p


def floor_loss(fit: FitResult, *, sigma_bar: float | None = None) -> float:
    """The loss the law approaches as N and D grow without bound (E, or L∞, plus any noise term)."""
    return _terms(fit, sigma_bar)[0]


def _need_positive(name: str, value: float) -> float:
    if not (value > 0 and math.isfinite(value)):
        raise ScalingError(f"{name}={value} must be a finite positive number")
    return float(value)


def _unreachable(target: float, floor: float, where: str) -> UnreachableTargetError:
    return UnreachableTargetError(
        f"target loss {target:.4f} (ppl {math.exp(target):.3g}) is not above the fitted floor {floor:.4f} "
        f"(ppl {math.exp(floor):.3g}){where}; raise the target perplexity"
        + (", or plan at a larger size" if where else "")
    )


def tokens_for_target(fit: FitResult, *, target_loss: float, n: float, sigma_bar: float | None = None,
                      extrapolate: float = 1.0, force: bool = False) -> float:
    """Tokens D at which the law reaches ``target_loss`` for a model of ``n`` parameters.

    ``extrapolate`` and ``force`` are as in :func:`check_in_domain` and :func:`check_fit_usable`.

    Raises:
        ScalingError: the form has no D term (power_law).
        UnreachableTargetError: ``target_loss`` ≤ the floor at this N, E + A/N^α (+ noise term).
        OutsideFitError, DegenerateFitError: N or the answer D outside the fitted range; a degenerate fit.
    """
    if fit.form == "power_law":
        raise ScalingError("power_law has no D term; fit chinchilla or dp_noise to plan tokens")
    const, p = _terms(fit, sigma_bar)
    check_fit_usable(fit, force=force)
    check_in_domain(fit, extrapolate=extrapolate, N=n, sigma_bar=sigma_bar)
    floor = const + p["A"] * _need_positive("n", n) ** -p["alpha"]
    if target_loss <= floor:
        raise _unreachable(target_loss, floor, f" at N={n:.3g}")
    d = (p["B"] / (target_loss - floor)) ** (1.0 / p["beta"])
    check_in_domain(fit, extrapolate=extrapolate, D=d)
    return d


def params_for_target(fit: FitResult, *, target_loss: float, d: float | None = None,
                      sigma_bar: float | None = None, extrapolate: float = 1.0, force: bool = False) -> float:
    """Parameters N at which the law reaches ``target_loss`` (at ``d`` tokens, except for power_law).

    Raises:
        ScalingError: ``d`` missing for a form with a D term.
        UnreachableTargetError: ``target_loss`` ≤ the floor (at this D).
        OutsideFitError, DegenerateFitError: D or the answer N outside the fitted range; a degenerate fit.
    """
    const, p = _terms(fit, sigma_bar)
    check_fit_usable(fit, force=force)
    check_in_domain(fit, extrapolate=extrapolate, D=d, sigma_bar=sigma_bar)
    if fit.form == "power_law":
        floor, coef, expo, where = const, p["a"], p["alpha"], ""
    else:
        if d is None:
            raise ScalingError(f"{fit.form} needs the token count d to solve for N")
        floor = const + p["B"] * _need_positive("d", d) ** -p["beta"]
        coef, expo, where = p["A"], p["alpha"], f" at D={d:.3g}"
    if target_loss <= floor:
        raise _unreachable(target_loss, floor, where)
    n = (coef / (target_loss - floor)) ** (1.0 / expo)
    check_in_domain(fit, extrapolate=extrapolate, N=n)
    return n


def compute_optimal(fit: FitResult, *, compute: float, sigma_bar: float | None = None, extrapolate: float = 1.0,
                    force: bool = False) -> dict[str, float]:
    """The (N, D) that minimise predicted loss subject to 6·N·D = ``compute``.

    Closed form (setting dL/dN = 0 along D = C/(6N)): N* = G·(C/6)^(β/(α+β)) with
    G = (αA/(βB))^(1/(α+β)), and D* = C/(6N*).

    Returns:
        ``{"N", "D", "compute", "loss", "ppl"}``.
    """
    if fit.form == "power_law":
        raise ScalingError("power_law has no D term, so no compute trade-off; fit chinchilla or dp_noise")
    const, p = _terms(fit, sigma_bar)
    check_fit_usable(fit, force=force)
    check_in_domain(fit, extrapolate=extrapolate, sigma_bar=sigma_bar)
    c6 = _need_positive("compute", compute) / FLOPS_PER_PARAM_TOKEN
    a, b = p["alpha"], p["beta"]
    if a <= 0 or b <= 0:
        raise ScalingError(f"fitted exponents alpha={a:g}, beta={b:g} must be > 0 for a compute optimum")
    g = (a * p["A"] / (b * p["B"])) ** (1.0 / (a + b))
    n = g * c6 ** (b / (a + b))
    d = c6 / n
    check_in_domain(fit, extrapolate=extrapolate, N=n, D=d)
    loss = const + p["A"] * n**-a + p["B"] * d**-b
    return {"N": n, "D": d, "compute": float(compute), "loss": loss, "ppl": math.exp(loss)}


def compute_for_target(fit: FitResult, *, target_loss: float, sigma_bar: float | None = None,
                       extrapolate: float = 1.0, force: bool = False) -> dict[str, float]:
    """Least compute 6·N·D that reaches ``target_loss``, and the compute-optimal (N, D) that does it.

    At the optimum αA/N^α = βB/D^β, so with X = target − floor: A/N^α = X·β/(α+β), B/D^β = X·α/(α+β).

    Raises:
        UnreachableTargetError: ``target_loss`` ≤ the floor.
    """
    if fit.form == "power_law":
        raise ScalingError("power_law has no D term, so no compute trade-off; fit chinchilla or dp_noise")
    const, p = _terms(fit, sigma_bar)
    check_fit_usable(fit, force=force)
    check_in_domain(fit, extrapolate=extrapolate, sigma_bar=sigma_bar)
    if target_loss <= const:
        raise _unreachable(target_loss, const, "")
    x, a, b = target_loss - const, p["alpha"], p["beta"]
    n = (p["A"] * (a + b) / (x * b)) ** (1.0 / a)
    d = (p["B"] * (a + b) / (x * a)) ** (1.0 / b)
    check_in_domain(fit, extrapolate=extrapolate, N=n, D=d)
    return {"N": n, "D": d, "compute": FLOPS_PER_PARAM_TOKEN * n * d, "loss": target_loss,
            "ppl": math.exp(target_loss)}


def select_fit(doc: Mapping[str, Any], *, epsilon: str | float | None = None) -> tuple[FitResult, float | None]:
    """Pick the fit for an ε group from a fit.json document, and the σ̄ to plan with.

    Args:
        doc: the document :func:`dpllm.scaling.fit.fit_runs` wrote.
        epsilon: ``8``, ``"inf"`` (non-private) or ``None`` when the document has one fit.

    Returns:
        ``(fit, sigma_bar)``; ``sigma_bar`` is the group's single σ̄ for dp_noise fits, else ``None``.

    Raises:
        ScalingError: no fit for that ε, ambiguous choice, or a dp_noise group with several σ̄.
    """
    fits = doc["fits"]
    group = parse_epsilon(epsilon)
    if JOINT in fits:
        fit = FitResult.from_dict(fits[JOINT])
        if group is None:
            return fit, None
        info = doc.get("inputs", {}).get("groups", {}).get(group)
        if info is None:
            raise ScalingError(f"no runs at {group} in this fit; groups: {', '.join(doc['inputs']['groups'])}")
        sigmas = info["sigma_bar"]
        if len(sigmas) != 1:
            raise ScalingError(f"runs at {group} used several σ̄ ({', '.join(f'{s:.3g}' for s in sigmas)}); "
                               f"pass --sigma-bar")
        return fit, sigmas[0]
    if group is None:
        if len(fits) != 1:
            raise ScalingError(f"this fit has groups {', '.join(fits)}; pick one with --epsilon")
        group = next(iter(fits))
    if group not in fits:
        if group != NON_PRIVATE and all(g == NON_PRIVATE for g in fits):
            what = (f"{doc['prior']['name']} is a published non-private law" if doc.get("prior")
                    else f"this {doc.get('form', 'fit')} fit has only non-private runs")
            raise ScalingError(
                f"{what}: it has no noise term, so it cannot predict at {group}. To plan at a privacy budget, "
                f"fit --form noise_batch (loss in N, steps and σ̄) to runs at several ε, then `dpllm scaling plan "
                f"--fit FIT --records R --epsilon E --delta δ --compute C`; or drop --epsilon for the "
                f"non-private prediction")
        raise ScalingError(f"no fit for {group}; fitted groups: {', '.join(fits) or 'none'}"
                           + (f" (skipped: {doc['skipped'][group]})" if group in doc.get("skipped", {}) else ""))
    return FitResult.from_dict(fits[group]), None
