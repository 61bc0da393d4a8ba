"""Sequence-level DP, declared (``PrivacyArguments(privacy_unit="sequence")``, issue 48).

The user declares that the protected unit is one **sequence**: one row of ``train_dataset``, a block of T
consecutive tokens cut from the concatenated training texts (transformers' ``run_clm.py`` ``group_texts``), as in
published sequence-level DP pretraining (VaultGemma: 1,024-token sequences). DP-SGD then runs exactly as at record
level with the blocks as its records: each block is Poisson-sampled, its gradient clipped to C, N counts blocks.
The accountant's ε protects one block.

A record (a document, a patient's note) is not a block. A record of at most T tokens lies in at most two
consecutive blocks (one of L tokens in at most ⌈L/T⌉ + 1), so it is protected as a **group of 2 blocks**. Its ε is
computed here with the tight group-privacy accounting dpllm uses for users of k records
(:func:`dpllm.privacy.user_level.mixture_epsilon`, k = 2): the two blocks are sampled independently, so in each
step J ~ Bin(2, q) of them are in the batch and the worst case moves the noised sum by J·C; one step is the
mixture of Gaussians Σⱼ P(J = j)·N(j·C, σ²C²) against N(0, σ²C²) (Ganesh 2024), composed over the whole
history by dp-accounting's PLD with pessimistic discretisation (an upper bound). The shortcut "group of k: run the
accountant at σ/k" treats the k blocks as always sampled together; the mixture accounts for how they are actually
sampled, and on the settings we tried its ε was 1.2–3.3× the mixture's.

    >>> info = sequence_level_info(history=[(1.0, 0.1, 10)], delta=1e-5, tokens=128)
    >>> info["group_size"], round(info["group_epsilon"], 1)
    (2, 6.2)
"""

from __future__ import annotations

import math

from dpllm.privacy import user_level

GROUP_SIZE = 2  # blocks one record of at most T tokens can touch
GROUP_PRIVACY = ("a record of at most T tokens lies in at most 2 consecutive sequences: a group of 2, each sampled "
                 "independently; its ε is the tight group-privacy accounting (mixture of Gaussians N(J·C, σ²C²), "
                 "J ~ Bin(2, q), against N(0, σ²C²), Ganesh 2024) composed by dp-accounting's PLD at the same δ")


def sequence_level_info(*, history, delta: float, tokens: int) -> dict:
    """The report's ``sequence_level`` field: what one unit is and the ε of a record that spans two of them.

    Args:
        history: the run's ``[(σ, q, steps), ...]``.
        delta: the run's δ (the group's ε is read at the same δ).
        tokens: T, the tokens of one sequence (the rows' length).
    """
    eps2 = user_level.mixture_epsilon(history=history, delta=delta, group_size=GROUP_SIZE)
    return {"unit": "sequence", "tokens_per_sequence": int(tokens), "group_size": GROUP_SIZE,
            "group_epsilon": eps2 if math.isfinite(eps2) else None, "group_delta": delta,
            "group_privacy": GROUP_PRIVACY}

