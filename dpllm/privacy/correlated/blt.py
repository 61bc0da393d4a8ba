"""BLT (buffered linear Toeplitz) correlated noise: the strategy, its online noise, its sensitivity and accounting.

**The strategy.** DP-MF releases ``Ĝ = G + C⁻¹Z``: the stream of clipped gradient sums ``G`` (one row per step)
plus noise correlated across steps by the inverse of a lower-triangular T×T *strategy* matrix ``C``; ``Z`` has
i.i.d. N(0, σ²·clip²) entries. A BLT strategy is Toeplitz with coefficients ``c₀ = 1`` and
``c_m = Σᵢ ωᵢ·θᵢ^(m−1)`` (m ≥ 1) for d *buffers* with decays ``θᵢ`` and scales ``ωᵢ`` (McMahan et al. 2024,
arXiv 2408.08868; Dvijotham et al. 2024, arXiv 2404.16706). Its generating function is the rational function
``C(x) = Πⱼ(1 − θ̂ⱼx) / Πᵢ(1 − θᵢx)``, so ``C⁻¹`` is again a BLT: its decays θ̂ are the eigenvalues of
``diag(θ) − ω·1ᵀ`` and its scales follow from partial fractions,
``ωᵢ = Πⱼ(θᵢ − θ̂ⱼ) / Π_{l≠i}(θᵢ − θ_l)`` (and the same with the roles of θ and θ̂ swapped for ω̂).
We optimise the *interlaced* family ``1 > θ₁ > θ̂₁ > θ₂ > θ̂₂ > … > θ_d > θ̂_d > 0``; in it every ω > 0,
every ω̂ < 0 and ``c₁ = Σω = Σ(θᵢ − θ̂ᵢ) < 1``, so the coefficients are positive and decreasing and both C and
C⁻¹ are stable.

**Online noise, d buffers per parameter.** ``x = C⁻¹z`` solves ``Cx = z``:
``x_t = z_t − Σᵢ ωᵢ·bᵢ`` with buffers ``bᵢ ← θᵢ·bᵢ + x_t`` (zero at the start). :class:`BLTRecurrence` keeps the d
buffers of each parameter (``extra_tensors_per_parameter = d`` model-sized tensors; float64 buffers on request).

**Sensitivity under b-min-separation.** A record that takes part in at most k steps, any two at least
b apart, changes ``CG`` by at most ``sens(C, b, k)·clip`` in Frobenius norm. When C's coefficients are
non-negative and non-increasing (true here) the worst pattern is k participations exactly b apart from step
0 (arXiv 2405.13763, Thm 2; jax_privacy computes it the same way), so ``sens² = ‖Σ_{j<k} C·e_{jb}‖²``: a sum of
geometric series in closed form (:func:`blt_sensitivity`, O(d² log k), independent of T).

**Accounting: no amplification, one Gaussian mechanism.** Amplification by sampling is proven for *banded*
strategies under cyclic Poisson sampling (Choquette-Choo et al. 2023, Thm 1); a BLT is not banded (every
coefficient is non-zero). For non-banded strategies under Poisson, balls-in-bins or b-min-sep sampling the
published analyses (MMCC, Choquette-Choo et al. 2024, and later) are not in dp-accounting, and jax_privacy
accounts them only by Monte Carlo (experimental). We therefore account the rigorous way: ``Ĝ`` is
post-processing of ``CG + Z``, a Gaussian mechanism with sensitivity ``sens(C, b, k)·clip`` and noise
``σ·clip``, so the whole run is ``μ``-GDP with ``μ = sens(C, b, k)/σ`` (gradients chosen adaptively included:
Denisov et al. 2022; Choquette-Choo et al. 2022 for (k, b)-participation), and (ε, δ) follows exactly from μ
(:func:`epsilon_for_mu`), from dp-accounting (:func:`dp_event`) or from dpllm's accountants
(:func:`history_entry`). μ is for the steps actually run: sens grows with T, so a run that goes past the T the
strategy was optimised for is accounted with ``sensitivity(steps_run)``.

**The sampler this accounting assumes** (pair it with nothing else): a *fixed-participation cyclic* sampler.
Records are assigned to ``b = min_separation`` groups once, each record's group decided from that record alone
(a keyed hash of its content, as the splits are; under user-level DP the user is assigned); step t trains on
*all* records of group ``t mod b`` (no Poisson draw is credited), so every record takes part in at most
``k = ⌈T/b⌉`` steps exactly b apart. The noisy sum is divided by a fixed public batch size, never the realised
group size. Poisson sampling without groups, and reshuffling per epoch, can put one record in two steps less
than b apart and are NOT covered. (Dropping records within a group at random is still covered, without
credit for it: the guarantee holds for every fixed pattern, hence for any random mixture of them.)

Example:
    >>> s = optimize_blt(steps=64, buffers=2, min_separation=16)
    >>> round(s.prefix_sum_rmse(64), 1) < round(dpsgd_prefix_sum_rmse(steps=64, min_separation=16), 1)
    True
    >>> import torch
    >>> rec = s.recurrence()
    >>> x = rec.apply(0, torch.ones(3)); rec.end_step(); x.tolist()
    [1.0, 1.0, 1.0]
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import numpy as np
from scipy import optimize as sp_optimize
from scipy import special

if TYPE_CHECKING:  # torch is imported where noise is drawn (and by the O(T) reference loss), never by dpllm plan
    import torch

NAME = "blt"
MAX_BUFFERS = 8  # past ~8 buffers the partial-fraction scales lose float64 precision (jax_privacy warns at 15)


def participations(steps: int, min_separation: int, max_participations: int | None = None) -> int:
    """The most steps one record can take part in: ⌈T/b⌉, or ``max_participations`` when smaller."""
    if steps < 1 or min_separation < 1:
        raise ValueError(f"steps={steps} and min_separation={min_separation} must both be at least 1")
    k = -(-steps // min_separation)
    return k if max_participations is None else max(1, min(k, int(max_participations)))


def _scales(theta: np.ndarray, theta_hat: np.ndarray) -> np.ndarray:
    """Partial-fraction scales ω of C(x) = Π(1 − θ̂x)/Π(1 − θx): ωᵢ = Πⱼ(θᵢ − θ̂ⱼ)/Π_{l≠i}(θᵢ − θ_l)."""
    num = np.prod(theta[:, None] - theta_hat[None, :], axis=1)
    diff = theta[:, None] - theta[None, :]
    np.fill_diagonal(diff, 1.0)
    return num / np.prod(diff, axis=1)


class BLT:
    """A lower-triangular Toeplitz matrix with c₀ = 1 and c_m = Σᵢ ωᵢ θᵢ^(m−1), as two float64 arrays."""

    def __init__(self, theta, omega):
        self.theta = np.asarray(theta, dtype=np.float64).reshape(-1)
        self.omega = np.asarray(omega, dtype=np.float64).reshape(-1)
        if self.theta.shape != self.omega.shape:
            raise ValueError(f"theta has {self.theta.size} entries and omega {self.omega.size}; they must match")
        if not (np.all(np.isfinite(self.theta)) and np.all(np.isfinite(self.omega))):
            raise ValueError(f"BLT parameters must be finite: theta={self.theta}, omega={self.omega}")

    @classmethod
    def from_decays(cls, theta, theta_hat) -> BLT:
        """The BLT with decays θ whose inverse has decays θ̂: C(x) = Π(1 − θ̂x)/Π(1 − θx)."""
        theta, theta_hat = np.asarray(theta, dtype=np.float64), np.asarray(theta_hat, dtype=np.float64)
        return cls(theta, _scales(theta, theta_hat))

    @property
    def buffers(self) -> int:
        return int(self.theta.size)

    def coefs(self, n: int) -> np.ndarray:
        """The first n Toeplitz coefficients c₀ … c_{n−1}."""
        m = np.arange(max(n - 1, 0), dtype=np.float64)
        tail = (self.omega[None, :] * self.theta[None, :] ** m[:, None]).sum(axis=1)
        return np.concatenate([[1.0], tail])[:n]

    def matrix(self, n: int) -> np.ndarray:
        """The n×n lower-triangular Toeplitz matrix (for tests and small n)."""
        return toeplitz_matrix(self.coefs(n))

    def inverse(self) -> BLT:
        """C⁻¹ as a BLT, in closed form: decays = eigenvalues of diag(θ) − ω·1ᵀ, scales by partial fractions.

        Raises:
            ValueError: two decays coincide (the partial fractions do not exist) or an inverse decay is complex.
        """
        if self.buffers == 0:
            return BLT([], [])
        gaps = np.abs(self.theta[:, None] - self.theta[None, :]) + np.eye(self.buffers)
        if gaps.min() < 1e-12:
            raise ValueError(f"BLT decays {self.theta.tolist()} must be distinct (gap >= 1e-12) to invert")
        ev = np.linalg.eigvals(np.diag(self.theta) - np.outer(self.omega, np.ones(self.buffers)))
        if np.max(np.abs(ev.imag)) > 1e-9:
            raise ValueError(f"C⁻¹ of this BLT has complex decays {ev.tolist()}; use an interlaced BLT")
        theta_hat = np.sort(ev.real)[::-1]
        return BLT(theta_hat, _scales(theta_hat, self.theta))

    def is_interlaced(self) -> bool:
        """1 > θ₁ > θ̂₁ > … > θ_d > θ̂_d > 0: positive decreasing coefficients, stable C and C⁻¹."""
        if self.buffers == 0:
            return True
        both = np.empty(2 * self.buffers)
        both[0::2] = np.sort(self.theta)[::-1]
        both[1::2] = self.inverse().theta
        return bool(both[0] < 1 and both[-1] > 0 and np.all(np.diff(both) < 0))


def toeplitz_matrix(coefs: np.ndarray) -> np.ndarray:
    """The lower-triangular Toeplitz matrix whose first column is ``coefs``."""
    n = len(coefs)
    idx = np.arange(n)[:, None] - np.arange(n)[None, :]
    return np.where(idx >= 0, np.asarray(coefs)[np.clip(idx, 0, None)], 0.0)


def toeplitz_inverse_coefs(coefs: np.ndarray) -> np.ndarray:
    """Coefficients of the inverse of a lower-triangular Toeplitz matrix (c₀ ≠ 0), O(n²)."""
    c = np.asarray(coefs, dtype=np.float64)
    inv = np.zeros_like(c)
    inv[0] = 1.0 / c[0]
    for m in range(1, len(c)):
        inv[m] = -np.dot(c[1:m + 1], inv[m - 1::-1]) / c[0]
    return inv


def toeplitz_sensitivity(coefs, *, min_separation: int, max_participations: int | None = None) -> float:
    """sens(C, b, k) of a Toeplitz C with non-negative, non-increasing coefficients, in O(T): ‖Σ_{j<k} C·e_{jb}‖.

    Raises:
        ValueError: the coefficients are not non-negative and non-increasing (the closed form needs both).
    """
    c = np.asarray(coefs, dtype=np.float64)
    if np.any(c < 0) or np.any(np.diff(c) > 1e-12 * max(1.0, abs(c[0]))):
        raise ValueError("the min-separation sensitivity formula needs non-negative, non-increasing coefficients")
    n, b = len(c), min_separation
    k = participations(n, b, max_participations)
    # Σ_{j<k} shift_{jb}(c): the sum over all j of the shifts (a cumulative sum along steps ≡ t mod b), minus
    # the same sum shifted by kb
    cs = np.cumsum(np.concatenate([c, np.zeros(-n % b)]).reshape(-1, b), axis=0).reshape(-1)[:n]
    v = cs.copy()
    v[k * b:] -= cs[:max(n - k * b, 0)]
    return float(np.sqrt(np.dot(v, v)))


def blt_sensitivity(blt: BLT, *, steps: int, min_separation: int, max_participations: int | None = None) -> float:
    """sens(C, b, k) of a BLT with non-negative decreasing coefficients, in closed form: O(d² log k), whatever T.

    ``sens² = Σ_{j,j'<k} ⟨C e_{jb}, C e_{j'b}⟩``; for j ≤ j' with Δ = (j'−j)b and L = T − j'b rows below the
    later column, ``⟨·,·⟩ = c_Δ + Σ_{i,l} ωᵢω_l θ_l^Δ (1 − (θᵢθ_l)^(L−1))/(1 − θᵢθ_l)`` (with c₀ = 1); summed over
    j ≤ j' these are sums of geometric series (:func:`_closed_sens2`, the comment above it).

    Raises:
        ValueError: the BLT's coefficients could be negative or increasing (ω ≤ 0, θ ∉ (0, 1) or Σω > 1).
    """
    th, om = blt.theta, blt.omega
    if blt.buffers and (np.any(om <= 0) or np.any(th <= 0) or np.any(th >= 1) or om.sum() > 1):
        raise ValueError("the closed form needs 0 < theta < 1, omega > 0 and sum(omega) <= 1 "
                         f"(got theta={th.tolist()}, omega={om.tolist()})")
    k = participations(steps, min_separation, max_participations)
    if not blt.buffers:
        return math.sqrt(k)
    return math.sqrt(float(_closed_sens2(np.log(th), om, int(steps), int(min_separation), k)))


def prefix_sum_rmse_of(noise_coefs: np.ndarray, sensitivity: float) -> float:
    """RMSE per step of the prefix sums A·C⁻¹z (z ~ N(0, 1)), times the sensitivity: the MF error metric.

    A·C⁻¹ is Toeplitz with coefficients B = cumsum(c⁻¹); step t's variance is Σ_{m≤t} B_m².
    """
    b = np.cumsum(np.asarray(noise_coefs, dtype=np.float64))
    return float(sensitivity * np.sqrt(np.mean(np.cumsum(b * b))))


def dpsgd_prefix_sum_rmse(*, steps: int, min_separation: int, max_participations: int | None = None) -> float:
    """DP-SGD (C = I) on the same participation schema, unamplified: √k · √((T+1)/2)."""
    k = participations(steps, min_separation, max_participations)
    return math.sqrt(k * (steps + 1) / 2.0)


def sqrt_factorization_coefs(n: int) -> np.ndarray:
    """Coefficients of A^½ (A the prefix-sum matrix): binom(2m, m)/4^m (Fichtenberger et al. 2023)."""
    m = np.arange(1, n, dtype=np.float64)
    return np.concatenate([[1.0], np.cumprod((2 * m - 1) / (2 * m))])


def sqrt_prefix_sum_rmse(*, steps: int, min_separation: int, max_participations: int | None = None) -> float:
    """The square-root factorisation A = C·C (C = A^½): its noise matrix A·C⁻¹ = C."""
    c = sqrt_factorization_coefs(steps)
    sens = toeplitz_sensitivity(c, min_separation=min_separation, max_participations=max_participations)
    return float(sens * np.sqrt(np.mean(np.cumsum(c * c))))


# Elements per chunk of the recurrence: the 2d passes over a chunk of x and of each buffer run while it is in cache,
# so x is read from memory once per step instead of 2d times (124M float32 parameters, d = 3, one thread: 0.37 s per
# step whole, 0.27 s in chunks of 2¹⁸; 2¹⁷-2²⁰ within 8% of that, 2¹³ slower than whole from the per-call overhead)
CHUNK = 1 << 18


class BLTRecurrence:
    """``x_t = (C⁻¹z)_t`` computed online, one parameter at a time, with d buffers per parameter.

    Call :meth:`apply` once per parameter per step with that step's fresh N(0, σ²clip²) draw, then
    :meth:`end_step`. The analysis is for exact arithmetic: buffers are kept in float32 at least (bf16 and
    fp16 draws get float32 buffers), so their rounding is that of the float32 noise itself; float64 buffers
    (``dtype=torch.float64``, twice the memory) keep it at float64's for long runs (decays near 1).
    The buffers are secret state (they determine future noise): save :meth:`state_dict` only with the
    resumable RNG state (owner-only files under ``checkpoints/``).
    """

    def __init__(self, blt: BLT, *, dtype: torch.dtype | None = None, reuse_draws: bool = False):
        import torch
        if dtype not in (None, torch.float32, torch.float64):
            raise ValueError(f"BLT buffers in {dtype} would round the noise's correlation away; use torch.float32 "
                             "or torch.float64")
        self.blt = blt
        self.dtype = dtype  # None: the draw's dtype, at least float32 (bf16/fp16 draws get float32 buffers)
        # x computed in the draw's own storage when it has the buffers' dtype: the bk optimizer's draws are fresh and
        # used once, and a model-sized allocation and copy per step cost more than the recurrence's arithmetic
        # (124M float32 parameters, d = 1, one loaded thread: 0.52 s per step with the copy, 0.14 s without)
        self.reuse_draws = bool(reuse_draws)
        self.extra_tensors_per_parameter = blt.buffers
        self._buffers: dict[int, torch.Tensor] = {}
        self._seen: set[int] = set()
        self._step = 0
        self._omega, self._theta = blt.omega.tolist(), blt.theta.tolist()

    def state_dtype(self, draw_dtype: torch.dtype) -> torch.dtype:
        """The buffers' dtype for draws of ``draw_dtype``: the one built with, else float64 for float64 draws and
        float32 for any other (bf16/fp16 buffers would round the correlation away)."""
        import torch

        return self.dtype or (torch.float64 if draw_dtype == torch.float64 else torch.float32)

    def apply(self, key: int, z: torch.Tensor) -> torch.Tensor:
        """This step's correlated noise for parameter ``key`` from its fresh draw ``z`` (``z`` is not modified, unless
        the recurrence was built with ``reuse_draws`` and ``z`` has the buffers' dtype: x is then ``z`` itself)."""
        import torch
        if key in self._seen:
            raise RuntimeError(f"BLT noise for parameter {key} was already drawn at step {self._step}; "
                               "call end_step() between steps")
        self._seen.add(key)
        if self.blt.buffers == 0:
            return z.clone()
        buf = self._buffers.get(key)
        if buf is None:
            if self._step > 0:
                raise RuntimeError(f"parameter {key} first appears at step {self._step}; every noised parameter "
                                   "must be noised from the first step on")
            buf = torch.zeros((self.blt.buffers, *z.shape), dtype=self.state_dtype(z.dtype), device=z.device)
            self._buffers[key] = buf
        elif buf.shape[1:] != z.shape:
            raise ValueError(f"parameter {key}: draw of shape {tuple(z.shape)}, buffers of {tuple(buf.shape[1:])} "
                             "(a state saved for other shards): resume on the process count and sharding the run used")
        elif buf.device != z.device:  # restored from a checkpoint loaded on another device
            buf = self._buffers[key] = buf.to(z.device)
        x = z if self.reuse_draws and z.dtype == buf.dtype else z.to(buf.dtype, copy=True)
        if x.is_contiguous() and buf.is_contiguous():  # (always, for the optimizers' fresh draws) chunk by chunk
            flat, bufs = x.view(-1), buf.view(buf.shape[0], -1)
            for start in range(0, flat.numel(), CHUNK):
                self._update(flat[start: start + CHUNK], bufs[:, start: start + CHUNK])
        else:
            self._update(x, buf)
        return x.to(z.dtype)

    def _update(self, x: torch.Tensor, buf: torch.Tensor) -> None:
        """x ← x − Σᵢ ωᵢ·bufᵢ, then bufᵢ ← θᵢ·bufᵢ + x: one fused multiply-add per buffer and pass (faster than a
        tensordot and a broadcast update, and no temporaries beyond x)."""
        import torch

        for i, w in enumerate(self._omega):
            x.add_(buf[i], alpha=-w)
        for i, th in enumerate(self._theta):
            torch.add(x, buf[i], alpha=th, out=buf[i])

    def end_step(self) -> None:
        """Close the step; refuses a step that skipped a parameter (its sequence would fall out of step)."""
        missing = set(self._buffers) - self._seen
        if missing:
            raise RuntimeError(f"step {self._step} drew no BLT noise for parameters {sorted(missing)[:5]}")
        self._seen = set()
        self._step += 1

    def state_dict(self) -> dict:
        if self._seen:
            raise RuntimeError("state_dict() in the middle of a step; call it after end_step()")
        return {"mechanism": NAME, "theta": self.blt.theta.tolist(), "omega": self.blt.omega.tolist(),
                "dtype": None if self.dtype is None else str(self.dtype), "step": self._step,
                "buffers": {k: v.clone() for k, v in self._buffers.items()}}

    def load_state_dict(self, state: dict) -> None:
        if state.get("mechanism") != NAME or state["theta"] != self.blt.theta.tolist() \
                or state["omega"] != self.blt.omega.tolist():
            raise ValueError("the saved noise state belongs to another strategy (mechanism or BLT parameters "
                             "differ); resume with the strategy the run started with")
        if state["dtype"] != (None if self.dtype is None else str(self.dtype)):
            raise ValueError(f"the saved noise buffers are {state['dtype'] or 'in the draws dtype'}; resume with "
                             f"the same buffer dtype (this recurrence has {self.dtype})")
        self._buffers = {int(k): v.clone() for k, v in state["buffers"].items()}
        self._step = int(state["step"])
        self._seen = set()


