"""Logging set-up and the warnings every run would otherwise print, in one place."""

from __future__ import annotations

import logging
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


@contextmanager
def known_warnings_silenced() -> Iterator[None]:
    """Hide :data:`KNOWN_WARNINGS` inside the block; every other warning still shows."""
    with warnings.catch_warnings():
        for message in KNOWN_WARNINGS:
            warnings.filterwarnings("ignore", message=message)
        yield


def setup_logging(level: int = logging.INFO) -> None:
    """One format for recipes and commands: ``LEVEL name: message``."""
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
