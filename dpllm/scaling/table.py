"""Read a table of runs (the sweep's runs.jsonl, or any CSV/TSV) into runs-table rows.

A runs table from the trainer is JSONL with the fields of :data:`dpllm.scaling.runs.RUN_FIELDS`. A table
from elsewhere (a paper's data, a spreadsheet) has its own column names: ``columns`` maps each field to
the column that holds it, so ``{"tokens_seen": "D", "final_eval_loss": "loss"}`` reads a CSV with columns
``N,D,loss``. Rows without a ``privacy_enabled`` field are private when they have a finite positive
``epsilon`` and non-private otherwise (a table of non-private runs needs no privacy columns at all).

Example:
    >>> import pathlib, tempfile
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "runs.csv"
    >>> _ = path.write_text("N,D,loss\\n1e6,1e8,3.2\\n")
    >>> rows = read_table(path, columns={"params_trainable": "N", "tokens_seen": "D", "final_eval_loss": "loss"})
    >>> rows[0]["params_trainable"], rows[0]["final_eval_loss"], rows[0]["privacy_enabled"]
    (1000000.0, 3.2, False)
"""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path
from typing import Any, Mapping

from dpllm.scaling.forms import ScalingError
from dpllm.scaling.runs import load_runs

FORMATS = ("auto", "jsonl", "csv", "tsv")
_TRUE, _FALSE = {"true", "yes", "1"}, {"false", "no", "0", ""}


def table_format(path: str | os.PathLike, fmt: str = "auto") -> str:
    """``jsonl``, ``csv`` or ``tsv``: ``fmt`` unless ``auto``, else from the suffix (.csv, .tsv; else jsonl)."""
    if fmt not in FORMATS:
        raise ScalingError(f"--format {fmt!r} is not known; choose one of {', '.join(FORMATS)}")
    if fmt != "auto":
        return fmt
    return {".csv": "csv", ".tsv": "tsv"}.get(Path(path).suffix.lower(), "jsonl")


def _value(text: str) -> Any:
    """A CSV cell as a number where it is one, a bool for true/false, None when empty, else the text."""
    t = text.strip()
    if t == "":
        return None
    try:
        return float(t)
    except ValueError:
        low = t.lower()
        return True if low in ("true", "yes") else False if low in ("false", "no") else t


def _private(row: Mapping[str, Any]) -> bool:
    v = row.get("privacy_enabled")
    if isinstance(v, str):
        return v.strip().lower() in _TRUE
    if v is not None:
        return bool(v)
    try:
        eps = float(row.get("epsilon"))
    except (TypeError, ValueError):
        return False
    return math.isfinite(eps) and eps > 0


def _looks_like_csv(path: Path) -> str | None:
    """The first non-blank line when it is not a JSON object but has commas or tabs (a header), else None."""
    with open(path, "rb") as fh:
        for raw in fh:
            line = raw.decode("utf-8", errors="replace").strip()
            if line:
                return line if not line.startswith("{") and ("," in line or "\t" in line) else None
    return None


def read_table(path: str | os.PathLike, *, fmt: str = "auto", columns: Mapping[str, str] | None = None) -> list[dict]:
    """Rows of a JSONL, CSV or TSV table, with ``columns`` renamed to runs-table fields.

    Args:
        path: the table.
        fmt: ``auto`` (by suffix), ``jsonl``, ``csv`` or ``tsv``.
        columns: ``{field: column}``, e.g. ``{"tokens_seen": "D"}``; a column not in the table is an error.

    Returns:
        One dict per run, with every original column plus the mapped fields and ``privacy_enabled``.

    Raises:
        ScalingError: a missing or empty file, a CSV read as JSONL (the message says so), a bad JSON line,
            or a mapped column the table does not have (the message lists the columns it has).
    """
    path = Path(path)
    kind = table_format(path, fmt)
    if not path.is_file():
        raise ScalingError(f"runs file {path} does not exist; point --runs at the sweep's runs.jsonl or a CSV")
    if kind == "jsonl":
        header = _looks_like_csv(path)
        if header is not None:
            raise ScalingError(f"{path} looks like CSV, not JSONL (first line {header[:60]!r}); name it .csv or "
                               f"pass --format csv, and name its columns with --params-col, --tokens-col, --loss-col")
        rows = load_runs(path)
    else:
        with open(path, newline="", encoding="utf-8") as fh:
            reader = csv.DictReader(fh, delimiter="," if kind == "csv" else "\t")
            rows = [{k.strip(): _value(v or "") for k, v in r.items() if k is not None} for r in reader]
        if not rows:
            raise ScalingError(f"runs file {path} has no rows under its header; add runs")
    have = sorted({k for r in rows for k in r})
    out = []
    for row in rows:
        row = dict(row)
        for field, col in (columns or {}).items():
            if col not in row:
                raise ScalingError(f"column {col!r} (for {field}) is not in {path}; its columns are "
                                   f"{', '.join(have)}")
            row[field] = row[col]
        row["privacy_enabled"] = _private(row)
        out.append(row)
    return out


__all__ = ["FORMATS", "read_table", "table_format"]
