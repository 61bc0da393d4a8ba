"""Private scaling laws on 2-layer MLPs (the scaling-law paper's study) through dpllm's privacy engine, with formal ε.

Widths 16..256 (261..4,101 parameters) × {non-private, σ = 1, σ = 3} (C = 1) × 3 seeds, 100 epochs of
SGD (lr 0.01, expected batch 64, Poisson sampling); then L(N) = a·N^(−α) + L∞ is fitted per privacy level
with :func:`dpllm.scaling.fit_form` (1,000 bootstrap resamples of seeds within each width, seed 2026),
and ε is computed for each σ with the PRV and RDP accountants (δ = 1e-5). The 9 runs of each width (3 levels
× 3 seeds) train in lockstep (:mod:`dpllm.mlp.batched`: each run its own batches, noise, clipping and ε;
``--one_at_a_time`` trains them one by one through Opacus instead, with the same result).

    python recipes/mlp_scaling.py --output_dir docs/results/mlp_scaling
    python recipes/mlp_scaling.py --output_dir runs/mlp_scaling_quick --quick
    python recipes/mlp_scaling.py --output_dir runs/mlp_scaling_digits --dataset digits   # ~23 steps/epoch: minutes

Writes ``results.json`` (every run, the privacy of each σ, the fits), ``summary.md`` and
``scaling_laws.png`` / ``accuracy.png`` into ``--output_dir``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from mlp_study import (
    Timer,
    command_line,
    environment,
    finish,
    fmt,
    markdown_table,
    mean_std,
    paper_findings,
    progress,
    quiet_warnings,
    recipe_parser,
    save_figure,
)

from dpllm.mlp.data import load_dataset
from dpllm.scaling import ScalingError, fit_form

WIDTHS = (16, 32, 64, 128, 256)
LEVELS = (("non-private", None), ("σ=1", 1.0), ("σ=3", 3.0))
SEEDS = (42, 123, 789)  # the scaling-law paper's training seeds
BOOT_SEED = 2026  # the scaling-law paper's bootstrap seed
# What the scaling-law paper printed (its own DP-SGD, shuffled batches, no formal accounting).
PAPER_FITS = {
    "non-private": {"alpha": 0.321, "r2": 0.974, "alpha_ci": [0.051, 5.0], "a": 0.10, "L_inf": 0.0},
    "σ=1": {"alpha": 0.432, "r2": 0.956, "alpha_ci": [0.066, 5.0], "a": 0.42, "L_inf": 0.0},
    "σ=3": {"alpha": 0.431, "r2": 0.974, "alpha_ci": [0.059, 5.0], "a": 0.42, "L_inf": 0.0},
}


def grid(quick: bool) -> dict:
    if quick:  # 4 widths: the 3-parameter fit needs ≥ 4 distinct sizes
        return {"widths": (8, 16, 32, 64), "seeds": (42,), "epochs": 20, "n_boot": 50}
    return {"widths": WIDTHS, "seeds": SEEDS, "epochs": 100, "n_boot": 1000}


def main(argv: list[str] | None = None) -> dict:
    parser = recipe_parser(__doc__, default_output="runs/mlp_scaling")
    parser.add_argument("--one_at_a_time", action="store_true",
                        help="train each run alone through Opacus (dpllm.mlp.train.train_mlp) instead of the "
                             "9 runs of each width together (dpllm.mlp.batched.train_mlps; same result)")
    args = parser.parse_args(argv)
    # the training stack (opacus) loads once the arguments are read: --help and typos answer at once
    from dpllm.mlp.batched import train_mlps
    from dpllm.mlp.train import MLPRun, plan_for, train_mlp
    quiet_warnings()
    torch.set_num_threads(1)  # tiny models: extra threads only add synchronisation
    timer = Timer()
    g = grid(args.quick)
    data = load_dataset(args.dataset)
    plans, eps_cache = {}, {}
    specs = [(label, MLPRun(width=width, epochs=g["epochs"], lr=0.01, batch_size=64, seed=seed,
                            private=sigma is not None, noise_multiplier=sigma, max_grad_norm=1.0))
             for label, sigma in LEVELS for width in g["widths"] for seed in g["seeds"]]
    run_plans = [plan_for(run, n_train=data.n_train, cache=plans) if run.private else None for _, run in specs]
    records: list = [None] * len(specs)
    bar = progress(len(specs), "mlp_scaling", args.no_progress)
    if args.one_at_a_time:
        for i, ((_, run), plan) in enumerate(zip(specs, run_plans)):
            records[i] = train_mlp(run, data, plan=plan, eps_cache=eps_cache).record
            bar.update()
    else:  # every level and seed of one width in lockstep: each run keeps its own batches, noise and ε
        for width in g["widths"]:
            group = [i for i, (_, run) in enumerate(specs) if run.width == width]
            trained = train_mlps([specs[i][1] for i in group], data, plans=[run_plans[i] for i in group],
                                 eps_cache=eps_cache)
            for i, t in zip(group, trained):
                records[i] = t.record
            bar.update(len(group))
    runs = [{"level": label, **record} for (label, _), record in zip(specs, records)]
    bar.close()
    train_s = timer.seconds()

    fits, fit_errors = {}, {}
    for label, _ in LEVELS:
        rs = [r for r in runs if r["level"] == label]
        try:
            fits[label] = fit_form("power_law", loss=[r["metrics"]["test_loss"] for r in rs],
                                   N=[r["n_params"] for r in rs], n_boot=g["n_boot"], seed=BOOT_SEED,
                                   label=label).to_dict()
        except ScalingError as err:
            fit_errors[label] = str(err)
    privacy = []
    for label, _sigma in LEVELS[1:]:
        r = next(r for r in runs if r["level"] == label)
        privacy.append({"level": label, **{k: r[k] for k in (
            "noise_multiplier", "max_grad_norm", "sample_rate", "expected_batch_size", "steps", "delta",
            "epsilon_prv", "epsilon_rdp", "prv_note")}})

    results = {
        "recipe": "mlp_scaling", "command": command_line(__file__, argv), "quick": args.quick,
        "runs": runs, "privacy": privacy, "fits": fits, "fit_errors": fit_errors,
        "settings": {**{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()}, "lr": 0.01,
                     "batch_size": 64, "max_grad_norm": 1.0, "delta": 1e-5, "boot_seed": BOOT_SEED,
                     "levels": [[lab, s] for lab, s in LEVELS], "grad_sample_mode": "hooks", "clipping": "flat"},
        "dataset": data.info, "paper_reported": PAPER_FITS, "environment": environment(),
    }
    return finish(args.output_dir, results, plot=lambda out: plot(runs, fits, out), summary=summary, timer=timer,
                  train_s=train_s, label=f"mlp_scaling: {len(runs)} runs")


def summary(res: dict) -> str:
    runs, fits, g = res["runs"], res["fits"], res["settings"]
    levels = [lab for lab, _ in g["levels"]]
    r0 = runs[0]
    lines = [
        "# MLP scaling laws under DP (the scaling-law paper's study on dpllm's engine)", "",
        f"Command: `{res['command']}`", "",
        f"Wall time: **{res['timing']['wall_s']} s** (training {res['timing']['train_s']} s), CPU time "
        f"{res['timing'].get('cpu_s')} s, on {res['environment']['torch_threads']} torch thread(s); "
        f"{len(runs)} runs.", "",
        f"Data: {res['dataset'].get('n_train')} train / {res['dataset'].get('n_test')} test records of "
        f"`{r0['dataset']}`. Model: Linear–ReLU–Linear, widths {', '.join(map(str, g['widths']))}. "
        f"SGD lr {g['lr']}, expected batch {g['batch_size']} (Poisson, q = 1/⌈N/B⌉ = {r0['sample_rate']:.4f}), "
        f"{g['epochs']} epochs = {r0['steps']} steps, seeds {', '.join(map(str, g['seeds']))}. "
        "DP runs: flat clipping C = 1; the 9 runs of each width step together (`dpllm.mlp.batched`: per-run "
        "batches, clipping, noise and ε; equal to `dpllm.privacy.engine.make_private` with Opacus hooks run by "
        "run, `--one_at_a_time`).", "",
        "## Privacy of each noise level", "",
        markdown_table(["level", "σ", "C", "q", "steps", "δ", "ε (PRV)", "ε (RDP)"], [
            [p["level"], fmt(p["noise_multiplier"]), fmt(p["max_grad_norm"]), f"{p['sample_rate']:.4f}", p["steps"],
             f"{p['delta']:g}", fmt(p["epsilon_prv"]), fmt(p["epsilon_rdp"])] for p in res["privacy"]]), "",
        "The scaling-law paper gave no formal ε (its limitations say so); these are the guarantees of the runs "
        "above.", "",
        "## Power-law fits L(N) = a·N^(−α) + L∞ (test cross-entropy)", "",
    ]
    alpha_np = fits.get("non-private", {}).get("params", {}).get("alpha")
    rows = []
    for lab in levels:
        f, s = fits.get(lab), PAPER_FITS.get(lab, {})
        if f is None:
            rows.append([lab, "fit failed: " + res["fit_errors"].get(lab, "?")] + [""] * 7)
            continue
        p, ci = f["params"], f["ci"].get("alpha", [None, None])
        ratio = p["alpha"] / alpha_np if alpha_np else None
        rows.append([lab, fmt(p["alpha"]), f"[{fmt(ci[0])}, {fmt(ci[1])}]", fmt(p["a"]), fmt(p["L_inf"]),
                     fmt(f["r2"], 4), fmt(ratio), f"{fmt(s.get('alpha'))} / {fmt(s.get('r2'))}",
                     f"[{fmt(s.get('alpha_ci', [None])[0])}, {fmt(s.get('alpha_ci', [None, None])[1])}]"])
    lines += [markdown_table(["level", "α", "95% CI α (bootstrap)", "a", "L∞", "R²", "α/α_NP",
                              "paper α / R²", "paper CI α"], rows), ""]
    lines += ["Bootstrap: 1 point per width = mean over seeds; resamples draw seeds within each width "
              f"({g['n_boot']} resamples, seed {g['boot_seed']}); α is bounded to [0, 5] as in the paper.", "",
              "## Test loss and accuracy by width (mean ± sd over seeds)", ""]
    rows = []
    for w in g["widths"]:
        row = [w, next(r["n_params"] for r in runs if r["config"]["width"] == w)]
        for lab in levels:
            rs = [r for r in runs if r["level"] == lab and r["config"]["width"] == w]
            lm, ls = mean_std(r["metrics"]["test_loss"] for r in rs)
            am, _ = mean_std(r["metrics"]["test_accuracy"] for r in rs)
            row += [f"{lm:.3f} ± {ls:.3f}", f"{am:.3f}"]
        rows.append(row)
    hdr = ["width", "N"] + [h for lab in levels for h in (f"loss {lab}", f"acc {lab}")]
    lines += [markdown_table(hdr, rows), ""]
    lines += paper_findings("the scaling-law paper", r0["dataset"], findings(res), res["plots"])
    return "\n".join(lines)


def findings(res: dict) -> list[str]:
    runs, fits = res["runs"], res["fits"]
    out = []
    dp = {lab: f for lab, f in fits.items() if lab != "non-private"}
    r2s = ", ".join(f"{lab} {f['r2']:.3f}" for lab, f in dp.items())
    holds = bool(dp) and all(f["r2"] > 0.95 for f in dp.values())
    out.append(f"- **Power law under DP (R² > 0.95).** Paper: holds (0.956, 0.974). Ours: R² {r2s} → "
               f"{'holds' if holds else 'does NOT hold for every DP level'}.")
    if "non-private" in fits and dp:
        a_np = fits["non-private"]["params"]["alpha"]
        cmp = ", ".join(f"{lab} α = {f['params']['alpha']:.3f} ({f['params']['alpha'] / a_np:.2f}× non-private)"
                        for lab, f in dp.items())
        overlap = all(max(f["ci"]["alpha"][0], fits["non-private"]["ci"]["alpha"][0])
                      <= min(f["ci"]["alpha"][1], fits["non-private"]["ci"]["alpha"][1]) for f in dp.values()
                      if f.get("ci"))
        lower = all(f["params"]["alpha"] < a_np for f in dp.values())
        higher = all(f["params"]["alpha"] > a_np for f in dp.values())
        direction = ("DP α above non-private, as in the paper" if higher else
                     "DP α BELOW non-private: the opposite direction to the paper" if lower else "mixed directions")
        verdict = ("overlap, so neither these data nor the paper's separate the exponents" if overlap
                   else "do not all overlap")
        out.append(f"- **Exponent.** Paper: DP α ≈ 0.43 above non-private 0.32, CIs [0.05, 5]. Ours: "
                   f"non-private α = {a_np:.3f}; {cmp}; {direction}. The 95% CIs {verdict}.")
        a_cmp = ", ".join(f"{lab} {f['params']['a']:.3g}" for lab, f in fits.items())
        l_cmp = ", ".join(f"{lab} {fmt(f['params']['L_inf'])}" for lab, f in fits.items())
        out.append(f"- **Level of the curves.** Paper: DP raises a (0.10 → 0.42), L∞ ≈ 0. Ours: a: {a_cmp}; "
                   f"L∞: {l_cmp}. With three free parameters and five widths, a, α and L∞ trade off against each "
                   "other; compare the loss table, not single parameters.")
    perfect = sum(r["metrics"]["test_accuracy"] == 1.0 for r in runs)
    mean = lambda lab, m: float(np.mean([r["metrics"][m] for r in runs if r["level"] == lab]))  # noqa: E731
    accs = ", ".join(f"{lab} {mean(lab, 'test_accuracy'):.3f}" for lab in fits)
    out.append(f"- **Accuracy.** Paper: all 45 runs at 100% test accuracy, so its differences were in loss "
               f"(calibration) only. Ours: {perfect}/{len(runs)} runs at 100%; mean test accuracy {accs}.")
    if "non-private" in fits:
        acc_np, loss_np = mean("non-private", "test_accuracy"), mean("non-private", "test_loss")
        gaps = "; ".join(f"{lab}: {100 * (acc_np - mean(lab, 'test_accuracy')):.1f} accuracy points lower, "
                         f"loss ×{mean(lab, 'test_loss') / loss_np:.2f}" for lab in dp)
        out.append(f"- **Cost of DP, averaged over widths.** {gaps}. Our Gaussian task is a little harder than the "
                   "paper's (its generator is not published; see `dpllm.mlp.data`), so accuracy is below 100% here.")
    if len(dp) >= 2:
        first, last = list(dp)[0], list(dp)[-1]
        pairs = [(a, b) for a in runs if a["level"] == first for b in runs if b["level"] == last
                 and (b["config"]["seed"], b["config"]["width"]) == (a["config"]["seed"], a["config"]["width"])]
        diff = max(abs(a["metrics"]["test_loss"] - b["metrics"]["test_loss"]) for a, b in pairs)
        b = pairs[0][1]
        step_sd = b["config"]["lr"] * b["noise_multiplier"] * b["max_grad_norm"] / b["expected_batch_size"]
        eps = {p["level"]: fmt(p["epsilon_prv"]) for p in res["privacy"]}
        out.append("- **Noise or clipping?** Runs with the same seed see the same batches and the same "
                   f"standard-normal noise draws, so {first} and {last} differ only in the noise scale; their test "
                   f"losses differ by at most {diff:.3f}. Per step, the noise moves each weight by "
                   f"lr·σC/(qN) = {step_sd:.1e} (sd) at {last}, so the utility cost here is clipping's, not "
                   "noise's, which fits the paper's "
                   f"'clipping-dominated' reading. The guarantees do differ: ε = {eps[first]} ({first}) vs "
                   f"{eps[last]} ({last}), PRV.")
    eps = "; ".join(f"{p['level']}: ε = {fmt(p['epsilon_prv'])} (PRV), {fmt(p['epsilon_rdp'])} (RDP)"
                    for p in res["privacy"])
    out.append(f"- **Formal privacy** (absent from the paper), δ = 1e-5, q = {res['privacy'][0]['sample_rate']:.4f}, "
               f"{res['privacy'][0]['steps']} steps: {eps}.")
    return out


def plot(runs: list[dict], fits: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    levels = list(dict.fromkeys(r["level"] for r in runs))
    names = []
    for metric, fname, ylabel in (("test_loss", "scaling_laws.png", "test cross-entropy (nats)"),
                                  ("test_accuracy", "accuracy.png", "test accuracy")):
        fig, ax = plt.subplots(figsize=(6, 4.2))
        for i, lab in enumerate(levels):
            rs = [r for r in runs if r["level"] == lab]
            ns = sorted({r["n_params"] for r in rs})
            vals = [[r["metrics"][metric] for r in rs if r["n_params"] == n] for n in ns]
            colour = f"C{i}"
            ax.errorbar(ns, [np.mean(v) for v in vals], yerr=[np.std(v) for v in vals], fmt="o", color=colour,
                        capsize=3, label=lab)
            if metric == "test_loss" and lab in fits:
                p = fits[lab]["params"]
                grid_n = np.geomspace(min(ns), max(ns), 100)
                ax.plot(grid_n, p["a"] * grid_n ** -p["alpha"] + p["L_inf"], color=colour,
                        label=f"fit α={p['alpha']:.2f}, R²={fits[lab]['r2']:.3f}")
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # minor labels overlap at this range
        if metric == "test_loss":
            ax.set_yscale("log")
            ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("parameters N")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
        ax.set_title("MLP test " + ("loss" if metric == "test_loss" else "accuracy") + " vs size (mean ± sd)")
        names.append(save_figure(fig, out / fname))
    return names


if __name__ == "__main__":
    main()
