"""Likelihood-ratio attack (LiRA, Carlini et al. 2022) from shadow-model confidences.

Pure functions: training the shadow models (each on a random half of the candidate records) is the
caller's job. The inputs are, for ``n`` candidate records,

* ``target``: the target model's confidence on each record, shape ``[n]``;
* ``shadow``: each shadow model's confidence on each record, shape ``[n_shadows, n]``;
* ``shadow_in``: whether shadow ``s`` trained on record ``i``, boolean ``[n_shadows, n]``.

A confidence is the log-probability of the correct label (classifiers) or ``-loss`` (language
models: the log of the geometric-mean token probability). LiRA works on the logit
``phi(p) = log(p / (1 - p))``, which makes the per-record shadow distributions close to Gaussian;
pass ``input_scale="logit"`` if the values are already ``phi``.

Example:
    >>> import numpy as np
    >>> logit_confidence(np.log(np.array([0.5, 0.9]))).round(4).tolist()
    [0.0, 2.1972]
"""

from __future__ import annotations

import numpy as np
from scipy.special import logsumexp

_MIN_STD = 1e-6  # a record every shadow fits identically would otherwise give sigma = 0


def logit_confidence(logp) -> np.ndarray:
    """``phi = log(p / (1 - p))`` from ``log p``, stable for p near 0 and near 1.

    ``log(1 - p) = log(-expm1(log p))`` keeps full precision when ``p`` is close to 1, where
    ``1 - exp(logp)`` would round to 0. ``log p = 0`` (p = 1) is clipped to a tiny negative value.
    """
    logp = np.minimum(np.asarray(logp, dtype=np.float64), -1e-12)
    return logp - np.log(-np.expm1(logp))


def logit_confidence_from_logits(logits, labels) -> np.ndarray:
    """``phi`` of a classifier's correct-class probability: ``z_y - logsumexp(z_others)``.

    Args:
        logits: ``[n, n_classes]`` raw outputs.
        labels: ``[n]`` integer labels.
    """
    logits = np.asarray(logits, dtype=np.float64)
    labels = np.asarray(labels, dtype=int)
    rows = np.arange(logits.shape[0])
    correct = logits[rows, labels]
    others = logits.copy()
    others[rows, labels] = -np.inf
    return correct - logsumexp(others, axis=1)


def _prepare(target, shadow, shadow_in, input_scale: str):
    target = np.asarray(target, dtype=np.float64).ravel()
    shadow = np.atleast_2d(np.asarray(shadow, dtype=np.float64))
    shadow_in = np.atleast_2d(np.asarray(shadow_in, dtype=bool))
    if shadow.shape != shadow_in.shape or shadow.shape[1] != target.size:
        raise ValueError(f"shapes disagree: target {target.shape}, shadow {shadow.shape}, "
                         f"shadow_in {shadow_in.shape}; expected [n], [n_shadows, n], [n_shadows, n]")
    if input_scale == "logprob":
        return logit_confidence(target), logit_confidence(shadow), shadow_in
    if input_scale == "logit":
        return target, shadow, shadow_in
    raise ValueError(f"input_scale={input_scale!r}; use 'logprob' or 'logit'")


def _gaussian_fit(phi: np.ndarray, mask: np.ndarray, global_variance: bool, which: str):
    """Per-record mean and std of ``phi`` over the shadows selected by ``mask``."""
    count = mask.sum(axis=0)
    need = 1 if global_variance else 2
    if (count < need).any():
        bad = int(np.flatnonzero(count < need)[0])
        raise ValueError(
            f"record {bad} has {int(count[bad])} {which} shadow model(s), needs >= {need}; train "
            f"more shadows (each on a random half of the records)"
            + ("" if global_variance else " or pass global_variance=True"))
    mean = np.where(mask, phi, 0.0).sum(axis=0) / count
    dev2 = np.where(mask, (phi - mean) ** 2, 0.0)
    if global_variance:
        # One variance pooled over all records: much more stable with few shadows per record.
        dof = int(mask.sum() - mask.shape[1])
        if dof <= 0:
            raise ValueError(f"a pooled {which} variance needs some record with >= 2 {which} "
                             f"shadows; train more shadow models")
        std = np.full(mean.shape, np.sqrt(dev2.sum() / dof))
    else:
        std = np.sqrt(dev2.sum(axis=0) / (count - 1))
    return mean, np.maximum(std, _MIN_STD)


def lira_offline(target, shadow, shadow_in, *, global_variance: bool = False,
                 input_scale: str = "logprob") -> np.ndarray:
    """Offline LiRA: a one-sided test against the OUT-shadow Gaussian of each record.

    Only shadows that did NOT train on a record are used, so the shadows can be trained before the
    target records are known.

    Args:
        target: Target confidences ``[n]``.
        shadow: Shadow confidences ``[n_shadows, n]``.
        shadow_in: Inclusion mask ``[n_shadows, n]``.
        global_variance: Use one pooled variance instead of one per record (few shadows).
        input_scale: ``"logprob"`` (converted with :func:`logit_confidence`) or ``"logit"``.

    Returns:
        ``z = (phi_target - mu_out) / sigma_out`` per record (higher = more likely member). The
        one-sided p-value of "record is OUT" is ``scipy.stats.norm.sf(z)``; ranking by ``z`` is
        ranking by that p-value, without the saturation of ``norm.cdf`` at large ``z``.

    Raises:
        ValueError: On shape mismatch or a record with too few OUT shadows.
    """
    phi_t, phi_s, is_in = _prepare(target, shadow, shadow_in, input_scale)
    mu_out, sd_out = _gaussian_fit(phi_s, ~is_in, global_variance, "OUT")
    return (phi_t - mu_out) / sd_out


def lira_online(target, shadow, shadow_in, *, global_variance: bool = False,
                input_scale: str = "logprob") -> np.ndarray:
    """Online LiRA: log likelihood ratio of the IN and OUT Gaussians of each record.

    Args:
        target: Target confidences ``[n]``.
        shadow: Shadow confidences ``[n_shadows, n]``.
        shadow_in: Inclusion mask ``[n_shadows, n]``.
        global_variance: Pool the IN and the OUT variances over records (recommended below ~64
            shadows, as in the LiRA paper).
        input_scale: ``"logprob"`` or ``"logit"``.

    Returns:
        ``log N(phi; mu_in, sd_in^2) - log N(phi; mu_out, sd_out^2)`` per record.

    Raises:
        ValueError: On shape mismatch or a record with too few IN or OUT shadows.
    """
    phi_t, phi_s, is_in = _prepare(target, shadow, shadow_in, input_scale)
    mu_in, sd_in = _gaussian_fit(phi_s, is_in, global_variance, "IN")
    mu_out, sd_out = _gaussian_fit(phi_s, ~is_in, global_variance, "OUT")

    def log_normal(x, mu, sd):
        return -0.5 * ((x - mu) / sd) ** 2 - np.log(sd)  # the shared -log(sqrt(2 pi)) cancels

    return log_normal(phi_t, mu_in, sd_in) - log_normal(phi_t, mu_out, sd_out)
