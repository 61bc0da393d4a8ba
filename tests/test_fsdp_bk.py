"""bk under FSDP2 on 2 gloo processes: one sharded step equals one single-process step; noise once per coordinate.

One launch of tests/fsdp_bk_worker.py (module fixture) runs every case; the tests read what it found. The
ghost_fsdp path (tests/fsdp_worker.py) runs in the same launch.

Tolerance of the equalities (σ = 0): the models are float64, but ``sequence_loss`` takes each record's loss in
float32 and their mean over the physical batch in float32, and bk recovers a record's gradient by multiplying
by the batch's row count B: each record's gradient then carries the float32 rounding of 1/B, a relative error
of at most 2⁻²⁴ ≈ 6e-8 that differs between the reference's one batch of 10 records and the processes' batches
of 6 and 4 (or 3 + 3 and 2 + 2). Everything else is float64 (≈1e-16). We allow 1e-6 relative, 16× that
bound; losing or doubling a process's share, a shard's rows, or the tied head's second part moves the update
by O(1) of its size.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EQUAL = 1e-6  # see the module docstring


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def found(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp_bk")
    out = tmp / "found.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
           os.path.join(ROOT, "tests", "fsdp_bk_worker.py"), str(out), str(tmp / "ghost_fsdp")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", ["llama_full", "gpt2_tied_full", "llama_lora", "virtual_batches", "uls",
                                  "checkpointing"])
def test_a_sharded_bk_step_equals_one_process(found, case):
    """σ = 0: the update, the parameters after it and every record's (user's) norm equal the single-process bk
    step over all the step's records (GPT-2's head tied to its embedding; LoRA; two physical batches per process;
    user-level sampling; gradient checkpointing under FSDP)."""
    r = found[case]
    assert r["update_rel"] < EQUAL and r["param_rel"] < EQUAL and r["norm_rel"] < EQUAL, r
    assert 0 < r["clipped"] < r["records"]  # C at the median norm: the clip factors matter


def test_each_process_noises_its_own_shard_once(found):
    """σ > 0: over all coordinates the noise has variance σ²C² (every coordinate noised once: twice would give
    2σ²C², a shard left out would leave exact zeros), and the two processes' draws are independent."""
    import numpy as np

    r = found["noise"]
    n = r["coordinates"]
    # the mean of n squared N(0, s²) draws has relative standard deviation sqrt(2/n); allow 5 of them
    assert abs(r["variance"] / r["sigma_C"] ** 2 - 1) < 5 * (2 / n) ** 0.5, r["variance"]
    assert r["zero_coordinates"] == 0
    a, b = np.array(r["first_rank0"]), np.array(r["first_rank1"])
    assert not np.allclose(a[: len(b)], b[: len(a)])
    m = min(len(a), len(b))
    assert abs(np.corrcoef(a[:m], b[:m])[0, 1]) < 5 / m ** 0.5  # independent streams


def test_mixed_precision_and_gathered_parameters_keep_the_hooks(found):
    """bf16 compute with fp32 shards and reduction, parameters kept gathered after forward: the clipped step
    matches the fp32 reference to bf16 precision (unit roundoff 2⁻⁸ ≈ 4e-3; we allow 3e-2 over the layers)."""
    r = found["mixed_precision"]
    assert r["rel_l2"] < 3e-2 and r["grad_dtype"] == "torch.float32"


def test_a_raw_gradient_is_refused_under_fsdp(found):
    """A trainable weight used outside its own layer reaches FSDP's unsharded parameter: bk refuses it there,
    before FSDP's reduce-scatter could carry it unclipped into .grad, whatever the FSDP settings."""
    for setting, message in found["refusal"].items():
        assert "emb.weight got a gradient from a use outside its own layer" in message, setting


def test_the_parameter_use_guard_applies_under_ghost_fsdp(found):
    assert "used outside its own layer: emb.weight" in found["ghost_fsdp_guard"]


def test_fsdp_private_path_on_cpu(found):
    """FSDP2 + ghost_fsdp: uneven/empty shares, eval, sharded resumable save/load, final weights."""
    for finetuning, r in found["ghost_fsdp"].items():
        assert r["sharded"] and r["optimizer"] == "FSDPOptimizerFastGradientClipping", finetuning
        assert r["expected_batch_size"] == 7.5  # per process: Opacus divides by the number of processes
        assert r["history"] == [[1.0, 0.25, 2]]  # both steps counted, including the empty share
        assert r["weights_restored"] and r["optimizer_restored"], finetuning
    assert r["eval"] > 0 and found["ghost_fsdp"]["full"]["final_checkpoint_matches"]
