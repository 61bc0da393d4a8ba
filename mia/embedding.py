"""Membership inference through an embedding interface ("Embedding-as-an-Interface").

Threat model: the fine-tuned model is served as an embedding API. The attacker submits any text and gets
back its embedding, the hidden states of one layer ``L`` mean-pooled over the text's tokens, and nothing
else: no logits, no loss, no generated text. An audit asks whether those vectors still tell the records
the model was trained on (members) from records of the same distribution it never saw (non-members). The
loss attacks of :mod:`mia.attacks` do not apply here; the attacks below use only embeddings.

The attacks (scores: higher = more likely a member), in a string-keyed registry like :mod:`mia.attacks`:

``halves``
    Cosine similarity between the embeddings of a record's first and second half (token halves). Training
    on a text pulls the representations of its parts together; Song and Raghunathan (2020, "Information
    leakage in embedding models") turned that co-occurrence similarity into a membership test. Needs only
    the target's embeddings.
``halves_ref``
    The same similarity minus the reference model's similarity on the same halves (difficulty calibration:
    some texts are self-similar under any model). Needs ``reference``.
``ref_distance``
    Distance between the target's and the reference's embedding of the record, standardised per dimension
    over the audited records (how far fine-tuning moved this record's representation; members move more).
    Needs ``reference``.
``prefix_lens``
    The embedding of a causal model's text is the mean of its positions' hidden states, and position ``t``
    sees only tokens ``<= t``. So the embeddings of the prefixes ``x_<=t`` and ``x_<t`` give position ``t``'s
    state exactly: ``h_t = t·e(x_<=t) - (t-1)·e(x_<t)`` (``T`` queries per record). Through a public output
    head (the reference model's final norm and unembedding: the "logit lens", nostalgebraist 2020; for a
    LoRA run the frozen base head, which is the target's own) those states give next-token log-probabilities,
    and the mean log-probability of the record's own tokens is the loss attack rebuilt from embeddings.
    Needs ``reference`` (whose head is public). The audit computes the ``T`` prefix states with one forward
    pass, which gives the same vectors for a causal model (``tests/test_mia_embedding.py`` checks it against
    real prefix queries).
``prefix_lens_ref``
    ``prefix_lens`` minus the reference model's own mean log-probability of the record's tokens at the same
    layer (difficulty calibration, as the ``ref`` loss attack). Needs ``reference``.
``classifier``
    A logistic regression on embedding features (the target's embedding, and with a reference the shift
    from it, plus the ``halves`` similarities), trained on records whose membership the attacker knows:
    the audited records are split into K folds and each fold is scored by a classifier fitted on the other
    folds (cross-fitting), so no record's own label enters its score. This is the supervised attacker of
    the shadow-data setting, with labelled data drawn from the same run: stronger than a shadow attacker
    (its labelled records are exact members and non-members of *this* model), so a low AUC is more
    convincing.

Every attack is evaluated with the metrics of :func:`mia.metrics.evaluate` (AUC and TPR at low FPR with
bootstrap intervals) and drawn against the DP region ``TPR <= e^ε FPR + δ``: a model trained with (ε, δ)-DP
bounds every test on any function of it, embeddings included (post-processing), so the bound applies as is.

Example:
    >>> emb = embed_records(model, tokenizer, ["some text"], layer=-1, max_length=128)  # doctest: +SKIP
    >>> report, scores = run_embedding_audit(model, tok, members, nonmembers, layer=-1)  # doctest: +SKIP
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable

import numpy as np

from mia.metrics import DEFAULT_FPRS, evaluate


@dataclass(frozen=True)
class EmbeddingAttack:
    """A registered embedding attack: ``fn(target, reference, labels, *, seed) -> scores``."""

    name: str
    fn: Callable[..., np.ndarray]
    needs_reference: bool
    help: str


EMBEDDING_ATTACKS: dict[str, EmbeddingAttack] = {}


def _register(name: str, *, needs_reference: bool = False, help: str = ""):
    def wrap(fn):
        EMBEDDING_ATTACKS[name] = EmbeddingAttack(name, fn, needs_reference, help)
        return fn
    return wrap


@dataclass
class Embeddings:
    """What the interface returns for each audited record: the whole record's and its two halves' embeddings.

    Attributes:
        full: ``[n, d]`` embedding of each record.
        first: ``[n, d]`` embedding of the first half of its tokens.
        second: ``[n, d]`` embedding of the second half.
        lens: ``[n]`` mean log-probability of each record's tokens through a public head applied to its
            prefix states (:func:`make_lens`), when a head was given.
    """

    full: np.ndarray
    first: np.ndarray
    second: np.ndarray
    lens: np.ndarray | None = None


def resolve_layer(model, layer: int) -> int:
    """Index into ``hidden_states`` (0 = token embeddings, ``num_layers`` = last block's output; negative from
    the end), checked against the model's depth.

    Raises:
        ValueError: A layer the model does not have.
    """
    config = getattr(model, "config", None)
    depth = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)
    if depth is None:
        return layer
    if not -(depth + 1) <= layer <= depth:
        raise ValueError(f"--layer {layer} is outside this model's hidden states 0..{depth} (or -1..-{depth + 1} "
                         f"from the end); pick a layer in that range")
    return layer % (depth + 1)


def _pool(hidden, mask):
    # Mean over the record's real tokens: what a sentence-embedding API serves by default.
    mask = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(1) / mask.sum(1).clamp_min(1.0)


def embed_ids(model, ids: list[list[int]], *, layer: int, batch_size: int = 8, pad_id: int = 0,
              progress: bool = False, desc: str = "embeddings", lens=None):
    """Mean-pooled hidden states of layer ``layer`` for each token sequence (right padded, padding masked).

    Args:
        model: A causal LM or a peft model around one.
        ids: Token ids per record.
        layer: Index into the model's ``hidden_states`` (see :func:`resolve_layer`).
        batch_size: Records per forward pass.
        pad_id: Padding id (never attended to, never pooled).
        progress: Show a tqdm bar.
        lens: Optional ``hidden [T, d] -> logits [T, V]`` (:func:`make_lens`): also return each record's mean
            log-probability of its tokens ``2..T`` through it, from the states of positions ``1..T-1``.

    Returns:
        ``[n, d]`` float64 array; with ``lens``, ``(embeddings, lens_scores [n])``.
    """
    import torch
    from tqdm.auto import tqdm

    from mia.signals import right_padded

    device = next(model.parameters()).device
    out = [None] * len(ids)
    scores = np.full(len(ids), np.nan)
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    with torch.no_grad():
        for start in tqdm(range(0, len(ids), batch_size), desc=desc, disable=not progress, leave=False):
            batch = order[start:start + batch_size]
            input_ids, mask = right_padded([ids[i] for i in batch], pad_id)
            hidden = model(input_ids=input_ids.to(device), attention_mask=mask.to(device),
                           output_hidden_states=True).hidden_states[layer]
            pooled = _pool(hidden.float(), mask.to(device)).double().cpu().numpy()
            for row, i in enumerate(batch):
                out[i] = pooled[row]
                if lens is not None and len(ids[i]) > 1:
                    # Position t's state (what the prefix queries recover) predicts token t + 1.
                    k = len(ids[i]) - 1
                    logp = torch.log_softmax(lens(hidden[row, :k]).float(), dim=-1)
                    target = torch.tensor(ids[i][1:], device=logp.device)
                    scores[i] = float(logp.gather(-1, target[:, None]).mean())
    return (np.stack(out), scores) if lens is not None else np.stack(out)


def make_lens(model, layer: int):
    """``hidden -> logits`` through ``model``'s output head, with its final norm for a layer below the last
    (``hidden_states[-1]`` of Hugging Face decoders already has the final norm applied).

    Raises:
        ValueError: The model has no output head, or no final norm where one is needed.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        raise ValueError("the prefix_lens attacks need a reference model with an output head (a causal LM)")
    depth = resolve_layer(model, -1)
    if resolve_layer(model, layer) == depth:
        return head
    decoder = model.get_decoder()
    norm = next((getattr(decoder, n) for n in ("norm", "ln_f", "final_layer_norm") if hasattr(decoder, n)), None)
    if norm is None:
        raise ValueError(f"cannot find the final norm of {type(decoder).__name__} for the logit lens at layer "
                         f"{layer}; use --layer -1 or drop the prefix_lens attacks")
    return lambda h: head(norm(h))


