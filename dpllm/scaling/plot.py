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
