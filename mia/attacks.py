"""Reference-free and reference-based membership scores computed from :class:`~mia.signals.Signals`.

Each attack is a pure function of the signals and returns one score per record, HIGHER = more
likely a member. Attacks live in a string-keyed registry so the CLI and the recipes pick them by
name (``--attacks loss,zlib,mink,minkpp,ref``).

Example:
    >>> import numpy as np
    >>> from mia.signals import Signals
    >>> sig = Signals(loss=np.array([1.0, 3.0]), num_tokens=np.array([4, 4]),
    ...               zlib_bytes=np.array([10, 10]), token_logprobs=[], token_mu=[], token_sigma=[])
    >>> score("loss", sig).tolist()
    [-1.0, -3.0]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

if TYPE_CHECKING:  # keeps `import mia.attacks` (and `--help`) free of torch
    from mia.signals import Signals


@dataclass(frozen=True)
class Attack:
    """A registered attack.

    Attributes:
        name: Registry key.
        fn: ``fn(signals, *, reference, **params) -> scores``.
        needs_reference: Whether it needs a reference model's signals on the same records.
        help: One line for ``--help`` and the reports.
    """

    name: str
    fn: Callable[..., np.ndarray]
    needs_reference: bool
    help: str


ATTACKS: dict[str, Attack] = {}


def register(name: str, *, needs_reference: bool = False, help: str = ""):
    """Decorator adding an attack function to :data:`ATTACKS` under ``name``."""
    def wrap(fn):
        ATTACKS[name] = Attack(name, fn, needs_reference, help)
        return fn
    return wrap


def _lowest_fraction_mean(values: np.ndarray, k: float) -> float:
    # At least one token, so short records still get a score.
    count = max(1, int(np.ceil(k * values.size)))
    return float(np.sort(values)[:count].mean())


def _check_k(k: float) -> None:
    if not 0.0 < k <= 1.0:
        raise ValueError(f"k={k} must be a fraction in (0, 1], e.g. 0.2 for the lowest 20% of tokens")


@register("loss", help="-(mean token NLL) (Yeom et al. 2018)")
def loss_attack(signals: Signals | np.ndarray, **_) -> np.ndarray:
    """Negative mean token NLL: members are fit better.

    Also accepts a plain array of per-example losses (classifiers, e.g. the MLP recipes):
    ``loss_attack(per_example_loss)``.
    """
    return -np.asarray(getattr(signals, "loss", signals), dtype=np.float64)


@register("zlib", help="-(total NLL) / zlib-compressed bytes (Carlini et al. 2021)")
def zlib_attack(signals: Signals, **_) -> np.ndarray:
    """Total NLL calibrated by the text's zlib entropy, so plain repetitive text is not flagged."""
    total_nll = np.asarray(signals.loss) * np.asarray(signals.num_tokens)
    return -total_nll / np.asarray(signals.zlib_bytes, dtype=np.float64)


@register("mink", help="mean of the lowest k% token log-probs (Min-K%, Shi et al. 2024)")
def mink_attack(signals: Signals, *, k: float = 0.2, **_) -> np.ndarray:
    """Mean log-prob of the ``k`` fraction least likely tokens; non-members have more outliers."""
    _check_k(k)
    return np.array([_lowest_fraction_mean(lp, k) for lp in signals.token_logprobs])


@register("minkpp", help="Min-K% of standardised log-probs (Min-K%++, Zhang et al. 2024)")
def minkpp_attack(signals: Signals, *, k: float = 0.2, **_) -> np.ndarray:
    """Min-K% on ``(log p(x_t) - mu_t) / sigma_t``: how far each token sits above the model's own
    expected log-prob at that position, so inherently hard positions are not held against a record.
    """
    _check_k(k)
    scores = []
    for lp, mu, sigma in zip(signals.token_logprobs, signals.token_mu, signals.token_sigma):
        # A near-deterministic position has sigma ~ 0; the floor keeps the ratio finite.
        z = (lp - mu) / np.maximum(sigma, 1e-6)
        scores.append(_lowest_fraction_mean(z, k))
    return np.array(scores)


@register("ref", needs_reference=True,
          help="-(target loss - reference loss) (reference-model calibration, Carlini et al. 2021)")
def ref_attack(signals: Signals, *, reference: Signals | None = None, **_) -> np.ndarray:
    """Target loss relative to a reference model that never saw the records (e.g. the base)."""
    if reference is None:
        raise ValueError("attack 'ref' needs reference-model signals; pass --reference PATH "
                         "(e.g. the pre-fine-tuning base model)")
    if len(reference) != len(signals):
        raise ValueError(f"reference signals cover {len(reference)} records, target {len(signals)}; "
                         f"score the same records with both models")
    return -(np.asarray(signals.loss) - np.asarray(reference.loss))


def parse_attacks(spec: str | list[str]) -> list[str]:
    """Split ``"loss,zlib"`` into names and check each is registered.

    Raises:
        ValueError: On an empty list or an unknown attack name.
    """
    names = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else list(spec)
    names = [s for s in names if s]
    if not names:
        raise ValueError(f"no attacks given; choose from {', '.join(ATTACKS)}")
    for name in names:
        if name not in ATTACKS:
            raise ValueError(f"unknown attack {name!r}; choose from {', '.join(ATTACKS)}")
    return names


def score(name: str, signals: Signals, *, reference: Signals | None = None, **params) -> np.ndarray:
    """Scores of attack ``name`` (higher = more likely member).

    Args:
        name: A key of :data:`ATTACKS`.
        signals: The target model's signals.
        reference: Reference-model signals on the same records (needed by ``ref``).
        **params: Attack parameters, e.g. ``k=0.1`` for ``mink``/``minkpp``.

    Raises:
        ValueError: For an unknown name or a missing reference.
    """
    parse_attacks([name])
    return np.asarray(ATTACKS[name].fn(signals, reference=reference, **params), dtype=np.float64)
