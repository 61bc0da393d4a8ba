"""Per-record signals of a causal LM, computed once and shared by every attack.

One forward pass per batch gives, for each record, the log-probability of each real next token and
the mean and spread of ``log p(.)`` under the model's next-token distribution at that position
(Min-K%++ needs both). Records are tokenised exactly as in training
(``tokenizer(text, truncation=True, max_length=L)``), padded on the right and the padding masked,
so a record's signals do not depend on which other records share its batch.

A run that split long records into windows (``long_records: split``, :mod:`dpllm.windows`) trained each record as
one unit over its first ``max_windows`` windows of ``max_length`` tokens: ``max_windows=`` scores it the same way,
each window a row, and a record's per-token signals are its windows' concatenated (its loss is the mean over all
of its scored tokens), so every attack scores the record, not a window.

Instruction and chat records (``dpllm.sft``: a run trained on ``messages`` or ``prompt``/``completion`` data)
are scored as a deployed assistant is attacked: the answer tokens given the prompt. They are rendered and
truncated exactly as in training, and every signal (loss, Min-K%, zlib of the answer) covers the answer
tokens only; the prompt is context, never scored.

Example:
    >>> sig = compute_signals(model, tokenizer, ["some text"], max_length=128)  # doctest: +SKIP
    >>> sig.loss.shape  # doctest: +SKIP
    (1,)
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class Signals:
    """Per-record signals; all arrays have one entry per record, in input order.

    Attributes:
        loss: Mean next-token NLL over the record's real tokens (nats), shape ``[n]``.
        num_tokens: Number of scored (predicted) tokens, i.e. tokenised length - 1, shape ``[n]``.
        zlib_bytes: Length in bytes of the zlib-compressed UTF-8 text, shape ``[n]``.
        token_logprobs: Per record, ``log p(x_t | x_<t)`` of each scored token.
        token_mu: Per record and token, ``E_p[log p]`` of the next-token distribution.
        token_sigma: Per record and token, ``Std_p[log p]`` of the next-token distribution.
    """

    loss: np.ndarray
    num_tokens: np.ndarray
    zlib_bytes: np.ndarray
    token_logprobs: list[np.ndarray] = field(repr=False)
    token_mu: list[np.ndarray] = field(repr=False)
    token_sigma: list[np.ndarray] = field(repr=False)

    def __len__(self) -> int:
        return int(self.loss.shape[0])

    def subset(self, idx) -> "Signals":
        """The signals of the records at positions ``idx``."""
        idx = np.asarray(idx, dtype=int)
        return Signals(
            loss=self.loss[idx], num_tokens=self.num_tokens[idx], zlib_bytes=self.zlib_bytes[idx],
            token_logprobs=[self.token_logprobs[i] for i in idx],
            token_mu=[self.token_mu[i] for i in idx],
            token_sigma=[self.token_sigma[i] for i in idx],
        )


def model_context_length(model) -> int | None:
    """The model's maximum number of positions, from its config (None when it does not say)."""
    config = getattr(model, "config", None)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def tokenize_records(tokenizer, texts: list[str], *, max_length: int | None,
                     context_length: int | None) -> list[list[int]]:
    """Token ids of each record, truncated like the training data.

    Raises:
        ValueError: If a record is longer than the model's context and no ``max_length`` was
            given, if ``max_length`` exceeds the context, or if a record has fewer than 2 tokens.
    """
    if max_length is not None and context_length is not None and max_length > context_length:
        raise ValueError(f"max_length={max_length} exceeds the model's context of {context_length} "
                         f"positions; pass --max-length {context_length} or less")
    if max_length is not None:
        ids = tokenizer(list(texts), truncation=True, max_length=max_length)["input_ids"]
    else:
        ids = tokenizer(list(texts))["input_ids"]
    for i, row in enumerate(ids):
        if context_length is not None and len(row) > context_length:
            raise ValueError(
                f"record {i} has {len(row)} tokens, more than the model's context of "
                f"{context_length}; pass max_length (--max-length) equal to the training "
                f"max_length so records are truncated exactly as they were in training")
        if len(row) < 2:
            raise ValueError(f"record {i} ({texts[i][:40]!r}) has {len(row)} token(s); at least 2 "
                             f"are needed to score a next-token prediction; drop empty records")
    return [list(map(int, row)) for row in ids]


