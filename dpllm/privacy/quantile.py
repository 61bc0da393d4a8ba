"""Quantile-adaptive clipping (``privacy.clipping: quantile``): C tracks a quantile of the per-record norms.

Andrew et al. 2021 ("Differentially private learning with adaptive clipping", arXiv 1905.03871). Each step
clips every record flatly at the current C and releases *two* things: the clipped gradient sum and the
number of records whose norm was at most C. After the step

    b̃ = (Σᵢ (bᵢ − ½) + N(0, σ_b²)) / m + ½,        C ← C · exp(−η · (b̃ − γ)),

with bᵢ = 1[‖gᵢ‖ ≤ C], m = q·N the *expected* batch size (public; the realised batch size is not), γ the
target quantile (``target_quantile``), η the learning rate (``quantile_lr``) and σ_b the count's noise
(``count_noise_multiplier``, fixed for the run). C is a function of released, noised values only, so its
trajectory may be logged, checkpointed and reported.

Why the pair is one Gaussian mechanism of noise multiplier σ (the σ the plan calibrates and the accountant
reports; everything rests on this):

1. Add or remove one record (Poisson subsampling acts on the pair alike). Its clipped gradient moves the sum by
   a vector of norm ≤ C; its centred bit bᵢ − ½ ∈ {−½, +½} moves the centred count by exactly ½. (Uncentred
   bits would move it by up to 1, and the split below would then under-noise the pair.)
2. The released pair is (S + N(0, σ_g²C²·I), K + N(0, σ_b²)). Divide the first part by σ_g·C and the second by
   σ_b: both noises become N(0, 1) per coordinate, and the change of step 1 becomes a vector of squared norm
   ≤ (C/(σ_g·C))² + (½/σ_b)² = σ_g⁻² + (2σ_b)⁻².
3. A Gaussian mechanism with unit noise and L2 sensitivity Δ has noise multiplier 1/Δ. With
   σ_g = (σ⁻² − (2σ_b)⁻²)^(−1/2) the sensitivity of step 2 is ≤ (σ⁻²)^(1/2) = 1/σ: the pair is the subsampled
   Gaussian mechanism of noise multiplier σ, and the accountant records σ (never σ_g).
4. σ_g is finite only for (2σ_b)⁻² < σ⁻², i.e. σ_b > σ/2: a smaller σ_b would spend the whole budget (or more)
   on the count. The plan refuses it (:func:`check_count_noise`). As σ_b → ∞, σ_g → σ: flat clipping at C.
   (The bound is σ/2, not 1/(2σ): the count's sensitivity ½ over σ_b must stay below the pair's 1/σ.)

C changes between steps only as post-processing of earlier releases; each step is the mechanism above at the C
it started with (adaptive composition of identical Gaussian mechanisms). Under a noise schedule step t's σ_t
replaces σ in steps 2-4: the optimizer splits each step's pair from its own σ_t (σ_g,t = (σ_t⁻² − (2σ_b)⁻²)^(−1/2),
σ_b fixed), so step t is the Gaussian mechanism of σ_t that the accountant records for it; σ_b must exceed the
largest σ_t/2.

The engine wiring asks :class:`QuantileClipping` for this step's C, σ_g and σ_b: bk's
:class:`dpllm.privacy.bk.optimizer.QuantileAccumulation` (``Distributed...`` under DDP, ``Sharded...`` under
FSDP2), and for Opacus hooks and ghost :class:`dpllm.privacy.clipping.QuantileNoiseMixin` (one process or DDP;
``dpllm.privacy.user_level`` for ULS under hooks). Across processes every process's count is summed and the
noise added once, on rank 0 (:func:`dpllm.privacy.bk.optimizer.release_count`), so every process moves C alike.
A unit of several rows (a ULS user, a long record split into windows) is clipped once, in one physical batch on
one process: its bit enters the count once, and one unit moves the pair as one record does above. Only real units
enter the count: the masked stand-in row the trainer runs for an empty share is skipped
(:meth:`QuantileClipping.skip_next`); counted, it would make an empty batch and a batch of one record differ by 1.
The math here is testable without a model.

Example:
    >>> round(gradient_noise_multiplier(1.0, 2.0), 4)   # (1 − 1/16)^(−1/2)
    1.0328
    >>> q = QuantileClipping(initial=1.0, target_quantile=0.5, lr=0.2, count_noise_multiplier=2.0,
    ...                      expected_batch_size=4)
    >>> q.weights(torch.tensor([0.5, 2.0, 4.0])).tolist(), q.count
    ([1.0, 0.5, 0.25], -0.5)
"""

from __future__ import annotations

import math

import torch

from dpllm.privacy.accounting import PrivacyPlanError

DEFAULT_COUNT_NOISE_FRACTION = 20  # σ_b = m/20 by default, the paper's recommendation (Andrew et al. 2021, §3)


def smallest_count_noise(sigma: float) -> float:
    """σ/2: σ_b must exceed it, or σ_g would be infinite (step 4 of the module docstring)."""
    return sigma / 2.0


def gradient_noise_multiplier(sigma: float, count_noise_multiplier: float) -> float:
    """σ_g = (σ⁻² − (2σ_b)⁻²)^(−1/2): the gradient's noise that leaves the pair at noise multiplier σ.

    Raises:
        PrivacyPlanError: σ_b ≤ σ/2.
    """
    check_count_noise(sigma, count_noise_multiplier)
    return (sigma ** -2 - (2.0 * count_noise_multiplier) ** -2) ** -0.5


