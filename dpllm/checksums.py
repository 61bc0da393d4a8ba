"""Checksums of a resumable checkpoint's files: written with the checkpoint, checked before it is read.

A checkpoint whose bytes changed after it was written (a failing disk, a copy cut short, a file edited) must
not be loaded: a damaged safetensors header fails deep inside the loader with a traceback on every process,
and damaged tensor bytes load silently and show up steps later as a NaN loss. So every resumable checkpoint
holds ``sha256sums.json``, each of its files' size and sha256, written into the checkpoint's temporary
directory last (it appears with the checkpoint, in the same rename), and :func:`damage` compares the files on
disk with it before anything else of the checkpoint is read.

>>> import tempfile
>>> d = Path(tempfile.mkdtemp())
>>> _ = (d / "optimizer.pt").write_bytes(b"state")
>>> write(d)
>>> damage(d) is None
True
>>> _ = (d / "optimizer.pt").write_bytes(b"stale")
>>> damage(d)
'optimizer.pt does not match the sha256 recorded when the checkpoint was written'
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

from dpllm.io import write_json_atomic

SUMS = "sha256sums.json"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.relative_to(directory).as_posix() != SUMS)


def write(directory: str | Path) -> None:
    """Record the size and sha256 of every file under ``directory`` in its ``sha256sums.json``."""
    directory = Path(directory)
    files = {p.relative_to(directory).as_posix(): {"size": p.stat().st_size, "sha256": _sha256(p)}
             for p in _files(directory)}
    write_json_atomic(directory / SUMS, {"files": files})


def has_sums(directory: str | Path) -> bool:
    """Whether ``directory`` holds checksums (checkpoints written before dpllm of 2026-11-27 do not)."""
    return (Path(directory) / SUMS).is_file()


def damage(directory: str | Path) -> Optional[str]:
    """What differs between ``directory``'s files and its ``sha256sums.json``, in a few words; None if nothing.

    Files that are not listed are not read by a resume and are left alone; a listed file that is missing,
    of another size or with other bytes is damage, and so is a checksum file that cannot be read.
    """
    directory = Path(directory)
    try:
        listed = json.loads((directory / SUMS).read_text())["files"]
        items = [(name, int(entry["size"]), str(entry["sha256"])) for name, entry in listed.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        return f"its {SUMS} cannot be read ({type(err).__name__})"
    for name, size, digest in items:
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size or _sha256(path) != digest:
            return f"{name} does not match the sha256 recorded when the checkpoint was written"
    return None
