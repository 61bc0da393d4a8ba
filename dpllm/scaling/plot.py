"""Plots of a scaling fit: loss vs N and loss vs D on log-log axes, one colour per privacy group.

Points are per-configuration means with ±1 std over seeds as error bars; lines are the fitted law.
A form's curve vs N depends on D (and σ̄), so up to three D values (min, median, max of the group) get
one line style each. matplotlib is imported here only, with the Agg backend (no display needed).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from dpllm.scaling.fit import JOINT, FitResult
from dpllm.scaling.runs import NON_PRIVATE

STYLES = ("-", "--", ":")


def _colours(groups: list[str]) -> dict[str, Any]:
    import matplotlib.pyplot as plt

    private = sorted((g for g in groups if g != NON_PRIVATE), key=lambda g: float(g.split("=", 1)[1]))
    cmap = plt.get_cmap("viridis")
    # Stop at 0.85 of the ramp: viridis's last yellows are unreadable on white.
    out = {g: cmap(0.85 * i / max(len(private) - 1, 1)) for i, g in enumerate(private)}
    out[NON_PRIVATE] = "black"  # the baseline stands apart from the ε colour ramp
    return out


def _pick(values: np.ndarray) -> list[float]:
    """Up to three representative values: all if ≤ 3 distinct, else min, median, max."""
    v = np.unique(values)
    return list(v) if len(v) <= 3 else [v[0], v[len(v) // 2], v[-1]]


def _means(points: Mapping[str, np.ndarray], mask: np.ndarray) -> dict[str, np.ndarray]:
    keys = np.column_stack([points[k][mask] for k in ("N", "D", "sigma_bar")])
    cfg, inv = np.unique(keys, axis=0, return_inverse=True)
    inv = inv.ravel()
    loss = points["loss"][mask]
    mean = np.array([loss[inv == i].mean() for i in range(len(cfg))])
    std = np.array([loss[inv == i].std(ddof=1) if (inv == i).sum() > 1 else 0.0 for i in range(len(cfg))])
    return {"N": cfg[:, 0], "D": cfg[:, 1], "sigma_bar": cfg[:, 2], "mean": mean, "std": std}


def plot_fit(doc: Mapping[str, Any], points: Mapping[str, np.ndarray], out_dir: str | os.PathLike) -> list[Path]:
    """Draw ``loss_vs_N.png`` (and ``loss_vs_D.png`` for forms with a D term) into ``out_dir``.

    Args:
        doc: a fit.json document (:func:`dpllm.scaling.fit.fit_runs`).
        points: the runs it was fitted to (:func:`dpllm.scaling.runs.runs_to_points`, same filter).
        out_dir: where to write (usually next to fit.json).

    Returns:
        The paths written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    form = doc["form"]
    if form == "noise_batch":
        return [plot_noise_batch(doc, points, out_dir)]
    groups = sorted(set(points["group"]))
    colours = _colours(groups)
    axes_to_draw = ("N",) if form == "power_law" else ("N", "D")
    written = []
    for xname in axes_to_draw:
        other = "D" if xname == "N" else "N"
        fig, ax = plt.subplots(figsize=(6.4, 4.8))
        for g in groups:
            fit_d = doc["fits"].get(JOINT) or doc["fits"].get(g)
            m = _means(points, points["group"] == g)
            ax.errorbar(m[xname], m["mean"], yerr=m["std"], fmt="o", ms=4, capsize=2, color=colours[g],
                        label=f"{g} (runs)")
            if fit_d is None:
                continue  # group skipped by the fit: points only
            fit = FitResult.from_dict(fit_d)
            lo, hi = m[xname].min(), m[xname].max()
            xs = np.geomspace(lo / 1.5, hi * 1.5, 200)
            sb = float(np.median(m["sigma_bar"]))
            for style, ov in zip(STYLES, [None] if form == "power_law" else _pick(m[other])):
                inputs = {xname: xs, "sigma_bar": np.full_like(xs, sb)}
                if ov is not None:
                    inputs[other] = np.full_like(xs, ov)
                tag = f"{g} fit" + ("" if ov is None else f", {other}={ov:.2g}")
                ax.plot(xs, fit.predict(**inputs), style, color=colours[g], lw=1.2, label=tag)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel({"N": "parameters N", "D": "tokens D"}[xname])
        ax.set_ylabel("eval loss (nats)")
        r2 = ", ".join(f"{g}: R²={f['r2']:.3f}" for g, f in doc["fits"].items())
        ax.set_title(f"{form}: loss vs {xname}\n{r2}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"loss_vs_{xname}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def plot_noise_batch(doc: Mapping[str, Any], points: Mapping[str, np.ndarray], out_dir: str | os.PathLike) -> Path:
    """``loss_vs_sigma_bar.png``: one panel per step count, loss against σ̄ with one colour per model size.

    Non-private runs (σ̄ = 0) are drawn as dashed horizontal lines at the size's loss; the fitted law is a
    solid curve over the fitted σ̄ range.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fit = FitResult.from_dict(doc["fits"][JOINT])
    steps = np.unique(points["S"])
    shown = _pick(steps)
    sizes = np.unique(points["N"])
    cmap = plt.get_cmap("viridis")
    colour = {n: cmap(0.85 * i / max(len(sizes) - 1, 1)) for i, n in enumerate(sizes)}
    fig, axes = plt.subplots(1, len(shown), figsize=(4.2 * len(shown), 4.2), sharey=True, squeeze=False)
    lo, hi = fit.domain.get("sigma_bar", [1e-4, 1e-2])
    xs = np.geomspace(lo / 1.5, hi * 1.5, 200)
    for ax, s in zip(axes[0], shown):
        for n in sizes:
            m = (points["S"] == s) & (points["N"] == n)
            if not m.any():
                continue
            priv = m & (points["sigma_bar"] > 0)
            ax.plot(points["sigma_bar"][priv], points["loss"][priv], "o", ms=4, color=colour[n])
            nonpriv = m & (points["sigma_bar"] == 0)
            if nonpriv.any():
                ax.axhline(points["loss"][nonpriv].mean(), ls="--", lw=0.8, color=colour[n])
            ax.plot(xs, fit.predict(N=np.full_like(xs, n), S=np.full_like(xs, s), sigma_bar=xs), "-", lw=1.2,
                    color=colour[n], label=f"N={n:.3g}")
        ax.set_xscale("log")
        ax.set_xlabel("σ̄ = noise multiplier / logical batch")
        ax.set_title(f"S = {s:g} steps", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("eval loss (nats); dashed: non-private")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(f"noise_batch fit, R² = {fit.r2:.3f}", fontsize=9)
    fig.tight_layout()
    path = Path(out_dir) / "loss_vs_sigma_bar.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_frontier(curves: Mapping[str, list], out_dir: str | os.PathLike) -> Path:
    """``frontier.png``: best predicted loss (with its bootstrap interval) against compute, one line per ε,
    and the model size and batch the planner chose along it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4.2))
    cmap = plt.get_cmap("viridis")
    for i, (label, rows) in enumerate(curves.items()):
        if not rows:
            continue
        col = cmap(0.85 * i / max(len(curves) - 1, 1))
        c = np.array([r["compute"] for r in rows])
        ax.plot(c, [r["loss"] for r in rows], "o-", color=col, label=label)
        ax.fill_between(c, [r["loss_low"] for r in rows], [r["loss_high"] for r in rows], color=col, alpha=0.2)
        ax2.plot(c, [r["N"] for r in rows], "o-", color=col, label=f"{label}: N")
        ax2.plot(c, [r["batch"] for r in rows], "s--", color=col, label=f"{label}: batch")
    for a in (ax, ax2):
        a.set_xscale("log")
        a.set_xlabel("compute (FLOPs)")
        a.grid(True, which="both", alpha=0.3)
        a.legend(fontsize=7)
    ax2.set_yscale("log")
    ax.set_ylabel("best predicted eval loss (95% interval)")
    ax2.set_ylabel("chosen model size N / logical batch")
    fig.suptitle("compute-optimal private training (noise_batch fit)", fontsize=9)
    fig.tight_layout()
    path = Path(out_dir) / "frontier.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
