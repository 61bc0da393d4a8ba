"""mia: membership-inference audits and empirical ε lower bounds for dpllm models.

Modules (import what you need; importing ``mia`` itself loads nothing heavy):

* :mod:`mia.signals` — per-record LM signals (loss, token log-probs, Min-K%++ statistics);
* :mod:`mia.attacks` — registry of score functions (``loss``, ``zlib``, ``mink``, ``minkpp``, ``ref``);
* :mod:`mia.lira` — offline / online LiRA from shadow-model confidences;
* :mod:`mia.metrics` — ROC, AUC, TPR at low FPR, balanced accuracy, loss gap, bootstrap CIs;
* :mod:`mia.canaries` — one-run (Steinke et al. 2023) and Clopper-Pearson ε lower bounds;
* :mod:`mia.audit` / :mod:`mia.report` — loading targets and records, writing reports;
* ``python -m mia audit|canaries`` — the command line (see ``docs/mia.md``).
"""

__all__ = ["attacks", "audit", "canaries", "lira", "metrics", "report", "signals"]
