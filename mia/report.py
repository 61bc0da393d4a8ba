"""Audit results as data (JSON) first, then a markdown table and a log-log ROC plot.

Files written into the output directory:

* ``mia_report.json`` — settings and, per attack, the metrics of :func:`mia.metrics.evaluate`;
* ``mia_scores.json`` — per attack, the member and non-member scores (no texts), for re-analysis;
* ``mia_report.md`` — one table row per attack;
* ``mia_roc.png`` — ROC curves of all attacks on log-log axes with the chance diagonal;
* ``embedding_report.json`` / ``embedding_scores.json`` / ``embedding_report.md`` / ``embedding_roc.png`` — the
  embedding-interface audit (:func:`write_embedding_report`);
* ``canary_report.json`` / ``canary_report.md`` / ``canary_roc.png`` — the canary ε audit
  (:func:`write_canary_report`);
* ``whitebox_report.json`` / ``whitebox_report.md`` — the white-box audit (:func:`write_whitebox_report`).

ROC plots of a private run also draw the region an (ε, δ)-DP run allows: ``TPR <= e^ε FPR + δ``, and below it
the run's own trade-off curve (:mod:`dpllm.privacy.tradeoff`), the most any attack can reach against it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from mia.metrics import roc_curve, tpr_key

CONVENTIONS = (
    "Scores: higher = more likely member. A threshold t predicts member for score >= t; thresholds "
    "are the observed scores, so tied records are always classified together. TPR@FPR<=b is the "
    "largest TPR over thresholds with FPR <= b (with fewer than 1/b non-members only FPR = 0 "
    "qualifies). AUC is Mann-Whitney (ties count 1/2). Balanced accuracy is the best over "
    "thresholds. Loss gap = mean non-member loss - mean member loss (nats). CIs: percentile "
    "bootstrap resampling members and non-members separately."
)


def _fmt(x, digits: int = 3) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def markdown_table(report: dict) -> str:
    """The attack table of an audit report."""
    fprs = report["fprs"]
    head = ["attack", "AUC [CI]"] + [f"TPR@{b * 100:g}%FPR" for b in fprs] + ["bal. acc", "loss gap"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in report["attacks"].items():
        ci = r.get("ci", {}).get("auc")
        auc_cell = _fmt(r["auc"]) + (f" [{_fmt(ci[0])}, {_fmt(ci[1])}]" if ci else "")
        cells = [name, auc_cell] + [_fmt(r[tpr_key(b)]) for b in fprs]
        cells += [_fmt(r["balanced_accuracy"]), _fmt(r.get("loss_gap"))]
        lines.append("| " + " | ".join(cells) + " |")
    b = report.get("privacy_bounds") or {}
    if "auc" in b:  # the most any attack can reach against the run's mechanism (dpllm.privacy.tradeoff)
        cells = [f"**bound: any attack** ({b['unit']} level)", f"≤ {b['auc']:.4f}"]
        cells += [f"≤ {b[tpr_key(f)]:.4f}" if tpr_key(f) in b else "–" for f in fprs] + ["–", "–"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def bounds_summary(report: dict) -> str | None:
    """What the audit says about the run's bounds, in a few lines (None when the report has none)."""
    b = report.get("privacy_bounds")
    if not b:
        return None
    if "unavailable" in b:
        return f"no bound on attacks for this run: {b['unavailable']}"
    head = (f"Bounds for any attack against this run's mechanism ({b['unit']} level, from its privacy history's "
            f"trade-off curve): {b['plain_reading']}")
    if b["exceeded"]:
        name, metric, measured, allowed = b["exceeded"][0]
        return (f"{head}\nPRIVACY BUG: attack {name!r} measured {metric} = {measured:.4f}, above what the mechanism "
                f"allows ({allowed:.4f}) beyond sampling error ({b['confidence']:.0%} confidence): the training does "
                "not deliver its accounted guarantee. Check the noise, sampling, clipping and accounting.")
    return head + f"\nNo measured value is above its bound beyond sampling error ({b['confidence']:.0%} confidence)."


