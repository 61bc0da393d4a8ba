"""Plots of a scaling fit, each answering one question about it.

- ``loss_vs_N.png`` / ``loss_vs_D.png``: does the law follow the runs? One panel per privacy group; runs
  are per-configuration means (±1 std over seeds), coloured by the *other* input (D on the N plot), and the
  law is drawn at that input's own values in the data (quantile bins when it takes many), in the same
  colours, so each curve has its runs beside it even when the sweep varies N and D together.
- ``pred_vs_obs.png``: every run's observed loss against the law's prediction, with the 95% prediction
  interval at its configuration; the title counts how many runs fall inside (in-sample).
- ``residuals.png``: log(observed / predicted) against each input (N, D, S, σ̄): a trend left in a panel is
  a term the form is missing. The dashed lines are the residual part of the 95% prediction interval.
- ``extrapolation.png``: how well the law extrapolates on this sweep: the rolling-origin validation's held-out
  runs (fitted on the smaller sizes, predicted at the larger), their error against how far beyond the fold's
  data they lie, with the in-range and the widened interval (:mod:`dpllm.scaling.extrapolate`).

Loss axes are logarithmic with plain tick labels ("2.5", not "2.5×10⁰"). matplotlib is imported here only,
with the Agg backend (no display needed).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from dpllm.scaling.fit import JOINT, FitResult
from dpllm.scaling.forms import get_form
from dpllm.scaling.runs import NON_PRIVATE

MAX_CURVES = 5
NAMES = {"N": "parameters N", "D": "tokens D", "S": "steps S", "sigma_bar": "σ̄ = noise multiplier / batch"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _tick(v: float, _pos=None) -> str:
    text = f"{v:.3g}"
    return text.replace("e+0", "e").replace("e+", "e").replace("e-0", "e-")  # 3e4, not 3e+04


def plain_log_axis(ax, axis: str = "y") -> None:
    """Log scale with plain tick labels ("2.5", "3e4"; not "2.5×10⁰"), called after the data are drawn.

    An axis spanning under ~a decade (a loss axis) gets round linear steps; a wider one 1-2-5 steps per decade.
    No minor ticks: the major steps already grid the axis, and a log axis's default minor ticks (every integer
    multiple within each decade, each a Tick artist of its own) were ~40% of ``plot_fit``'s time (4.8 -> 3.0 CPU-s
    for a three-group chinchilla fit's five figures).
    """
    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullLocator

    getattr(ax, f"set_{axis}scale")("log")
    target = ax.yaxis if axis == "y" else ax.xaxis
    lo, hi = sorted(ax.get_ylim() if axis == "y" else ax.get_xlim())
    wide = lo > 0 and hi / lo > 8
    target.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)) if wide else MaxNLocator(nbins=6, min_n_ticks=3))
    target.set_major_formatter(FuncFormatter(_tick))
    target.set_minor_locator(NullLocator())


def _colours(groups: list[str]) -> dict[str, Any]:
    plt = _plt()
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


def _levels(values: np.ndarray) -> tuple[list[float], np.ndarray]:
    """The values a family of curves is drawn at, and each point's curve: the distinct values when there
    are at most :data:`MAX_CURVES`, else that many equal-count bins of log value (curve at the bin's
    geometric mean)."""
    v = np.asarray(values, dtype=float)
    uniq = np.unique(v)
    if len(uniq) <= MAX_CURVES:
        return list(uniq), np.searchsorted(uniq, v)
    edges = np.quantile(np.log(v), np.linspace(0, 1, MAX_CURVES + 1))
    idx = np.clip(np.searchsorted(edges, np.log(v), side="right") - 1, 0, MAX_CURVES - 1)
    return [float(np.exp(np.log(v[idx == i]).mean())) if (idx == i).any() else float(np.exp(edges[i]))
            for i in range(MAX_CURVES)], idx


def _means(points: Mapping[str, np.ndarray], mask: np.ndarray, keys: tuple[str, ...]) -> dict[str, np.ndarray]:
    cols = np.column_stack([np.nan_to_num(points[k][mask], nan=0.0) for k in keys])
    cfg, inv = np.unique(cols, axis=0, return_inverse=True)
    inv = inv.ravel()
    loss = points["loss"][mask]
    mean = np.array([loss[inv == i].mean() for i in range(len(cfg))])
    std = np.array([loss[inv == i].std(ddof=1) if (inv == i).sum() > 1 else 0.0 for i in range(len(cfg))])
    return {**{k: cfg[:, j] for j, k in enumerate(keys)}, "mean": mean, "std": std}


def _group_fits(doc: Mapping[str, Any], points: Mapping[str, np.ndarray]) -> list[tuple[str, FitResult, np.ndarray]]:
    """(group, its fit, its runs' mask) for every group with a fit (a joint fit serves every group)."""
    out = []
    for g in sorted(set(points["group"])):
        d = doc["fits"].get(JOINT) or doc["fits"].get(g)
        if d is not None:
            out.append((g, FitResult.from_dict(d), points["group"] == g))
    return out


def _x(points: Mapping[str, np.ndarray], mask: np.ndarray, inputs: tuple[str, ...]) -> dict[str, np.ndarray]:
    return {k: points[k][mask] for k in inputs}


def _family(m: dict, xname: str, other: str) -> tuple[str, list[float], np.ndarray]:
    """How to draw the law against ``xname`` so each curve has its runs beside it: ``("iso", C values, idx)``
    when the runs lie on at most :data:`MAX_CURVES` compute budgets C = 6·N·D (an isoFLOP sweep: curves of
    constant compute), else ``("fixed", levels, idx)`` at ``other``'s own values (binned when many)."""
    c = 6.0 * m["N"] * m["D"]
    rounded = np.array([float(f"{v:.2g}") for v in c])
    uniq = np.unique(rounded)
    if len(uniq) <= MAX_CURVES and len(uniq) < len(np.unique(m[other])):
        return "iso", [float(np.exp(np.log(c[rounded == u]).mean())) for u in uniq], np.searchsorted(uniq, rounded)
    levels, idx = _levels(m[other])
    return "fixed", levels, idx


def _curves_panel(ax, fit: FitResult, m: dict, xname: str, other: str | None, sb: float) -> str:
    """Runs (means ± std) coloured by their curve, and the law along each curve in the same colour.

    Returns what the curves are, for the title."""
    plt = _plt()
    lo, hi = m[xname].min(), m[xname].max()
    xs = np.geomspace(lo / 1.3, hi * 1.3, 200)
    if other is None:
        ax.errorbar(m[xname], m["mean"], yerr=m["std"], fmt="o", ms=4, capsize=2, color="black", label="runs")
        ax.plot(xs, fit.predict(**{xname: xs}), "-", color="black", lw=1.2, label="law")
        return "law"
    kind, levels, idx = _family(m, xname, other)
    cmap = plt.get_cmap("viridis")
    colour = [cmap(0.85 * i / max(len(levels) - 1, 1)) for i in range(len(levels))]
    binned = kind == "fixed" and len(levels) < len(np.unique(m[other]))
    for i, level in enumerate(levels):
        sel = idx == i
        ax.errorbar(m[xname][sel], m["mean"][sel], yerr=m["std"][sel], fmt="o", ms=4, capsize=2, color=colour[i])
        if kind == "iso":
            span = m[xname][sel]
            xi = np.geomspace(span.min() / 1.3, span.max() * 1.3, 100)
            inputs = {xname: xi, other: level / (6.0 * xi)}
            label = f"C=6ND={level:.2g}"
        else:
            xi, inputs, label = xs, {xname: xs, other: np.full_like(xs, level)}, f"{other}={level:.3g}"
        ax.plot(xi, fit.predict(**inputs, sigma_bar=np.full_like(xi, sb)), "-", color=colour[i], lw=1.2, label=label)
    if binned:  # a binned curve is only near its runs: mark the law at each run's own inputs as well
        own = fit.predict(**{k: m[k] for k in ("N", "D")}, sigma_bar=np.full_like(m["N"], sb))
        ax.plot(m[xname], own, "x", ms=5, color="grey", label="law at each run's own N, D")
    return {"iso": "lines of constant compute", "fixed": f"lines at the runs' {other}"}[kind] + \
        (" (binned)" if binned else "")


def plot_fit(doc: Mapping[str, Any], points: Mapping[str, np.ndarray], out_dir: str | os.PathLike) -> list[Path]:
    """Draw the fit's plots into ``out_dir`` (see the module docstring).

    Args:
        doc: a fit.json document (:func:`dpllm.scaling.fit.fit_runs`).
        points: the runs it was fitted to (:func:`dpllm.scaling.runs.runs_to_points`, same filter).
        out_dir: where to write (usually next to fit.json).

    Returns:
        The paths written: ``loss_vs_N.png`` (and ``loss_vs_D.png`` for forms with D, or
        ``loss_vs_sigma_bar.png`` for noise_batch), ``pred_vs_obs.png`` and ``residuals.png``.
    """
    plt = _plt()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    form = doc["form"]
    inputs = get_form(form).inputs
    fits = _group_fits(doc, points)
    written = [plot_noise_batch(doc, points, out_dir)] if form == "noise_batch" else []
    for xname in ([] if form == "noise_batch" else [k for k in ("N", "D") if k in inputs]):
        other = next((k for k in ("N", "D") if k in inputs and k != xname), None)
        fig, axes = plt.subplots(1, len(fits), figsize=(5.2 * len(fits), 4.4), squeeze=False, sharey=True)
        for ax, (g, fit, mask) in zip(axes[0], fits):
            m = _means(points, mask, inputs)
            sb = float(np.median(m["sigma_bar"])) if "sigma_bar" in m else 0.0
            what = _curves_panel(ax, fit, m, xname, other, sb)
            plain_log_axis(ax, "x")
            plain_log_axis(ax)
            ax.set_xlabel(NAMES[xname])
            ax.set_title(f"{g}: R²={fit.r2:.3f}; {what}", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        axes[0][0].set_ylabel("eval loss (nats)")
        fig.suptitle(f"{form}: loss vs {xname}", fontsize=10)
        fig.tight_layout()
        written.append(_save(fig, out_dir / f"loss_vs_{xname}.png"))
    written.append(plot_pred_vs_obs(fits, points, inputs, out_dir / "pred_vs_obs.png", form))
    written.append(plot_residuals(fits, points, inputs, out_dir / "residuals.png", form))
    if any(f.extrapolation.get("runs") for _, f, _ in fits):
        written.append(plot_extrapolation(fits, out_dir / "extrapolation.png"))
    return written


def plot_extrapolation(fits, path: Path) -> Path:
    """Held-out larger sizes of the rolling-origin validation: error (%) against distance beyond the fold's
    data, with the fold's in-range interval (grey) and the widened one (colour); one panel per group."""
    plt = _plt()
    fits = [(g, f) for g, f, _ in fits if f.extrapolation.get("runs")]
    fig, axes = plt.subplots(1, len(fits), figsize=(5.6 * len(fits), 4.4), squeeze=False)
    for ax, (g, fit) in zip(axes[0], fits):
        ex = fit.extrapolation
        r = {k: np.asarray(v, dtype=float) for k, v in ex["runs"].items()}
        axis = ex["axis"]
        factor = r[axis] / r["cut"]
        cuts = sorted(set(r["cut"]))
        colours = plt.get_cmap("viridis")(np.linspace(0.0, 0.85, max(len(cuts), 1)))
        for c, col in zip(cuts, colours):
            m = r["cut"] == c
            jitter = factor[m] * np.exp(0.03 * (cuts.index(c) - len(cuts) / 2))
            ax.vlines(jitter, 100 * r["in_range"][m, 0], 100 * r["in_range"][m, 1], color="0.6", lw=4, alpha=0.5)
            ax.vlines(jitter, 100 * r["widened"][m, 0], 100 * r["widened"][m, 1], color=col, lw=1)
            ax.scatter(jitter, 100 * r["error"][m], color=col, s=14, zorder=3,
                       label=f"fitted on {axis} ≤ {c:.3g}")
        ax.axhline(0.0, color="k", lw=0.8)
        ax.set_xscale("log")
        plain_log_axis(ax, "x")
        ax.set_xlabel(f"held-out {axis} / largest fitted {axis} (×)")
        ax.set_ylabel("log(observed / predicted), %")
        cov = ex["coverage"]
        ax.set_title(f"{g}: {100 * ex['level']:g}% intervals cover {100 * cov['in_range']:.0f}% in-range (grey), "
                     f"{100 * cov['widened']:.0f}% widened\n(colour; {100 * cov['widened_cv']:.0f}% cross-validated), "
                     f"{ex['n_held_out']} held-out runs" if cov.get("widened_cv") is not None else
                     f"{g}: {100 * ex['level']:g}% intervals cover {100 * cov['in_range']:.0f}% in-range (grey), "
                     f"{100 * cov['widened']:.0f}% widened (colour)", fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=120)
    _plt().close(fig)
    return path


def plot_pred_vs_obs(fits, points, inputs, path: Path, form: str) -> Path:
    """Observed loss of every run against the law's prediction, with the 95% prediction interval."""
    plt = _plt()
    colours = _colours([g for g, _, _ in fits])
    fig, ax = plt.subplots(figsize=(5.6, 5.2))
    inside = total = 0
    for g, fit, mask in fits:
        x = _x(points, mask, inputs)
        pred, obs = fit.predict(**x), points["loss"][mask]
        lo, hi = fit.prediction_interval(**x)
        if np.isfinite(lo).all():
            ax.vlines(pred, lo, hi, color=colours[g], alpha=0.35, lw=2)
            inside += int(((lo <= obs) & (obs <= hi)).sum())
            total += len(obs)
        ax.plot(pred, obs, "o", ms=4, color=colours[g], label=f"{g} ({len(obs)} runs)")
    lims = np.array(ax.get_xlim() + ax.get_ylim())
    span = [lims.min(), lims.max()]
    ax.plot(span, span, "--", color="grey", lw=1, label="observed = predicted")
    ax.set_xlim(span)
    ax.set_ylim(span)
    plain_log_axis(ax, "x")
    plain_log_axis(ax, "y")
    ax.set_xlabel("predicted loss (the law at the run's inputs)")
    ax.set_ylabel("observed eval loss (nats)")
    share = f"{inside} of {total} runs ({100 * inside / total:.0f}%)" if total else "no runs"
    ax.set_title(f"{form}: observed vs predicted\nbars: 95% prediction interval; {share} inside (in-sample)",
                 fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return _save(fig, path)


def plot_residuals(fits, points, inputs, path: Path, form: str) -> Path:
    """log(observed / predicted) against each input, one panel per input, one colour per group."""
    plt = _plt()
    colours = _colours([g for g, _, _ in fits])
    panels = [k for k in inputs if any(np.isfinite(points[k][m]).all() and (points[k][m] > 0).any()
                                       for _, _, m in fits)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels), 3.8), squeeze=False, sharey=True)
    for ax, k in zip(axes[0], panels):
        for g, fit, mask in fits:
            x = _x(points, mask, inputs)
            res = np.log(points["loss"][mask] / fit.predict(**x))
            pos = x[k] > 0  # σ̄ = 0 (non-private) has no place on a log axis
            ax.plot(x[k][pos], res[pos], "o", ms=4, color=colours[g], label=g)
            r = np.asarray(fit.scatter.get("log_residuals", [])) * fit.scatter.get("inflation", 1.0)
            if len(r) > 1:
                for q in np.percentile(r, [2.5, 97.5]):
                    ax.axhline(q, ls="--", lw=0.8, color=colours[g])
        ax.axhline(0.0, color="grey", lw=1)
        plain_log_axis(ax, "x")
        ax.set_xlabel(NAMES[k])
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("log(observed / predicted)")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(f"{form}: residuals (dashed: residual part of the 95% prediction interval)", fontsize=9)
    fig.tight_layout()
    return _save(fig, path)


def plot_noise_batch(doc: Mapping[str, Any], points: Mapping[str, np.ndarray], out_dir: str | os.PathLike) -> Path:
    """``loss_vs_sigma_bar.png``: one panel per step count, loss against σ̄ with one colour per model size.

    Non-private runs (σ̄ = 0) are drawn as dashed horizontal lines at the size's loss; the fitted law is a
    solid curve over the fitted σ̄ range.
    """
    plt = _plt()
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
    """``frontier.png``: best predicted loss (with its 95% prediction interval) against compute, one line per
    ε, and the model size and batch the planner chose along it."""
    plt = _plt()
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
    ax.set_ylabel("best predicted eval loss (band: 95% prediction interval)")
    ax2.set_ylabel("chosen model size N / logical batch")
    fig.suptitle("compute-optimal private training (noise_batch fit)", fontsize=9)
    fig.tight_layout()
    path = Path(out_dir) / "frontier.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
