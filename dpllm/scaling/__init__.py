"""Scaling laws for (private) fine-tuning: fit forms to a runs table, plan N, D and compute.

Pure functions live in :mod:`~dpllm.scaling.forms` (the registry), :mod:`~dpllm.scaling.fit` and
:mod:`~dpllm.scaling.plan`; :mod:`~dpllm.scaling.runs` reads/writes the runs table,
:mod:`~dpllm.scaling.table` reads any CSV/TSV/JSONL table of runs, :mod:`~dpllm.scaling.published` holds
published laws (priors from other data), and :mod:`~dpllm.scaling.plot` (matplotlib, imported lazily)
draws. ``dpllm scaling`` is :mod:`~dpllm.scaling.cli`. Predictions carry two intervals:
:meth:`FitResult.prediction_interval` (where a new run lands) and :meth:`FitResult.confidence_interval`
(where the law's mean lies).
"""

from dpllm.scaling.fit import FitResult, fit_form, fit_runs, load_fit, write_fit
from dpllm.scaling.forms import FORMS, Form, ScalingError, get_form, register_form
from dpllm.scaling.plan import (
    UnreachableTargetError,
    compute_for_target,
    compute_optimal,
    floor_loss,
    loss_from_ppl,
    params_for_target,
    select_fit,
    tokens_for_target,
)
from dpllm.scaling.runs import RUN_FIELDS, append_run, group_label, load_runs, runs_to_points

__all__ = [
    "FORMS", "FitResult", "Form", "RUN_FIELDS", "ScalingError", "UnreachableTargetError", "append_run",
    "compute_for_target", "compute_optimal", "fit_form", "fit_runs", "floor_loss", "get_form", "group_label",
    "load_fit", "load_runs", "loss_from_ppl", "params_for_target", "register_form", "runs_to_points",
    "select_fit", "tokens_for_target", "write_fit",
]