class BLTStrategy:
    """A BLT strategy for ``steps`` steps with participations at least ``min_separation`` apart."""

    name = NAME
    # what the accounting below assumes (module docstring): the wiring pairs the strategy with this sampler only
    sampler = "cyclic_fixed"  # b groups by keyed hash of each record, step t = all of group t mod b
    accounting = "gaussian_mechanism"  # the whole run is one Gaussian mechanism, μ = sens(C, b, k)/σ; no amplification

    def __init__(self, blt: BLT, *, steps: int, min_separation: int, max_participations: int | None = None,
                 momentum: float = 0.0):
        if not blt.is_interlaced():
            raise ValueError(f"BLT theta={blt.theta.tolist()} omega={blt.omega.tolist()} is not interlaced "
                             "(1 > θ₁ > θ̂₁ > … > θ̂_d > 0): its noise could grow or its sensitivity be wrong")
        self.blt = blt
        self.steps = int(steps)
        self.min_separation = int(min_separation)
        self.max_participations = participations(steps, min_separation, max_participations)
        self.momentum = float(momentum)

    def recurrence(self, *, dtype: torch.dtype | None = None, reuse_draws: bool = False) -> BLTRecurrence:
        return BLTRecurrence(self.blt, dtype=dtype, reuse_draws=reuse_draws)

    def sensitivity(self, steps: int | None = None) -> float:
        """sens(C, b, k) over ``steps`` (default: the steps it was built for), k = ⌈steps/b⌉ capped."""
        n = self.steps if steps is None else steps
        return blt_sensitivity(self.blt, steps=n, min_separation=self.min_separation,
                               max_participations=self.max_participations)

    def prefix_sum_rmse(self, steps: int) -> float:
        """RMSE per step on the prefix-sum workload, noise std 1, times sens(C, b, k): multiply by clip/μ.

        In closed form (:func:`_closed_error`), equal to :func:`prefix_sum_rmse_of` of C⁻¹'s coefficients."""
        inv = self.blt.inverse()
        return self.sensitivity(steps) * math.sqrt(float(_closed_error(np.log(inv.theta), inv.omega, int(steps)))
                                                   / steps)

    def to_json(self) -> dict:
        inv = self.blt.inverse()
        return {"mechanism": NAME, "sampler": self.sampler, "accounting": self.accounting,
                "buffers": self.blt.buffers, "steps": self.steps,
                "min_separation": self.min_separation, "max_participations": self.max_participations,
                "momentum": self.momentum, "theta": self.blt.theta.tolist(), "omega": self.blt.omega.tolist(),
                "inverse_theta": inv.theta.tolist(), "inverse_omega": inv.omega.tolist(),
                "sensitivity": self.sensitivity(), "prefix_sum_rmse": self.prefix_sum_rmse(self.steps)}

    @classmethod
    def from_json(cls, d: dict) -> BLTStrategy:
        if d.get("mechanism") != NAME:
            raise ValueError(f"not a BLT strategy: mechanism={d.get('mechanism')!r}")
        return cls(BLT(d["theta"], d["omega"]), steps=d["steps"], min_separation=d["min_separation"],
                   max_participations=d["max_participations"], momentum=d.get("momentum", 0.0))


