"""Scaling sweep: model sizes × token budgets (× ε values) with the fine-tuning engine, then a fit.

Every run is an ordinary dpllm run (its own run directory, privacy report and checkpoint) that appends
one line to ``OUTPUT_DIR/runs.jsonl``; the sweep then fits the chosen scaling-law form to that table.

    accelerate launch recipes/scaling_sweep.py --config recipes/configs/tiny/scaling_sweep_cpu.yaml \\
        --output_dir runs/sweep
    dpllm scaling fit --runs runs/sweep/runs.jsonl --form chinchilla --out runs/sweep/fit
    dpllm scaling plan --fit runs/sweep/fit/fit.json --epsilon 8 --target-ppl 20

The sweep YAML has ``base`` (a normal run config: model / data / train / privacy) and ``sweep``:
``sizes`` (list of model overrides), ``max_steps`` (token budgets), ``epsilons`` (``null`` = non-private)
and ``seeds``; ``quick`` overrides any of those for ``--quick``. A finished run is skipped on re-launch
(its run_summary.json exists), so an interrupted sweep resumes where it stopped.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import time
from pathlib import Path

import yaml

from dpllm.config import ConfigError, config_from_dict
from dpllm.train import train


def expand(doc: dict, *, quick: bool) -> list[tuple[str, dict]]:
    """(name, run-config mapping) for every point of the sweep grid."""
    for key in doc:
        if key not in ("base", "sweep", "quick", "fit"):
            raise ConfigError(f"sweep config: unknown top-level key {key!r}; use base, sweep, quick, fit")
    base, grid = doc.get("base", {}), dict(doc.get("sweep", {}))
    if quick:
        grid.update(doc.get("quick", {}))
    sizes, budgets = grid.get("sizes", [{}]), grid.get("max_steps", [])
    epsilons, seeds = grid.get("epsilons", [8.0]), grid.get("seeds", [0])
    if not budgets:
        raise ConfigError("sweep config: sweep.max_steps must list at least one token budget")
    points = []
    for (i, size), steps, eps, seed in itertools.product(enumerate(sizes), budgets, epsilons, seeds):
        cfg = {section: dict(base.get(section, {})) for section in ("model", "data", "train", "privacy")}
        cfg["model"].update(size)
        cfg["train"].update({"max_steps": int(steps), "epochs": None, "seed": int(seed)})
        if eps is None:
            cfg["privacy"]["enabled"] = False
        else:
            cfg["privacy"].update({"enabled": True, "target_epsilon": float(eps), "noise_multiplier": None})
        name = f"size{i}_steps{steps}_{'nodp' if eps is None else f'eps{eps:g}'}_seed{seed}"
        points.append((name, cfg))
    return points


def tokens_fits(rows: list[dict], *, n_boot: int) -> dict:
    """Loss versus tokens D for each (privacy group, model size): the power law L(D) = a·D^(−α) + L∞."""
    from dpllm.scaling.fit import fit_form
    from dpllm.scaling.forms import ScalingError
    from dpllm.scaling.runs import group_label

    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(f"{group_label(r)} N={r['params_trainable']}", []).append(r)
    out = {}
    for key, rs in sorted(groups.items()):
        try:
            out[key] = fit_form("power_law", loss=[r["final_eval_loss"] for r in rs],
                                N=[r["tokens_seen"] for r in rs], n_boot=n_boot, label=key).to_dict()
        except ScalingError as err:  # too few budgets for this size
            out[key] = {"skipped": str(err)}
    return {k: v for k, v in out.items() if "skipped" not in v}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="sweep YAML (base + sweep [+ quick, fit])")
    ap.add_argument("--output_dir", default="runs/sweep")
    ap.add_argument("--quick", action="store_true", help="the reduced grid of the config's quick section")
    ap.add_argument("--form", default=None, help="scaling form fitted at the end (default: the config's fit.form)")
    ap.add_argument("--n_boot", type=int, default=None, help="bootstrap resamples for the fit")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    doc = yaml.safe_load(Path(args.config).read_text()) or {}
    out = Path(args.output_dir)
    runs_file = out / "runs.jsonl"
    points = expand(doc, quick=args.quick)
    # validate every point before the first run starts: a typo must not surface after an hour
    configs = []
    for name, cfg in points:
        cfg["train"].update({"output_dir": str(out / name), "runs_file": str(runs_file),
                             "overwrite_output_dir": True})
        configs.append((name, config_from_dict(cfg)))
    from tqdm.auto import tqdm

    start = time.time()
    for name, cfg in tqdm(configs, desc="sweep", unit="run"):
        if (out / name / "run_summary.json").is_file():
            continue  # finished earlier; its line is already in runs.jsonl
        train(cfg)
    wall = time.time() - start

    from dpllm.scaling.fit import fit_runs, write_fit
    from dpllm.scaling.plot import plot_fit
    from dpllm.scaling.runs import load_runs, runs_to_points

    fit_cfg = doc.get("fit", {})
    form = args.form or fit_cfg.get("form", "chinchilla")
    n_boot = args.n_boot if args.n_boot is not None else int(fit_cfg.get("n_boot", 1000))
    rows = load_runs(runs_file)
    fit = fit_runs(rows, form=form, n_boot=n_boot)
    fit["tokens_power_law"] = tokens_fits(rows, n_boot=n_boot)
    write_fit(fit, out / "fit" / "fit.json")
    plot_fit(fit, runs_to_points(rows), out / "fit")
    print(f"\n{len(rows)} runs in {wall:.0f} s -> {runs_file}")
    for group, f in fit["fits"].items():
        params = ", ".join(f"{k}={v:.4g}" for k, v in f["params"].items())
        print(f"{form} [{group}]: R² = {f['r2']:.3f}; {params}")
    for key, f in fit["tokens_power_law"].items():
        print(f"loss vs tokens [{key}]: L(D) = {f['params']['a']:.4g}·D^(-{f['params']['alpha']:.3f}) + "
              f"{f['params']['L_inf']:.3f}, R² = {f['r2']:.3f}")
    print(f"fit: {out / 'fit' / 'fit.json'}")
    return {"runs": len(rows), "wall_time_s": wall, "fit": fit}


if __name__ == "__main__":
    main()
