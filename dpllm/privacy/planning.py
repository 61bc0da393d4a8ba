"""``dpllm plan``: noise multiplier for a target ε, ε for a noise multiplier, and the noise-to-signal ratio.

Every ε and σ here comes from :mod:`dpllm.privacy.accounting` (Opacus accountants); nothing is
approximated by formula. Printed σ are rounded *up* (to 4 significant figures) and the printed ε is
computed at that rounded σ, so copying the printed σ into a config never overshoots the budget.

    dpllm plan --num-records 1000000 --batch 1024 --epochs 1 --target-epsilon 8 --delta 1e-7
    dpllm plan --num-records 50000 --batch 512 --steps 2000 --noise-multiplier 0.8 --delta 1e-6 --json

User-level DP (docs/user_level.md): ``--unit user --num-users U --records-per-user k`` and a sampling scheme.
ULS samples users (``--users-per-batch`` B_u, default round(B·U/N), the trainer's rule; N defaults to U·k);
ELS samples records of the k-capped data and converts to users by group privacy. δ must be < 1/U.

    dpllm plan --unit user --sampling uls --num-users 2000 --records-per-user 8 --batch 256 --epochs 2 \
        --target-epsilon 8 --delta 1e-4
    dpllm plan --unit user --sampling els --num-users 2000 --records-per-user 8 --num-records 12000 \
        --batch 256 --epochs 2 --target-epsilon 8 --delta 1e-4

Correlated noise (docs/privacy.md, "Correlated noise"): ``--noise banded --bands auto|k`` adds, for the target ε,
σ and the prefix-sum RMSE (in units of the clipping norm C: σ times the strategy's error at unit noise) of DP-SGD
and of b-banded noise, for the b that ``bands: auto`` picks (or the given b):

    dpllm plan --num-records 10000 --batch 250 --epochs 10 --target-epsilon 3 --delta 1e-5 --noise banded

NSR = σ·C / (B·ḡ): the per-coordinate standard deviation of the Gaussian noise in the averaged clipped
gradient (σ·C/B) over the mean per-example gradient norm ḡ (``--grad-norm``; ḡ ≤ C after clipping).
The noise *vector* over d coordinates has norm ≈ √d times that, so compare NSRs between plans rather
than reading one as an absolute signal-to-noise figure.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from typing import Any, Callable, Sequence

from dpllm.privacy.accounting import (
    ACCOUNTANTS,
    AccountantUnavailable,
    PrivacyPlanError,
    calibrate_noise,
    check_delta,
    compute_epsilon,
    compute_epsilon_history,
    first_that_runs,
)
from dpllm.privacy.plan import check_finite_positive, expected_batch, noise_batch_warning, sample_rate_for, steps_for
from dpllm.privacy.prv import round_up

DEFAULT_EPSILONS = (1.0, 2.0, 4.0, 8.0, 10.0)
SIGMA_DIGITS = 4


def noise_to_signal(*, noise_multiplier: float, max_grad_norm: float, batch: int, grad_norm: float) -> float:
    """NSR = σ·C/(B·ḡ): per-coordinate noise std of the averaged gradient over the mean gradient norm.

    >>> noise_to_signal(noise_multiplier=1.0, max_grad_norm=1.0, batch=1000, grad_norm=0.5)
    0.002
    """
    return noise_multiplier * max_grad_norm / (batch * grad_norm)


def _accounted(fn, accountant: str, **kw: Any) -> float:
    """Call an accounting function, turning an accountant's numeric failure into a clear error."""
    try:
        return fn(accountant=accountant, **kw)
    except (PrivacyPlanError, AccountantUnavailable):
        raise
    except (ValueError, ArithmeticError, RuntimeError) as err:
        raise PrivacyPlanError(
            f"the {accountant} accountant failed at sample rate {kw['sample_rate']:.4g}, {kw['steps']:,} steps, "
            f"delta={kw['delta']:g} ({err}); use accountant='prv' or 'rdp'") from err


