"""Canary records for privacy audits: a registry of designs, each canary included by a fair coin.

A canary is a record the auditor writes, trains on with probability 1/2 (an independent coin per
canary, drawn before training) and later scores; ``mia canaries`` turns the scores into a lower
bound on ε. Each canary has a public ``prefix`` (the format, shared by all canaries) and a random
``secret`` after it; the audit scores the secret's tokens only, since the shared prefix is learnt
from members and non-members alike and carries no membership signal.

Designs (``data.canary_design``):

* ``random`` — the "secret sharer" format of Carlini et al. (2019): ``canary {i}: the secret code is``
  followed by 40 random letters and digits. Close to ordinary text, so the model's fit to the data
  also lowers non-members' loss.
* ``rare`` — input-space canaries in the spirit of Panda et al. (2025, "Privacy auditing of large
  language models"): make the secret out of tokens the training data (almost) never uses, so that
  nothing but the canary itself moves the model's predictions of those tokens and the canary is
  easy to memorise. Here: 12 random letters of the Cyrillic and Greek alphabets after a 3-character
  prefix (for byte-level tokenizers these are byte pairs that English documentation never contains).
* ``rare_long`` — the same with 32-letter secrets: more memorisable content per canary, at the price
  of a gradient shared over more tokens.
* ``short`` — no prefix, a secret of 2 random characters from U+0100..U+07FF (never in the data; for
  byte-level tokenizers 4 bytes, each character a lead/continuation byte pair). As short as a record
  can be, so the clipped gradient is concentrated on a few next-token predictions that other records
  hardly share: the input-space counterpart of a Dirac canary. Secrets are distinct.
* ``new_token`` — the "new token" canaries of Panda et al. (2025): the secret is one token that
  did not exist before, ``<dpllm_canary_{i}>``, added to the vocabulary for all ``m`` canaries
  (members and non-members alike, so the vocabulary says nothing about the coins), after the shared
  prefix ``§``. Its output row and input row are touched by that canary alone (and by every
  record's softmax push-down, the same for all canaries), so training on it moves the model in a
  direction nothing else does, and its loss reads that direction out. The auditor must control the
  vocabulary (a model developer's audit run, full fine-tuning); it costs ``m`` vocabulary rows.

Example:
    >>> [c["text"][:20] for c in make(2, design="random", seed=0)]  # doctest: +SKIP
"""

from __future__ import annotations

import random
import string

_ALNUM = string.ascii_lowercase + string.digits
# 32 Cyrillic + 24 Greek lower-case letters: two UTF-8 bytes each, never in English prose or code.
_RARE = "".join(chr(c) for c in range(0x430, 0x450)) + "".join(chr(c) for c in range(0x3B1, 0x3CA) if c != 0x3C2)


def _random(i: int, rng: random.Random) -> tuple[str, str]:
    return f"canary {i}: the secret code is ", "".join(rng.choice(_ALNUM) for _ in range(40))


def _rare(length: int):
    def design(i: int, rng: random.Random) -> tuple[str, str]:
        return "§§ ", "".join(rng.choice(_RARE) for _ in range(length))
    return design


_WIDE = "".join(chr(c) for c in range(0x100, 0x800))


def _short(i: int, rng: random.Random) -> tuple[str, str]:
    return "", "".join(rng.choice(_WIDE) for _ in range(2))


NEW_TOKEN = "<dpllm_canary_{}>"


def _new_token(i: int, rng: random.Random) -> tuple[str, str]:
    return "§", NEW_TOKEN.format(i)


DESIGNS = {"random": _random, "rare": _rare(12), "rare_long": _rare(32), "short": _short,
           "new_token": _new_token}
NEEDS_TOKENS = ("new_token",)


def added_tokens(canaries: list[dict]) -> list[str]:
    """Vocabulary entries the canaries need (every canary's, included or not), in canary order."""
    return [c["text"][len(c["prefix"]):] for c in canaries if c["design"] in NEEDS_TOKENS]


def add_tokens(model, tokenizer, tokens: list[str]) -> int:
    """Add ``tokens`` as special tokens and grow the model's embeddings to match; returns how many were new.

    New input and output rows start at the mean of the existing rows, with no randomness: every new
    token starts alike, so canaries differ after training only by what training did to them, and
    every process of a distributed run builds the same model.
    """
    import torch

    if not tokens:
        return 0
    old = len(tokenizer)
    added = tokenizer.add_tokens(tokens, special_tokens=True)
    new = len(tokenizer)
    if not added:  # an earlier stage's checkpoint already has them, trained
        return 0
    if new > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(new, mean_resizing=False)
    with torch.no_grad():
        rows = [model.get_input_embeddings().weight]
        out = model.get_output_embeddings()
        if out is not None and out.weight is not rows[0]:
            rows.append(out.weight)
        for w in rows:
            w[old:new] = w[:old].mean(dim=0)
        bias = getattr(out, "bias", None)
        if bias is not None:
            bias[old:new] = bias[:old].mean()
    return added


def make(num: int, *, design: str = "random", seed: int = 1234) -> list[dict]:
    """``num`` canaries of one design, each with its own fair inclusion coin.

    Args:
        num: Number of canaries m.
        design: A key of :data:`DESIGNS`.
        seed: Seeds the secrets and the coins (one ``random.Random`` stream, in canary order).

    Returns:
        ``[{"id", "text", "prefix", "design", "included"}, ...]``; ``text = prefix + secret``.
        The ``random`` design draws exactly as earlier dpllm versions did (same texts and coins).

    Raises:
        ValueError: An unknown design.
    """
    if design not in DESIGNS:
        raise ValueError(f"canary_design={design!r} is not known; choose one of {', '.join(DESIGNS)}")
    rng = random.Random(seed)
    out, seen = [], set()
    for i in range(num):
        prefix, secret = DESIGNS[design](i, rng)
        while prefix + secret in seen:  # a canary both in and out would have no label; redraw
            prefix, secret = DESIGNS[design](i, rng)
        seen.add(prefix + secret)
        out.append({"id": i, "text": prefix + secret, "prefix": prefix, "design": design,
                    "included": rng.random() < 0.5})
    return out
