"""Logging set-up and the warnings every run would otherwise print, in one place."""

from __future__ import annotations

import logging
import os
import warnings
from contextlib import contextmanager
from typing import Iterator

# Messages that every run prints and that say nothing about this run:
KNOWN_WARNINGS = (
    "Full backward hook is firing",  # Opacus ghost clipping on a model whose inputs need no grad (all LMs)
    ".*is_gradient_checkpointing.*",  # transformers 5 renamed a property that peft still reads
    "Secure RNG turned off",  # Opacus, when secure_mode is off: our noise is secretly seeded, see randomness.py
    ".*GDP accounting is experimental.*",  # Opacus; dpllm reports max(GDP, RDP), never GDP alone
    "Optimal order is the (largest|smallest) alpha",  # RDP screening bound used inside PRV reporting
    "PrivacyEngine detected new dataset object",  # one engine per stage; the dataset object is ours
)


# Deprecations inside third-party code that a user cannot act on (FutureWarning only, matched by message):
KNOWN_DEPRECATIONS = (
    ".*is_gradient_checkpointing.*is deprecated",  # transformers 5 renamed the property; peft reads the old name
)


def silence_known_deprecations() -> None:
    """Hide :data:`KNOWN_DEPRECATIONS` for the rest of the process: for a command's entry point (a process of its
    own), never a library call. Every other warning still shows."""
    for message in KNOWN_DEPRECATIONS:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)


@contextmanager
def known_warnings_silenced() -> Iterator[None]:
    """Hide :data:`KNOWN_WARNINGS` inside the block; every other warning still shows."""
    with warnings.catch_warnings():
        for message in KNOWN_WARNINGS:
            warnings.filterwarnings("ignore", message=message)
        yield


class _AboveTheBars(logging.StreamHandler):
    """Writes each record through ``tqdm.write``, which lifts a live progress bar out of the way and redraws it
    below, so a log line never runs into a bar (``... eps=8.00]09:15:49 INFO ...``)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=self.stream)
            self.flush()
        except Exception:  # logging's own contract: a handler never raises
            self.handleError(record)


def _no_shard_bar(factory, args, kwargs):
    """transformers' tqdm hook: no "Writing model shards" bar (one shard in a second, at every checkpoint, and its
    cursor-up escape lands in the log); every other bar (downloads, loading) as it was."""
    if kwargs.get("desc") == "Writing model shards":
        kwargs = {**kwargs, "disable": True}
    return factory(*args, **kwargs)


def main_process() -> bool:
    """Whether this is the first process of a launch (``RANK`` 0, or no launcher)."""
    return int(os.environ.get("RANK", "0") or 0) == 0


def setup_logging(level: int = logging.INFO) -> None:
    """One format for recipes and commands: ``TIME LEVEL name: message``, written above any progress bar.

    Under a launcher with several processes only the first logs below ERROR: the others would repeat each line
    (they run the same code on the same config); an error, which can be one process's own, is logged by every
    process, marked with its rank. Also turns off transformers' per-save "Writing model shards" bar.
    """
    fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    if not main_process():
        level = max(level, logging.ERROR)
        fmt = f"%(asctime)s %(levelname)s [rank {os.environ.get('RANK')}] %(name)s: %(message)s"
    logging.basicConfig(level=level, format=fmt, datefmt="%H:%M:%S", handlers=[_AboveTheBars()])
    try:
        from transformers.utils import logging as hf_logging

        if getattr(hf_logging, "set_tqdm_hook", None) is not None:  # transformers ≥ 5 (older: the bar stays)
            hf_logging.set_tqdm_hook(_no_shard_bar)
    except ImportError:
        pass