def plan_table(*, num_records: int, batch: int, delta: float, target_epsilon: float | None = None,
                 epochs: float | None = None, steps: int | None = None, accountant: str = "prv",
                 noise_multiplier: float | None = None, max_grad_norm: float = 1.0, grad_norm: float = 1.0,
                 epsilons: Sequence[float] = DEFAULT_EPSILONS, progress: Callable[[str], None] | None = None,
                 schedule=None) -> dict:
    """A full privacy plan as data (what ``dpllm plan --json`` prints).

    One accountant computes every σ and ε of the plan. If ``accountant`` cannot run for it (PRV's domain
    would not fit in memory, or its numerics fail), the whole plan is redone with its fallback and
    ``plan["accountant_note"]`` says why.

    Args:
        num_records: N, private records (the privacy unit).
        batch: logical batch B (Poisson sampling at rate q = 1/⌈N/B⌉).
        delta: target δ; must be < 1/N.
        target_epsilon: if given, the σ that meets it (``plan["target"]``).
        epochs, steps: exactly one; steps = ceil(epochs·⌈N/B⌉).
        accountant: ``prv`` (default), ``rdp`` or ``gdp``.
        noise_multiplier: if given, the ε it spends (``plan["given_noise"]``).
        max_grad_norm: clipping bound C; grad_norm: assumed mean per-example gradient norm ḡ.
        epsilons: ε values for the table (σ and NSR per ε).
        progress: called with a line per stage of the work (the CLI prints them on stderr).
        schedule: a non-constant :class:`dpllm.privacy.schedule.NoiseSchedule`: every σ is then the schedule's
            first piece σ₀, calibrated (or, given, accounted) over the whole schedule, as the trainer does;
            each row's ``pieces`` lists its ``(σ, q, steps)`` history.

    Returns:
        ``{"num_records", "batch", "steps", "sample_rate", "delta", "accountant", "max_grad_norm",
        "grad_norm", "target", "given_noise", "table"}``; each of target / table rows holds
        ``target_epsilon, noise_multiplier, epsilon, nsr`` (``epsilon`` = accountant ε at that σ).

    Raises:
        PrivacyPlanError: δ ≥ 1/N, B > N, bad sizes, or an unreachable ε.
    """
    for name, value in (("delta", delta), ("target_epsilon", target_epsilon), ("noise_multiplier", noise_multiplier)):
        check_finite_positive(name, value)
    for e in epsilons:
        check_finite_positive("epsilons", e)
    check_delta(delta, num_records)
    if not 0 < batch <= num_records:
        raise PrivacyPlanError(f"batch={batch} must be in [1, num_records={num_records:,}]")
    for name, v in (("max_grad_norm", max_grad_norm), ("grad_norm", grad_norm)):
        if not v > 0:
            raise PrivacyPlanError(f"{name}={v} must be positive")
    n_steps = steps_for(num_records=num_records, batch=batch, epochs=epochs, steps=steps)
    q = sample_rate_for(num_records, batch)  # the trainer's rate, 1/⌈N/B⌉ (≤ B/N)
    common = {"sample_rate": q, "steps": n_steps, "delta": delta}
    say = progress or (lambda line: None)

    scheduled = schedule is not None and not schedule.is_constant
    if scheduled:
        schedule.lengths(n_steps)  # refuses fewer steps than pieces

    def build(acc: str) -> dict:
        def row(target: float | None, sigma: float) -> dict:
            if scheduled:
                pieces = schedule.history(sigma, q, n_steps)
                eps = compute_epsilon_history(history=pieces, delta=delta, accountant=acc, strict=True)
            else:
                eps = _accounted(compute_epsilon, acc, noise_multiplier=sigma, strict=True, **common)
            out = {"target_epsilon": target, "noise_multiplier": sigma, "epsilon": eps,
                   "nsr": noise_to_signal(noise_multiplier=sigma, max_grad_norm=max_grad_norm, batch=batch,
                                          grad_norm=grad_norm)}
            if scheduled:
                out["pieces"] = [list(h) for h in pieces]
            return out

        cache: dict[float, dict] = {}

        def for_target(eps: float) -> dict:
            if eps not in cache:  # the target is usually also a table row; calibrate it once
                say(f"ε={eps:g}: searching σ with the {acc} accountant ({n_steps:,} steps at q={q:.4g})")
                if scheduled:
                    from dpllm.privacy.schedule import calibrate

                    sigma = calibrate(schedule, target_epsilon=eps, delta=delta, sample_rate=q, steps=n_steps,
                                      accountant=acc)
                else:
                    sigma = _accounted(calibrate_noise, acc, target_epsilon=eps, progress=say, **common)
                cache[eps] = row(eps, round_up(sigma))
            return cache[eps]

        plan: dict[str, Any] = {
            "num_records": num_records, "batch": batch, "epochs": epochs, "steps": n_steps, "sample_rate": q,
            "delta": delta, "accountant": acc, "accountant_note": None, "max_grad_norm": max_grad_norm,
            "grad_norm": grad_norm, "noise_schedule": schedule.to_json() if scheduled else None,
            "target": for_target(float(target_epsilon)) if target_epsilon is not None else None,
            "given_noise": row(None, float(noise_multiplier)) if noise_multiplier is not None else None,
        }
        plan["table"] = [for_target(float(e)) for e in sorted(set(epsilons))]
        return plan

    notes: list[str] = []  # PRV, then PLD, then RDP: the first accountant that runs does the whole plan
    return first_that_runs(accountant, lambda acc: {**build(acc), "accountant_note": "; ".join(notes) or None},
                           on_switch=lambda note: (notes.append(note), say(note)))


