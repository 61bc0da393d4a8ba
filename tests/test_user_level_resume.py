"""User-level crash safety: a ULS or ELS run killed with SIGKILL and resumed is the uninterrupted run.

The resumed run must train on the same kept records (the cap's choice is read back from splits.json, never
redrawn) and draw the same user batches (the user sampler's generator is restored); under ELS the resumed
ledger's user-level ε (mixture accounting over the restored history) verifies.
"""

import json

import pytest
import torch

from dpllm import ledger
from tests.test_resume import kill_mid_run, run


@pytest.mark.slow
@pytest.mark.parametrize("sampling, mode", [("uls", "hooks"), ("els", "bk")])
def test_user_level_sigkill_then_resume_equals_uninterrupted(tmp_path, sampling, mode):
    USER = ["--privacy_unit", "user", "--user_sampling", sampling, "--grad_sample_mode", mode,
           "--max_records_per_user", "3", "--target_delta", "1e-3"]
    killed = tmp_path / "killed"
    kill_mid_run(killed, *USER)
    kept = json.loads((killed / "splits.json").read_text())["train"]
    run(killed, "--resume_from", "latest", *USER)
    run(tmp_path / "whole", *USER)
    assert json.loads((killed / "splits.json").read_text())["train"] == kept
    r1, r2 = (json.loads((d / "privacy_report.json").read_text()) for d in (killed, tmp_path / "whole"))
    for key in ("steps", "epsilon", "history", "num_records", "user_level"):
        assert r1[key] == r2[key], key
    assert r1["user_level"]["sampling"] == sampling and r1["epsilon"] <= 8.0
    from safetensors.torch import load_file

    a, b = (load_file(str(d / "checkpoint" / "model.safetensors")) for d in (killed, tmp_path / "whole"))
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert ledger.verify(killed).ok
