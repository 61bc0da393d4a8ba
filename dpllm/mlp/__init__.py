"""The MLP trainer of dpllm's smoke studies (reference papers' MLP experiments, with rigorous ε).

* :mod:`dpllm.mlp.data` — the synthetic Gaussian clusters and scikit-learn digits, as tensors;
* :mod:`dpllm.mlp.train` — the MLP, one private or non-private run through
  :func:`dpllm.privacy.engine.make_private`, and ε under the PRV and RDP accountants.

The recipes are ``recipes/mlp_scaling.py``, ``mlp_privacy_cliff.py``, ``mlp_clipping.py`` and
``mlp_membership.py``, sharing ``recipes/mlp_study.py`` (intervals, tables, result files);
``docs/mlp.md`` describes them.
"""
