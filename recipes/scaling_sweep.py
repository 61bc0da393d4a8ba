"""Scaling sweep: model sizes × token budgets (× ε values) with the fine-tuning engine, then a fit.

Every run is an ordinary dpllm run (its own run directory, privacy report and checkpoint) that appends
one line to ``OUTPUT_DIR/runs.jsonl``; the sweep then fits the chosen scaling-law form to that table.

    accelerate launch --config_file recipes/accelerate/single_gpu.yaml recipes/scaling_sweep.py \\
        --config recipes/configs/tiny/scaling_sweep_cpu.yaml --output_dir runs/sweep
    dpllm scaling fit --runs runs/sweep/runs.jsonl --form chinchilla --out runs/sweep/fit
    dpllm scaling plan --fit runs/sweep/fit/fit.json --epsilon 8 --target-ppl 20

The sweep YAML has ``base`` (a normal run config: model / data / train / privacy) and ``sweep``:
``sizes`` (list of model overrides; a size may carry ``train:`` overrides, e.g. its physical batch),
``max_steps`` (token budgets), ``epsilons`` (``null`` = non-private), ``seeds`` and optionally
``logical_batch_sizes``; ``quick`` overrides any of those for ``--quick``.

Two-stage protocol (the GPU sweep, recipes/configs/llama/scaling_sweep_gpu.yaml), switched on by optional
sections: ``corpora`` builds a public and a private-role corpus from CPython's stdlib
(:mod:`dpllm.scaling.corpora`); ``pretrain`` trains each size without privacy on the public corpus
(``max_steps``, ``learning_rate``: scalars or one per size); ``lr_grid`` DP fine-tunes each size at
``learning_rates`` (at one ``max_steps`` / ``epsilon``) and keeps the best for that size's main grid, which
fine-tunes the pretrained model on the private corpus.

Resuming: a run is done when its line is in a runs table (``runs.jsonl``, ``lr_runs.jsonl``,
``pretrain_runs.jsonl``) or its run_summary.json exists, so re-running the same command continues, also on a
fresh machine given only the runs tables. Pretraining saves checkpoints (``pretrain.save_every``) and resumes
from them. ``--stop_after_s`` starts no new run after that many seconds (a device command is capped at
10 minutes); ``--only_sizes 0,1`` restricts to some sizes; ``--no_fit`` skips the fit.

Correlated noise: ``--noise banded --bands auto|k`` (or ``privacy.noise`` / ``privacy.bands`` in ``base``) makes every
private run of the sweep a BandMF run, ``--noise blt --bands auto|b --buffers auto|d`` a BLT run (docs/privacy.md);
the runs table records each run's ``noise`` and ``bands`` (BLT: its cyclic groups).
A fit form that reads σ̄ = σ/B (``dp_noise``, ``noise_batch``) is refused for such a sweep before any run: σ̄ is
DP-SGD's noise per record and ``dpllm scaling plan`` calibrates σ with DP-SGD's event, neither of which is the
correlated run's; fit ``chinchilla`` or ``power_law`` (loss against N and tokens at each ε) instead.

    python recipes/scaling_sweep.py --config recipes/configs/tiny/scaling_sweep_cpu.yaml --output_dir runs/sweep_mf \
        --noise banded --bands auto
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import time
from pathlib import Path

import yaml

from dpllm.config import ConfigError, config_from_dict
from dpllm.scaling.runs import load_runs

TOP_KEYS = ("base", "sweep", "quick", "fit", "corpora", "pretrain", "lr_grid")


def _grid(doc: dict, quick: bool) -> dict:
    for key in doc:
        if key not in TOP_KEYS:
            raise ConfigError(f"sweep config: unknown top-level key {key!r}; use {', '.join(TOP_KEYS)}")
    grid = dict(doc.get("sweep", {}))
    if quick:
        grid.update(doc.get("quick", {}))
    return grid


def _run_cfg(base: dict, size: dict, *, steps: int, eps, seed: int, batch=None, lr=None) -> dict:
    cfg = {section: dict(base.get(section, {})) for section in ("model", "data", "train", "privacy")}
    size = dict(size)
    cfg["train"].update(size.pop("train", {}))
    cfg["model"].update(size)
    cfg["train"].update({"max_steps": int(steps), "epochs": None, "seed": int(seed)})
    if batch is not None:
        cfg["train"]["logical_batch_size"] = int(batch)
    if lr is not None:
        cfg["train"]["learning_rate"] = float(lr)
    if eps is None:
        cfg["privacy"]["enabled"] = False
    else:
        cfg["privacy"].update({"enabled": True, "target_epsilon": float(eps), "noise_multiplier": None})
    return cfg


def _tag(eps) -> str:
    return "nodp" if eps is None else f"eps{eps:g}"


def expand(doc: dict, *, quick: bool) -> list[tuple[str, dict]]:
    """(name, run-config mapping) for every point of the main sweep grid."""
    base, grid = doc.get("base", {}), _grid(doc, quick)
    sizes, budgets = grid.get("sizes", [{}]), grid.get("max_steps", [])
    epsilons, seeds = grid.get("epsilons", [8.0]), grid.get("seeds", [0])
    batches = grid.get("logical_batch_sizes", [None])
    if not budgets:
        raise ConfigError("sweep config: sweep.max_steps must list at least one token budget")
    points = []
    for (i, size), steps, batch, eps, seed in itertools.product(enumerate(sizes), budgets, batches, epsilons, seeds):
        cfg = _run_cfg(base, size, steps=steps, eps=eps, seed=seed, batch=batch)
        name = f"size{i}_steps{steps}" + ("" if batch is None else f"_b{batch}") + f"_{_tag(eps)}_seed{seed}"
        points.append((name, cfg))
    return points


def _per_size(value, i: int):
    return value[i] if isinstance(value, list) else value


def _done(out: Path, tables: list[Path]) -> set[str]:
    """Names of finished runs: a line in one of the runs tables, or a run_summary.json on disk."""
    names = {p.parent.name for p in out.glob("*/run_summary.json")}
    for t in tables:
        if t.is_file():
            names |= {Path(r["run_dir"]).name for r in load_runs(t)}
    return names


def _rows(path: Path) -> list[dict]:
    """The runs table with one row per run (a run re-done after a crash keeps its last line)."""
    rows = {Path(r["run_dir"]).name: r for r in load_runs(path)}
    return list(rows.values())


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


def plan_stages(doc: dict, *, quick: bool, out: Path, only_sizes: list[int] | None,
                done: set[str], lr_rows: list[dict]) -> list[tuple[str, str, dict]]:
    """(stage, name, run-config mapping) of every run still to do, in order: per size, pretrain (if any
    later run of that size needs it), the LR grid, then the main grid at the size's best LR.

    A main-grid run waits for its size's LR grid to finish (its LR is not known before); re-running the
    command after the LR grid completes schedules it.
    """
    base, grid = doc.get("base", {}), _grid(doc, quick)
    sizes = grid.get("sizes", [{}])
    pre, lrg = doc.get("pretrain"), doc.get("lr_grid")
    corpora = doc.get("corpora")
    data_private = str(out / "corpora" / "private.jsonl") if corpora else None
    main = expand(doc, quick=quick)
    todo = []
    for i, size in enumerate(sizes):
        if only_sizes is not None and i not in only_sizes:
            continue
        mine = [(n, c) for n, c in main if n.startswith(f"size{i}_")]
        lr_names = []
        lr_points = []
        if lrg:
            for lr in lrg["learning_rates"]:
                cfg = _run_cfg(base, size, steps=lrg["max_steps"], eps=lrg.get("epsilon", 8.0), seed=0,
                               batch=lrg.get("logical_batch_size"), lr=lr)
                name = f"lr_size{i}_lr{lr:g}"
                lr_names.append(name)
                lr_points.append((name, cfg))
        pending = [n for n, _ in mine + lr_points if n not in done]
        if not pending:
            continue
        pre_name = f"pre_size{i}"
        if pre:
            cfg = _run_cfg(base, size, steps=_per_size(pre["max_steps"], i), eps=None, seed=0,
                           batch=pre.get("logical_batch_size"), lr=_per_size(pre.get("learning_rate"), i))
            cfg["data"].update(pre.get("data", {}))
            if corpora:
                cfg["data"]["dataset"] = str(out / "corpora" / "public.jsonl")
            cfg["train"].update({"save_every": pre.get("save_every"), "resume_from": "latest",
                                 "overwrite_output_dir": False})
            if not (out / pre_name / "run_summary.json").is_file():
                todo.append(("pretrain", pre_name, cfg))
        def finetune(cfg: dict, pre_name=pre_name) -> dict:
            if pre:
                cfg["model"]["model_name_or_path"] = str(out / pre_name)
            if data_private:
                cfg["data"]["dataset"] = data_private
            return cfg
        todo += [("lr_grid", n, finetune(c)) for n, c in lr_points if n not in done]
        best_lr = None
        if lrg:
            got = {Path(r["run_dir"]).name: r["final_eval_loss"] for r in lr_rows}
            if not all(n in got for n in lr_names):
                continue  # main runs of this size wait for the LR grid
            best_lr = lrg["learning_rates"][min(range(len(lr_names)), key=lambda j: got[lr_names[j]])]
        for n, c in mine:
            if n not in done:
                if best_lr is not None:
                    c["train"]["learning_rate"] = float(best_lr)
                todo.append(("main", n, finetune(c)))
    return todo


def with_noise(doc: dict, *, noise: str | None, bands: str | None, form: str | None, fit: bool = True,
               buffers: str | None = None) -> dict:
    """Set the base's ``privacy.noise`` / ``bands`` / ``buffers`` (every private run inherits them) and, when the sweep
    ends with a fit, refuse a form that reads σ̄ under correlated noise (``form``: the one asked for, else the
    config's).

    Raises:
        ConfigError: a correlated mechanism (banded or blt) with a form whose inputs include ``sigma_bar``, or
            buffers without ``noise: blt``.
    """
    from dpllm.scaling.forms import get_form

    privacy = doc.setdefault("base", {}).setdefault("privacy", {})
    if noise is not None:
        privacy["noise"] = noise
    if bands is not None:
        privacy["bands"] = str(bands)
    if buffers is not None:
        privacy["buffers"] = str(buffers)
    mechanism = privacy.get("noise", "independent")
    if str(privacy.get("buffers", "auto")).strip() != "auto" and mechanism != "blt":
        raise ConfigError(f"sweep: privacy.buffers={privacy['buffers']} needs privacy.noise=blt (--noise blt)")
    fitted = form or doc.get("fit", {}).get("form", "chinchilla")
    if fit and mechanism != "independent" and "sigma_bar" in get_form(fitted).inputs:
        raise ConfigError(f"sweep: fit form {fitted} reads σ̄ = noise_multiplier / logical batch as DP-SGD's noise, "
                          f"and dpllm scaling plan calibrates σ with DP-SGD's event; with privacy.noise: {mechanism} "
                          "neither is the run's: fit chinchilla or power_law (--form), or pass --no_fit")
    return doc


def build_parser() -> argparse.ArgumentParser:
    """The sweep's command line."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="sweep YAML (base + sweep [+ quick, fit, corpora, pretrain, "
                    "lr_grid])")
    ap.add_argument("--output_dir", default="runs/sweep")
    ap.add_argument("--quick", action="store_true", help="the reduced grid of the config's quick section")
    ap.add_argument("--form", default=None, help="scaling form fitted at the end (default: the config's fit.form)")
    ap.add_argument("--n_boot", type=int, default=None, help="bootstrap resamples for the fit")
    ap.add_argument("--only_sizes", default=None, help="comma-separated size indices to run (default all)")
    ap.add_argument("--stop_after_s", type=float, default=None, help="start no new run after this many seconds")
    ap.add_argument("--no_fit", action="store_true", help="run only; skip the fit and plots")
    ap.add_argument("--noise", default=None, help="privacy.noise of every private run (independent, banded, blt; "
                    "default: the config's base)")
    ap.add_argument("--bands", default=None, help="privacy.bands of every private run (auto or b: banded's bands, "
                    "blt's cyclic groups; default: the config's base)")
    ap.add_argument("--buffers", default=None, help="privacy.buffers of every private run (noise blt: auto or 1–8; "
                    "default: the config's base)")
    return ap