def embed_records(model, tokenizer, texts: list[str], *, layer: int = -1, max_length: int | None = None,
                  batch_size: int = 8, device=None, progress: bool = False, desc: str = "embeddings",
                  lens=None) -> Embeddings:
    """The interface's answer for each record, and for each record's two token halves.

    Records are tokenised exactly as in training (:func:`mia.signals.tokenize_records`); the halves split the
    truncated token sequence at its midpoint, so both halves hold at least one token.

    Raises:
        ValueError: Records too short or too long (as :func:`mia.signals.tokenize_records`), a bad layer.
    """
    from mia.signals import model_context_length, tokenize_records

    if device is not None:
        model.to(device)
    model.eval()
    layer = resolve_layer(model, layer)
    ids = tokenize_records(tokenizer, texts, max_length=max_length, context_length=model_context_length(model))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    mid = [len(r) // 2 for r in ids]
    common = dict(layer=layer, batch_size=batch_size, pad_id=pad, progress=progress)
    full = embed_ids(model, ids, desc=desc, lens=lens, **common)
    full, scores = full if lens is not None else (full, None)
    return Embeddings(full=full, lens=scores,
                      first=embed_ids(model, [r[:m] for r, m in zip(ids, mid)], desc=f"{desc} (1st half)", **common),
                      second=embed_ids(model, [r[m:] for r, m in zip(ids, mid)], desc=f"{desc} (2nd half)", **common))


def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    na, nb = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
    return (a * b).sum(1) / np.maximum(na * nb, 1e-12)


@_register("halves", help="cosine similarity of the embeddings of a record's two halves (Song & Raghunathan 2020)")
def _halves(target: Embeddings, reference, labels, *, seed: int) -> np.ndarray:
    return _cosine(target.first, target.second)


@_register("halves_ref", needs_reference=True,
           help="halves similarity minus the reference model's (difficulty calibration)")
def _halves_ref(target: Embeddings, reference: Embeddings, labels, *, seed: int) -> np.ndarray:
    return _cosine(target.first, target.second) - _cosine(reference.first, reference.second)


@_register("ref_distance", needs_reference=True,
           help="how far fine-tuning moved the record's embedding from the reference's (standardised)")
def _ref_distance(target: Embeddings, reference: Embeddings, labels, *, seed: int) -> np.ndarray:
    shift = target.full - reference.full
    # Standardise per dimension over the audited records: a few dimensions that move for every record (a
    # global drift of fine-tuning) would otherwise drown the record-specific part. Uses no labels.
    z = (shift - shift.mean(0)) / np.maximum(shift.std(0), 1e-12)
    return np.linalg.norm(z, axis=1)


@_register("prefix_lens", needs_reference=True,
           help="per-position states from prefix embeddings, through the reference's public head: mean log-prob")
def _prefix_lens(target: Embeddings, reference: Embeddings, labels, *, seed: int) -> np.ndarray:
    return target.lens


@_register("prefix_lens_ref", needs_reference=True,
           help="prefix_lens minus the reference model's own mean log-prob of the record (calibrated)")
def _prefix_lens_ref(target: Embeddings, reference: Embeddings, labels, *, seed: int) -> np.ndarray:
    return target.lens - reference.lens


def features(target: Embeddings, reference: Embeddings | None) -> np.ndarray:
    """The classifier's inputs: target embedding, its shift from the reference, and the halves similarities."""
    cols = [target.full, _cosine(target.first, target.second)[:, None]]
    if reference is not None:
        cols += [target.full - reference.full, _cosine(reference.first, reference.second)[:, None]]
        if target.lens is not None:
            cols += [target.lens[:, None], (target.lens - reference.lens)[:, None]]
    return np.hstack(cols)


@_register("classifier", help="logistic regression on embedding features, cross-fitted on records of known "
                              "membership (each fold scored by a model fitted on the others)")
def _classifier(target: Embeddings, reference, labels, *, seed: int, folds: int = 5) -> np.ndarray:
    from sklearn.linear_model import LogisticRegressionCV
    from sklearn.model_selection import StratifiedKFold
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    x, y = features(target, reference), np.asarray(labels, dtype=int)
    folds = int(min(folds, np.bincount(y, minlength=2).min()))
    if folds < 2:
        raise ValueError("the classifier attack needs at least 2 members and 2 non-members")
    scores = np.empty(len(y))
    for train, test in StratifiedKFold(folds, shuffle=True, random_state=seed).split(x, y):
        inner = int(min(3, np.bincount(y[train], minlength=2).min()))
        clf = make_pipeline(StandardScaler(), LogisticRegressionCV(Cs=8, cv=max(inner, 2), max_iter=2000))
        clf.fit(x[train], y[train])
        scores[test] = clf.decision_function(x[test])
    return scores


def parse_attacks(attacks) -> list[str]:
    """Attack names from a list or a comma-separated string.

    Raises:
        ValueError: An unknown name (the message lists the known ones).
    """
    names = [a.strip() for a in attacks.split(",")] if isinstance(attacks, str) else list(attacks)
    unknown = [n for n in names if n not in EMBEDDING_ATTACKS]
    if unknown or not names:
        raise ValueError(f"unknown embedding attack(s) {unknown}; choose from {', '.join(EMBEDDING_ATTACKS)}")
    return names


def default_attacks(with_reference: bool) -> list[str]:
    """Every attack the given models allow."""
    return [n for n, a in EMBEDDING_ATTACKS.items() if with_reference or not a.needs_reference]


def check_reference(model, tokenizer, ref_model, ref_tokenizer) -> None:
    """The reference must be the kind of model the target was fine-tuned from: same width and vocabulary
    (its embeddings are compared with the target's, and its head reads the target's states).

    Raises:
        ValueError: A different hidden size or vocabulary.
    """
    widths = [getattr(getattr(m, "config", None), a, None) for m in (model, ref_model)
              for a in ("hidden_size",)]
    if None not in widths and widths[0] != widths[1]:
        raise ValueError(f"the reference's hidden size {widths[1]} differs from the target's {widths[0]}; pass the "
                         f"model the target was fine-tuned from as --reference")
    if tokenizer.get_vocab() != ref_tokenizer.get_vocab():
        raise ValueError("the reference's tokenizer differs from the target's; pass the model the target was "
                         "fine-tuned from as --reference")


@contextmanager
def adapters_disabled(model):
    """The base model under a LoRA model (peft's ``disable_adapter``): the reference a LoRA audit needs for free."""
    ctx = model.disable_adapter() if hasattr(model, "disable_adapter") else None
    if ctx is None:
        raise ValueError("reference 'base' needs a LoRA (peft) model; for a fully fine-tuned model pass "
                         "--reference PATH to the model it started from")
    with ctx:
        yield model


def run_embedding_audit(model, tokenizer, members: list[str], nonmembers: list[str], *, layer: int = -1,
                        attacks=None, reference=None, max_length=None, batch_size: int = 8, device=None,
                        n_bootstrap: int = 1000, seed: int = 0, max_records: int | None = None,
                        progress: bool = True, blind: bool = True) -> tuple[dict, dict]:
    """Embed members and non-members through layer ``layer``, score each embedding attack, evaluate it.

    Args:
        model: The target model (causal LM or peft model).
        tokenizer: Its tokenizer.
        members, nonmembers: Texts trained on / not trained on (same distribution).
        layer: Hidden-state index the embedding API serves (``-1``: the last).
        attacks: Names from :data:`EMBEDDING_ATTACKS` (default: all the models allow).
        reference: ``(model, tokenizer)`` of a reference model, or ``"base"`` for the target's own base
            model with its LoRA adapters disabled.
        max_length: Training truncation length.
        batch_size, device, n_bootstrap, seed, max_records, progress, blind: As :func:`mia.audit.run_audit`.

    Returns:
        ``(report, scores)`` in the shape :func:`mia.report.write_attack_report` writes.

    Raises:
        ValueError: Unknown attack, a reference-based attack without a reference, empty or overlapping sets.
    """
    from mia.audit import _subsample, check_member_sets

    names = parse_attacks(attacks) if attacks else default_attacks(reference is not None)
    needs = [n for n in names if EMBEDDING_ATTACKS[n].needs_reference]
    if needs and reference is None:
        raise ValueError(f"attack(s) {needs} need a reference model; pass --reference PATH (the model before "
                         f"fine-tuning) or --reference base for a LoRA run, or drop them from --attacks")
    check_member_sets(members, nonmembers)
    rng = np.random.default_rng(seed)
    members, nonmembers = _subsample(members, max_records, rng), _subsample(nonmembers, max_records, rng)
    texts, n_m = members + nonmembers, len(members)
    labels = np.r_[np.ones(n_m, dtype=int), np.zeros(len(nonmembers), dtype=int)]
    common = dict(layer=layer, max_length=max_length, batch_size=batch_size, device=device, progress=progress)
    ref, lens = None, None
    if reference is not None:
        ref_model, ref_tok = (model, tokenizer) if reference == "base" else reference
        check_reference(model, tokenizer, ref_model, ref_tok)
        # The public head: the reference's (a LoRA run's base head is frozen, so it is also the target's).
        lens = make_lens(ref_model, layer)
    target = embed_records(model, tokenizer, texts, desc="target", lens=lens, **common)
    if reference is not None:
        with adapters_disabled(model) if reference == "base" else nullcontext():
            ref = embed_records(ref_model, ref_tok, texts, desc="reference", lens=lens, **common)
    report = {"interface": "embedding", "layer": resolve_layer(model, layer), "pooling": "mean over tokens",
              "n_members": n_m, "n_nonmembers": len(nonmembers), "max_length": max_length,
              "embedding_dim": int(target.full.shape[1]), "reference": None if reference is None else (
                  "base (LoRA adapters disabled)" if reference == "base" else "given model"),
              "fprs": list(DEFAULT_FPRS), "seed": seed, "n_bootstrap": n_bootstrap, "ci_confidence": 0.95,
              "attacks": {}}
    scores = {}
    for name in names:
        s = EMBEDDING_ATTACKS[name].fn(target, ref, labels, seed=seed)
        scores[name] = (s[:n_m], s[n_m:])
        report["attacks"][name] = evaluate(s[:n_m], s[n_m:], n_bootstrap=n_bootstrap, seed=seed)
    report["attack_help"] = {n: EMBEDDING_ATTACKS[n].help for n in names}
    if blind:
        from mia.blind import blind_baseline

        report["blind"] = blind_baseline(members, nonmembers, seed=seed)
    return report, scores