def user_plan_table(*, sampling: str, num_users: int, records_per_user: int, batch: int, delta: float,
                    num_records: int | None = None, users_per_batch: int | None = None,
                    target_epsilon: float | None = None, noise_multiplier: float | None = None,
                    epochs: float | None = None, steps: int | None = None, accountant: str = "prv",
                    max_grad_norm: float = 1.0, grad_norm: float = 1.0,
                    epsilons: Sequence[float] = DEFAULT_EPSILONS) -> dict:
    """A user-level privacy plan (what ``dpllm plan --unit user`` prints), computed as training computes it.

    ULS: :func:`plan_table` over U users at B_u users per step; its ε is the user-level ε. ELS: σ calibrated
    by the tight mixture accounting of k records per user (:func:`dpllm.privacy.user_level.calibrate_mixture`);
    each row then has ``epsilon`` (user level) and ``record_epsilon`` (record level at δ/k, for comparison).

    Args:
        sampling: ``uls`` or ``els``.
        num_users: U, training users (δ must be < 1/U).
        records_per_user: k, the declared cap ``max_records_per_user`` (the group size of ELS's accounting,
            never the largest user found in the data).
        num_records: records after the cap (default U·k).
        users_per_batch: ULS users per step (default round(batch·U/N)).
        Other arguments as for :func:`plan_table` (``batch`` counts records).

    Raises:
        PrivacyPlanError: δ ≥ 1/U, bad sizes, or an unreachable ε.
    """
    from dpllm.privacy import user_level

    if sampling not in ("uls", "els"):
        raise PrivacyPlanError(f"sampling={sampling!r}: choose uls or els")
    for name, v in (("num_users", num_users), ("records_per_user", records_per_user)):
        if not (isinstance(v, int) and v >= 1):
            raise PrivacyPlanError(f"{name}={v} must be a positive integer")
    check_finite_positive("delta", delta)
    check_delta(delta, num_users)
    n = num_records if num_records is not None else num_users * records_per_user
    common = dict(epochs=epochs, steps=steps, accountant=accountant, max_grad_norm=max_grad_norm,
                  grad_norm=grad_norm)
    info = {"unit": "user", "sampling": sampling, "num_users": num_users, "records_per_user": records_per_user,
            "num_records": n, "user_delta": delta}
    if sampling == "uls":
        b_u = users_per_batch if users_per_batch is not None else max(1, round(batch * num_users / n))
        plan = plan_table(num_records=num_users, batch=b_u, delta=delta, target_epsilon=target_epsilon,
                          noise_multiplier=noise_multiplier, epsilons=epsilons, **common)
        return {**plan, **info, "users_per_batch": b_u, "group_privacy": user_level.ULS_UNIT}
    k = records_per_user
    for name, value in (("target_epsilon", target_epsilon), ("noise_multiplier", noise_multiplier)):
        check_finite_positive(name, value)
    for e in epsilons:
        check_finite_positive("epsilons", e)
    # The record-level skeleton (q, steps, checks) at δ/k, the record-level δ training states beside the user level.
    plan = plan_table(num_records=n, batch=batch, delta=delta / k, epsilons=[], **common)
    q, n_steps = plan["sample_rate"], plan["steps"]

    def row(target: float | None, sigma: float) -> dict:
        eps_u = user_level.mixture_epsilon(history=[(sigma, q, n_steps)], delta=delta, group_size=k)
        eps_r = _accounted(compute_epsilon, accountant, noise_multiplier=sigma, sample_rate=q, steps=n_steps,
                           delta=delta / k)
        return {"target_epsilon": target, "noise_multiplier": sigma, "epsilon": eps_u, "record_epsilon": eps_r,
                "nsr": noise_to_signal(noise_multiplier=sigma, max_grad_norm=max_grad_norm, batch=batch,
                                       grad_norm=grad_norm)}

    def for_target(eps: float) -> dict:
        sigma = user_level.calibrate_mixture(target_epsilon=eps, delta=delta, sample_rate=q, steps=n_steps,
                                             group_size=k)
        return row(eps, round_up(sigma))

    plan["target"] = for_target(float(target_epsilon)) if target_epsilon is not None else None
    plan["given_noise"] = row(None, float(noise_multiplier)) if noise_multiplier is not None else None
    plan["table"] = [for_target(float(e)) for e in sorted(set(epsilons))]
    return {**plan, **info, "delta": delta, "record_delta": delta / k, "group_privacy": user_level.GROUP_PRIVACY}