def main(argv: list[str] | None = None, *, command: bool = False) -> dict:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    doc = yaml.safe_load(Path(args.config).read_text()) or {}
    with_noise(doc, noise=args.noise, bands=args.bands, buffers=args.buffers, form=args.form, fit=not args.no_fit)
    out = Path(args.output_dir)
    runs_file, lr_file, pre_file = out / "runs.jsonl", out / "lr_runs.jsonl", out / "pretrain_runs.jsonl"
    files = {"main": runs_file, "lr_grid": lr_file, "pretrain": pre_file}
    only = [int(v) for v in args.only_sizes.split(",")] if args.only_sizes else None
    start = time.time()
    if doc.get("corpora"):
        from dpllm.scaling.corpora import build_corpora

        manifest = build_corpora(out / "corpora", **doc["corpora"])
        print(json.dumps({k: {f: v[f] for f in ("records", "utf8_bytes")} for k, v in manifest["corpora"].items()}))
    models = [config_from_dict(cfg).model for _, cfg in expand(doc, quick=args.quick)]  # the main grid too, though
    # its LRs come later; the pretraining and LR-grid runs are the same sizes of the same base model
    if command:  # a process of its own: bitsandbytes stays unimported when no run needs it
        from dpllm.quantization import quiet_command

        quantized = sorted({m.quantization for m in models} - {"none"})
        quiet_command(*{m.model_name_or_path for m in models}, quantization=quantized[0] if quantized else "none")
    n_run, checked = 0, False
    while True:  # an LR grid that finishes unlocks its size's main grid: plan again until nothing is left
        lr_rows = _rows(lr_file) if lr_file.is_file() else []
        todo = plan_stages(doc, quick=args.quick, out=out, only_sizes=only,
                           done=_done(out, [runs_file, lr_file]), lr_rows=lr_rows)
        configs = []
        for stage, name, cfg in todo:
            cfg["train"].update({"output_dir": str(out / name), "runs_file": str(files[stage])})
            if stage != "pretrain":
                cfg["train"]["overwrite_output_dir"] = True
            configs.append((stage, name, cfg))
        if n_run == 0 and not checked:
            # validate every point before the first run starts: a typo must not surface after an hour
            for _, _, cfg in configs:
                config_from_dict(cfg)
            checked = True
        if not configs:
            break
        if args.stop_after_s is not None and time.time() - start > args.stop_after_s:
            print(f"stopped after {time.time() - start:.0f} s with {len(configs)}+ runs left; run the same command "
                  f"again to continue")
            return {"stopped": True, "runs_done": n_run}
        stage, name, cfg = configs[0]
        print(f"[{time.time() - start:.0f} s] {stage}: {name}", flush=True)
        from dpllm.train import train

        train(config_from_dict(cfg))
        n_run += 1
    wall = time.time() - start
    if args.no_fit:
        return {"runs": n_run, "wall_time_s": wall}
    return _fit_and_report(doc, out, runs_file, args, wall)


