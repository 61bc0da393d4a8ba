"""Errors shared by modules in different layers (docs/architecture.md), kept below all of them."""

from __future__ import annotations


class DataError(ValueError):
    """Unusable data: missing file, missing column, empty after filtering..."""


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. a NaN loss); nothing half-written is left behind."""