def correlated_table(*, num_records: int, batch: int, steps: int, target_epsilon: float, delta: float,
                     bands="auto", accountant: str = "prv", noise: str = "banded", buffers="auto") -> dict:
    """DP-SGD, b-banded noise and BLT at one target ε (``dpllm plan --noise banded|blt``), as each would be run.

    ``bands`` (and ``buffers``) apply to the mechanism named by ``noise``; the other correlated one uses ``auto``.
    DP-SGD and BandMF are accounted as amplified DP-SGD (Poisson, or cyclic Poisson over b groups); BLT as one
    Gaussian mechanism with μ = sens(C, b, ⌈T/b⌉)/σ (no amplification: :mod:`dpllm.privacy.correlated.blt`). Every
    σ below is that of the strategy normalised to sensitivity 1 (BLT: 1/μ; training draws z at σ·sens), so
    ``error`` = σ·RMSE is comparable across the three: the root-mean-square noise per step in the prefix sums of the
    clipped gradient sums, in units of C.

    Returns:
        ``{"bands", "auto", "rows"}`` (banded: b = 1 (DP-SGD) first, then every b ``auto`` tries, or the given b),
        ``"blt": {"bands", "buffers", "auto", "mu", "noise_multiplier", "draw_noise_multiplier", "sensitivity",
        "epsilon", "prefix_sum_rmse", "error", "rows"}``, ``"comparison"`` (one row per mechanism, least error
        first) and ``"best"`` (the mechanism with the least error).

    Raises:
        PrivacyPlanError: as :func:`dpllm.privacy.correlated.build` (b > ⌈N/B⌉, b > steps, ...).
    """
    from dpllm.privacy import correlated

    if noise not in ("banded", "blt"):
        raise PrivacyPlanError(f"--noise {noise!r}: compare with banded or blt")
    common = dict(steps=steps, num_records=num_records, batch=batch, target_epsilon=target_epsilon, delta=delta,
                  accountant=accountant)
    banded_bands = bands if noise == "banded" else "auto"
    chosen = correlated.build("banded", banded_bands, **common)
    rows = list(chosen.choice) or correlated.compare_bands(sorted({1, chosen.bands}), steps=steps,
                                                           num_records=num_records, batch=batch,
                                                           target_epsilon=target_epsilon, delta=delta,
                                                           accountant=accountant)
    blt = correlated.build("blt", bands if noise == "blt" else "auto", buffers=buffers, **common)
    draw = blt.calibrate(target_epsilon=target_epsilon, delta=delta, accountant=accountant)
    sigma = draw / blt.sensitivity  # = 1/μ: the same for every b at this ε
    rmse = blt.strategy.prefix_sum_rmse(steps)
    blt_rows = [{**r, "noise_multiplier": sigma, "error": sigma * r["prefix_sum_rmse"]} for r in
                (blt.choice or correlated.compare_blt([blt.bands], steps=steps, buffers=blt.strategy.blt.buffers))]
    eps = _accounted(compute_epsilon_history, accountant, history=[blt.event(draw)], delta=delta, strict=True)
    blt_table = {"bands": blt.bands, "buffers": blt.strategy.blt.buffers, "auto": bool(blt.choice),
                 "buffers_auto": correlated.parse_buffers(buffers) is None, "mu": 1.0 / sigma,
                 "noise_multiplier": sigma, "draw_noise_multiplier": draw, "sensitivity": blt.sensitivity,
                 "epsilon": eps, "prefix_sum_rmse": rmse, "error": sigma * rmse, "rows": blt_rows,
                 "accounting": correlated.GAUSSIAN}
    picked = next(r for r in rows if r["bands"] == chosen.bands)
    comparison = sorted([
        {"mechanism": "independent", "bands": 1, "buffers": 0, **{k: rows[0][k] for k in
                                                                  ("noise_multiplier", "prefix_sum_rmse", "error")},
         "accounting": correlated.AMPLIFIED},
        {"mechanism": "banded", "bands": chosen.bands, "buffers": 0,
         **{k: picked[k] for k in ("noise_multiplier", "prefix_sum_rmse", "error")},
         "accounting": correlated.AMPLIFIED},
        {"mechanism": "blt", "bands": blt.bands, "buffers": blt_table["buffers"], "noise_multiplier": sigma,
         "prefix_sum_rmse": rmse, "error": sigma * rmse, "accounting": correlated.GAUSSIAN},
    ], key=lambda r: r["error"])
    return {"bands": chosen.bands, "auto": correlated.parse_bands(banded_bands) is None,
            "rows": [dict(r) for r in rows], "blt": blt_table, "comparison": comparison,
            "best": comparison[0]["mechanism"]}