def check_count_noise(sigma: float, count_noise_multiplier: float) -> None:
    """Refuse a count noise σ_b too small for the planned σ, naming the smallest allowed value.

    Raises:
        PrivacyPlanError: σ_b ≤ σ/2 (or not a number).
    """
    low = smallest_count_noise(sigma)
    if not (count_noise_multiplier > low):  # also NaN
        raise PrivacyPlanError(
            f"count_noise_multiplier={count_noise_multiplier:g} is too small for the planned noise multiplier "
            f"σ={sigma:.4g}: clipping: quantile needs σ_b > σ/2 = {low:.4g} (the gradient's noise "
            f"σ_g = (σ⁻² − (2σ_b)⁻²)^(−1/2) is infinite otherwise); raise count_noise_multiplier above {low:.4g} "
            "(the default is the expected batch / 20), or a larger logical batch, or a larger target_epsilon")


def centred_count(norms: torch.Tensor, clip: float) -> float:
    """Σᵢ (1[‖gᵢ‖ ≤ C] − ½): one record moves it by exactly ½."""
    return float((norms <= clip).to(torch.float64).sum() - 0.5 * norms.numel())


def noised_fraction(count: float, noise: float, expected_batch_size: float) -> float:
    """b̃ = (count + noise) / m + ½, with m the expected (public) batch size, not the realised one."""
    return (count + noise) / expected_batch_size + 0.5


def next_clip(clip: float, fraction: float, target_quantile: float, lr: float) -> float:
    """C · exp(−η · (b̃ − γ)): C shrinks when more than γ of the records were under it, grows otherwise."""
    return clip * math.exp(-lr * (fraction - target_quantile))


class QuantileClipping:
    """The state of one run's adaptive C: the current C, this step's centred count and the trajectory.

    Args:
        initial: the first C (``max_grad_norm``).
        target_quantile: γ in (0, 1).
        lr: η ≥ 0 (0 keeps C fixed: flat clipping with a count nobody uses).
        count_noise_multiplier: σ_b, the count's noise standard deviation, in records.
        expected_batch_size: m = q·N, over all processes.
    """

    def __init__(self, *, initial: float, target_quantile: float, lr: float, count_noise_multiplier: float,
                 expected_batch_size: float):
        self.clip = float(initial)
        self.initial = float(initial)
        self.target_quantile, self.lr = float(target_quantile), float(lr)
        self.count_noise_multiplier = float(count_noise_multiplier)
        self.expected_batch_size = float(expected_batch_size)
        self.count = 0.0  # Σ(bᵢ − ½) over this step's micro-batches so far
        self.steps = 0
        self._skip = False  # the next weights() call is an empty share's stand-in row, not a record

    def gradient_noise_multiplier(self, sigma: float) -> float:
        """σ_g for the plan's σ and this run's σ_b (:func:`gradient_noise_multiplier`)."""
        return gradient_noise_multiplier(sigma, self.count_noise_multiplier)

    def skip_next(self) -> None:
        """The next :meth:`weights` call clips a stand-in row of zero gradient (an empty share), not a record."""
        self._skip = True

    def weights(self, norms: torch.Tensor) -> torch.Tensor:
        """Flat clipping weights min(1, C/‖gᵢ‖) at the current C; adds the records' centred bits to the count.

        Raises:
            RuntimeError: after :meth:`skip_next`, anything but one row of zero norm (a dpllm bug).
        """
        if self._skip:
            self._skip = False
            if norms.numel() != 1 or float(norms.max()) != 0.0:
                raise RuntimeError(f"clipping: quantile expected an empty share's one stand-in row of zero gradient, "
                                   f"got norms {norms.tolist()[:4]}; a dpllm bug")
        else:
            self.count += centred_count(norms, self.clip)
        return (self.clip / norms.clamp(min=1e-12)).clamp(max=1.0)

    def release(self, noise: float) -> float:
        """End a step: b̃ from this step's count and the count's ``noise`` (drawn by the caller), then the new C.

        Returns:
            b̃, the noised fraction of records whose norm was at most the C this step used.
        """
        return self.release_noised(self.count + noise)

    def release_noised(self, noised_count: float) -> float:
        """End a step from the noised count over all processes (under DDP: every process's count summed, the
        noise added once, on rank 0, as for the gradient); returns b̃."""
        fraction = noised_fraction(noised_count, 0.0, self.expected_batch_size)
        self.clip = next_clip(self.clip, fraction, self.target_quantile, self.lr)
        self.count, self.steps = 0.0, self.steps + 1
        return fraction

    def state_dict(self) -> dict:
        """What a resumable checkpoint keeps: C and the steps taken (both released values, not secrets)."""
        return {"clip": self.clip, "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.clip, self.steps, self.count, self._skip = float(state["clip"]), int(state["steps"]), 0.0, False

    def info(self, *, sigma: float, schedule=None) -> dict:
        """The report's ``adaptive_clipping`` entry; under a noise schedule (``schedule``: each piece's σ_t, σ₀ first)
        ``gradient_noise_multiplier`` is σ₀'s σ_g and ``gradient_noise_multipliers`` lists each piece's."""
        out = {"kind": "quantile", "target_quantile": self.target_quantile, "quantile_lr": self.lr,
               "count_noise_multiplier": self.count_noise_multiplier,
               "gradient_noise_multiplier": gradient_noise_multiplier(sigma, self.count_noise_multiplier),
               "initial_max_grad_norm": self.initial, "final_max_grad_norm": self.clip, "steps": self.steps}
        if schedule:
            out["gradient_noise_multipliers"] = [gradient_noise_multiplier(s, self.count_noise_multiplier)
                                                 for s in schedule]
        return out
