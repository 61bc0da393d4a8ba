"""ULS on 2 processes (real `accelerate launch`, gloo on CPU) trains the same run as on 1 process.

The user sampler hands each process whole users (u ≡ rank mod 2) of one global draw; each process clips its
users' mean gradients (hooks: Opacus's per-sample rows averaged; bk: per-user norms from one backward) and Opacus's
distributed optimizer adds rank 0's noise once and all-reduces.
"""

import json

import pytest
import torch

from tests.test_distributed import SGD, _finish, _launch, _trainable

ULS = ("--reproducible_noise", "true", "--privacy_unit", "user", "--user_sampling", "uls",
       "--max_records_per_user", "3", "--target_delta", "1e-3")


@pytest.mark.slow
@pytest.mark.parametrize("mode, noise", [("hooks", ()), ("bk", ()), ("hooks", ("--noise", "banded", "--bands", "2"))],
                         ids=["hooks", "bk", "hooks_banded"])
def test_uls_one_and_two_processes_train_the_same_run(tmp_path, mode, noise):
    """Banded noise (hooks): users in 2 cyclic groups by their ids, Opacus's DDP optimizer subclassed so that rank 0
    alone adds the recurrence's noise: the same run as one process (dpllm.privacy.correlated.optimizer)."""
    extra = ULS + ("--grad_sample_mode", mode) + SGD + noise
    two = _launch(tmp_path / "two", "--multi_gpu", "--num_processes", "2", extra=extra)
    one = _launch(tmp_path / "one", "--cpu", "--num_processes", "1", extra=extra)
    _finish(one)
    _finish(two)
    r1, r2 = (json.loads((tmp_path / n / "privacy_report.json").read_text()) for n in ("one", "two"))
    for key in ("steps", "epsilon", "noise_multiplier", "sample_rate", "history", "num_records", "user_level"):
        assert r1[key] == r2[key], key
    assert r2["privacy_unit"] == "user" and r2["user_level"]["sampling"] == "uls"
    assert r1["grad_sample_mode"] == r2["grad_sample_mode"] == mode
    if noise:  # ⌈T/2⌉ accounted steps at q_b
        assert r2["correlated_noise"]["bands"] == 2 and r2["history"][0][2] == -(-r2["steps"] // 2)
    s1, s2 = (json.loads((tmp_path / n / "run_summary.json").read_text()) for n in ("one", "two"))
    assert s2["world_size"] == 2 and s1["tokens_seen"] == s2["tokens_seen"]  # same users, split by user
    p1, p2 = _trainable(tmp_path / "one"), _trainable(tmp_path / "two")
    for name in p1:
        assert torch.allclose(p1[name], p2[name], atol=1e-5), name