def format_correlated(table: dict) -> str:
    """The human view of :func:`correlated_table`."""
    lines = ["", f"correlated noise (banded MF; b = 1 is DP-SGD): b = {table['bands']}"
             + (" picked by bands=auto (least σ·RMSE)" if table["auto"] else ""),
             f"{'bands b':>8}  {'σ':>9}  {'RMSE(σ=1)':>9}  {'σ·RMSE (units of C)':>20}"]
    dpsgd = table["rows"][0]["error"]
    for r in table["rows"]:
        mark = "  ← chosen" if r["bands"] == table["bands"] else ""
        lines.append(f"{r['bands']:>8}  {r['noise_multiplier']:>9.4g}  {r['prefix_sum_rmse']:>9.4g}  "
                     f"{r['error']:>20.4g}  ({r['error'] / dpsgd:.2f}× DP-SGD){mark}")
    blt = table.get("blt")
    if blt:
        lines += ["", f"BLT (one Gaussian mechanism, μ = sens/σ_draw = {blt['mu']:.4g}, ε = {blt['epsilon']:.4f}; "
                      "no amplification): b = "
                  f"{blt['bands']} groups" + (" picked by bands=auto (least RMSE)" if blt["auto"] else "")
                  + f", {blt['buffers']} buffer(s)" + (" (buffers=auto)" if blt["buffers_auto"] else ""),
                  f"  σ = 1/μ of the strategy normalised to sensitivity 1; training would draw z at σ·sens = "
                  f"{blt['draw_noise_multiplier']:.4g} (sens = {blt['sensitivity']:.4g})",
                  f"{'groups b':>8}  {'buffers':>7}  {'σ':>9}  {'RMSE(σ=1)':>9}  {'σ·RMSE (units of C)':>20}"]
        for r in blt["rows"]:
            mark = "  ← chosen" if r["bands"] == blt["bands"] else ""
            lines.append(f"{r['bands']:>8}  {r['buffers']:>7}  {r['noise_multiplier']:>9.4g}  "
                         f"{r['prefix_sum_rmse']:>9.4g}  {r['error']:>20.4g}  ({r['error'] / dpsgd:.2f}× DP-SGD){mark}")
    if table.get("comparison"):
        lines += ["", "at this ε, least expected error first (σ·RMSE in units of C):"]
        for r in table["comparison"]:
            what = {"independent": "DP-SGD (Poisson, amplified)",
                    "banded": f"banded MF, b = {r['bands']} (cyclic Poisson, amplified)",
                    "blt": f"BLT, b = {r['bands']}, {r['buffers']} buffer(s) (one Gaussian mechanism)"}[r["mechanism"]]
            lines.append(f"  {r['error']:>10.4g}  ({r['error'] / dpsgd:.2f}× DP-SGD)  σ={r['noise_multiplier']:.4g}  "
                         f"{what}")
    return "\n".join(lines)