def print_bounds(report: dict) -> int:
    """Print :func:`bounds_summary`; the exit code: 1 when a measured value exceeds its bound, else 0."""
    import sys

    text = bounds_summary(report)
    if text is None:
        return 0
    bug = bool((report.get("privacy_bounds") or {}).get("exceeded"))
    print("\n" + text, file=sys.stderr if bug else sys.stdout)
    return 1 if bug else 0


def plot_roc(scores: dict[str, tuple[np.ndarray, np.ndarray]], path: str | Path,
             title: str = "Membership inference ROC", dp_bound: tuple[float, float] | None = None,
             curve: Mapping[str, Sequence[float]] | None = None) -> Path:
    """Log-log ROC curves of several attacks plus the chance diagonal, saved as PNG.

    Args:
        scores: ``{attack: (member_scores, nonmember_scores)}``.
        path: Output file.
        title: Plot title.
        dp_bound: ``(ε, δ)`` of the run: also draw ``TPR = min(1, e^ε FPR + δ)``, the most any
            attack can reach on an (ε, δ)-DP run (Kairouz et al. 2015).
        curve: ``{"fpr": [...], "tpr": [...]}``: the run's own upper trade-off curve (``privacy_bounds["curve"]``
            of :func:`mia.audit.privacy_bounds`), the tightest bound any attack on this mechanism meets; drawn
            solid, below the (ε, δ) line.
    """
    import matplotlib

    matplotlib.use("Agg")  # headless: never needs a display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 5))
    floor = min([1.0] + [1.0 / max(len(m), 1) for m, _ in scores.values()]
                + [1.0 / max(len(n), 1) for _, n in scores.values()])
    if dp_bound is not None:  # reach down to where the bound bends (FPR = e^-ε), so it is visible
        floor = max(min(floor, 0.5 * math.exp(-dp_bound[0])), 1e-6)
    for name, (m, n) in scores.items():
        fpr, tpr, _ = roc_curve(m, n)
        # Log axes cannot show 0; draw zero rates at half the smallest resolvable rate.
        ax.plot(np.maximum(fpr, floor / 2), np.maximum(tpr, floor / 2), label=name)
    ax.plot([floor / 2, 1], [floor / 2, 1], "k--", lw=1, label="chance")
    if dp_bound is not None:
        eps, delta = dp_bound
        x = np.logspace(math.log10(floor / 2), 0, 200)
        ax.plot(x, np.minimum(1.0, math.exp(min(eps, 700.0)) * x + delta), "r:", lw=1.5,
                label=f"DP bound ε={eps:.3g}, δ={delta:.0e}")
    if curve is not None:
        ax.plot(np.maximum(curve["fpr"], floor / 2), np.maximum(curve["tpr"], floor / 2), "r-", lw=1.5,
                label="bound for any attack on this run")
    ax.set(xscale="log", yscale="log", xlabel="false positive rate", ylabel="true positive rate",
           xlim=(floor / 2, 1.2), ylim=(floor / 2, 1.2), title=title)  # a curve at 1 stays in view
    ax.legend(loc="lower right")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_attack_report(report: dict, scores: dict[str, tuple[np.ndarray, np.ndarray]], out_dir: str | Path, *,
                        stem: str, title: str, summary: str, extra_scores: dict | None = None, plot: bool = True,
                        plot_title: str = "Membership inference ROC",
                        notes: list[str] | None = None) -> dict[str, Path]:
    """Write ``{stem}_report.json``, ``{stem}_scores.json``, ``{stem}_report.md`` and ``{stem}_roc.png``.

    Each file is written atomically (temp file + rename), so a crash never leaves half a report.

    Args:
        report: Settings plus ``"attacks"`` (metrics per attack), as from :func:`mia.audit.run_audit`.
        scores: ``{attack: (member_scores, nonmember_scores)}``.
        out_dir: Directory (created if missing).
        stem: File-name prefix (``mia``, ``lira``).
        title, summary: The markdown heading and the paragraph under it.
        extra_scores: More JSON-serialisable entries for the scores file (no texts).
        plot: Also draw the ROC PNG; plot_title: its title. With ``report["dp_bound"]``
            (``{"epsilon", "delta"}``) the plot also shows the DP bound curve.
        notes: Paragraphs placed under the table (e.g. the blind-baseline verdict).

    Returns:
        ``{"json", "scores", "md", "png"?}`` paths.
    """
    from dpllm.io import write_text_atomic

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{stem}_report.json", "scores": out / f"{stem}_scores.json",
             "md": out / f"{stem}_report.md"}
    write_text_atomic(paths["json"], json.dumps({**report, "conventions": CONVENTIONS}, indent=2) + "\n")
    data = {k: {"members": np.asarray(m).tolist(), "nonmembers": np.asarray(n).tolist()}
            for k, (m, n) in scores.items()}
    data.update(extra_scores or {})
    write_text_atomic(paths["scores"], json.dumps(data) + "\n")
    md = [title, "", summary, "", markdown_table(report), ""]
    if bounds_summary(report):
        md += [bounds_summary(report), ""]
    for note in notes or []:
        md += [note, ""]
    md += [f"Conventions: {CONVENTIONS}", ""]
    if plot:
        b = report.get("dp_bound")
        paths["png"] = plot_roc(scores, out / f"{stem}_roc.png", title=plot_title,
                                dp_bound=(b["epsilon"], b["delta"]) if b else None,
                                curve=(report.get("privacy_bounds") or {}).get("curve"))
        md += [f"![ROC]({stem}_roc.png)", ""]
    write_text_atomic(paths["md"], "\n".join(md))
    return paths