def optimal_toeplitz_coefs(*, steps: int, min_separation: int, max_participations: int | None = None) -> np.ndarray:
    """The best dense Toeplitz strategy with non-negative non-increasing coefficients (a baseline; O(T³) per step).

    Parametrised as c₀ = 1, c_m = c_{m−1}·sigmoid(u_m), started from the square-root factorisation.
    """
    import torch
    k = participations(steps, min_separation, max_participations)
    r = sqrt_factorization_coefs(steps)
    u0 = special.logit(np.clip(r[1:] / r[:-1], 1e-9, 1 - 1e-9))
    e0 = torch.zeros(steps, 1, dtype=torch.float64)
    e0[0] = 1.0
    idx = torch.arange(steps)[:, None] - torch.arange(steps)[None, :]

    def coefs(u):
        return torch.cat([torch.ones(1, dtype=u.dtype), torch.cumprod(torch.sigmoid(u), 0)])

    def fun(u):
        ut = torch.tensor(u, dtype=torch.float64, requires_grad=True)
        c = coefs(ut)
        mat = torch.where(idx >= 0, c[idx.clamp(min=0)], torch.zeros((), dtype=c.dtype))
        cinv = torch.linalg.solve_triangular(mat, e0, upper=False)[:, 0]
        v = sum(torch.cat([c.new_zeros(j * min_separation), c[:steps - j * min_separation]]) for j in range(k))
        bco = torch.cumsum(cinv, 0)
        val = torch.dot(v, v) * torch.mean(torch.cumsum(bco * bco, 0))
        (g,) = torch.autograd.grad(val, ut)
        return float(val.detach()), g.numpy()

    res = sp_optimize.minimize(fun, u0, jac=True, method="L-BFGS-B", options={"maxiter": 2000})
    return coefs(torch.tensor(res.x, dtype=torch.float64)).numpy()


