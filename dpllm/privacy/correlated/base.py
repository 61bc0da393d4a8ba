"""What every noise mechanism provides: a strategy (pure math) and its noise recurrence (small, stateful).

A *strategy* is the lower-triangular matrix C of a matrix-factorization mechanism: the run releases
``A·(G + C⁻¹Z)`` where G are the clipped gradient sums, Z i.i.d. Gaussian of std σ·(clipping norm) and A
the optimizer's workload (prefix sums for SGD). So the noise added at step t is ``x_t = (C⁻¹ z)_t``.
C = I is DP-SGD. Each mechanism module defines its strategy type; :class:`Independent` is C = I.

A *noise recurrence* turns this step's fresh draw ``z_t`` for one parameter into ``x_t`` online, keeping
what it needs of earlier steps per parameter (b−1 tensors for b-banded C: :mod:`.banded`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:  # torch is imported where noise is drawn, never by dpllm plan
    import torch


@runtime_checkable
class NoiseRecurrence(Protocol):
    """``x_t = (C⁻¹ z)_t`` online, for one parameter at a time.

    ``apply(key, z)`` is called once per parameter per step, with ``z`` this step's fresh draw of
    N(0, σ²C²) for parameter ``key``; it returns ``x_t`` (possibly in ``z``'s storage) and remembers what
    later steps need. The caller must not write into the returned tensor (a recurrence may keep it).
    ``end_step()`` closes the step. ``state_dict()`` is secret (it holds past noise): it belongs with the
    generators' state in owner-only files under ``checkpoints/`` (:mod:`dpllm.resume`).
    """

    extra_tensors_per_parameter: int

    def state_dtype(self, draw_dtype: torch.dtype) -> torch.dtype: ...  # of what it keeps for draws of draw_dtype

    def apply(self, key: int, z: torch.Tensor) -> torch.Tensor: ...

    def end_step(self) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@runtime_checkable
class Strategy(Protocol):
    """A strategy matrix C, normalised so that its sensitivity under ``min_separation``-separated
    participation is 1 (the noise's std is then σ times the clipping norm, as for DP-SGD)."""

    name: str
    min_separation: int

    def recurrence(self) -> NoiseRecurrence: ...

    def prefix_sum_rmse(self, steps: int) -> float: ...

    def to_json(self) -> dict: ...


class IdentityRecurrence:
    """C = I: the noise is the draw itself, and nothing is kept."""

    extra_tensors_per_parameter = 0

    def state_dtype(self, draw_dtype: torch.dtype) -> torch.dtype:
        return draw_dtype  # (it keeps nothing)

    def apply(self, key: int, z: torch.Tensor) -> torch.Tensor:
        return z

    def end_step(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


@dataclass(frozen=True)
class Independent:
    """DP-SGD's independent noise (C = I, every record may join every step)."""

    name: str = "independent"
    min_separation: int = 1

    def recurrence(self) -> IdentityRecurrence:
        return IdentityRecurrence()

    def prefix_sum_rmse(self, steps: int) -> float:
        """sqrt(‖A‖²_F / T) = sqrt((T+1)/2) for the T×T lower-triangular ones matrix A.

        Example:
            >>> Independent().prefix_sum_rmse(3)
            1.4142135623730951
        """
        return math.sqrt((steps + 1) / 2)

    def to_json(self) -> dict:
        return {"mechanism": self.name, "bands": 1}