def _set_notes(report: dict) -> list[str]:
    """What an audit's markdown says about its member and non-member sets: how they were drawn, and the blind
    baseline's verdict on whether they differ without the model."""
    notes = []
    if report.get("split"):
        notes.append(f"Sets: {report['split']}.")
    if report.get("blind"):
        b = report["blind"]
        notes.append(f"**Blind baseline** ({b['method']}): {b['message']}")
    return notes


def write_audit_report(report: dict, scores: dict[str, tuple[np.ndarray, np.ndarray]],
                       out_dir: str | Path, *, plot: bool = True) -> dict[str, Path]:
    """Write ``mia_report.json``, ``mia_scores.json``, ``mia_report.md`` and ``mia_roc.png`` of an audit.

    Args:
        report: The dict from :func:`mia.audit.run_audit` (``"attacks"``, ``"fprs"``, settings).
        scores: ``{attack: (member_scores, nonmember_scores)}``.
        out_dir: Directory (created if missing).
        plot: Also draw the ROC PNG.
    """
    summary = (f"{report['n_members']} members, {report['n_nonmembers']} non-members; "
               f"max_length={report.get('max_length')}; CIs {report.get('ci_confidence', 0.95):.0%}.")
    return write_attack_report(report, scores, out_dir, stem="mia", plot=plot, summary=summary,
                               notes=_set_notes(report),
                               title=f"# Membership-inference audit of `{report.get('checkpoint', '?')}`")


def write_embedding_report(report: dict, scores: dict[str, tuple[np.ndarray, np.ndarray]],
                           out_dir: str | Path, *, plot: bool = True) -> dict[str, Path]:
    """Write ``embedding_report.{json,md}``, ``embedding_scores.json`` and ``embedding_roc.png`` of an
    embedding-interface audit (:func:`mia.embedding.run_embedding_audit`)."""
    summary = (f"Threat model: the attacker sees only embeddings (layer {report['layer']} hidden states, "
               f"{report['pooling']}; dimension {report['embedding_dim']}). {report['n_members']} members, "
               f"{report['n_nonmembers']} non-members; max_length={report.get('max_length')}; reference: "
               f"{report.get('reference') or 'none'}; CIs {report.get('ci_confidence', 0.95):.0%}.")
    notes = [f"- `{k}`: {v}" for k, v in report.get("attack_help", {}).items()] + _set_notes(report)
    return write_attack_report(report, scores, out_dir, stem="embedding", plot=plot, summary=summary, notes=notes,
                               plot_title=f"Embedding-interface MIA (layer {report['layer']})",
                               title=f"# Embedding-interface membership audit of `{report.get('checkpoint', '?')}`")


