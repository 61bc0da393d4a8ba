"""White-box one-run audit: Dirac gradient canaries scored from the noisy updates.

Threat model: the auditor sees **every noisy update** of DP-SGD (what the accountant's guarantee
covers: the whole sequence of released gradients, as with a curious party in federated or
distributed training), and may insert records whose gradient it chooses. Each of ``m`` canaries is
a record whose per-sample gradient is ``K e_j`` on a coordinate ``j`` that no other record touches
(a "Dirac" canary, Steinke, Nasr & Jagielski 2023, §6; Nasr et al. 2023); with ``K >= C`` clipping
makes it exactly ``C e_j``. Each canary is included by a fair coin. After training the auditor scores
canary ``j`` from coordinate ``j`` of the noisy updates alone, and the scores go to the one-run
bounds of :mod:`mia.canaries`.

Our code, not a re-implementation: the run is a tiny Llama trained on real records through
``dpllm.privacy.plan.plan_privacy`` (noise calibrated by the configured accountant to the target
ε over all records, canaries included) and ``make_private`` (Opacus per-sample clipping with the
configured clipping function, Gaussian noise, Poisson sampling by ``dpllm.sampling``). The canary
coordinates are an ``nn.Embedding(m + 1, 1)`` "probe" inside the trained module, so they get their
per-sample gradients, clipping and noise from the same optimizer step as the language model.
Only the hooks per-sample mode is used (the probe's loss is not a token loss, which ghost clipping
needs); the noise and accounting are identical in both modes.

Scores (the per-step noisy coordinate ``x_t``, in units of ``C``, is ``N(0, σ²)`` plus 1 when the
canary was sampled):

* ``"lr"`` (default): the log-likelihood ratio of "Bernoulli(q) signal + noise" against "noise", summed
  over steps; the most powerful score when the auditor knows q and σ (Neyman-Pearson per step);
* ``"sum"``: the plain sum of the coordinate over steps.

Example:
    >>> rep = whitebox_audit(m=1000, steps=50, target_epsilon=8.0)  # doctest: +SKIP
    >>> rep["primary"]["epsilon_lower"] <= rep["accountant_epsilon"]  # doctest: +SKIP
    True
"""

from __future__ import annotations

import math
import time
import warnings

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset


class _Records(Dataset):
    """Token ids plus the canary index of each record (``m`` for a real record)."""

    def __init__(self, items: list[tuple[torch.Tensor, int]]):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        return self.items[i]


