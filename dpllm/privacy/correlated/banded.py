"""Banded matrix factorization (BandMF): correlated noise whose earlier draws partly cancel in the model.

The strategy C is lower-triangular, banded and Toeplitz: ``C[t, t−j] = c_j`` for ``0 ≤ j < b``, zero
elsewhere. The noise added at step t is ``x_t = (z_t − Σ_{j=1}^{b−1} c_j·x_{t−j}) / c₀`` with
``z_t ~ N(0, σ²C²)`` (C here the clipping norm), i.e. ``x = C⁻¹z``: :class:`BandedRecurrence` keeps the
b−1 latest ``x`` of every parameter. b = 1 is DP-SGD exactly (c₀ = 1, nothing kept).

Sensitivity. Column t of C holds ``c₀ … c_{b−1}`` in rows t … t+b−1, so every column norm is at most
``‖c‖₂``, which is normalised to 1. A record that joins steps at least b apart (cyclic Poisson sampling
over b groups, :mod:`dpllm.privacy.correlated`) touches columns whose supports are disjoint; that is the
setting in which b-banded MF has the privacy of DP-SGD with the same σ, the group's sampling rate and
⌈T/b⌉ steps (Choquette-Choo et al. 2023, arXiv 2306.08153, Thm 1).

Error. For the prefix-sum workload A (lower-triangular ones: SGD's parameter trajectory), the noise in
the T released prefix sums is ``A C⁻¹ z``; its root-mean-square per step at unit noise is
``sqrt(‖A C⁻¹‖²_F / T)``. ``C⁻¹`` is Toeplitz with the coefficients of the power series ``1/c(x)``, and
``A C⁻¹`` with those of ``1/((1−x)·c(x))``: ``β_k``, the cumulative sums. A Toeplitz lower-triangular T×T
matrix holds its k-th coefficient on T−k entries, so ``‖A C⁻¹‖²_F = Σ_k (T−k)·β_k²``: one linear filter
of length T (O(T·b)). :func:`optimize` minimises it over c on the unit sphere with L-BFGS, starting from
the truncated square-root factorization (``c(x) = (1−x)^(−1/2)``, the known near-optimum for b = T).

Example:
    >>> s = BandMF.optimized(bands=1, steps=8)
    >>> s.coefficients, round(s.prefix_sum_rmse(8), 6)  # DP-SGD: sqrt((T+1)/2)
    ((1.0,), 2.12132)
    >>> BandMF.optimized(bands=4, steps=8).prefix_sum_rmse(8) < s.prefix_sum_rmse(8)
    True
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from scipy.optimize import minimize

if TYPE_CHECKING:  # torch is imported where noise is drawn, never by dpllm plan
    import torch


def sqrt_coefficients(n: int) -> np.ndarray:
    """The first ``n`` coefficients of ``(1−x)^(−1/2)``: 1, 1/2, 3/8, 5/16, ...

    Example:
        >>> sqrt_coefficients(4).tolist()
        [1.0, 0.5, 0.375, 0.3125]
    """
    k = np.arange(1, n)
    return np.concatenate([[1.0], np.cumprod((2 * k - 1) / (2 * k))])


def _impulse(n: int) -> np.ndarray:
    e = np.zeros(n)
    e[0] = 1.0
    return e


def prefix_coefficients(c: np.ndarray, steps: int) -> np.ndarray:
    """``β``: the Toeplitz coefficients of ``A C⁻¹`` (series of ``1/((1−x)·c(x))``), length ``steps``."""
    from scipy.signal import lfilter  # here, not at import: scipy.signal takes ~1 s to import, dpllm plan none

    return lfilter([1.0], np.convolve(c, [1.0, -1.0]), _impulse(steps))


def workload_error(c: np.ndarray, steps: int) -> float:
    """``‖A C⁻¹‖²_F = Σ_k (T−k)·β_k²`` for the T×T prefix-sum workload (not normalised)."""
    beta = prefix_coefficients(np.asarray(c, dtype=np.float64), steps)
    return float(np.sum((steps - np.arange(steps)) * beta ** 2))


def _loss_and_grad(v: np.ndarray, steps: int) -> tuple[float, np.ndarray]:
    """log ‖A C⁻¹‖²_F at c = v/‖v‖ and its gradient in v.

    ∂β/∂c_j is the series of ``−x^j / ((1−x)·c(x)²)`` = ``−x^j·β(x)/c(x)``, so with ``e = β/c`` (one more
    filter) ``∂L/∂c_j = −2 Σ_k w_k β_k e_{k−j}``, ``w_k = T−k``. The log keeps L-BFGS's scale independent of T.
    """
    from scipy.signal import lfilter

    norm = float(np.linalg.norm(v))
    c = v / norm
    with np.errstate(over="ignore", invalid="ignore"):  # an unstable c (a root of c(x) inside the unit disk)
        beta = prefix_coefficients(c, steps)
        w = steps - np.arange(steps)
        loss = float(np.sum(w * beta ** 2))
        e = lfilter([1.0], c, beta)
        wb = w * beta
        grad_c = np.array([-2.0 * np.dot(wb[j:], e[: steps - j]) for j in range(len(c))])
        grad_v = (grad_c - c * np.dot(c, grad_c)) / norm  # through the normalisation c = v/‖v‖
    if not (math.isfinite(loss) and np.all(np.isfinite(grad_v))):
        return 1e300, np.zeros_like(v)
    return math.log(loss), grad_v / loss


@functools.lru_cache(maxsize=64)
def optimize(bands: int, steps: int) -> tuple[float, ...]:
    """The b coefficients (unit norm, c₀ > 0) minimising the prefix-sum error over ``steps`` steps.

    Deterministic for given (bands, steps): a resumed run recomputes exactly the same strategy (and the
    plan's check refuses a resume whose coefficients differ).

    Raises:
        ValueError: ``bands`` not in 1 … ``steps``.
    """
    if not 1 <= bands <= steps:
        raise ValueError(f"bands={bands} must be between 1 and the number of steps ({steps})")
    x0 = sqrt_coefficients(bands)
    x0 /= np.linalg.norm(x0)
    if bands == 1:
        return (1.0,)
    res = minimize(_loss_and_grad, x0, args=(steps,), jac=True, method="L-BFGS-B",
                   options={"maxiter": 1000, "ftol": 1e-14, "gtol": 1e-10})
    c = res.x / np.linalg.norm(res.x)
    if workload_error(c, steps) > workload_error(x0, steps):  # never worse than the start
        c = x0
    c = c * np.sign(c[0])
    return tuple(float(v) for v in c)


def materialize(coefficients, steps: int) -> np.ndarray:
    """The T×T banded Toeplitz strategy matrix C (for tests and small T)."""
    c = np.asarray(coefficients, dtype=np.float64)
    out = np.zeros((steps, steps))
    for j, cj in enumerate(c[:steps]):
        out += cj * np.eye(steps, k=-j)
    return out


def column_norms(coefficients, steps: int) -> np.ndarray:
    """Norms of C's T columns: column t holds ``c₀ … c_{min(b, T−t)−1}``."""
    c2 = np.cumsum(np.asarray(coefficients, dtype=np.float64) ** 2)
    return np.sqrt(c2[np.minimum(len(c2), steps - np.arange(steps)) - 1])


class BandedRecurrence:
    """``x_t = (z_t − Σ_{j≥1} c_j x_{t−j}) / c₀`` per parameter, keeping each parameter's b−1 latest ``x``.

    The returned ``x_t`` lives in ``z``'s storage and is kept as history: the caller reads it (adds it to
    the gradient) and never writes into it.
    """

    def __init__(self, coefficients):
        self.coefficients = tuple(float(v) for v in coefficients)
        self.extra_tensors_per_parameter = len(self.coefficients) - 1
        self.history: dict[int, list[torch.Tensor]] = {}  # newest first, at most b−1
        self.step = 0
        self._applied: set[int] = set()

    def state_dtype(self, draw_dtype: torch.dtype) -> torch.dtype:
        """The past draws are kept as drawn: ``draw_dtype``."""
        return draw_dtype

    def apply(self, key: int, z: torch.Tensor) -> torch.Tensor:
        if key in self._applied:
            raise RuntimeError(f"noise recurrence: parameter {key} noised twice in step {self.step + 1}")
        self._applied.add(key)
        past = self.history.get(key, [])
        x = z
        if past and past[0].shape != z.shape:  # a state saved for other shards (another process count)
            raise RuntimeError(f"noise recurrence: parameter {key} has past noise of shape {tuple(past[0].shape)}, "
                               f"this step's draw {tuple(z.shape)}; resume on the process count the run used")
        for cj, prev in zip(self.coefficients[1:], past):
            x.sub_(prev, alpha=cj)
        c0 = self.coefficients[0]
        if c0 != 1.0:  # b = 1: the draw itself, bit for bit
            x.div_(c0)
        if self.extra_tensors_per_parameter:
            self.history[key] = ([x] + past)[: self.extra_tensors_per_parameter]
        return x

    def end_step(self) -> None:
        self.step += 1
        self._applied.clear()

    def state_dict(self) -> dict:
        return {"coefficients": list(self.coefficients), "step": self.step,
                "history": {int(k): list(v) for k, v in self.history.items()}}

    def load_state_dict(self, state: dict) -> None:
        if tuple(state["coefficients"]) != self.coefficients:
            raise ValueError("noise recurrence: the saved coefficients differ from this run's strategy; resume with "
                             "the configuration the run started with")
        self.step = int(state["step"])
        self.history = {int(k): list(v) for k, v in state["history"].items()}
        self._applied.clear()


@dataclass(frozen=True)
class BandMF:
    """A b-banded Toeplitz strategy with unit-norm coefficients (sensitivity 1 under b-separated participation)."""

    coefficients: tuple
    name: str = "banded"

    def __post_init__(self):
        c = np.asarray(self.coefficients, dtype=np.float64)
        if c.ndim != 1 or len(c) < 1 or not np.all(np.isfinite(c)) or c[0] <= 0:
            raise ValueError(f"banded coefficients {self.coefficients} must be finite with c₀ > 0")
        if abs(np.linalg.norm(c) - 1.0) > 1e-9:
            raise ValueError(f"banded coefficients must have unit norm (have {np.linalg.norm(c):.12g})")

    @classmethod
    def optimized(cls, *, bands: int, steps: int) -> "BandMF":
        """The strategy :func:`optimize` finds for ``bands`` bands over ``steps`` steps."""
        return cls(coefficients=optimize(int(bands), int(steps)))

    @property
    def min_separation(self) -> int:
        return len(self.coefficients)

    def recurrence(self) -> BandedRecurrence:
        return BandedRecurrence(self.coefficients)

    def prefix_sum_rmse(self, steps: int) -> float:
        return math.sqrt(workload_error(np.asarray(self.coefficients), steps) / steps)

    def sensitivity(self, steps: int) -> float:
        """The largest column norm of C over ``steps`` steps (1 when steps ≥ 1: c is normalised)."""
        return float(column_norms(self.coefficients, steps).max())

    def to_json(self) -> dict:
        return {"mechanism": self.name, "bands": self.min_separation, "coefficients": list(self.coefficients)}
