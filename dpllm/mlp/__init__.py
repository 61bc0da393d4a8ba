"""MLP smoke studies on dpllm's privacy engine (the seeds' experiments, with rigorous ε).

* :mod:`dpllm.mlp.data` — the synthetic Gaussian clusters and scikit-learn digits, as tensors;
* :mod:`dpllm.mlp.train` — the MLP, one private or non-private run through
  :func:`dpllm.privacy.engine.make_private`, and ε under the PRV and RDP accountants;
* :mod:`dpllm.mlp.report` — confidence intervals, markdown tables and result files for the recipes.

The recipes are ``recipes/mlp_scaling.py``, ``mlp_privacy_cliff.py``, ``mlp_clipping.py`` and
``mlp_membership.py``; ``docs/mlp.md`` describes them.
"""
