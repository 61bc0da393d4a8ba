"""``dpllm scaling``: fit a scaling law to a runs table, and plan with the fit.

    dpllm scaling fit --runs runs/sweep/runs.jsonl --form chinchilla --out runs/sweep/fit
    dpllm scaling fit --runs runs/sweep/runs.jsonl --form power_law --epsilon 8 --n-boot 200
    dpllm scaling fit --runs runs/sweep/runs.jsonl --form dp_noise --out runs/sweep/fit_dp
    dpllm scaling plan --fit runs/sweep/fit/fit.json --epsilon 8 --target-ppl 20 --n 1.2e8
    dpllm scaling plan --fit runs/sweep/fit/fit.json --epsilon 8 --target-ppl 20 --compute 1e19

``fit`` writes ``OUT/fit.json`` (parameters, 95% bootstrap intervals, R² on loss, residuals, input
summary and the filter used) and ``OUT/loss_vs_N.png`` / ``loss_vs_D.png``.
``plan`` prints tokens for a target at ``--n``, parameters at ``--d``, the compute-optimal point for
``--compute``, or (with none of them) the least compute that reaches the target.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from dpllm.scaling import plan as planning
from dpllm.scaling.fit import fit_runs, load_fit, write_fit
from dpllm.scaling.forms import FORMS, ScalingError
from dpllm.scaling.runs import load_runs, parse_epsilon, runs_to_points


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dpllm scaling", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fit", help="fit a scaling-law form to a runs.jsonl")
    f.add_argument("--runs", required=True, help="runs table (JSONL, one run_summary.json per line)")
    f.add_argument("--form", default="chinchilla", help=f"one of: {', '.join(sorted(FORMS))} (default chinchilla)")
    f.add_argument("--out", help="output folder for fit.json and PNGs (default: <runs folder>/fit)")
    f.add_argument("--n-boot", type=int, default=1000, help="bootstrap resamples (default 1000; 0 = none)")
    f.add_argument("--seed", type=int, default=0, help="bootstrap RNG seed (default 0)")
    f.add_argument("--params", choices=("trainable", "total"), default="trainable",
                   help="which parameter count is N (default trainable)")
    f.add_argument("--epsilon", help="fit only runs at this ε (rounded to 2 significant figures); 'inf' = "
                   "non-private only")
    f.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    q = sub.add_parser("plan", help="plan N, D or compute for a target perplexity from a fit.json")
    q.add_argument("--fit", required=True, help="fit.json written by `dpllm scaling fit`")
    q.add_argument("--epsilon", help="which ε group's fit to use ('inf' = non-private); needed when "
                   "the fit has several")
    q.add_argument("--target-ppl", type=float, help="target eval perplexity (loss = ln ppl)")
    q.add_argument("--sigma-bar", type=float, help="noise multiplier / logical batch, for dp_noise fits "
                   "(default: the ε group's σ̄ from the runs)")
    what = q.add_mutually_exclusive_group()
    what.add_argument("--n", type=float, help="model size N: print the tokens D needed")
    what.add_argument("--d", type=float, help="tokens D: print the model size N needed")
    what.add_argument("--compute", type=float, help="FLOPs C = 6ND: print the compute-optimal N, D and loss")
    q.add_argument("--json", action="store_true", help="print the answer as JSON")
    return p


def _fmt_param(name: str, value: float, ci: list[float] | None) -> str:
    band = f"  95% CI [{ci[0]:.4g}, {ci[1]:.4g}]" if ci else ""
    return f"    {name:<7} {value:>12.5g}{band}"


def _fit(args: argparse.Namespace) -> int:
    runs_path = Path(args.runs)
    rows = load_runs(runs_path)
    doc = fit_runs(rows, form=args.form, params=args.params, epsilon=args.epsilon, n_boot=args.n_boot,
                   seed=args.seed)
    doc["inputs"]["runs_file"] = str(runs_path)
    out = Path(args.out) if args.out else runs_path.parent / "fit"
    path = write_fit(doc, out / "fit.json")
    plots = []
    if not args.no_plots:
        from dpllm.scaling.plot import plot_fit

        points = runs_to_points(rows, params=args.params, group=parse_epsilon(args.epsilon))
        plots = plot_fit(doc, points, out)
    print(f"{doc['form']}: {doc['formula']}")
    print(f"  N = {doc['filter']['N_field']}; {doc['inputs']['n_runs']} runs of {doc['inputs']['n_runs_in_file']} "
          f"in {runs_path}")
    for label, fit in doc["fits"].items():
        boot = fit["bootstrap"]
        print(f"  [{label}] points={fit['n_points']} runs={fit['n_runs']} R²(loss)={fit['r2']:.4f} "
              f"bootstrap {boot['n_ok']}/{boot['n_boot']} ({boot['method']})")
        for name, value in fit["params"].items():
            print(_fmt_param(name, value, fit["ci"].get(name))
                  + ("  (at its bound: not determined by the data)" if name in fit.get("at_bound", []) else ""))
    for label, reason in doc["skipped"].items():
        print(f"  [{label}] skipped: {reason}")
    print(f"wrote {path}" + "".join(f", {p}" for p in plots))
    return 0


def _plan(args: argparse.Namespace) -> int:
    doc = load_fit(args.fit)
    fit, sigma_bar = planning.select_fit(doc, epsilon=args.epsilon)
    if args.sigma_bar is not None:
        sigma_bar = args.sigma_bar
    if fit.form == "dp_noise" and sigma_bar is None:
        raise ScalingError("this is a dp_noise fit: pass --epsilon (a group with one σ̄) or --sigma-bar")
    if args.target_ppl is None and args.compute is None:
        raise ScalingError("give --target-ppl (with --n, --d or neither), or --compute")
    target = planning.loss_from_ppl(args.target_ppl) if args.target_ppl is not None else None
    kw = {"sigma_bar": sigma_bar}
    answer: dict = {"group": fit.label, "form": fit.form, "r2": fit.r2, "sigma_bar": sigma_bar,
                    "floor_loss": planning.floor_loss(fit, **kw)}
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
        if target is not None:
            answer["meets_target"] = opt["loss"] <= target
    elif fit.form == "power_law":
        answer.update(question="parameters N to reach the target",
                      N=planning.params_for_target(fit, target_loss=target, **kw))
    else:
        need = planning.compute_for_target(fit, target_loss=target, **kw)
        answer.update(question="least compute that reaches the target, at its compute-optimal N, D",
                      N=need["N"], D=need["D"], compute=need["compute"])
    if args.json:
        print(json.dumps(answer, indent=2))
        return 0
    sb = f", σ̄={sigma_bar:.3g}" if sigma_bar is not None else ""
    print(f"fit: {fit.form} [{fit.label}] R²(loss)={fit.r2:.4f}{sb}; floor loss {answer['floor_loss']:.4f} "
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
    if "predicted_ppl" in answer:
        verdict = "" if target is None else ("  (meets target)" if answer["meets_target"] else "  (misses target)")
        print(f"  predicted loss {answer['predicted_loss']:.4f} (ppl {answer['predicted_ppl']:.4g}){verdict}")
    return 0


def cli_main(argv: list[str]) -> int:
    """Run ``dpllm scaling ARGS``; returns the exit code (2 on bad input, with the reason on stderr)."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exit_:  # argparse exits on --help / bad flags; hand back its code instead
        return int(exit_.code or 0)
    try:
        return _fit(args) if args.command == "fit" else _plan(args)
    except ScalingError as err:
        print(f"dpllm scaling {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(cli_main(sys.argv[1:]))
