"""Atomic file and directory writes: a crash never leaves a half-written file behind."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional


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


def load_yaml(text: str) -> Any:
    """``yaml.safe_load(text)``, parsed by libyaml where PyYAML was built with it (~10x faster: every run, resume,
    export and report reads its config). The values are the same (the same safe constructor and resolver build
    them); a document libyaml refuses is parsed again by the pure-Python parser, whose error quotes the line and
    points at the column."""
    import yaml

    fast = getattr(yaml, "CSafeLoader", None)
    if fast is not None:
        try:
            return yaml.load(text, Loader=fast)  # noqa: S506 (a safe loader)
        except yaml.YAMLError:
            pass
    return yaml.safe_load(text)


def dump_yaml(data: Any) -> str:
    """``yaml.safe_dump(data, sort_keys=False)``, emitted by libyaml where PyYAML has it (the same text)."""
    import yaml

    return yaml.dump(data, Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper), sort_keys=False)


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


#: suffixes that make a name a file path, never a Hub id (datasets' loaders read these kinds)
FILE_SUFFIXES = (".jsonl", ".json", ".csv", ".txt", ".parquet", ".arrow", ".yaml", ".yml")


def path_like(name: str) -> bool:
    """A name that can only be a local path: :func:`looks_local`, or a file suffix (``data.jsonl``).

    >>> path_like("org/dataset"), path_like("records.jsonl"), path_like("./x")
    (False, True, True)
    """
    return looks_local(name) or Path(name).suffix.lower() in FILE_SUFFIXES


def suggest_path(name: str) -> Optional[str]:
    """The existing path closest to a mistyped ``name``, component by component (difflib), or None.

    >>> suggest_path("/usr/bni") in ("/usr/bin", None)
    True
    """
    import difflib

    p = Path(name).expanduser()
    for extra in FILE_SUFFIXES[:5]:  # a missing suffix: data → data.jsonl
        if Path(f"{p}{extra}").is_file():
            return f"{name}{extra}"
    parts = p.parts
    here = Path(parts[0]) if p.is_absolute() else Path(".")
    for part in parts[1:] if p.is_absolute() else parts:
        if (here / part).exists():
            here = here / part
            continue
        try:
            names = [c.name for c in here.iterdir()]
        except OSError:
            return None
        close = difflib.get_close_matches(part, names, n=1, cutoff=0.6)
        if not close:
            return None
        here = here / close[0]
    return str(here) if here.exists() and here != p else None


def missing_path_error(name: Optional[str], *, option: str, local: bool = False) -> Optional[str]:
    """The one-line error for a local path that does not exist, with "did you mean ...?"; None when ``name``
    exists, is empty, or is not meant as a path (a Hub id, a built-in name; ``local``: every name is a path)."""
    if not name or Path(name).expanduser().exists():
        return None
    near = suggest_path(name)
    if not local and not path_like(name) and not ("/" not in name and Path(name).suffix and near):
        return None  # a Hub id; only a file-like name (README.mdd) next to a close local match is taken as a typo
    hint = f"did you mean {near}?" if near else "check the path" + ("" if local else " (a Hub id looks like org/name)")
    return f"{option}={name}: no such file or directory; {hint}"


def output_dir_error(out: str | Path) -> Optional[str]:
    """Why ``out`` cannot be a run directory (a file in the way, a folder that refuses a new directory), or None.

    Tries what the run will do (make a directory) in the deepest existing folder, and removes it at once.
    """
    import tempfile

    p = Path(out).expanduser()
    if p.exists():
        return None if p.is_dir() else f"output_dir={out} is a file, not a directory; choose another output_dir"
    parent = p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return f"output_dir={out}: {parent} is a file, not a directory; choose another output_dir"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".dpllm-probe-", dir=parent))
    except OSError as err:
        return f"output_dir={out} cannot be created under {parent} ({err.strerror}); choose another output_dir"
    return None


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
                # json's "Unterminated string starting at" already ends with "at"
                where = "column" if err.msg.endswith(" at") else "at column"
                raise JsonlError(f"{path}:{i}: not valid JSON ({err.msg} {where} {err.colno})") from None
            if not isinstance(row, dict):
                raise JsonlError(f"{path}:{i}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
    return rows