def _fit_and_report(doc: dict, out: Path, runs_file: Path, args, wall: float) -> dict:
    from dpllm.scaling.fit import fit_runs, write_fit
    from dpllm.scaling.plot import plot_fit
    from dpllm.scaling.runs import runs_to_points

    fit_cfg = doc.get("fit", {})
    form = args.form or fit_cfg.get("form", "chinchilla")
    n_boot = args.n_boot if args.n_boot is not None else int(fit_cfg.get("n_boot", 1000))
    rows = _rows(runs_file)
    fit = fit_runs(rows, form=form, n_boot=n_boot)
    fit["tokens_power_law"] = tokens_fits(rows, n_boot=n_boot)
    write_fit(fit, out / "fit" / "fit.json")
    plot_fit(fit, runs_to_points(rows), out / "fit")
    print(f"\n{len(rows)} runs in {wall:.0f} s -> {runs_file}")
    for group, f in fit["fits"].items():
        params = ", ".join(f"{k}={v:.4g}" for k, v in f["params"].items())
        print(f"{form} [{group}]: R² = {f['r2']:.3f}; {params}")
        for reason in f.get("degenerate", []):
            print(f"  DEGENERATE: {reason}")
    for key, f in fit["tokens_power_law"].items():
        print(f"loss vs tokens [{key}]: L(D) = {f['params']['a']:.4g}·D^(-{f['params']['alpha']:.3f}) + "
              f"{f['params']['L_inf']:.3f}, R² = {f['r2']:.3f}")
    print(f"fit: {out / 'fit' / 'fit.json'}")
    return {"runs": len(rows), "wall_time_s": wall, "fit": fit}


if __name__ == "__main__":
    main(command=True)  # quiet_command: for this process only, never a caller's
