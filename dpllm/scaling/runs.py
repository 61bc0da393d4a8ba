"""The runs table: one JSON object per line, one line per training run.

Each row is the ``run_summary.json`` the trainer writes (see docs/run_directory.md)::

    {"run_dir", "model", "params_total", "params_trainable", "tokens_seen", "steps",
     "logical_batch_size", "epsilon", "delta", "noise_multiplier", "privacy_enabled",
     "final_eval_loss", "final_eval_ppl", "seed"}

:func:`append_run` and :func:`load_runs` handle the file; :func:`runs_to_points` turns rows into the
arrays the fitters read (``N``, ``D`` = tokens_seen, ``sigma_bar`` = noise_multiplier / logical batch,
``loss`` = final_eval_loss) and labels each row with its privacy group.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from dpllm.io import JsonlError, read_jsonl
from dpllm.scaling.forms import ScalingError

RUN_FIELDS = (
    "run_dir", "model", "params_total", "params_trainable", "tokens_seen", "steps", "logical_batch_size",
    "epsilon", "delta", "noise_multiplier", "privacy_enabled", "final_eval_loss", "final_eval_ppl", "seed",
)
PARAMS_FIELDS = {"trainable": "params_trainable", "total": "params_total"}
NON_PRIVATE = "non-private"


def append_run(path: str | os.PathLike, row: Mapping[str, Any]) -> None:
    """Append one run as one JSON line, flushed and fsynced.

    The line is written with a single ``write`` on an ``O_APPEND`` descriptor, so concurrent writers
    (several sweep workers) do not interleave partial lines on local file systems.

    Raises:
        ScalingError: if ``row`` lacks one of :data:`RUN_FIELDS`.
    """
    missing = [k for k in RUN_FIELDS if k not in row]
    if missing:
        raise ScalingError(f"run row is missing {', '.join(missing)}; write the trainer's run_summary.json")
    line = (json.dumps(dict(row), sort_keys=True) + "\n").encode()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


def load_runs(path: str | os.PathLike) -> list[dict]:
    """Read every row of a runs JSONL file (blank lines are skipped).

    Raises:
        ScalingError: if the file is missing or has no rows, or a line is not UTF-8 JSON or not an object
            (the message names the line number).
    """
    path = Path(path)
    if not path.is_file():
        raise ScalingError(f"runs file {path} does not exist; point --runs at the sweep's runs.jsonl")
    try:
        rows = read_jsonl(path)
    except JsonlError as err:  # names the file and line
        raise ScalingError(f"{err}; fix or delete that line") from err
    if not rows:
        raise ScalingError(f"runs file {path} is empty; run the sweep (or append_run) first")
    return rows


def epsilon_key(epsilon: float | None) -> float | None:
    """ε rounded to 2 significant figures, so 7.993 (calibrated just under 8) groups with 8.

    ``None``/``inf`` (no privacy) stays ``None``.
    """
    if epsilon is None or not math.isfinite(float(epsilon)):
        return None
    e = float(epsilon)
    if e <= 0:
        return e
    return float(f"{e:.2g}")


def group_label(row: Mapping[str, Any]) -> str:
    """``"non-private"`` or ``"eps=8"``: the privacy group a run belongs to."""
    if not row.get("privacy_enabled", False):
        return NON_PRIVATE
    key = epsilon_key(row.get("epsilon"))
    return NON_PRIVATE if key is None else f"eps={key:g}"


def parse_epsilon(value: str | float | None) -> str | None:
    """Turn a user ``--epsilon`` value (``8``, ``7.99``, ``inf``, ``none``) into a group label."""
    if value is None:
        return None
    text = str(value).strip().lower()
    if text in ("inf", "none", "non-private", "nonprivate", "off"):
        return NON_PRIVATE
    try:
        eps = float(text)
    except ValueError as err:
        raise ScalingError(f"--epsilon {value!r} is not a number; give e.g. 8 or 'inf' (non-private)") from err
    return NON_PRIVATE if not math.isfinite(eps) else f"eps={epsilon_key(eps):g}"


# The option of `dpllm scaling fit` that names the column holding each field (for a table's own names).
COLUMN_OPTION = {"params_trainable": "--params-col", "params_total": "--params-col", "tokens_seen": "--tokens-col",
                 "steps": "--steps-col", "logical_batch_size": "--batch-col", "final_eval_loss": "--loss-col",
                 "noise_multiplier": "--noise-col", "epsilon": "--epsilon-col"}


def _number(row: Mapping[str, Any], field: str, lineno: int, *, allow_zero: bool = False) -> float:
    value = row.get(field)
    if field not in row:
        where = row.get("run_dir", f"row {lineno}")
        raise ScalingError(f"run {where} has no {field!r}; name the column that holds it with "
                           f"{COLUMN_OPTION.get(field, 'the matching --*-col option')} NAME")
    try:
        v = float(value)
    except (TypeError, ValueError):
        v = math.nan
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        where = row.get("run_dir", f"row {lineno}")
        need = "non-negative" if allow_zero else "positive"
        raise ScalingError(f"run {where}: {field}={value!r} must be a finite {need} number; "
                           f"fix the run or filter it out of the runs file")
    return v


def _optional(row: Mapping[str, Any], field: str, *, allow_zero: bool = False) -> float:
    """The field as a number, or nan when it is absent or not a valid one (a form that needs it asks again)."""
    try:
        v = float(row.get(field))
    except (TypeError, ValueError):
        return math.nan
    return v if math.isfinite(v) and (v > 0 or (allow_zero and v == 0)) else math.nan


def runs_to_points(rows: Iterable[Mapping[str, Any]], *, params: str = "trainable",
                   group: str | None = None, inputs: Iterable[str] | None = None) -> dict[str, np.ndarray]:
    """Arrays for fitting, one entry per run.

    Args:
        rows: runs-table rows.
        params: which parameter count is ``N``: ``"trainable"`` (default; what DP noise acts on) or
            ``"total"``.
        group: keep only this privacy group (a :func:`group_label` value), e.g. ``"eps=8"``.
        inputs: the inputs a form reads (``Form.inputs``): only their fields must be valid (a chinchilla fit
            needs no steps or batch size); the others are nan where missing. ``None`` requires them all.

    Returns:
        ``{"N", "D", "S", "B", "sigma_bar", "loss", "seed", "group", "run_dir"}`` as numpy arrays
        (S = optimizer steps, B = logical batch size).

    Raises:
        ScalingError: unknown ``params``, no rows left after filtering, or a missing/non-positive/NaN value
            of a needed field.
    """
    need = set(inputs) if inputs is not None else {"N", "D", "S", "sigma_bar"}
    if params not in PARAMS_FIELDS:
        raise ScalingError(f"params={params!r} is not known; choose trainable or total")
    rows = list(rows)
    labels = [group_label(r) for r in rows]
    if group is not None:
        kept = [(r, g) for r, g in zip(rows, labels) if g == group]
        if not kept:
            raise ScalingError(f"no runs in group {group}; groups present: {', '.join(sorted(set(labels)))}")
        rows, labels = [r for r, _ in kept], [g for _, g in kept]
    out: dict[str, list] = {k: [] for k in ("N", "D", "S", "B", "sigma_bar", "loss", "seed", "group", "run_dir")}
    for i, (row, label) in enumerate(zip(rows, labels), start=1):
        out["N"].append(_number(row, PARAMS_FIELDS[params], i))
        out["D"].append(_number(row, "tokens_seen", i) if "D" in need else _optional(row, "tokens_seen"))
        out["S"].append(_number(row, "steps", i) if "S" in need else _optional(row, "steps"))
        private = label != NON_PRIVATE
        need_batch = "sigma_bar" in need and private
        out["B"].append(_number(row, "logical_batch_size", i) if need_batch else _optional(row, "logical_batch_size"))
        out["loss"].append(_number(row, "final_eval_loss", i))
        # Non-private runs have no noise: σ̄ = 0, whatever the row's noise_multiplier field says.
        if not private:
            sigma_bar = 0.0
        elif "sigma_bar" in need:
            sigma_bar = _number(row, "noise_multiplier", i) / _number(row, "logical_batch_size", i)
        else:
            sigma_bar = _optional(row, "noise_multiplier", allow_zero=True) / _optional(row, "logical_batch_size")
        out["sigma_bar"].append(sigma_bar)
        out["seed"].append(row.get("seed"))
        out["group"].append(label)
        out["run_dir"].append(str(row.get("run_dir", f"row {i}")))
    return {k: np.asarray(v, dtype=float if k in ("N", "D", "S", "B", "sigma_bar", "loss") else object)
            for k, v in out.items()}
