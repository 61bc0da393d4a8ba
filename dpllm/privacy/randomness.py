"""Secret, fresh randomness for the two things DP-SGD must keep from an attacker: the noise and the sampling.

The Gaussian mechanism protects a record only if nobody can regenerate the noise that was added, and
Poisson subsampling amplifies privacy only if nobody can tell which batches held which records. So both
generators are seeded from the operating system's entropy (:func:`secrets.randbits`), anew for every run,
every stage and every process, and the seed is never written anywhere. ``train.seed`` still controls
weight initialisation, the data split and the non-private shuffle; it has no say here.

What a resumable checkpoint under ``checkpoints/`` keeps is the generators' *state* (owner-only files),
so that a killed run continues with exactly the noise and batches it would have drawn. The final
``checkpoint/``, the report, the summary and the logs never hold it.

``privacy.reproducible_noise: true`` derives both from ``train.seed`` instead, for tests and debugging:
the report then says ``"noise_secret": false`` and ``dpllm report``, ``dpllm ledger verify`` and
``dpllm export`` treat the run as not releasable. A resumed launch restores each process's saved noise
state; on another number of processes it cannot (:func:`dpllm.resume.rng_for_process`), and the noise
stream it starts instead is keyed by the step it resumes from and the new process count as well, so it
never restarts a stream an earlier launch of the stage drew from (every earlier launch started at an
earlier step).

``privacy.secure_mode: true`` goes one step further and draws the noise from Opacus's cryptographically
secure generator (torchcsprng): it closes the gap that torch's Mersenne-Twister generator, although
secretly seeded, is not a cryptographic generator. It needs ``pip install torchcsprng`` (no build for
every torch release exists) and costs time for each noise draw (Opacus's docs cite a few-fold slower
noise generation; noise is a small part of a step for LLMs).
"""

from __future__ import annotations

import secrets
from typing import Optional

import torch

from dpllm.distributed import World, broadcast_object
from dpllm.sampling import stream_seed


def secret_seed() -> int:
    """63 bits from the operating system's entropy pool."""
    return secrets.randbits(63)


def privacy_generators(*, reproducible: bool, seed: int, stage: str, world: World, device,
                       secure_mode: bool = False,
                       resumed_at: Optional[int] = None) -> dict[str, Optional[torch.Generator]]:
    """The Poisson-sampling and noise generators of one run stage on this process.

    Sampling must draw the same global mask on every process, so rank 0's secret seed is broadcast to
    the others (over the process group, never to disk). Noise is independent on every process (under
    FSDP each adds noise to its own shard): each process seeds its own.

    Args:
        reproducible: derive both seeds from ``seed`` and ``stage`` (tests and debugging only).
        seed: ``train.seed``; used only when ``reproducible``.
        stage: the stage's name, so that two reproducible stages never share noise.
        world: this process's place among the processes.
        device: where the noise is drawn.
        secure_mode: Opacus draws the noise itself from its secure generator (returns ``noise: None``).
        resumed_at: the step a resumed launch starts from (None for a fresh run). Under ``reproducible``, the
            noise seed then also depends on it and on ``world.size``: a resume on another number of processes
            keeps the generator made here, and with the fresh run's seed rank 0 would draw again the noise it
            drew from step 1 on.

    Returns:
        ``{"sampling": Generator, "noise": Generator or None}``.
    """
    if reproducible:
        sampling_seed = stream_seed(seed, f"{stage}:poisson")
        noise_seed = stream_seed(seed, f"{stage}:noise:{world.rank}" + (
            "" if resumed_at is None else f":resumed-at:{resumed_at}:of:{world.size}"))
    else:
        sampling_seed = broadcast_object(secret_seed() if world.is_main else None, world)
        noise_seed = secret_seed()
    sampling = torch.Generator().manual_seed(sampling_seed)
    noise = None if secure_mode else torch.Generator(device=device).manual_seed(noise_seed)
    return {"sampling": sampling, "noise": noise}