class ProbedLM(nn.Module):
    """A causal LM plus one trainable coordinate per canary (the Dirac canaries' parameters)."""

    def __init__(self, lm: nn.Module, m: int, push: float):
        super().__init__()
        self.lm = lm
        self.probe = nn.Embedding(m + 1, 1)  # row m: the shared, untouched row of real records
        nn.init.zeros_(self.probe.weight)
        self.m, self.push = m, push

    def forward(self, input_ids, attention_mask, position_ids, canary):
        logits = self.lm(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        probe = self.probe(canary).squeeze(-1)  # [B]
        return logits, probe


def _collate(pad_id: int):
    from dpllm.data import make_collate

    base = make_collate(pad_id)

    def collate(batch):
        if not batch:
            return {}
        out = base([ids for ids, _ in batch])
        out["canary"] = torch.tensor([j for _, j in batch], dtype=torch.long)
        return out
    return collate


def _loss(model, batch, m: int, push: float):
    from dpllm.models import position_ids_for
    from dpllm.privacy.engine import sequence_loss

    ids = batch["input_ids"]
    logits, probe = model(ids, batch["attention_mask"], position_ids_for(ids), batch["canary"])
    is_canary = (batch["canary"] < m).float()
    # Per record: its LM loss (0 for canaries: their labels are all masked) plus push * probe for a
    # canary, whose gradient is push * e_j. sequence_loss is a mean over records, so add a mean too.
    return sequence_loss(logits, batch["labels"]) + (push * probe * is_canary).mean()


def score_updates(x: np.ndarray, *, q: float, sigma: float, kind: str = "lr") -> np.ndarray:
    """Per-canary score from its noisy coordinates ``x`` (``[steps, m]``, in units of C).

    Example:
        >>> score_updates(np.zeros((2, 1)), q=0.5, sigma=1.0, kind="sum")
        array([0.])
    """
    if kind == "sum":
        return x.sum(axis=0)
    if kind == "lr":
        # log((1 - q) + q exp((x - 1/2) / σ²)), computed stably with logaddexp.
        return np.logaddexp(math.log1p(-q), math.log(q) + (x - 0.5) / sigma ** 2).sum(axis=0)
    raise ValueError(f"score={kind!r}; use 'lr' or 'sum'")


def whitebox_audit(*, m: int = 1000, num_records: int = 200, steps: int = 100, sample_rate: float = 0.05,
                   target_epsilon: float | None = 8.0, noise_multiplier: float | None = None,
                   delta: float = 1e-5, accountant: str = "prv", max_grad_norm: float = 1.0,
                   clipping: str = "flat", score: str = "lr", confidence: float = 0.95,
                   max_length: int = 16, seed: int = 0) -> dict:
    """Train a tiny Llama with DP-SGD plus ``m`` Dirac canaries and audit it from the noisy updates.

    Args:
        m: Number of canaries (each included with probability 1/2).
        num_records: Real pydoc records trained alongside them.
        steps: DP-SGD steps.
        sample_rate: Target Poisson rate q; the batch size is ``round(q * N)`` over the N records.
        target_epsilon: Calibrate σ to this ε (None: use ``noise_multiplier``).
        noise_multiplier: σ to use when ``target_epsilon`` is None (e.g. 1e-3 for a no-noise check).
        delta, accountant, max_grad_norm, clipping: As in ``PrivacyConfig``.
        score: ``"lr"`` or ``"sum"`` (:func:`score_updates`).
        confidence: Of the one-run bounds.
        max_length: Token length of the real records.
        seed: Coins, model init, sampling and noise.

    Returns:
        ``{"accountant_epsilon", "delta", "noise_multiplier", "sample_rate", "steps", "m",
        "n_included", "num_records", "score", "primary" (epsdelta bound), "gdp", "seconds",
        "scores", "included"}``.
    """
    from dpllm.config import ModelConfig, PrivacyConfig
    from dpllm.data import DataConfig, load_records
    from dpllm.models import build_tiny, byte_tokenizer, prepare_model
    from dpllm.privacy.engine import add_empty_share, make_private
    from dpllm.privacy.plan import plan_privacy
    from mia.canaries import one_run_audit

    start = time.time()
    rng = np.random.default_rng(seed)
    included = rng.random(m) < 0.5
    torch.manual_seed(seed)
    tok = byte_tokenizer()
    texts = load_records(DataConfig(dataset="pydoc"))[:num_records]
    enc = tok(texts, truncation=True, max_length=max_length)["input_ids"]
    items = [(torch.tensor(ids), m) for ids in enc]
    # A canary's tokens never reach the loss (labels masked); two tokens keep the LM forward cheap.
    items += [(torch.tensor([tok.eos_token_id, tok.eos_token_id]), int(j)) for j in np.flatnonzero(included)]
    n = len(items)
    batch = max(1, int(round(sample_rate * n)))

    mcfg = ModelConfig(model_name_or_path="tiny-llama", finetuning="full", tiny_hidden_size=16,
                       tiny_num_layers=1, tiny_num_heads=2, tiny_intermediate_size=32,
                       tiny_max_positions=max(32, max_length))
    lm, _ = prepare_model(build_tiny(mcfg, tok, max_length), mcfg, dp=True)
    push = 10.0 * max_grad_norm  # >= C, so flat clipping leaves exactly C e_j
    model = ProbedLM(lm, m, push)
    pcfg = PrivacyConfig(target_epsilon=target_epsilon if noise_multiplier is None else None,
                         noise_multiplier=noise_multiplier, target_delta=delta, accountant=accountant,
                         max_grad_norm=max_grad_norm, grad_sample_mode="hooks", clipping=clipping)
    plan = plan_privacy(num_records=n, logical_batch_size=batch, steps=steps, target_epsilon=pcfg.target_epsilon,
                        delta=delta, accountant=accountant, noise_multiplier=noise_multiplier)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(seed + 1)
    private = make_private(model=model, optimizer=optimizer, dataset=_Records(items),
                           collate_fn=_collate(tok.pad_token_id), cfg=pcfg, plan=plan,
                           logical_batch_size=batch, noise_generator=gen,
                           sampling_generator=torch.Generator().manual_seed(seed + 2))
    probe = private.model._module.probe.weight
    scale = private.optimizer.expected_batch_size / max_grad_norm  # noisy mean -> sum, in units of C
    x = np.zeros((steps, m))
    loader = iter(private.data_loader)
    # Canary records have no trainable input; torch warns that the backward hook sees only outputs.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        for t in range(steps):
            b = next(loader)
            private.optimizer.zero_grad(set_to_none=True)
            if b:
                _loss(private.model, b, m, push).backward()
            else:
                add_empty_share(private.optimizer)
            private.optimizer.step()
            # What the auditor sees: the released noisy gradient, here the canaries' coordinates.
            x[t] = probe.grad[:m, 0].detach().numpy() * scale
    sigma = plan.noise_multiplier
    q = plan.sample_rate
    scores = score_updates(x, q=q, sigma=sigma, kind=score)
    eps = private.epsilon()
    primary = one_run_audit(scores, included, delta=delta, confidence=confidence, family="epsdelta")
    gdp = one_run_audit(scores, included, delta=delta, confidence=confidence, family="gdp")
    for r in (primary, gdp):
        r.pop("grid")
    lower = primary["epsilon_lower"]
    bug = bool(lower > eps)
    msg = (f"white-box ε >= {lower:.3f} ({confidence:.0%} confidence over the canary coins) "
           f"{'EXCEEDS' if bug else '<='} the accountant's ε = {eps:.3f} at δ = {delta:g}"
           + (": the engine leaks more than it accounts for." if bug else "."))
    return {"privacy_bug": bug, "message": msg, "epsilon_lower": lower,
            "threat_model": "white-box: every noisy update seen; Dirac gradient canaries",
            "accountant": accountant, "accountant_epsilon": eps, "delta": delta,
            "noise_multiplier": sigma, "sample_rate": q, "steps": steps, "m": m,
            "n_included": int(included.sum()), "num_records": n, "score": score,
            "confidence": confidence, "primary": primary, "gdp": gdp,
            "seconds": time.time() - start, "scores": scores.tolist(),
            "scores_sum": score_updates(x, q=q, sigma=sigma, kind="sum").tolist(),
            "included": included.tolist()}
