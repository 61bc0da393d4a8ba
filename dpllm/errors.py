"""Errors shared by modules in different layers (docs/architecture.md), kept below all of them."""

from __future__ import annotations

QLORA_EXTRA = "pip install 'dpllm[qlora]'"  # what to run when bitsandbytes is missing


class DataError(ValueError):
    """Unusable data: missing file, missing column, empty after filtering..."""


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. a NaN loss); nothing half-written is left behind."""


class ModelError(ValueError):
    """A model that cannot be loaded or trained as configured."""
