"""Published scaling laws, shipped as named fits: priors to plan with before running a sweep.

``--fit published:NAME`` (or :func:`dpllm.scaling.fit.load_fit` on that string) gives a fit document like
the one ``dpllm scaling fit`` writes, with one fit whose ``prior`` field names the source. They are
**priors from other data**: non-private pre-training of decoder-only transformers on MassiveText, with
DeepMind's tokenizer, loss in nats per token of their held-out text. Your losses are on your data and
tokenizer, so the absolute loss will not carry over; the exponents (how loss falls with N and D) are the
part worth borrowing. Nothing here ever enters a fit to your runs: a plan or prediction uses either your
fit or a published one, and every output from a published one says so.

Sources (figures as published; checked against secondary sources that quote them):

- ``chinchilla-hoffmann2022``: Hoffmann et al. (2022), "Training Compute-Optimal Large Language Models",
  arXiv:2203.15556, approach 3 (parametric fit, eq. 10): E = 1.69, A = 406.4, B = 410.7, α = 0.34,
  β = 0.28, fitted to over 400 runs of 70M to 16B parameters on 5B to 500B tokens. The paper reports
  no usable intervals (Besiroglu et al. show its bootstrap intervals are implausibly narrow).
- ``chinchilla-besiroglu2024``: Besiroglu, Erdil, Barnett and You (2024), "Chinchilla Scaling: A
  replication attempt", arXiv:2404.10102: the same form refitted (Huber loss on log-loss, as here) to
  240 points they reconstructed from Hoffmann et al.'s Figure 4: E = 1.8172, A = 482.01, B = 2085.43,
  α = 0.3478, β = 0.3658, standard errors 0.03, 124.58, 1293.23, 0.02, 0.02. Its compute-optimal split
  (N ∝ C^0.51) agrees with Hoffmann et al.'s approaches 1 and 2, where the rounded approach-3 figures
  (N ∝ C^0.45) do not.

Example:
    >>> fit = published_fit("chinchilla-besiroglu2024")
    >>> round(float(fit.predict(N=70e9, D=1.4e12)), 3), fit.prior["name"]
    (1.974, 'chinchilla-besiroglu2024')
"""

from __future__ import annotations

from dpllm.scaling.forms import ScalingError, get_form
from dpllm.scaling.result import FitResult

PREFIX = "published:"

# The range both fits were made on (Hoffmann et al.: 70M to 16B parameters, 5B to 500B tokens): plans
# outside it are refused like plans outside your own fit's range.
_HOFFMANN_DOMAIN = {"N": [7e7, 1.6e10], "D": [5e9, 5e11]}
_CAVEAT = ("a prior from other data: non-private pre-training on MassiveText with DeepMind's tokenizer, loss in "
           "nats per token of their text; your data, tokenizer and DP noise change the loss, so compare "
           "exponents, not absolute losses, and refit on your own runs before trusting a number")

PUBLISHED: dict[str, dict] = {
    "chinchilla-hoffmann2022": {
        "params": {"E": 1.69, "A": 406.4, "alpha": 0.34, "B": 410.7, "beta": 0.28},
        "ci": {},
        "citation": "Hoffmann et al. (2022), Training Compute-Optimal Large Language Models, arXiv:2203.15556, "
                    "approach 3, eq. 10",
        "url": "https://arxiv.org/abs/2203.15556",
        "data": "over 400 runs, 70M-16B parameters, 5B-500B tokens, MassiveText (non-private)",
        "note": "rounded figures from the paper's body; Besiroglu et al. (2024) find they fit the data poorly and "
                "that the paper's intervals are implausibly narrow, so none are shipped",
    },
    "chinchilla-besiroglu2024": {
        "params": {"E": 1.8172, "A": 482.01, "alpha": 0.3478, "B": 2085.43, "beta": 0.3658},
        # ±1.96 standard errors as published (marginal; the parameters are strongly correlated)
        "ci": {k: [v - 1.96 * se, v + 1.96 * se] for k, v, se in (
            ("E", 1.8172, 0.03), ("A", 482.01, 124.58), ("alpha", 0.3478, 0.02), ("B", 2085.43, 1293.23),
            ("beta", 0.3658, 0.02))},
        "citation": "Besiroglu, Erdil, Barnett, You (2024), Chinchilla Scaling: A replication attempt, "
                    "arXiv:2404.10102",
        "url": "https://arxiv.org/abs/2404.10102",
        "data": "240 points reconstructed from Hoffmann et al.'s Figure 4 (non-private)",
        "note": "refit of Hoffmann et al.'s approach 3 with a Huber loss on log-loss; ci are ±1.96 published "
                "standard errors",
    },
}


def is_published(spec: object) -> bool:
    """Whether ``spec`` (a --fit value) names a published fit rather than a file."""
    return isinstance(spec, str) and spec.startswith(PREFIX)


def published_fit(name: str) -> FitResult:
    """The published law ``name`` as a :class:`FitResult` marked with its ``prior`` (source and caveats).

    It has no residuals or bootstrap samples, so it has no prediction interval (nan): the papers do not give
    the scatter of their runs, and none is invented here.

    Raises:
        ScalingError: ``name`` is not one of :data:`PUBLISHED`.
    """
    name = name[len(PREFIX):] if name.startswith(PREFIX) else name
    if name not in PUBLISHED:
        raise ScalingError(f"no published fit {name!r}; choose one of "
                           f"{', '.join(PREFIX + k for k in sorted(PUBLISHED))}")
    entry = PUBLISHED[name]
    prior = {"name": name, "citation": entry["citation"], "url": entry["url"], "data": entry["data"],
             "note": entry["note"], "caveat": _CAVEAT}
    return FitResult(form="chinchilla", params=dict(entry["params"]), ci={k: list(v) for k, v in entry["ci"].items()},
                     r2=float("nan"), n_points=0, n_runs=0, label=PREFIX + name,
                     domain={k: list(v) for k, v in _HOFFMANN_DOMAIN.items()}, prior=prior)


def published_doc(spec: str) -> dict:
    """A fit.json-shaped document holding one published fit (what ``load_fit("published:NAME")`` returns)."""
    fit = published_fit(spec)
    return {"form": fit.form, "formula": get_form(fit.form).formula, "prior": fit.prior,
            "fits": {"non-private": fit.to_dict()}, "skipped": {}, "inputs": {"groups": {}}}


__all__ = ["PREFIX", "PUBLISHED", "is_published", "published_doc", "published_fit"]
