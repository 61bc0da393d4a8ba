"""Two disjoint, offline, public corpora from CPython's own standard library, for the two-stage sweep.

- ``public`` (pretraining, no privacy): the test suite, every ``.py`` file under a ``test``/``tests``/
  ``idle_test`` directory of the stdlib.
- ``private`` (the private *role*, DP fine-tuning): every other stdlib ``.py`` file, except
  ``pydoc_data`` (documentation text, not code) and ``site-packages``.

Disjoint by construction (no file is in both) and by content: a private record whose text also occurs as
a public record (licence headers, shared boilerplate) is dropped, and the count is written to the manifest.
Records are runs of whole lines of at most ``max_chars`` characters (a byte-level tokenizer makes that
≤ max_chars + 1 tokens, so nothing is truncated at ``max_length = max_chars + 16``).

Example:
    >>> recs = list(chunk_lines("a = 1\\n\\nb = 2\\n", max_chars=8))
    >>> recs
    ['a = 1', 'b = 2']
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from pathlib import Path
from typing import Iterator

TEST_DIRS = {"test", "tests", "idle_test"}
SKIP_DIRS = {"site-packages", "pydoc_data", "__pycache__"}


def stdlib_files(root: str | None = None) -> dict[str, list[Path]]:
    """``{"public": [...], "private": [...]}``: the stdlib's ``.py`` files, sorted, split by role."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    out: dict[str, list[Path]] = {"public": [], "private": []}
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        parts = set(Path(dirpath).relative_to(root).parts)
        role = "public" if parts & TEST_DIRS else "private"
        out[role] += [Path(dirpath) / f for f in sorted(files) if f.endswith(".py")]
    return out


def chunk_lines(text: str, *, max_chars: int) -> Iterator[str]:
    """Blank-line separated blocks, packed into records of ≤ ``max_chars`` characters (longer lines cut)."""
    buf = ""
    for block in text.split("\n\n"):
        for line in block.split("\n"):
            while len(line) > max_chars:
                if buf.strip():
                    yield buf.strip("\n")
                buf = ""
                yield line[:max_chars]
                line = line[max_chars:]
            if len(buf) + len(line) + 1 > max_chars:
                if buf.strip():
                    yield buf.strip("\n")
                buf = ""
            buf += line + "\n"
        if buf.strip() and len(buf) > max_chars // 2:
            yield buf.strip("\n")
            buf = ""
        elif buf.strip():
            buf += "\n"
    if buf.strip():
        yield buf.strip("\n")


def build_corpora(out_dir: str | os.PathLike, *, max_chars: int = 240, min_chars: int = 32,
                  max_records: int | None = None) -> dict:
    """Write ``public.jsonl``, ``private.jsonl`` (one ``{"text": ...}`` per line) and ``manifest.json``.

    Rebuilt only when the manifest's Python version or settings differ, so a resumed sweep keeps its data.

    Returns:
        The manifest: Python version, stdlib path, settings, and per corpus files / records / characters /
        UTF-8 bytes (= byte-tokenizer tokens less one EOS per record) / sha256 of the JSONL file, plus the
        number of private records dropped because they also occur in the public corpus.
    """
    out = Path(out_dir)
    settings = {"max_chars": max_chars, "min_chars": min_chars, "max_records": max_records,
                "python": sys.version.split()[0]}
    manifest_path = out / "manifest.json"
    if manifest_path.is_file():
        old = json.loads(manifest_path.read_text())
        if old.get("settings") == settings and all((out / f"{k}.jsonl").is_file() for k in ("public", "private")):
            return old
    out.mkdir(parents=True, exist_ok=True)
    files = stdlib_files()
    records: dict[str, list[str]] = {}
    for role in ("public", "private"):
        seen, recs = set(), []
        for path in files[role]:
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            for r in chunk_lines(text, max_chars=max_chars):
                if len(r.strip()) >= min_chars and r not in seen:
                    seen.add(r)
                    recs.append(r)
        records[role] = recs
    public_set = set(records["public"])
    before = len(records["private"])
    records["private"] = [r for r in records["private"] if r not in public_set]
    dropped = before - len(records["private"])
    manifest = {"settings": settings, "stdlib": sysconfig.get_paths()["stdlib"],
                "private_dropped_as_in_public": dropped, "corpora": {}}
    for role, recs in records.items():
        if max_records is not None:
            recs = recs[:max_records]
        path = out / f"{role}.jsonl"
        tmp = path.with_suffix(".tmp")
        with tmp.open("w") as fh:
            for r in recs:
                fh.write(json.dumps({"text": r}) + "\n")
        os.replace(tmp, path)
        manifest["corpora"][role] = {
            "files": len(files[role]), "records": len(recs), "chars": sum(len(r) for r in recs),
            "utf8_bytes": sum(len(r.encode()) for r in recs),
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