def format_plan(plan: dict) -> str:
    """The human view of :func:`plan_table`'s (or :func:`user_plan_table`'s) result."""
    lines = [] if plan.get("unit") != "user" else [
        f"unit: USER  U={plan['num_users']:,} users, k={plan['records_per_user']} records per user, "
        f"N={plan['num_records']:,} records, sampling={plan['sampling']}, user-level δ={plan['user_delta']:g}"
        + (f", {plan['users_per_batch']} users per step (the rows below count users)" if plan["sampling"] == "uls"
           else f", record-level δ={plan['record_delta']:.3g}; ε below is user-level")]
    uls = plan.get("sampling") == "uls"
    if uls:  # the training config's default runs this plan as is
        lines.append("engine: grad_sample_mode auto (the default) clips each user's mean gradient with bk, or with "
                     "Opacus hooks where a layer has no bk rule")
    lines += [
        (f"users U={plan['num_users']:,}  users per step B_u={plan['batch']:,}  sample rate q=1/⌈U/B_u⌉="
         if uls else f"records N={plan['num_records']:,}  batch B={plan['batch']:,}  sample rate q=1/⌈N/B⌉=")
        + f"{plan['sample_rate']:.6g}",
        f"steps={plan['steps']:,}" + (f" (ceil({plan['epochs']:g} epochs × ⌈N/B⌉))" if plan["epochs"] else "")
        + f"  delta={plan['delta']:g}  accountant="
        + (f"user-level mixture PLD (record level: {plan['accountant']})" if plan.get("sampling") == "els"
           else plan["accountant"]),
        f"clip C={plan['max_grad_norm']:g}  assumed mean grad norm ḡ={plan['grad_norm']:g}  NSR = σ·C/(B·ḡ)",
    ]
    if plan.get("accountant_note"):
        lines.append(f"note: {plan['accountant_note']}")
    if plan.get("noise_schedule"):
        s = plan["noise_schedule"]
        lines.append(f"noise schedule: {s['kind']}, last piece σ₀×{s['end']:g}, {s['pieces']} pieces; σ below is σ₀ "
                     "(the first piece), calibrated over the whole schedule")
        row = plan["target"] or plan["given_noise"]
        if row:
            lines.append("  pieces: " + ", ".join(f"σ={p[0]:.4g}×{p[2]:,}" for p in row["pieces"]))
    if plan["target"]:
        t = plan["target"]
        lines.append(f"target epsilon {t['target_epsilon']:g}: noise multiplier "
                     f"σ={t['noise_multiplier']:.{SIGMA_DIGITS}g}"
                     f" → epsilon={t['epsilon']:.4f}, NSR={t['nsr']:.4g}")
    if plan["given_noise"]:
        g = plan["given_noise"]
        lines.append(f"noise multiplier σ={g['noise_multiplier']:g} → epsilon={g['epsilon']:.4f}, NSR={g['nsr']:.4g}")
    if plan["table"]:
        lines += ["", f"{'target ε':>9}  {'σ':>9}  {'ε at σ':>9}  {'NSR':>10}"]
        lines += [f"{r['target_epsilon']:>9g}  {r['noise_multiplier']:>9.{SIGMA_DIGITS}g}  {r['epsilon']:>9.4f}  "
                  f"{r['nsr']:>10.4g}" for r in plan["table"]]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dpllm plan", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--unit", choices=("record", "user"), default="record", help="privacy unit (default record)")
    p.add_argument("--num-records", type=int, help="private records N (--unit record: required; user: after the cap, "
                                                    "default U·k)")
    p.add_argument("--num-users", type=int, help="--unit user: training users U (δ < 1/U)")
    p.add_argument("--records-per-user", type=int, help="--unit user: k, records kept per user (the cap)")
    p.add_argument("--sampling", choices=("uls", "els"), default="uls", help="--unit user: uls (sample users) or "
                                                                             "els (sample records, group privacy)")
    p.add_argument("--users-per-batch", type=int, help="--unit user, uls: users per step (default round(B·U/N))")
    p.add_argument("--batch", type=int, required=True, help="logical batch size B (q = 1/ceil(N/B))")
    length = p.add_mutually_exclusive_group(required=True)
    length.add_argument("--epochs", type=float, help="epochs; steps = ceil(epochs·ceil(N/B))")
    length.add_argument("--steps", type=int, help="optimizer steps")
    p.add_argument("--delta", type=float, required=True, help="target δ, must be < 1/N")
    p.add_argument("--target-epsilon", type=float, help="print the noise multiplier that meets this ε")
    p.add_argument("--noise-multiplier", type=float, help="print the ε this noise multiplier spends")
    p.add_argument("--accountant", choices=ACCOUNTANTS, default="prv", help="default prv")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="clipping bound C (default 1.0)")
    p.add_argument("--grad-norm", type=float, default=1.0, help="assumed mean per-example gradient norm ḡ")
    p.add_argument("--epsilons", default=",".join(f"{e:g}" for e in DEFAULT_EPSILONS),
                   help="comma-separated ε values for the table ('' for none)")
    p.add_argument("--noise-schedule", choices=("constant", "linear", "exponential"), default="constant",
                   help="σ over training, as privacy.noise_schedule (σ printed is the first piece's)")
    p.add_argument("--schedule-end", type=float, default=0.5, help="last piece's σ / first piece's (default 0.5)")
    p.add_argument("--schedule-pieces", type=int, default=10, help="constant pieces of the schedule (default 10)")
    p.add_argument("--noise", choices=("independent", "banded", "blt"), default="independent",
                   help="banded or blt: also compare DP-SGD, banded MF and BLT at --target-epsilon")
    p.add_argument("--bands", default="auto", help="for the --noise mechanism: 'auto' (default) or b (banded: the "
                                                   "bands; blt: the cyclic groups)")
    p.add_argument("--buffers", default="auto", help="BLT buffers: 'auto' (default) or 1 to 8")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def cli_main(argv: list[str]) -> int:
    """Run ``dpllm plan ARGS``; returns 0, or 2 with the reason on stderr."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exit_:  # --help or a bad flag: argparse already printed why
        return int(exit_.code or 0)
    try:
        epsilons = [float(e) for e in args.epsilons.split(",") if e.strip()]
    except ValueError:
        print(f"dpllm plan: error: --epsilons {args.epsilons!r} must be comma-separated numbers", file=sys.stderr)
        return 2
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            how = ("the user-level mixture accounting (dp-accounting PLD)" if args.unit == "user" and
                   args.sampling == "els" else f"the {args.accountant} accountant")
            print(f"dpllm plan: calibrating with {how}...", file=sys.stderr, flush=True)
            common = dict(batch=args.batch, delta=args.delta, target_epsilon=args.target_epsilon, epochs=args.epochs,
                          steps=args.steps, accountant=args.accountant, noise_multiplier=args.noise_multiplier,
                          max_grad_norm=args.max_grad_norm, grad_norm=args.grad_norm, epsilons=epsilons)
            if args.noise != "independent" and ((args.unit == "user" and args.sampling != "uls") or
                                                args.target_epsilon is None or args.noise_schedule != "constant"):
                # ELS: records are grouped one by one, so a user can join more than ⌈T/b⌉ steps (config.py says why)
                raise PrivacyPlanError(f"--noise {args.noise} compares at --target-epsilon, for --unit record or "
                                       "--unit user --sampling uls plans with a constant σ")
            if args.unit == "user":
                if args.noise_schedule != "constant":
                    raise PrivacyPlanError("--noise-schedule is for --unit record plans for now")
                if args.num_users is None or args.records_per_user is None:
                    raise PrivacyPlanError("--unit user needs --num-users U and --records-per-user k")
                plan = user_plan_table(sampling=args.sampling, num_users=args.num_users,
                                       records_per_user=args.records_per_user, num_records=args.num_records,
                                       users_per_batch=args.users_per_batch, **common)
            else:
                if args.num_records is None:
                    raise PrivacyPlanError("--num-records is required (or --unit user with --num-users)")
                from dpllm.privacy.schedule import NoiseSchedule

                schedule = NoiseSchedule(kind=args.noise_schedule, end=args.schedule_end, pieces=args.schedule_pieces)
                plan = plan_table(num_records=args.num_records, **common, schedule=schedule,
                                  progress=lambda line: print(f"dpllm plan: {line}", file=sys.stderr, flush=True))
            if args.noise != "independent":
                print("dpllm plan: comparing banded and BLT correlated noise...", file=sys.stderr, flush=True)
                uls = args.unit == "user"  # ULS: the unit sampled (and put in a cyclic group) is the user
                plan["correlated_noise"] = correlated_table(
                    num_records=plan["num_users"] if uls else args.num_records,
                    batch=plan["users_per_batch"] if uls else args.batch, steps=plan["steps"],
                    target_epsilon=args.target_epsilon, delta=args.delta, bands=args.bands,
                    accountant=plan["accountant"], noise=args.noise, buffers=args.buffers)
    except PrivacyPlanError as err:
        print(f"dpllm plan: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(plan, indent=2) if args.json else format_plan(plan) + (
        format_correlated(plan["correlated_noise"]) if plan.get("correlated_noise") else ""))
    t = plan["target"] or plan["given_noise"]
    units = plan["num_users"] if plan.get("sampling") == "uls" else plan["num_records"]  # what a step samples
    warning = noise_batch_warning(t["noise_multiplier"], expected_batch(units, plan["batch"])) if t else None
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    for msg in sorted({str(w.message) for w in caught}):  # once each, not once per bisection step
        print(f"note: {msg}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(cli_main(sys.argv[1:]))