def write_canary_report(report: dict, out_dir: str | Path) -> dict[str, Path]:
    """Write ``canary_report.json``, ``canary_report.md`` and ``canary_roc.png`` for a canary ε audit."""
    from dpllm.io import write_text_atomic

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "canary_report.json", "md": out / "canary_report.md", "png": out / "canary_roc.png"}
    write_text_atomic(paths["json"], json.dumps(report, indent=2, default=float) + "\n")
    scores, inc = np.asarray(report["scores"]), np.asarray(report["included"], dtype=bool)
    eps = report["accountant_epsilon"]
    private = report["verdict"] != "not private"
    plot_roc({"canaries": (scores[inc], scores[~inc])}, paths["png"], title="Canary ROC",
             dp_bound=(eps, report["delta"]) if private else None)
    write_text_atomic(paths["md"], "\n".join([
        f"# Canary privacy audit of `{report['run_dir']}`", "",
        f"{report['m']} canaries ({report['n_included']} trained on), scored by {report['scored']}; "
        f"δ = {report['delta']:g}.", "",
        *_bound_table(report, eps), "",
        f"**Verdict: {report['verdict']}**", "", report["message"], "",
        "![canary ROC](canary_roc.png)", ""]))
    return paths


def _bound_table(report: dict, eps) -> list[str]:
    one, gdp, conf = report["one_run"], report["gdp"], report["confidence"]
    return ["| estimate | ε | confidence |", "|---|---|---|",
            f"| accountant (upper bound{': ' + report['accounted_as'] if report.get('accounted_as') else ''}) | "
            f"{_fmt(eps)} | – |",
            f"| **one-run lower bound** ({one['analysis']} analysis won; used for the verdict) | "
            f"**{_fmt(one['epsilon_lower'])}** | {conf:.0%} |",
            f"| Gaussian-DP reading: μ ≥ {_fmt(gdp['mu_lower'])} (not an ε bound for non-Gaussian "
            f"mechanisms) | {_fmt(gdp['epsilon_lower'])} | {conf:.0%} |", "",
            f"Best guess count: {one['correct']} of the top {one['k']} scores are members (m = {one['m']}; "
            f"{one['n_tests']} tests, each at {one['per_test_confidence']:.4f}, Bonferroni).", "",
            f"Bound: {report.get('bound', '')}."]


def whitebox_summary(report: dict) -> str:
    """One paragraph: the white-box bound beside the accountant's ε."""
    g = report["gdp"]
    return (f"white-box audit, {report['m']} Dirac canaries ({report['n_included']} in), σ = "
            f"{report['noise_multiplier']:.4g}, q = {report['sample_rate']:.4g}, {report['steps']} steps: "
            f"{report['message']} Gaussian-DP reading: μ >= {g['mu_lower']:.3f} (ε = {g['epsilon_lower']:.3f}).")


def write_whitebox_report(report: dict, out_dir: str | Path) -> dict[str, Path]:
    """Write ``whitebox_report.json`` and ``whitebox_report.md``."""
    from dpllm.io import write_text_atomic

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "whitebox_report.json", "md": out / "whitebox_report.md"}
    write_text_atomic(paths["json"], json.dumps(report, indent=2, default=float) + "\n")
    one, g = report["primary"], report["gdp"]
    write_text_atomic(paths["md"], "\n".join([
        "# White-box one-run audit (Dirac gradient canaries)", "",
        f"Threat model: {report['threat_model']}. {report['m']} canaries ({report['n_included']} in) and "
        f"{report['num_records'] - report['n_included']} real records; σ = {report['noise_multiplier']:.4g}, "
        f"q = {report['sample_rate']:.4g}, {report['steps']} steps, {report['accountant']} accountant; "
        f"score `{report['score']}`.", "",
        "| estimate | ε | confidence |", "|---|---|---|",
        f"| accountant | {_fmt(report['accountant_epsilon'])} | – |",
        f"| **one-run lower bound** ({one['analysis']} analysis) | **{_fmt(one['epsilon_lower'])}** | "
        f"{report['confidence']:.0%} |",
        f"| Gaussian-DP reading (μ ≥ {_fmt(g['mu_lower'])}) | {_fmt(g['epsilon_lower'])} | "
        f"{report['confidence']:.0%} |", "",
        f"Best guess count: {one['correct']} of the top {one['k']}.", "", report["message"], ""]))
    return paths
