"""``dpllm scaling``: fit a scaling law to a runs table, and plan with the fit.

    dpllm scaling fit --runs runs/sweep/runs.jsonl --form chinchilla --out runs/sweep/fit
    dpllm scaling fit --runs runs/sweep/runs.jsonl --form power_law --epsilon 8 --n-boot 200
    dpllm scaling fit --runs runs/sweep/runs.jsonl --form dp_noise --out runs/sweep/fit_dp
    dpllm scaling fit --runs table.csv --params-col N --tokens-col D --loss-col loss --out fit
    dpllm scaling predict --fit fit/fit.json --params 1e8 --tokens 2e9
    dpllm scaling predict --fit published:chinchilla-besiroglu2024 --params 1e9,7e9 --tokens 2e10,1.4e11
    dpllm scaling plan --fit runs/sweep/fit/fit.json --epsilon 8 --target-ppl 20 --n 1.2e8
    dpllm scaling plan --fit runs/sweep/fit/fit.json --epsilon 8 --target-ppl 20 --compute 1e19
    dpllm scaling plan --fit runs/gpu/fit_nb/fit.json --records 40000 --epsilon 8 --delta 1e-6 --compute 1e17
    dpllm scaling plan --fit runs/gpu/fit_nb/fit.json --records 40000 --epsilon 8 --delta 1e-6 --target-loss 1.1
    dpllm scaling frontier --fit runs/gpu/fit_nb/fit.json --records 40000 --epsilons 2,4,8 --delta 1e-6 --out DIR

``fit`` reads a runs.jsonl or a CSV/TSV (``--*-col`` name its columns) and writes ``OUT/fit.json``
(parameters, 95% bootstrap intervals, R² on loss, residuals, input summary and the filter used) and plots:
loss vs N and vs D with curves at the data's own D and N, predicted vs observed, residuals vs N and D.
``fit`` also validates how the law extrapolates on this sweep (rolling origin along N: fit the smaller sizes,
predict the larger; per held-out size in the summary, fit.json and extrapolation.png) and calibrates how much
wider intervals beyond the data must be.
``predict`` prints the law's loss at N, D (S, σ̄) with its 95% prediction interval (where a new run will
land) and the 95% CI of the mean (where the law itself lies), and says whether the point is inside the data
or beyond it (×k in which input) and how its interval was calibrated. ``--fit published:NAME`` uses a published
law instead of your fit (``dpllm scaling published`` lists them): a prior from other, non-private data.
``plan`` prints tokens for a target at ``--n``, parameters at ``--d``, the compute-optimal point for
``--compute``, or (with none of them) the least compute that reaches the target. With a ``noise_batch``
fit it plans private training: ``--records --epsilon --delta`` and ``--compute`` (best model size, batch,
steps and σ) or ``--target-loss`` (least compute that reaches it). Plans outside the fitted range are
refused (``--extrapolate X`` allows X× beyond it, loudly), and so are degenerate fits (``--force``).
``frontier`` draws the best predicted loss against compute for several ε (frontier.png, frontier.json).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from pathlib import Path

# Only the light modules here: `dpllm scaling --help` should not pay for scipy, torch or Opacus (the DP
# planner's accountant). Each command imports what it uses.
from dpllm.scaling.forms import FORMS, ScalingError

# --X-col option → runs-table field it names (the N field depends on --params)
COLUMNS = {"tokens": "tokens_seen", "loss": "final_eval_loss", "steps": "steps", "batch": "logical_batch_size",
           "epsilon": "epsilon", "noise": "noise_multiplier"}


def _fit_source(p: argparse.ArgumentParser, groups: bool = True) -> None:
    """--fit (and --epsilon, the ε group to use) for the commands that read a fit."""
    p.add_argument("--fit", required=True, help="fit.json written by `dpllm scaling fit`, or published:NAME")
    if groups:
        p.add_argument("--epsilon", help="which ε group's fit to use ('inf' = non-private); needed when the fit "
                       "has several")


def _range_options(p: argparse.ArgumentParser, verb: str) -> None:
    """--extrapolate and --force for the commands that use a fit beyond what it was fitted on."""
    p.add_argument("--extrapolate", type=float, default=1.0, help="allow inputs up to this factor beyond the "
                   "fitted range of each (default 1: refuse anything outside), with a warning")
    p.add_argument("--force", action="store_true", help=f"{verb} from a degenerate fit anyway (with a warning)")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dpllm scaling", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fit", help="fit a scaling-law form to a runs table (JSONL or CSV)")
    f.add_argument("--runs", required=True, help="runs table: JSONL (one run_summary.json per line) or CSV/TSV")
    f.add_argument("--format", default="auto", choices=("auto", "jsonl", "csv", "tsv"),
                   help="table format (default auto: .csv/.tsv by suffix, else JSONL)")
    f.add_argument("--params-col", help="column holding N (default params_trainable, or params_total with "
                   "--params total)")
    for opt, field in COLUMNS.items():
        f.add_argument(f"--{opt}-col", help=f"column holding {field} (default {field})")
    f.add_argument("--form", default="chinchilla", help=f"one of: {', '.join(sorted(FORMS))} (default chinchilla)")
    f.add_argument("--out", help="output folder for fit.json and PNGs (default: <runs folder>/fit)")
    f.add_argument("--n-boot", type=int, default=1000, help="bootstrap resamples (default 1000; 0 = none)")
    f.add_argument("--seed", type=int, default=0, help="bootstrap RNG seed (default 0)")
    f.add_argument("--params", choices=("trainable", "total"), default="trainable",
                   help="which parameter count is N (default trainable)")
    f.add_argument("--epsilon", help="fit only runs at this ε (rounded to 2 significant figures); 'inf' = "
                   "non-private only")
    f.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    e = sub.add_parser("predict", help="predicted loss with its 95%% prediction interval at given N, D (S, σ̄)")
    _fit_source(e)
    e.add_argument("--params", required=True, help="model size N (comma-separated for several)")
    e.add_argument("--tokens", help="tokens D (chinchilla, dp_noise; comma-separated)")
    e.add_argument("--steps", help="optimizer steps S (noise_batch; comma-separated)")
    e.add_argument("--sigma-bar", help="noise multiplier / logical batch (dp_noise, noise_batch; 0 = "
                   "non-private; comma-separated)")
    e.add_argument("--level", type=float, default=0.95, help="interval coverage (default 0.95)")
    _range_options(e, "predict")
    e.add_argument("--json", action="store_true", help="print the predictions as JSON")
    sub.add_parser("published", help="list the published laws usable as --fit published:NAME (priors)")
    q = sub.add_parser("plan", help="plan N, D or compute for a target perplexity from a fit.json")
    _fit_source(q)
    q.add_argument("--target-ppl", type=float, help="target eval perplexity (loss = ln ppl)")
    q.add_argument("--target-loss", type=float, help="target eval loss in nats (instead of --target-ppl)")
    q.add_argument("--records", type=int, help="noise_batch fits: private records (the privacy unit)")
    q.add_argument("--delta", type=float, help="noise_batch fits: δ (< 1/records)")
    q.add_argument("--accountant", default="prv", help="noise_batch fits: accountant for σ (default prv, as "
                   "the trainer)")
    q.add_argument("--tokens-per-record", type=float, help="noise_batch fits: tokens per record (default: the "
                   "sweep's, from fit.json)")
    q.add_argument("--sizes", help="noise_batch fits: comma-separated model sizes to consider (default: 9 across "
                   "the fitted range)")
    q.add_argument("--batches", help="noise_batch fits: comma-separated logical batches (default 16, 32, … ≤ records)")
    q.add_argument("--top", type=int, default=5, help="noise_batch fits: candidates to print (default 5)")
    _range_options(q, "plan")
    q.add_argument("--sigma-bar", type=float, help="noise multiplier / logical batch, for dp_noise fits "
                   "(default: the ε group's σ̄ from the runs)")
    what = q.add_mutually_exclusive_group()
    what.add_argument("--n", type=float, help="model size N: print the tokens D needed")
    what.add_argument("--d", type=float, help="tokens D: print the model size N needed")
    what.add_argument("--compute", type=float, help="FLOPs C = 6ND: print the compute-optimal N, D and loss")
    q.add_argument("--json", action="store_true", help="print the answer as JSON")
    r = sub.add_parser("frontier", help="best predicted loss vs compute at several ε, from a noise_batch fit")
    _fit_source(r, groups=False)
    r.add_argument("--records", type=int, required=True)
    r.add_argument("--delta", type=float, required=True)
    r.add_argument("--epsilons", default="2,4,8", help="comma-separated ε (default 2,4,8)")
    r.add_argument("--compute-min", type=float, help="smallest compute (default: the sweep's smallest run)")
    r.add_argument("--compute-max", type=float, help="largest compute (default: 10× the sweep's largest run)")
    r.add_argument("--points", type=int, default=9, help="computes on the log grid (default 9)")
    r.add_argument("--accountant", default="prv")
    _range_options(r, "plan")
    r.add_argument("--out", required=True, help="folder for frontier.json and frontier.png")
    return p


def _fmt_param(name: str, value: float, ci: list[float] | None) -> str:
    band = f"  95% CI [{ci[0]:.4g}, {ci[1]:.4g}]" if ci else ""
    return f"    {name:<7} {value:>12.5g}{band}"


def _columns(args: argparse.Namespace) -> dict[str, str]:
    from dpllm.scaling.runs import PARAMS_FIELDS

    cols = {field: getattr(args, f"{opt}_col") for opt, field in COLUMNS.items() if getattr(args, f"{opt}_col")}
    if args.params_col:
        cols[PARAMS_FIELDS[args.params]] = args.params_col
    return cols


def _column_names(args: argparse.Namespace, inputs: tuple[str, ...]) -> dict[str, str]:
    """The user's own column for each input the form reads and for the loss (``--params-col params`` → N =
    params), so the summary names what is in their table, not our runs-table fields."""
    from dpllm.scaling.runs import PARAMS_FIELDS

    cols = {field: field for field in COLUMNS.values()} | _columns(args)
    n_field = PARAMS_FIELDS[args.params]
    names = {"N": cols.get(n_field, n_field), "D": cols["tokens_seen"], "S": cols["steps"],
             "sigma_bar": f"{cols['noise_multiplier']} / {cols['logical_batch_size']}"}
    return {**{k: names[k] for k in inputs}, "loss": cols["final_eval_loss"]}


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.0f}%"


def _validation_lines(ex: dict) -> list[str]:
    """The rolling-origin validation of extrapolation, as printed by `fit`: per fold and held-out size, then
    pooled, then the widening it calibrated."""
    if not ex:
        return []
    if ex.get("kappa") is None:
        return [f"    extrapolation {ex['status']}: intervals beyond the data are the in-range ones, likely too narrow"]
    axis, lines = ex["axis"], [f"    extrapolation, validated by rolling origin along {ex['axis']} (fit the smaller "
                               f"sizes, predict each larger one; {_pct(ex['level'])} intervals):"]
    for r in ex["per_size"]:
        c = r["coverage"]
        lines.append(f"      fitted {axis} ≤ {r['cut']:.3g} → {axis}={r[axis]:.3g} (×{r['beyond_factor']:.2g} beyond): "
                     f"{r['n_runs']} runs, error {r['mean_error_pct']:+.2f}% (rms {r['rms_error_pct']:.2f}%), covered "
                     f"in-range {_pct(c['in_range'])}, widened {_pct(c['widened'])}")
    c, w = ex["coverage"], ex["median_width_pct"]
    lines.append(f"      all {ex['n_held_out']} held-out runs: covered by the CI of the mean "
                 f"{_pct(c['parameter_only'])}, "
                 f"the in-range prediction interval {_pct(c['in_range'])}, the widened one {_pct(c['widened'])} "
                 f"(cross-validated over folds {_pct(c['widened_cv'])}); median widths {w['parameter_only']:.2g}%, "
                 f"{w['in_range']:.2g}%, {w['widened']:.2g}%")
    lines.append(f"      beyond the data, intervals widen by kappa = {100 * ex['kappa']:.2g}% sd of log-loss per unit "
                 f"of Δ·(1 + Δ/W) (Δ e-folds beyond the data, W e-folds the fit spans in {axis})")
    return lines


def _scatter_line(fit: dict) -> str:
    r = fit.get("scatter", {}).get("log_residuals", [])
    if len(r) < 2:
        return ""
    import numpy as np

    sd = float(np.std(r, ddof=0)) * fit["scatter"].get("inflation", 1.0)
    return (f"    runs scatter around the law by {100 * sd:.2g}% (sd of log-loss, {len(r)} runs): a new run's 95% "
            f"prediction interval is at least ±{196 * sd:.2g}%; the parameter CIs above do not include it")


def _fit(args: argparse.Namespace) -> int:
    from dpllm.scaling.fit import fit_runs, write_fit
    from dpllm.scaling.forms import get_form
    from dpllm.scaling.runs import parse_epsilon, runs_to_points
    from dpllm.scaling.table import read_table

    runs_path = Path(args.runs)
    rows = read_table(runs_path, fmt=args.format, columns=_columns(args))
    doc = fit_runs(rows, form=args.form, params=args.params, epsilon=args.epsilon, n_boot=args.n_boot,
                   seed=args.seed)
    doc["inputs"]["runs_file"] = str(runs_path)
    doc["inputs"]["columns"] = _column_names(args, get_form(args.form).inputs)
    out = Path(args.out) if args.out else runs_path.parent / "fit"
    path = write_fit(doc, out / "fit.json")
    plots = []
    if not args.no_plots:
        from dpllm.scaling.plot import plot_fit

        points = runs_to_points(rows, params=args.params, group=parse_epsilon(args.epsilon),
                                inputs=get_form(args.form).inputs)
        plots = plot_fit(doc, points, out)
    print(f"{doc['form']}: {doc['formula']}")
    named = "; ".join(f"{k} = {v}" for k, v in doc["inputs"]["columns"].items())
    print(f"  {named}; {doc['inputs']['n_runs']} runs of {doc['inputs']['n_runs_in_file']} in {runs_path}")
    for label, fit in doc["fits"].items():
        boot = fit["bootstrap"]
        print(f"  [{label}] points={fit['n_points']} runs={fit['n_runs']} R²(loss)={fit['r2']:.4f} "
              f"bootstrap {boot['n_ok']}/{boot['n_boot']} ({boot['method']})")
        for name, value in fit["params"].items():
            print(_fmt_param(name, value, fit["ci"].get(name))
                  + ("  (at its bound: not determined by the data)" if name in fit.get("at_bound", []) else ""))
        if _scatter_line(fit):
            print(_scatter_line(fit))
        for line in _validation_lines(fit.get("extrapolation", {})):
            print(line)
        for reason in fit.get("degenerate", []):
            print(f"    DEGENERATE: {reason}")
    for label, reason in doc["skipped"].items():
        print(f"  [{label}] skipped: {reason}")
    print(f"wrote {path}" + "".join(f", {p}" for p in plots))
    return 0


def _prior_lines(fit) -> list[str]:
    """What a published fit is, printed above anything computed from it."""
    if not fit.prior:
        return []
    p = fit.prior
    return [f"PRIOR, not your data: {fit.label}: {p['citation']} ({p['url']})",
            f"  fitted to {p['data']}; {p['caveat']}"]


def _broadcast(args: argparse.Namespace, names: dict[str, str]) -> dict[str, list[float]]:
    """The comma-separated --params/--tokens/... values, each list of length 1 or one common length."""
    vals = {k: _floats(getattr(args, opt)) for k, opt in names.items() if getattr(args, opt) is not None}
    lengths = {len(v) for v in vals.values()} - {1}
    if len(lengths) > 1:
        raise ScalingError("give each of --params, --tokens, --steps, --sigma-bar one value or the same number of "
                           f"values; got {', '.join(f'{k}: {len(v)}' for k, v in vals.items())}")
    n = lengths.pop() if lengths else 1
    return {k: v * n if len(v) == 1 else v for k, v in vals.items()}


def _predict(args: argparse.Namespace) -> int:
    import numpy as np

    from dpllm.scaling import plan as planning
    from dpllm.scaling.fit import JOINT, load_fit

    doc = load_fit(args.fit)
    # A joint fit with an explicit σ̄ needs no ε group (whose runs may have used several σ̄).
    joint_with_sigma = JOINT in doc["fits"] and args.sigma_bar is not None
    fit, sigma_bar = planning.select_fit(doc, epsilon=None if joint_with_sigma else args.epsilon)
    inputs = _broadcast(args, {"N": "params", "D": "tokens", "S": "steps", "sigma_bar": "sigma_bar"})
    if "sigma_bar" not in inputs and sigma_bar is not None:
        inputs["sigma_bar"] = [sigma_bar] * len(inputs["N"])
    from dpllm.scaling.forms import get_form

    need = get_form(fit.form).inputs
    flag = {"N": "--params", "D": "--tokens", "S": "--steps", "sigma_bar": "--sigma-bar"}
    missing = [flag[k] for k in need if k not in inputs]
    if missing:
        raise ScalingError(f"a {fit.form} fit predicts from {', '.join(flag[k] for k in need)}; add "
                           f"{', '.join(missing)}" + (" (σ̄ = noise multiplier / logical batch; 0 = non-private)"
                                                       if "--sigma-bar" in missing else ""))
    if not 0 < args.level < 1:
        raise ScalingError(f"--level {args.level} must be between 0 and 1, e.g. 0.95")
    planning.check_fit_usable(fit, force=args.force)
    n = len(inputs["N"])
    rows = []
    for i in range(n):
        x = {k: inputs[k][i] for k in need}
        for k, v in x.items():
            if not (v > 0 or (k == "sigma_bar" and v == 0)) or not math.isfinite(v):
                raise ScalingError(f"{flag[k]} {v:g} must be a finite positive number"
                                   + (" (or 0 for non-private)" if k == "sigma_bar" else ""))
        planning.check_in_domain(fit, extrapolate=args.extrapolate, **x)
        lo, hi = fit.prediction_interval(args.level, **x)
        mlo, mhi = fit.confidence_interval(args.level, **x)
        rows.append({**x, "loss": float(fit.predict(**x)), "prediction_interval": [float(lo), float(hi)],
                     "mean_ci": [float(mlo), float(mhi)], **_where(fit, args.level, x)})
    if args.json:
        print(json.dumps({"fit": str(args.fit), "form": fit.form, "group": fit.label, "level": args.level,
                          "prior": fit.prior or None, "predictions": rows}, indent=2))
        return 0
    pct = f"{100 * args.level:g}%"
    for line in _prior_lines(fit):
        print(line)
    r2 = "" if fit.prior else f" R²(loss)={fit.r2:.4f}, {fit.n_runs} runs"
    print(f"fit: {fit.form} [{fit.label}]{r2}")
    for r in rows:
        where = "  ".join(f"{k}={r[k]:.4g}" for k in need)
        pi, ci = r["prediction_interval"], r["mean_ci"]
        band = (f"{pct} prediction interval [{pi[0]:.4f}, {pi[1]:.4f}] (a new run)" if np.isfinite(pi[0])
                else f"no prediction interval ({'a published point estimate' if fit.prior else 'no residuals'})")
        mean = (f"; {pct} CI of the mean [{ci[0]:.4f}, {ci[1]:.4f}]" if np.isfinite(ci[0]) else "")
        print(f"  {where}  loss {r['loss']:.4f} (ppl {math.exp(r['loss']):.4g})  {band}{mean}")
        print(f"    {r['data']}; interval: {r['interval_calibration']}")
    return 0


def _where(fit, level: float, x: dict) -> dict:
    """Whether ``x`` is inside or beyond the fit's data (how far, along which input) and how the interval there
    was calibrated: the fields every `predict` and `plan` answer carries."""
    from dpllm.scaling.extrapolate import describe

    factor, name = (v.item() if hasattr(v, "item") else v for v in fit.beyond(**x))
    inside = factor <= 1.0 + 1e-9
    what = {"N": "N", "D": "D", "S": "S", "sigma_bar": "σ̄", "compute": "compute 6·N·D"}.get(name, name)
    if fit.prior:
        data = "inside" if inside else f"beyond: ×{factor:.3g} in {what} past the range it was fitted on"
        return {"inside_data": inside, "beyond_factor": factor, "beyond_input": name or None,
                "data": f"{data} (published law's range)",
                "interval_calibration": "none: a published point estimate, its papers give no residuals"}
    if inside:
        how = (f"{100 * level:g}% in-range prediction interval (bootstrap laws + resampled run residuals; held "
               f"95.8% on held-out runs inside a fitted range, tests/test_scaling_intervals.py)")
        data = "inside the data"
    else:
        from dpllm.scaling.extrapolate import compute_range

        lo, hi = (fit.domain.get(name) if name in fit.domain else compute_range(fit.residuals) if name == "compute"
                  else None) or (None, None)
        edge = "" if hi is None else f" (fitted {what} {lo:.3g} to {hi:.3g})"
        data = f"BEYOND the data: ×{factor:.3g} in {what} past the fitted range{edge}"
        how = describe(fit.extrapolation)
    return {"inside_data": inside, "beyond_factor": factor, "beyond_input": name or None, "data": data,
            "interval_calibration": how, "validation_coverage": (fit.extrapolation or {}).get("coverage")}


def _published(args: argparse.Namespace) -> int:
    from dpllm.scaling.published import PREFIX, PUBLISHED, published_fit

    for name in sorted(PUBLISHED):
        fit = published_fit(name)
        law = ", ".join(f"{k}={v:g}" for k, v in fit.params.items())
        print(f"{PREFIX}{name}\n  {fit.form}: {law}\n  {fit.prior['citation']} ({fit.prior['url']})\n"
              f"  data: {fit.prior['data']}; fitted range N {fit.domain['N']}, D {fit.domain['D']}\n"
              f"  note: {fit.prior['note']}")
    print(f"\nAll are priors from other data: {published_fit(sorted(PUBLISHED)[0]).prior['caveat']}.")
    return 0


def _floats(text: str | None, kind=float) -> list | None:
    if text is None:
        return None
    try:
        return [kind(float(v)) for v in text.split(",") if v.strip()]
    except ValueError as err:
        raise ScalingError(f"{text!r} must be comma-separated numbers") from err


def _noise_batch_fit(doc: dict):
    from dpllm.scaling.fit import JOINT, FitResult

    fit = FitResult.from_dict(doc["fits"][JOINT]) if JOINT in doc["fits"] else None
    if fit is None or fit.form != "noise_batch":
        raise ScalingError("this needs a noise_batch fit: `dpllm scaling fit --form noise_batch`")
    return fit


def _dp_kw(args: argparse.Namespace, doc: dict) -> dict:
    for name in ("records", "delta"):
        if getattr(args, name) is None:
            raise ScalingError(f"a noise_batch plan needs --{name}")
    ell = getattr(args, "tokens_per_record", None) or doc.get("inputs", {}).get("tokens_per_record")
    if ell is None:
        raise ScalingError("fit.json does not record tokens per record; pass --tokens-per-record")
    return {"records": args.records, "delta": args.delta, "tokens_per_record": ell, "accountant": args.accountant,
            "extrapolate": args.extrapolate, "force": args.force}


def _plan_dp(args: argparse.Namespace, doc: dict, fit) -> int:
    from dpllm.scaling import dp_plan
    from dpllm.scaling import plan as planning
    from dpllm.scaling.runs import parse_epsilon

    if args.epsilon is None or parse_epsilon(args.epsilon) == "non-private":
        raise ScalingError("a noise_batch plan needs a finite --epsilon")
    kw = {**_dp_kw(args, doc), "epsilon": float(args.epsilon), "top": args.top,
          "sizes": _floats(args.sizes), "batches": _floats(args.batches, int)}
    target = args.target_loss if args.target_loss is not None else (
        planning.loss_from_ppl(args.target_ppl) if args.target_ppl is not None else None)
    if args.compute is not None:
        out = dp_plan.best_for_compute(fit, compute=args.compute, **kw)
    elif target is not None:
        out = dp_plan.least_compute_for_loss(fit, target_loss=target, **kw)
    else:
        raise ScalingError("give --compute FLOPS (best plan within it) or --target-loss / --target-ppl")
    print(json.dumps(out, indent=2) if args.json else dp_plan.format_plan(out))
    return 0


def _frontier(args: argparse.Namespace) -> int:
    import numpy as np

    from dpllm.scaling import dp_plan
    from dpllm.scaling.fit import load_fit, write_fit

    doc = load_fit(args.fit)
    fit = _noise_batch_fit(doc)
    kw = _dp_kw(args, doc)
    runs = [r for r in fit.residuals]
    ell = kw["tokens_per_record"]
    batches = doc["inputs"]["groups"]
    bs = sorted({b for g in batches.values() for b in g.get("logical_batch_size", [])}) or [1.0]
    run_c = [6 * r["N"] * r["S"] * ell * bs[0] for r in runs] or [1e12]
    lo = args.compute_min or min(run_c)
    hi = args.compute_max or 10 * max(run_c)
    computes = list(np.geomspace(lo, hi, args.points))
    curves = {}
    for eps in _floats(args.epsilons):
        curves[f"eps={eps:g}"] = dp_plan.frontier(fit, computes=computes, epsilon=eps, **kw)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_fit({"fit": str(args.fit), "records": args.records, "delta": args.delta, "curves": curves,
               "fits": {}}, out / "frontier.json")
    from dpllm.scaling.plot import plot_frontier

    png = plot_frontier(curves, out)
    for label, rows in curves.items():
        for r in rows:
            print(f"{label:>8}  C={r['budget']:.3g}  N={r['N']:.3g}  B={r['batch']}  S={r['steps']}  "
                  f"σ={r['noise_multiplier']:.3g}  loss={r['loss']:.4f}  95% prediction interval "
                  f"[{r['loss_low']:.4f}, {r['loss_high']:.4f}]"
                  + (f"  BEYOND the data ×{r['beyond_factor']:.2g} in {r['beyond_input']}"
                     if r.get("beyond_factor", 1.0) > 1.0 + 1e-9 else ""))
    if any(r.get("beyond_factor", 1.0) > 1.0 + 1e-9 for rows in curves.values() for r in rows):
        from dpllm.scaling.extrapolate import describe

        print(f"intervals beyond the data: {describe(fit.extrapolation)}")
    print(f"wrote {out / 'frontier.json'}, {png}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    from dpllm.scaling import plan as planning
    from dpllm.scaling.fit import JOINT, load_fit

    doc = load_fit(args.fit)
    if JOINT in doc["fits"] and doc["fits"][JOINT]["form"] == "noise_batch":
        return _plan_dp(args, doc, _noise_batch_fit(doc))
    fit, sigma_bar = planning.select_fit(doc, epsilon=args.epsilon)
    if args.sigma_bar is not None:
        sigma_bar = args.sigma_bar
    if fit.form == "dp_noise" and sigma_bar is None:
        raise ScalingError("this is a dp_noise fit: pass --epsilon (a group with one σ̄) or --sigma-bar")
    if args.target_ppl is None and args.target_loss is None and args.compute is None:
        raise ScalingError("give --target-ppl or --target-loss (with --n, --d or neither), or --compute")
    target = planning.loss_from_ppl(args.target_ppl) if args.target_ppl is not None else args.target_loss
    if target is not None and args.target_ppl is None:
        args.target_ppl = math.exp(target)
    kw = {"sigma_bar": sigma_bar, "extrapolate": args.extrapolate, "force": args.force}
    answer: dict = {"group": fit.label, "form": fit.form, "r2": fit.r2, "sigma_bar": sigma_bar,
                    "floor_loss": planning.floor_loss(fit, sigma_bar=sigma_bar)}
    if target is not None:
        answer.update(target_ppl=args.target_ppl, target_loss=target)
    if args.n is not None:
        answer.update(question="tokens D to reach the target at N",
                      N=args.n, D=planning.tokens_for_target(fit, target_loss=target, n=args.n, **kw))
    elif args.d is not None:
        answer.update(question="parameters N to reach the target at D",
                      D=args.d, N=planning.params_for_target(fit, target_loss=target, d=args.d, **kw))
    elif args.compute is not None:
        opt = planning.compute_optimal(fit, compute=args.compute, **kw)
        answer.update(question="compute-optimal N, D for the compute", N=opt["N"], D=opt["D"],
                      compute=opt["compute"], predicted_loss=opt["loss"],
                      predicted_ppl=opt["ppl"])
        x = {"N": opt["N"], "D": opt["D"], "sigma_bar": sigma_bar or 0.0}
        answer["prediction_interval"] = [float(v) for v in fit.prediction_interval(**x)]
        answer["mean_ci"] = [float(v) for v in fit.confidence_interval(**x)]
        if target is not None:
            answer["meets_target"] = opt["loss"] <= target
    elif fit.form == "power_law":
        answer.update(question="parameters N to reach the target",
                      N=planning.params_for_target(fit, target_loss=target, **kw))
    else:
        need = planning.compute_for_target(fit, target_loss=target, **kw)
        answer.update(question="least compute that reaches the target, at its compute-optimal N, D",
                      N=need["N"], D=need["D"], compute=need["compute"])
    if "prediction_interval" not in answer:  # "train N at D": the loss range such a run will likely give
        from dpllm.scaling.forms import get_form

        x = {k: v for k, v in {"N": answer.get("N"), "D": answer.get("D"), "sigma_bar": sigma_bar or 0.0}.items()
             if k in get_form(fit.form).inputs}
        answer["predicted_loss"] = float(fit.predict(**x))
        answer["prediction_interval"] = [float(v) for v in fit.prediction_interval(**x)]
        answer["mean_ci"] = [float(v) for v in fit.confidence_interval(**x)]
    else:
        x = {k: v for k, v in {"N": answer["N"], "D": answer["D"], "sigma_bar": sigma_bar or 0.0}.items()
             if k in ("N", "D") or fit.form == "dp_noise"}
    answer.update(_where(fit, 0.95, x))
    if fit.prior:
        answer["prior"] = fit.prior
    if args.json:
        print(json.dumps(answer, indent=2))
        return 0
    sb = f", σ̄={sigma_bar:.3g}" if sigma_bar is not None else ""
    for line in _prior_lines(fit):
        print(line)
    r2 = "" if fit.prior else f" R²(loss)={fit.r2:.4f}"
    print(f"fit: {fit.form} [{fit.label}]{r2}{sb}; floor loss {answer['floor_loss']:.4f} "
          f"(ppl {math.exp(answer['floor_loss']):.4g})")
    if target is not None:
        print(f"target: ppl {args.target_ppl:g} = loss {target:.4f} nats")
    print(f"{answer['question']}:")
    if "compute" in answer:
        print(f"  compute C = 6·N·D = {answer['compute']:.4g} FLOPs")
    if "N" in answer:
        print(f"  N = {answer['N']:.4g} parameters")
    if "D" in answer:
        print(f"  D = {answer['D']:.4g} tokens")
    verdict = "" if target is None or "meets_target" not in answer else (
        "  (meets target)" if answer["meets_target"] else "  (misses target)")
    print(f"  predicted loss {answer['predicted_loss']:.4f} (ppl {math.exp(answer['predicted_loss']):.4g}){verdict}")
    pi, ci = answer["prediction_interval"], answer["mean_ci"]
    if math.isfinite(pi[0]):
        print(f"  95% prediction interval [{pi[0]:.4f}, {pi[1]:.4f}] (a run at this N"
              + (", D" if "D" in answer else "") + ")"
              + (f"; 95% CI of the mean [{ci[0]:.4f}, {ci[1]:.4f}]" if math.isfinite(ci[0]) else ""))
    print(f"  {answer['data']}; interval: {answer['interval_calibration']}")
    return 0


def cli_main(argv: list[str]) -> int:
    """Run ``dpllm scaling ARGS``; returns the exit code (2 on bad input, with the reason on stderr)."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exit_:  # argparse exits on --help / bad flags; hand back its code instead
        return int(exit_.code or 0)
    try:
        from dpllm.scaling.plan import ExtrapolationWarning

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ExtrapolationWarning)
            code = {"fit": _fit, "plan": _plan, "predict": _predict, "published": _published,
                    "frontier": _frontier}[args.command](args)
        for w in caught:
            if issubclass(w.category, ExtrapolationWarning):
                print(f"WARNING: {w.message}", file=sys.stderr)
            else:
                warnings.showwarning(w.message, w.category, w.filename, w.lineno)
        return code
    except ScalingError as err:
        print(f"dpllm scaling {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(cli_main(sys.argv[1:]))
