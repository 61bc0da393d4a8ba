"""Shared plumbing of the MLP recipes (``recipes/mlp_*.py``): command line, statistics, tables, result files.

A study helper, not library code: the recipes import it as ``mlp_study`` (a script's own directory is on
``sys.path``; tests load recipes with ``tests.helpers.load_recipe``, which puts ``recipes/`` there too).

Example:
    >>> m, lo, hi = t_interval([0.90, 0.92, 0.94])
    >>> round(m, 2), round(hi - m, 3)
    (0.92, 0.05)
    >>> print(markdown_table(["a", "b"], [[1, "x"]]))
    | a | b |
    |---|---|
    | 1 | x |
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from dpllm.io import write_json_atomic, write_text_atomic


def recipe_parser(doc: str, *, default_output: str, dataset: str | None = "gaussian") -> argparse.ArgumentParser:
    """The options every MLP recipe has: ``--output_dir``, ``--quick`` and (optionally) ``--dataset``."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output_dir", default=default_output, help="where results.json, summary.md and PNGs go")
    ap.add_argument("--quick", action="store_true", help="reduced grid that runs in seconds (tests)")
    if dataset is not None:
        ap.add_argument("--dataset", default=dataset, choices=["gaussian", "digits"], help="data set")
    ap.add_argument("--no_progress", action="store_true", help="no tqdm progress bar")
    return ap


def command_line(script: str, argv: Sequence[str] | None) -> str:
    """The command that reproduces this run, for the top of ``summary.md``."""
    args = list(sys.argv[1:] if argv is None else argv)
    return shlex.join(["python", f"recipes/{Path(script).name}", *args])


def quiet_warnings() -> None:
    """Silence the two warnings Opacus prints on every wrap of a tiny model (they say nothing new here)."""
    import warnings

    warnings.filterwarnings("ignore", message="Secure RNG turned off")
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    warnings.filterwarnings("ignore", message="Optimal order is the")


def progress(total: int, desc: str, disable: bool = False):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=disable, dynamic_ncols=True, file=sys.stderr)


def t_interval(values: Iterable[float], level: float = 0.95) -> tuple[float, float, float]:
    """Mean and two-sided Student-t interval of the mean (``(mean, mean, mean)`` for a single value)."""
    from scipy import stats

    v = np.asarray(list(values), dtype=float)
    m = float(v.mean())
    if v.size < 2:
        return m, m, m
    half = float(stats.t.ppf(0.5 + level / 2, v.size - 1) * v.std(ddof=1) / np.sqrt(v.size))
    return m, m - half, m + half


def mean_std(values: Iterable[float]) -> tuple[float, float]:
    v = np.asarray(list(values), dtype=float)
    return float(v.mean()), float(v.std(ddof=1)) if v.size > 1 else 0.0


def fmt(x: Any, digits: int = 3) -> str:
    """Numbers for tables: ``None`` → ``—``, large values with thousands separators."""
    if x is None:
        return "—"
    if isinstance(x, str):
        return x
    x = float(x)
    if not np.isfinite(x):
        return "∞" if x > 0 else str(x)
    if 0 < abs(x) < 1e-6:
        return "≈0"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def environment() -> dict[str, str]:
    """Versions that matter for reproducing the numbers, read from package metadata (importing is slow)."""
    from importlib.metadata import version

    import torch

    out = {"python": platform.python_version()}
    out.update({name: version(name) for name in ("dpllm", "torch", "opacus", "numpy", "scipy", "scikit-learn")})
    out.update(torch_threads=str(torch.get_num_threads()), machine=platform.machine(), cpus=str(os.cpu_count()))
    return out


def write_outputs(out_dir: str | Path, results: dict, summary: str) -> Path:
    """Write ``results.json`` (data first) and ``summary.md`` (the human view) into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "results.json", results)
    write_text_atomic(out / "summary.md", summary)
    return out


def plots_line(plots: list[str]) -> list[str]:
    """The markdown line that shows every plot of a summary."""
    return ["", f"Plots: {', '.join(f'![{p}]({p})' for p in plots)}", ""]


def paper_findings(paper: str, dataset: str, findings: list[str], plots: list[str]) -> list[str]:
    """'Findings beside <paper>' section: our findings, flagged as context when the data set differs.

    Args:
        paper: how the summary names the reference study, e.g. ``"the privacy-cliff paper"``.
    """
    caveat = ([f"{paper[0].upper()}{paper[1:]} trained on Gaussian clusters; on `{dataset}` its numbers are "
               "context, not a reproduction target.", ""] if dataset != "gaussian" else [])
    return [f"## Findings beside {paper}", ""] + caveat + findings + plots_line(plots)


def finish(out_dir: str | Path, results: dict, *, plot, summary, timer, train_s: float, label: str) -> dict:
    """Plots, timing, ``results.json`` and ``summary.md`` of a finished study; prints where they are.

    Args:
        plot: ``plot(out_dir) -> [file names]``; summary: ``summary(results) -> markdown``.
        timer: started at the recipe's start (its ``seconds()`` is the wall time); label: the printed prefix.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results["plots"] = plot(out)
    results["timing"] = {"train_s": train_s, "wall_s": timer.seconds(), "cpu_s": timer.cpu_seconds()}
    write_outputs(out, results, summary(results))
    print(f"{label} in {results['timing']['wall_s']} s -> {out}/summary.md")
    return results


def save_figure(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path.name


class Timer:
    """Wall time (``time.perf_counter``) and this process's CPU time (``time.process_time``: what other jobs on a
    shared machine do not inflate) since construction."""

    def __init__(self) -> None:
        self.start, self.cpu_start = time.perf_counter(), time.process_time()

    def seconds(self) -> float:
        return round(time.perf_counter() - self.start, 1)

    def cpu_seconds(self) -> float:
        return round(time.process_time() - self.cpu_start, 1)