#: ``record_format`` value that guesses the record shape from the texts (files of bare records with no run
#: behind them); an audit of a run directory passes the run's own shape (``splits.json``), as training used it.
GUESS = "guess"


def sft_answer_masks(tokenizer, texts: list[str], *, max_length: int, record_format: str | None = GUESS):
    """``(ids, answer masks)`` when the texts are dpllm instruction / chat records, else None.

    Args:
        tokenizer: The model's tokenizer.
        texts: The records.
        max_length: Truncation length.
        record_format: The shape training used (``messages``, ``prompt_completion``; None: plain text), or
            :data:`GUESS` to guess it from the texts. A run's audit passes its own: a plain-text run whose
            texts happen to be JSON must be scored on every token, as it was trained.

    Raises:
        ValueError: a record with no answer token within ``max_length``.
    """
    try:
        from dpllm import sft
    except ImportError:  # mia without dpllm: plain text only
        return None
    fmt = sft.format_of(texts) if record_format == GUESS else record_format
    if fmt is None:
        return None
    sft.prepare_tokenizer(tokenizer, None, needed=True)
    ids, masks = [], []
    for i, t in enumerate(texts):
        enc = sft.encode(sft.parse(t), tokenizer, max_length=max_length)
        if enc["answer_tokens"] == 0:
            raise ValueError(f"record {i} has no answer token within max_length={max_length}; the run dropped such "
                             "records, so they cannot be members")
        ids.append(enc["input_ids"].tolist())
        masks.append((enc["labels"] != -100).tolist())
    return ids, masks


