"""Atomic file and directory writes: a crash never leaves a half-written file behind."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temp file in the same directory and ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; the result should read like any written file
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: str | Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


def append_jsonl(path: str | Path, row: dict) -> None:
    """Append one JSON line and fsync, so a crash loses at most the line being written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fh.write(json.dumps(row, default=str) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


@contextmanager
def atomic_directory(path: str | Path, *, private: bool = False) -> Iterator[Path]:
    """Yield a temp directory beside ``path``; on success it replaces ``path`` in one rename.

    On error the temp directory is removed and ``path`` (if any) is left untouched.

    Args:
        private: keep the directory owner-only (0700), e.g. for secret random-generator states.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    if not private:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if path.exists():
        old = path.parent / f".{path.name}.old.{os.getpid()}"
        os.replace(path, old)
    os.replace(tmp, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def looks_local(name: str) -> bool:
    """A name meant as a local path: ./x, /x, ~/x, a/b/c (Hub ids have one slash), or one under an existing dir."""
    p = Path(name).expanduser()
    return (name.startswith((".", "/", "~")) or name.count("/") >= 2 or p.exists()
            or (len(p.parts) > 1 and Path(p.parts[0]).is_dir()))


class JsonlError(ValueError):
    """A JSONL file that cannot be read; the message names the file and the line."""


def read_jsonl(path: str | Path, *, skip_blank: bool = True) -> list[dict]:
    """Every line of a JSONL file as a dict.

    Raises:
        JsonlError: a line that is not UTF-8, not JSON or not an object (``file:line: reason``).
        FileNotFoundError: no such file.
    """
    path = Path(path)
    rows: list[dict] = []
    with open(path, "rb") as fh:
        for i, raw in enumerate(fh, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise JsonlError(f"{path}:{i}: not UTF-8 text (byte {err.start} of the line)") from None
            if skip_blank and not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as err:
                raise JsonlError(f"{path}:{i}: not valid JSON ({err.msg} at column {err.colno})") from None
            if not isinstance(row, dict):
                raise JsonlError(f"{path}:{i}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
    return rows
