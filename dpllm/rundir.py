"""The run directory: created only after every check, locked for the life of a run, never someone else's data.

- A directory is a *dpllm run directory* if it holds the ``.dpllm_run`` marker that every run writes first
  (or, for runs made before the marker existed, ``config.yaml`` and ``splits.json`` beside a ledger).
  ``--overwrite_output_dir true`` clears only such a directory, and never one that holds the dataset
  or the model being trained from; anything else is refused with the reason.
- :class:`RunLock` holds an exclusive ``flock`` on ``OUTPUT_DIR/.lock`` from the moment the directory is
  prepared until the run ends. A second run, an overwrite or a ``--resume_from latest`` on the same
  directory is refused while the first is alive. The kernel drops the lock when its process dies (even
  by SIGKILL), so a lock left by a dead run is never in the way.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path
from typing import Iterable, Optional

from dpllm.config import CLI_OPTIONS, ConfigError, OptionNames

MARKER = ".dpllm_run"
LOCK = ".lock"


def is_run_dir(path: str | Path) -> bool:
    path = Path(path)
    if (path / MARKER).is_file():
        return True
    legacy = (path / "config.yaml").is_file() and (path / "splits.json").is_file()
    return legacy and ((path / "privacy_ledger.jsonl").is_file() or (path / "metrics.jsonl").is_file())


def _inside(child: Path, parent: Path) -> bool:
    try:
        child.resolve().relative_to(parent.resolve())
        return True
    except ValueError:
        return False


def check_output_dir(out: str | Path, *, overwrite: bool, protected: Iterable[Optional[str]] = (),
                     names: OptionNames = CLI_OPTIONS) -> None:
    """Refuse to start a fresh run in ``out`` unless it is new, empty, or a dpllm run we may overwrite.

    Args:
        out: the output directory.
        overwrite: ``train.overwrite_output_dir``.
        protected: paths that must survive (the dataset file, the model directory); ignored if not local.
        names: how the reader sets the options the message suggests (flags, or DPTrainer's fields).

    Raises:
        ConfigError: ``out`` is not empty and may not (or cannot safely) be cleared.
    """
    from dpllm.io import output_dir_error

    problem = output_dir_error(out)  # a file in the way, a folder where no directory can be made
    if problem:
        raise ConfigError(problem)
    out = Path(out)
    entries = [p for p in out.iterdir() if p.name != LOCK] if out.is_dir() else []
    if not entries:
        return
    if not overwrite:
        raise ConfigError(f"output_dir={out} exists and is not empty; pass {names.overwrite}, "
                          f"{names.resume} to continue it, or pick another")
    if not is_run_dir(out):
        shown = ", ".join(sorted(p.name for p in entries)[:4]) + (", ..." if len(entries) > 4 else "")
        raise ConfigError(f"refusing to overwrite output_dir={out}: it is not a dpllm run directory (no {MARKER} "
                          f"marker) and holds {len(entries)} entries ({shown}); nothing was deleted. Pick a new "
                          "or empty output_dir")
    for p in protected:
        if p and Path(p).exists() and _inside(Path(p), out):
            raise ConfigError(f"refusing to overwrite output_dir={out}: it contains {p}, which this run reads; "
                              "nothing was deleted. Move the data or model out, or pick another output_dir")


def clear(out: Path) -> None:
    """Empty a run directory that :func:`check_output_dir` allowed; the lock file stays (we hold it)."""
    for p in out.iterdir():
        if p.name == LOCK:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def mark(out: Path) -> None:
    (out / MARKER).write_text("dpllm run directory; see docs/run_directory.md\n")


class RunLock:
    """An exclusive, non-blocking lock on ``OUTPUT_DIR/.lock`` for the life of a run (rank 0 only)."""

    def __init__(self, out: str | Path):
        self.path = Path(out) / LOCK
        self.fd: Optional[int] = None

    def acquire(self) -> "RunLock":
        """Take the lock (creating the directory if needed).

        Raises:
            ConfigError: another live process holds it; the message gives its pid.
        """
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as err:  # a file in the way, a read-only or virtual file system
            raise ConfigError(f"output_dir={self.path.parent} cannot be used ({err.strerror}: {err.filename}); "
                              "choose another output_dir") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ConfigError(f"output_dir={self.path.parent} is in use by another run (pid {holder}); wait for it "
                              "to finish or stop it, or pick another output_dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None