def right_padded(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` of token rows padded on the right to the longest."""
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        input_ids[i, :len(r)] = torch.tensor(r)
        mask[i, :len(r)] = 1
    return input_ids, mask


@torch.no_grad()
def compute_signals(
    model,
    tokenizer,
    texts: list[str],
    *,
    max_length: int | None = None,
    batch_size: int = 8,
    device: str | torch.device | None = None,
    progress: bool = True,
    desc: str = "signals",
    record_format: str | None = GUESS,
    max_windows: int | None = None,
    window_stride: int = 0,
) -> Signals:
    """Score every record with one forward pass (batched) and return its signals.

    Args:
        model: A causal LM (``transformers`` model or a peft model around one). It is put in
            eval mode and moved to ``device``.
        tokenizer: Its tokenizer (the one saved with the checkpoint).
        texts: The records.
        max_length: Truncation length used in training; None means no truncation, in which case a
            record longer than the model's context is an error.
        batch_size: Records per forward pass.
        device: Where to run (``"cpu"``, ``"cuda"``, ...); default: where the model already is.
        progress: Show a tqdm progress bar.
        desc: Label of the progress bar.
        record_format: The records' shape as trained (see :func:`sft_answer_masks`); :data:`GUESS` by default.
        max_windows: Score each record over its first ``max_windows`` windows of ``max_length`` tokens, as a run
            with ``long_records: split`` trained it (text records only; None: one row, truncated).
        window_stride: with ``max_windows``, the run's overlap (``data.window_stride``): each window after a
            record's first repeats that many tokens of the one before as context, scored once (in the window before).

    Returns:
        The records' :class:`Signals`.

    Raises:
        ValueError: For records that are too long or too short (see :func:`tokenize_records`).
    """
    from tqdm.auto import tqdm

    if device is not None:
        model.to(device)
    model.eval()
    run_device = next(model.parameters()).device
    answers = sft_answer_masks(tokenizer, texts, max_length=max_length or model_context_length(model) or 10 ** 9,
                               record_format=record_format)
    owner = None  # split records: the record of each window row
    if answers is None and max_windows and max_length:
        from dpllm.windows import cut

        ids, owner, repeated = [], [], []
        for r, full in enumerate(tokenizer(list(texts), truncation=False, verbose=False)["input_ids"]):
            windows = cut(full, max_length=max_length, max_windows=max_windows, stride=window_stride)[0]
            ids += windows
            owner += [r] * len(windows)
            # a later window's tokens 1..s-1 are context (labels -100 in training): their predictions are dropped
            repeated += [0] + [max(0, window_stride - 1)] * (len(windows) - 1)
    elif answers is None:
        ids = tokenize_records(tokenizer, texts, max_length=max_length, context_length=model_context_length(model))
    else:
        ids, answers = answers
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    n = len(ids)
    logprobs: list = [None] * n
    mus: list = [None] * n
    sigmas: list = [None] * n
    # Batching records of similar length wastes less compute on padding; results go back in order.
    order = sorted(range(n), key=lambda i: len(ids[i]))
    bar = tqdm(total=n, desc=desc, disable=not progress, leave=False)
    for start in range(0, n, batch_size):
        batch = order[start:start + batch_size]
        input_ids, mask = right_padded([ids[i] for i in batch], pad_id)
        # Right padding keeps each real token at the position it had when run alone (a causal
        # model never attends forward), so padding cannot change a record's signals.
        logits = model(input_ids=input_ids.to(run_device), attention_mask=mask.to(run_device)).logits
        for row, i in enumerate(batch):
            k = len(ids[i]) - 1
            # One record at a time: a [tokens, vocab] float32 block is small even for 128k-token
            # vocabularies, where a whole batch would need gigabytes. float32 even for bf16
            # models, because log-probs of rare tokens need the precision.
            logp = torch.log_softmax(logits[row, :k].float(), dim=-1)
            targets = input_ids[row, 1:k + 1].to(run_device)
            p = logp.exp()
            # where(): a logit of -inf (masked token) has p = 0 and must contribute 0, not NaN.
            plogp = torch.where(p > 0, p * logp, 0.0)
            mu = plogp.sum(-1)
            # sigma^2 = E[(log p)^2] - mu^2 mathematically, but in float32 that difference of two
            # numbers near (log V)^2 loses ~4 digits; summing p (log p - mu)^2 does not.
            var = torch.where(p > 0, p * (logp - mu.unsqueeze(-1)).square(), 0.0).sum(-1)
            sigma = var.sqrt()
            logprobs[i] = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1).double().cpu().numpy()
            mus[i] = mu.double().cpu().numpy()
            sigmas[i] = sigma.double().cpu().numpy()
            if answers is not None:  # position t predicts token t + 1: keep the answer's predictions only
                keep = np.asarray(answers[i][1:k + 1], dtype=bool)
                logprobs[i], mus[i], sigmas[i] = logprobs[i][keep], mus[i][keep], sigmas[i][keep]
            elif owner is not None and repeated[i]:  # overlap: each token scored once, as trained
                logprobs[i], mus[i], sigmas[i] = (v[repeated[i]:] for v in (logprobs[i], mus[i], sigmas[i]))
        del logits
        bar.update(len(batch))
    bar.close()
    if owner is not None:  # one record, one unit: its windows' per-token signals, in order
        rows: list[list[int]] = [[] for _ in texts]
        for i, r in enumerate(owner):
            rows[r].append(i)
        logprobs, mus, sigmas = ([np.concatenate([v[i] for i in rows[r]]) for r in range(len(texts))]
                                 for v in (logprobs, mus, sigmas))

    return Signals(
        loss=np.array([-lp.mean() for lp in logprobs]),
        num_tokens=np.array([lp.size for lp in logprobs], dtype=np.int64),
        zlib_bytes=np.array([len(zlib.compress(t.encode("utf-8"))) for t in (texts if answers is None else [
            tokenizer.decode([x for x, a in zip(r, m) if a]) for r, m in zip(ids, answers)])], dtype=np.int64),
        token_logprobs=logprobs, token_mu=mus, token_sigma=sigmas,
    )