def toeplitz_prefix_sum_rmse(coefs, *, min_separation: int, max_participations: int | None = None) -> float:
    """The error metric of any non-negative non-increasing Toeplitz strategy (T = len(coefs))."""
    sens = toeplitz_sensitivity(coefs, min_separation=min_separation, max_participations=max_participations)
    return prefix_sum_rmse_of(toeplitz_inverse_coefs(coefs), sens)


# --- optimisation (torch float64 autograd, scipy L-BFGS) ------------------------------------------------------

def _interlaced(u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unconstrained u (2d) → θ (d) and θ̂ (d) with 1 > θ₁ > θ̂₁ > θ₂ > … > θ̂_d > 0."""
    import torch
    s = torch.cumsum(torch.cat([u[:1], torch.exp(u[1:])]), 0)
    vals = 1.0 - torch.sigmoid(s)
    return vals[0::2], vals[1::2]


def _torch_scales(theta: torch.Tensor, theta_hat: torch.Tensor) -> torch.Tensor:
    import torch
    num = torch.prod(theta[:, None] - theta_hat[None, :], dim=1)
    diff = theta[:, None] - theta[None, :] + torch.eye(len(theta), dtype=theta.dtype)
    return num / torch.prod(diff, dim=1)


def _torch_coefs(theta, omega, n):
    import torch
    m = torch.arange(n - 1, dtype=theta.dtype)
    tail = (omega[None, :] * torch.exp(m[:, None] * torch.log(theta[None, :]))).sum(1)
    return torch.cat([torch.ones(1, dtype=theta.dtype), tail])


def _workload_coefs(n: int, momentum: float) -> np.ndarray:
    """Toeplitz coefficients of the workload: prefix sums (momentum 0) or sums of momentum-filtered gradients."""
    if momentum == 0:
        return np.ones(n)
    return (1.0 - momentum ** np.arange(1, n + 1)) / (1.0 - momentum)


def _loss(u, n, b, k, workload):
    import torch
    theta, theta_hat = _interlaced(u)
    c = _torch_coefs(theta, _torch_scales(theta, theta_hat), n)
    cinv = _torch_coefs(theta_hat, _torch_scales(theta_hat, theta), n)
    pad = (-n) % b
    cs = torch.cumsum(torch.cat([c, c.new_zeros(pad)]).view(-1, b), 0).reshape(-1)[:n]
    v = cs - torch.cat([c.new_zeros(min(k * b, n)), cs[:max(n - k * b, 0)]])  # Σ_{j<k} shift_{jb}(c)
    if workload is None:
        bco = torch.cumsum(cinv, 0)
    else:  # Toeplitz product workload·C⁻¹ by FFT
        size = 2 * n
        bco = torch.fft.irfft(torch.fft.rfft(workload, size) * torch.fft.rfft(cinv, size), size)[:n]
    return torch.dot(v, v) * torch.mean(torch.cumsum(bco * bco, 0))


def _to_u(vals: np.ndarray) -> np.ndarray:
    """Inverse of :func:`_interlaced`: decreasing values in (0, 1) → unconstrained u."""
    s = special.logit(1.0 - vals)
    return np.concatenate([s[:1], np.log(np.maximum(np.diff(s), 1e-12))])


# --- the prefix-sum loss in closed form: O(d² log k) per evaluation, whatever T ----------------------------------
#
# Every sum below is a sum of geometric series, evaluated from ψ(z) = (eᶻ − 1 − z)/z² (a series near 0), so that no
# formula divides by 1 − θ where θ is near 1. With S1(L, N) = Σ_{m<N} e^{Lm} = N·E1(NL)/E1(L) (E1(z) = 1 + zψ(z))
# and S2(L, N) = Σ_{m<N} (N − m)e^{Lm} = ((N+1)²ψ((N+1)L) − (N+1)ψ(L))/E1(L)²:
#
# * error: C⁻¹'s prefix sums are B_m = α + Σᵢ βᵢθ̂ᵢ^m with βᵢ = −ω̂ᵢ/(1 − θ̂ᵢ) > 0 and α = 1 − Σβ > 0, so
#   Σ_m (T − m)B_m² = Σ_{p,q} a_p a_q S2(log r_p + log r_q, T) over (a, r) = (α, 1), (βᵢ, θ̂ᵢ): positive terms only.
# * sensitivity: sens² = Σ_{j ≤ j' < k} (2 − [j = j']) ⟨C e_{jb}, C e_{j'b}⟩ (module docstring) sums to
#   k + 2Σᵢ ωᵢθᵢ^{b−1}S2(xᵢ, k−1) + Σ_{i,l} ωᵢω_l [S1(P, r)(k + 2x_l S2(x_l, k−1))
#   + P^r S1(P, b)(S2(y, k−1) + 2x_l·Σ_{e+g≤k−3}(k−2−e−g)x_l^e y^g)], with xᵢ = θᵢ^b, P = θᵢθ_l, y = P^b and
#   r = T − 1 − (k−1)b. The last (two-variable) sum is an entry of the k-th power of a 4×4 bidiagonal matrix with
#   non-negative entries (a divided difference of t^k), computed by repeated squaring: stable for any decays.
# The gradient is exact by complex-step differentiation (all of the above is analytic), 2d evaluations in one batch.

_PSI_SMALL = 0.05  # below it, ψ's Taylor series (to z⁶) is exact to float64; above, the direct formula loses < 5e-15


def _psi(z: np.ndarray) -> np.ndarray:
    """(eᶻ − 1 − z)/z², real or complex, accurate for every z (series near 0)."""
    small = np.abs(z) < _PSI_SMALL
    zs = np.where(small, _PSI_SMALL, z)
    direct = (np.expm1(zs) - zs) / (zs * zs)
    series = 1 / 2 + z * (1 / 6 + z * (1 / 24 + z * (1 / 120 + z * (1 / 720 + z * (1 / 5040 + z / 40320)))))
    return np.where(small, series, direct)


def _psis(*zs: np.ndarray) -> list[np.ndarray]:
    """:func:`_psi` of several arrays in one call (the arrays are tiny: the cost is per call)."""
    out = _psi(np.concatenate([z.reshape(-1) for z in zs]))
    parts = np.split(out, np.cumsum([z.size for z in zs])[:-1])
    return [part.reshape(z.shape) for part, z in zip(parts, zs)]


def _simplex_sum(x: np.ndarray, y: np.ndarray, m: int) -> np.ndarray:
    """Σ_{e+g≤m−1} (m − e − g)·x^e·y^g (0 for m ≤ 0): entry (0, 3) of J^(m+2), J bidiagonal (y, x, 1, 1) with ones
    above the diagonal (a divided difference of t^(m+2) at y, x, 1, 1), by repeated squaring."""
    if m <= 0:
        return np.zeros_like(x)
    jm = np.zeros(x.shape + (4, 4), dtype=x.dtype)
    jm[..., 0, 0], jm[..., 1, 1], jm[..., 2, 2], jm[..., 3, 3] = y, x, 1.0, 1.0
    jm[..., 0, 1] = jm[..., 1, 2] = jm[..., 2, 3] = 1.0
    power, out, e = jm, None, m + 2
    while e:
        if e & 1:
            out = power if out is None else out @ power
        e >>= 1
        if e:
            power = power @ power
    return out[..., 0, 3]


def _closed_sens2(log_theta, omega, n: int, b: int, k: int):
    """sens(C, b, k)² of the BLT with decays exp(log_theta) and scales omega over n steps, k participations b apart
    (the sum above); leading axes are a batch."""
    r = n - 1 - (k - 1) * b
    lx = b * log_theta
    lp = log_theta[..., :, None] + log_theta[..., None, :]
    p_x, p_kx, p_p, p_rp, p_bp, p_kbp = _psis(lx, k * lx, lp, r * lp, b * lp, (k * b) * lp)
    e_x, e_p, e_bp = 1 + lx * p_x, 1 + lp * p_p, 1 + b * lp * p_bp
    s2_x = (k * k * p_kx - k * p_x) / (e_x * e_x)  # S2(x, k − 1)
    s2_y = (k * k * p_kbp - k * p_bp) / (e_bp * e_bp)  # S2(y, k − 1)
    s1_r = r * (1 + r * lp * p_rp) / e_p  # S1(P, r)
    s1_b = b * e_bp / e_p  # S1(P, b)
    x = np.broadcast_to(np.exp(lx)[..., None, :], lp.shape)  # x_l
    pair = s1_r * (k + 2 * x * s2_x[..., None, :]) + np.exp(r * lp) * s1_b * (
        s2_y + 2 * x * _simplex_sum(x, np.exp(b * lp), k - 2))
    return (k + 2 * np.sum(omega * np.exp((b - 1) * log_theta) * s2_x, axis=-1)
            + np.sum(omega[..., :, None] * omega[..., None, :] * pair, axis=(-2, -1)))


def _closed_error(log_theta_hat, omega_hat, n: int):
    """Σ_{m<n} (n − m)·B_m², B the prefix sums of the coefficients of C⁻¹ (decays exp(log_theta_hat), scales
    omega_hat): n times the mean squared prefix-sum error per step at noise std 1; leading axes are a batch."""
    lr = np.concatenate([np.zeros(log_theta_hat.shape[:-1] + (1,), dtype=log_theta_hat.dtype), log_theta_hat], -1)
    lrr = lr[..., :, None] + lr[..., None, :]
    p_rr, p_nrr = _psis(lrr, (n + 1) * lrr)
    e_rr = 1 + lrr * p_rr
    beta = omega_hat / (log_theta_hat * (1 + log_theta_hat * p_rr[..., 0, 1:]))  # −ω̂/(1 − θ̂), 1 − θ̂ = −expm1(log θ̂)
    a = np.concatenate([(1 - beta.sum(-1))[..., None], beta], axis=-1)
    s2_n = ((n + 1.0) ** 2 * p_nrr - (n + 1.0) * p_rr) / (e_rr * e_rr)  # S2(r_p r_q, n)
    return np.sum(a[..., :, None] * a[..., None, :] * s2_n, axis=(-2, -1))


def _softplus(s: np.ndarray) -> np.ndarray:
    pos = s.real > 0
    sp, sn = np.where(pos, s, 0.0), np.where(pos, 0.0, s)
    return np.where(pos, sp + np.log1p(np.exp(-sp)), np.log1p(np.exp(sn)))


def _batch_scales(theta: np.ndarray, theta_hat: np.ndarray) -> np.ndarray:
    """:func:`_scales` over leading batch axes (real or complex)."""
    num = np.prod(theta[..., :, None] - theta_hat[..., None, :], axis=-1)
    diff = theta[..., :, None] - theta[..., None, :] + np.eye(theta.shape[-1])
    return num / np.prod(diff, axis=-1)


def _closed_loss(u: np.ndarray, n: int, b: int, k: int) -> np.ndarray:
    """:func:`_loss` (prefix sums) in closed form, over leading batch axes of u; log θ = −softplus(s) directly."""
    s = np.cumsum(np.concatenate([u[..., :1], np.exp(u[..., 1:])], axis=-1), axis=-1)
    logs = -_softplus(s)  # log(1 − sigmoid(s)), exact even where θ rounds to 1
    vals = np.exp(logs)
    theta, theta_hat = vals[..., 0::2], vals[..., 1::2]
    return (_closed_sens2(logs[..., 0::2], _batch_scales(theta, theta_hat), n, b, k)
            * _closed_error(logs[..., 1::2], _batch_scales(theta_hat, theta), n) / n)


_FTOL = 1e-7  # L-BFGS stops below 1e-7 relative progress: optima within 2e-5 of 3 starts at scipy's default 2e-9
_STEP = 1e-30  # complex step: f(u + ih·e_j) = f(u) + ih·∂_j f + O(h²), exact to rounding for any h this small


def _distinct(u: np.ndarray) -> bool:
    """The decays and inverse decays of u are distinct, non-zero floats (else ω, ω̂ are not defined)."""
    vals = 1.0 - special.expit(np.cumsum(np.concatenate([u[:1], np.exp(u[1:])])))
    return bool(vals[-1] > 0 and np.all(np.diff(vals) < 0))


def _closed_loss_and_grad(u: np.ndarray, n: int, b: int, k: int) -> tuple[float, np.ndarray]:
    """The loss and its exact gradient (complex step, one batched evaluation); (1e300, 0) where not finite."""
    with np.errstate(all="ignore"):
        f = _closed_loss(u[None, :] + 1j * _STEP * np.eye(u.size), n, b, k)
    if not (np.all(np.isfinite(f)) and _distinct(u)):
        return 1e300, np.zeros_like(u)
    return float(f[0].real), f.imag / _STEP


def _initial_points(d: int, n: int, b: int, k: int, momentum: float):
    """Where L-BFGS starts, best first: for d > 1 the optimum for d − 1 buffers with one more buffer pair below its
    smallest decay (so more buffers never do worse), then decays spread geometrically between ~1 − 1/n and ~0.5
    (θ̂ between neighbouring θ's) and between ~1 − 3/n and ~0.8. :func:`_optimize` stops at the first start that
    converges to an interlaced BLT."""
    if d > 1:
        theta, omega = _optimize(n, d - 1, b, k, momentum)
        prev = BLT(theta, omega)
        vals = np.empty(2 * d - 2)
        vals[0::2], vals[1::2] = prev.theta, prev.inverse().theta
        yield _to_u(np.concatenate([vals, vals[-1] * np.array([0.5, 0.25])]))
    for top, bottom in ((1.0 / n, 0.5), (3.0 / n, 0.8)):
        yield _to_u(1.0 - np.geomspace(top, bottom, 2 * d + 1)[:-1])


def _torch_fun(n: int, b: int, k: int, workload: np.ndarray):
    """:func:`_loss` and its gradient for scipy (torch autograd): O(n) per evaluation."""
    import torch

    workload = torch.tensor(workload)
    def fun(u):
        ut = torch.tensor(u, dtype=torch.float64, requires_grad=True)
        val = _loss(ut, n, b, k, workload)
        if not torch.isfinite(val):
            return 1e300, np.zeros_like(u)
        (g,) = torch.autograd.grad(val, ut)
        return float(val.detach()), g.numpy()
    return fun


@functools.lru_cache(maxsize=64)
def _optimize(n: int, d: int, b: int, k: int, momentum: float) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(θ, ω) of the optimised BLT; cached on the integers, so a plan and a training start in one process (and the
    next buffer count's warm start) never optimise the same case twice."""
    if momentum == 0:  # prefix sums: the closed form, whatever n
        def fun(u):
            return _closed_loss_and_grad(u, n, b, k)
    else:  # the momentum workload: O(n) per evaluation (torch autograd, FFT product)
        fun = _torch_fun(n, b, k, _workload_coefs(n, momentum))
    best = (math.inf, None)
    for u0 in _initial_points(d, n, b, k, momentum):
        res = sp_optimize.minimize(fun, u0, jac=True, method="L-BFGS-B", options={"maxiter": 500, "ftol": _FTOL})
        vals = 1.0 - special.expit(np.cumsum(np.concatenate([res.x[:1], np.exp(res.x[1:])])))  # _interlaced
        theta, theta_hat = vals[0::2], vals[1::2]
        try:
            blt = BLT(theta, _scales(theta, theta_hat))
            ok = blt.is_interlaced() and np.allclose(blt.inverse().theta, theta_hat, rtol=1e-6, atol=1e-12)
        except ValueError:
            ok = False
        if ok and res.fun < best[0]:
            best = (res.fun, blt)
        if best[1] is not None:  # the first start that converges to an interlaced BLT (the warm one, for d > 1)
            break
    if best[1] is None:
        raise RuntimeError(f"BLT optimisation failed for steps={n}, buffers={d}, min_separation={b}; "
                           "try fewer buffers")
    return tuple(best[1].theta.tolist()), tuple(best[1].omega.tolist())


def optimize_blt(steps: int, buffers: int, min_separation: int, *, max_participations: int | None = None,
                 momentum: float = 0.0) -> BLTStrategy:
    """The BLT with ``buffers`` buffers minimising the sensitivity-scaled mean squared error over ``steps`` steps.

    The loss is ``sens(C, b, k)² · (1/T)·‖W·C⁻¹‖_F²`` with W the prefix-sum workload (or, with ``momentum`` β > 0,
    prefix sums of momentum-filtered gradients: coefficients (1 − β^(m+1))/(1 − β)). Deterministic; cached.

    Args:
        steps: T, the number of noised steps of the run.
        buffers: d, 0 (DP-SGD) to 8; 2–5 suffice for T up to ~10⁴.
        min_separation: b, the steps between two participations of one record (steps per epoch).
        max_participations: k when smaller than ⌈T/b⌉.
        momentum: β of the optimizer's momentum, for the momentum workload.

    Raises:
        ValueError: an argument out of range.
    """
    if not 0 <= buffers <= MAX_BUFFERS:
        raise ValueError(f"buffers={buffers} must be between 0 and {MAX_BUFFERS}")
    if not 0 <= momentum < 1:
        raise ValueError(f"momentum={momentum} must be in [0, 1)")
    k = participations(steps, min_separation, max_participations)
    if buffers == 0:
        blt = BLT([], [])
    else:
        blt = BLT(*_optimize(int(steps), int(buffers), int(min_separation), k, float(momentum)))
    return BLTStrategy(blt, steps=steps, min_separation=min_separation, max_participations=k, momentum=momentum)


def choose_blt(steps: int, min_separation: int, *, max_buffers: int = 5, rtol: float = 1.01,
               max_participations: int | None = None, momentum: float = 0.0) -> BLTStrategy:
    """``buffers: auto``: the fewest buffers (1 … max_buffers) after which one more lowers the RMSE by < ``rtol``×.

    Each buffer costs one model-sized tensor per process, so a buffer that buys under 1% is not taken.
    """
    kw = dict(max_participations=max_participations, momentum=momentum)
    best = optimize_blt(steps, 1, min_separation, **kw)
    for d in range(2, max_buffers + 1):
        more = optimize_blt(steps, d, min_separation, **kw)
        if more.prefix_sum_rmse(steps) * rtol >= best.prefix_sum_rmse(steps):
            break
        best = more
    return best


# --- accounting -------------------------------------------------------------------------------------------------

def gaussian_mu(strategy: BLTStrategy, *, noise_multiplier: float, steps: int | None = None) -> float:
    """μ of the whole run as one Gaussian mechanism: sens(C, b, k)/σ (σ the std of z in units of clip)."""
    if noise_multiplier <= 0:
        raise ValueError(f"noise_multiplier={noise_multiplier} must be positive")
    return strategy.sensitivity(steps) / noise_multiplier


def noise_multiplier_for_mu(strategy: BLTStrategy, *, mu: float, steps: int | None = None) -> float:
    """The σ that makes the run μ-GDP."""
    return strategy.sensitivity(steps) / mu


def dp_event(strategy: BLTStrategy, *, noise_multiplier: float, steps: int | None = None):
    """dp-accounting's event for the run: one ``GaussianDpEvent`` with noise multiplier σ/sens (no sampling)."""
    from dp_accounting import dp_event as events

    return events.GaussianDpEvent(noise_multiplier=1.0 / gaussian_mu(strategy, noise_multiplier=noise_multiplier,
                                                                     steps=steps))


def history_entry(strategy: BLTStrategy, *, noise_multiplier: float,
                  steps: int | None = None) -> tuple[float, float, int]:
    """The run as one ``(noise_multiplier, sample_rate, steps)`` entry for dpllm's accountants: (σ/sens, 1.0, 1).

    A Poisson-sampled Gaussian with q = 1 and one step *is* the Gaussian mechanism, so the PRV/PLD/RDP chain
    accounts it unchanged (and composes it with other stages).
    """
    return 1.0 / gaussian_mu(strategy, noise_multiplier=noise_multiplier, steps=steps), 1.0, 1


def _delta_of(eps: float, mu: float) -> float:
    # Balle & Wang 2018, Thm 8: the exact δ(ε) of the Gaussian mechanism with sensitivity/σ = μ
    return float(special.ndtr(-eps / mu + mu / 2) - math.exp(eps) * special.ndtr(-eps / mu - mu / 2))


def epsilon_for_mu(mu: float, delta: float) -> float:
    """The exact ε at ``delta`` of a μ-GDP (Gaussian) mechanism, by bisection on δ(ε) (tolerance 1e-10)."""
    if not 0 < delta < 1 or mu <= 0:
        raise ValueError(f"need mu > 0 and 0 < delta < 1 (got mu={mu}, delta={delta})")
    if _delta_of(0.0, mu) <= delta:
        return 0.0
    hi = 1.0
    while _delta_of(hi, mu) > delta:
        hi *= 2
    eps = float(sp_optimize.brentq(lambda e: _delta_of(e, mu) - delta, 0.0, hi, xtol=1e-12))
    while _delta_of(eps, mu) > delta:  # never below the root: step up past it
        eps += 1e-10
    return eps
