"""Collect the study's runs (run_study.sh OUT_DIR) into results.json, a markdown table on stdout and results.png.

Each setting (flat at one C, or quantile) has 3 seeds; the interval is the mean ± t(0.975, n−1)·s/√n (a 95% interval
for the setting's mean held-out loss over seeds, noise included). A seed fixes the model's initialisation and the
data order for every setting, so most of the spread between seeds is shared: the paired column compares each
setting with the best flat C (lowest mean) seed by seed, a 95% t-interval of the mean paired difference.
Usage: python docs/results/quantile_clipping/summarize.py OUT_DIR
"""

import json
import math
import re
import sys
from collections import defaultdict
from pathlib import Path

from scipy.stats import t as student

HERE = Path(__file__).parent


def read(run: Path) -> dict:
    report = json.loads((run / "privacy_report.json").read_text())
    evals = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [e for e in evals if e.get("split") == "eval"]
    a = report.get("adaptive_clipping") or {}
    setting, seed = re.fullmatch(r"(.+)_s(\d+)", run.name).groups()
    return {"run": run.name, "setting": setting, "seed": int(seed), "clipping": report["clipping"],
            "C_start": report["max_grad_norm"], "C_final": a.get("final_max_grad_norm", report["max_grad_norm"]),
            "sigma": report["noise_multiplier"], "sigma_g": a.get("gradient_noise_multiplier"),
            "sigma_b": a.get("count_noise_multiplier"), "epsilon": report["epsilon"], "delta": report["delta"],
            "sample_rate": report["sample_rate"], "steps": report["steps"], "accountant": report["accountant"],
            "heldout_loss": evals[-1]["loss"]}


def interval(values: list) -> tuple:
    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else float("nan")
    half = student.ppf(0.975, n - 1) * sd / math.sqrt(n) if n > 1 else float("nan")
    return mean, half


def main(out: Path) -> None:
    runs = [read(d) for d in sorted(p for p in out.iterdir() if (p / "privacy_report.json").is_file())]
    by = defaultdict(list)
    for r in runs:
        by[r["setting"]].append(r)
    settings = []
    for name, rs in by.items():
        mean, half = interval([r["heldout_loss"] for r in rs])
        c_mean, c_half = interval([r["C_final"] for r in rs])
        settings.append({"setting": name, "clipping": rs[0]["clipping"], "C_start": rs[0]["C_start"],
                         "seeds": sorted(r["seed"] for r in rs), "heldout_loss_mean": mean,
                         "heldout_loss_ci95": half, "C_final_mean": c_mean, "C_final_ci95": c_half,
                         "epsilon": max(r["epsilon"] for r in rs)})
    settings.sort(key=lambda s: (s["clipping"] != "flat", s["C_start"]))
    best = min((s for s in settings if s["clipping"] == "flat"), key=lambda s: s["heldout_loss_mean"])
    best_by_seed = {r["seed"]: r["heldout_loss"] for r in by[best["setting"]]}
    for s in settings:
        diffs = [r["heldout_loss"] - best_by_seed[r["seed"]] for r in by[s["setting"]] if r["seed"] in best_by_seed]
        s["vs_best_flat"] = best["setting"]
        s["vs_best_flat_mean"], s["vs_best_flat_ci95"] = interval(diffs)
        start = next((f for f in settings if f["clipping"] == "flat" and f["C_start"] == s["C_start"]), None)
        if s["clipping"] == "quantile" and start is not None:  # against flat clipping at the C it started from
            at_start = {r["seed"]: r["heldout_loss"] for r in by[start["setting"]]}
            s["vs_flat_at_start"] = start["setting"]
            s["vs_flat_at_start_mean"], s["vs_flat_at_start_ci95"] = interval(
                [r["heldout_loss"] - at_start[r["seed"]] for r in by[s["setting"]] if r["seed"] in at_start])
    (HERE / "results.json").write_text(json.dumps({
        "command": "bash docs/results/quantile_clipping/run_study.sh OUT && python "
                   "docs/results/quantile_clipping/summarize.py OUT",
        "interval": "95% t-interval of the mean over seeds", "settings": settings, "runs": runs}, indent=2) + "\n")
    print(f"| setting | C (start → final, mean over seeds) | seeds | ε | held-out loss (mean ± 95% CI) | "
          f"paired − {best['setting']} (mean ± 95% CI) |")
    print("|---|---|---|---|---|---|")
    for s in settings:
        c = (f"{s['C_start']:g} → {s['C_final_mean']:.3g} ± {s['C_final_ci95']:.2g}" if s["clipping"] == "quantile"
             else f"{s['C_start']:g}")
        print(f"| {s['setting']} | {c} | {len(s['seeds'])} | {s['epsilon']:.3f} | "
              f"{s['heldout_loss_mean']:.4f} ± {s['heldout_loss_ci95']:.4f} | "
              f"{s['vs_best_flat_mean']:+.4f} ± {s['vs_best_flat_ci95']:.4f} |")
    for s in settings:
        if "vs_flat_at_start" in s:
            print(f"\n{s['setting']} − {s['vs_flat_at_start']} (paired by seed): {s['vs_flat_at_start_mean']:+.4f} ± "
                  f"{s['vs_flat_at_start_ci95']:.4f}")
    plot(settings)


def plot(settings: list) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    flat = [s for s in settings if s["clipping"] == "flat"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.errorbar([s["C_start"] for s in flat], [s["heldout_loss_mean"] for s in flat],
                yerr=[s["heldout_loss_ci95"] for s in flat], fmt="o-", capsize=3, label="flat C (3 seeds, 95% CI)")
    for s in settings:
        if s["clipping"] == "quantile":
            m, h = s["heldout_loss_mean"], s["heldout_loss_ci95"]
            ax.axhspan(m - h, m + h, color="tab:orange", alpha=0.25)
            ax.axhline(m, color="tab:orange", label=f"quantile (γ 0.5, η 0.2, C 1 → {s['C_final_mean']:.2g})")
            ax.axvline(s["C_final_mean"], color="tab:orange", ls=":", lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("clipping norm C (flat) / final C (quantile, dotted)")
    ax.set_ylabel("held-out loss (nats/token)")
    ax.set_title("Tiny Llama LoRA, SGD lr 10, ε = 8, 20 steps")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(HERE / "results.png", dpi=120)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
