"""bk under FSDP2 on 2 gloo processes: one sharded step equals one single-process step; noise once per coordinate.

One launch for the module (the ``launch`` fixture: `accelerate launch --config_file recipes/accelerate/fsdp.yaml
--num_processes 2` of tests/ddp_runs.py) runs every case of tests/fsdp_bk_worker.py first, and the tests read what
it found; the ghost_fsdp path (tests/fsdp_worker.py) and its guard against a hook copy (tests/fsdp_guards_worker.py)
run there too. The same processes then run the recipe's sharded runs that the recipe test below checks (a launch's
two processes cost ~20 CPU-s of imports and first FSDP2 calls: they are paid once).

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

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EQUAL = 1e-6  # see the module docstring


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def found(launch):
    """What tests/fsdp_bk_worker.py's cases found, the first thing the module's launch runs."""
    import time

    out, deadline = launch["tmp"] / "found.json", time.time() + 600
    while not out.is_file():
        assert launch["proc"].poll() is None, (launch["logs"] / "stderr.log").read_text()[-4000:]
        assert time.time() < deadline
        time.sleep(0.05)
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", ["llama_full", "gpt2_tied_full", "llama_lora", "virtual_batches", "uls",
                                  "checkpointing", "empty_share"])
def test_a_sharded_bk_step_equals_one_process(found, case):
    """σ = 0: the update, the parameters after it and every record's (user's) norm equal the single-process bk
    step over all the step's records (GPT-2's head tied to its embedding; LoRA; two physical batches per process;
    user-level sampling; gradient checkpointing under FSDP; one process with all records in two physical
    batches while the other runs two masked rows)."""
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


def test_banded_noise_is_correlated_in_time_per_shard_and_independent_across_ranks(found):
    """privacy.noise: banded under FSDP2: each process adds the recurrence of its own draws to its own shards
    (b − 1 = 2 shard-sized tensors kept), consecutive steps' noise is correlated (x₀ = z₀/c₀, x₁ = (z₁ − c₁x₀)/c₀:
    corr(x₀, x₁) = −c₁/sqrt(c₀² + c₁²) = −0.45), and the two processes' noise is independent."""
    import numpy as np

    from dpllm.privacy.correlated.banded import BandMF

    r = found["banded"]
    assert r["max_abs_diff"] < 1e-6 and r["history"] == 2
    assert r["shapes"] != r["global_shapes"]  # shards, not the whole parameters
    c = BandMF.optimized(bands=3, steps=8).coefficients
    n = sum(int(np.prod(s)) for s in r["shapes"])
    assert abs(r["step_corr"] + c[1] / (c[0] ** 2 + c[1] ** 2) ** 0.5) < 5 / n ** 0.5, (r["step_corr"], n)
    a, b = np.array(r["first_rank0"]), np.array(r["first_rank1"])
    m = min(len(a), len(b))
    assert abs(np.corrcoef(a[:m], b[:m])[0, 1]) < 5 / m ** 0.5


def test_blt_noise_is_correlated_in_time_per_shard_and_independent_across_ranks(found):
    """privacy.noise: blt under FSDP2: each process runs the BLT recurrence over its own shards' draws (d = 2
    shard-sized buffers per parameter), the first two steps' noise has the correlation of C⁻¹C⁻ᵀ (x₀ = z₀,
    x₁ = z₁ − c₁z₀), and the two processes' noise is independent."""
    import numpy as np

    from dpllm.privacy.correlated.blt import optimize_blt

    r = found["blt"]
    assert r["max_abs_diff"] < 1e-6 and r["history"] == 2
    assert r["shapes"] != r["global_shapes"] and [s[1:] for s in r["buffer_shapes"]] == r["shapes"]
    cinv = np.linalg.inv(optimize_blt(8, 2, 2).blt.matrix(2))
    cov = cinv @ cinv.T
    want = cov[0, 1] / np.sqrt(cov[0, 0] * cov[1, 1])
    n = sum(int(np.prod(s)) for s in r["shapes"])
    assert abs(want) > 0.2 and abs(r["step_corr"] - want) < 5 / n ** 0.5, (r["step_corr"], want, n)
    a, b = np.array(r["first_rank0"]), np.array(r["first_rank1"])
    m = min(len(a), len(b))
    assert abs(np.corrcoef(a[:m], b[:m])[0, 1]) < 5 / m ** 0.5


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


def test_ghost_fsdp_refuses_a_hook_copy(found):
    """Under FSDP, ghost_fsdp's layers see unsharded copies of their weights: the guard reads each layer's parameters
    at every call (tests/fsdp_guards_worker.py, test_gradient_paths.py's HookCopy). On 888bb2b the hook copy trained
    there at 95.0 × C (2 gloo processes)."""
    for seen in found["ghost_fsdp_hook_copy"]:  # each process
        assert seen["mode"] == "ghost_fsdp"
        assert "lin.weight got a gradient through a path outside" in seen["refused"]
    assert found["ghost_fsdp_hook_copy"][0]["update_over_C"] == 0.0  # nothing was applied


def test_fsdp_private_path_on_cpu(found):
    """FSDP2 + ghost_fsdp: uneven/empty shares, eval, sharded resumable save/load, final weights."""
    for finetuning, r in found["ghost_fsdp"].items():
        assert r["sharded"] and r["optimizer"] == "FSDPOptimizerFastGradientClipping", finetuning
        assert r["expected_batch_size"] == 7.5  # per process: Opacus divides by the number of processes
        assert r["history"] == [[1.0, 0.25, 2]]  # both steps counted, including the empty share
        assert r["weights_restored"] and r["optimizer_restored"], finetuning
    assert r["eval"] > 0 and found["ghost_fsdp"]["full"]["final_checkpoint_matches"]


# ---- the recipe under FSDP2 (accelerate launch, 2 gloo processes), resumable checkpoints, export ---------------

FSDP_LAUNCH = ["--config_file", os.path.join(ROOT, "recipes", "accelerate", "fsdp.yaml"), "--num_processes", "2"]
# Plain SGD makes the update the noised clipped sum itself, so a noise stream not restored on resume, or a shard
# noised twice, moves the weights by ~lr·σC/B per coordinate, far above the comparison's 1e-6. Quantile clipping
# (its count noised once per step on rank 0, C moved alike on both processes) rides in the same runs: a clip norm
# not restored on resume moves every later clipped sum, and so the weights, too.
SEEDED = ["--reproducible_noise", "true", "--optimizer", "sgd", "--learning_rate", "0.5", "--save_every", "2",
          "--eval_every", "0", "--clipping", "quantile", "--count_noise_multiplier", "2"]


def _resume(out, *extra):
    """The recipe itself under the shipped FSDP2 launch, resuming ``out`` from its latest checkpoint."""
    from tests.test_distributed import ACCELERATE, TINY

    cmd = [ACCELERATE, "launch", "--main_process_port", str(_free_port()), *FSDP_LAUNCH,
           os.path.join(ROOT, "recipes", "finetune_llm.py"), *TINY, "--output_dir", str(out), *extra,
           "--resume_from", "latest"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            start_new_session=True)


def _runs(runs, logs):
    """Runs one after the other in ONE launch of tests/ddp_runs.py under recipes/accelerate/fsdp.yaml (the
    processes' imports paid once): each ``(output_dir, extra options[, environment])`` a run of the recipe (TINY plus
    its options, its ``main`` on each process), a dict as tests/ddp_runs.py reads it; stdout and stderr to
    ``logs``/stdout.log and stderr.log (a pipe nobody reads would stop the workers)."""
    from tests.test_distributed import ACCELERATE, TINY

    def spec(run):
        if isinstance(run, dict):
            return run
        out, extra, *env = run
        return {"argv": [*TINY, "--output_dir", str(out), *extra], "env": env[0] if env else {}}

    logs.mkdir()
    (logs / "runs.json").write_text(json.dumps([spec(r) for r in runs]))
    with open(logs / "stdout.log", "w") as out, open(logs / "stderr.log", "w") as err:
        return subprocess.Popen([ACCELERATE, "launch", "--main_process_port", str(_free_port()), *FSDP_LAUNCH,
                                 os.path.join(ROOT, "tests", "ddp_runs.py"), str(logs / "runs.json")], stdout=out,
                                stderr=err, cwd=ROOT, start_new_session=True)


def _done(proc):
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-4000:]
    return stdout


def _killed_after(proc, out, step: str, logs):
    """SIGKILL the launch ``proc`` (of :func:`_runs`, writing to ``logs``) once ``out`` has its ``step`` checkpoint;
    returns what the launch wrote to stderr."""
    import signal
    import time

    latest, deadline = out / "checkpoints" / "latest", time.time() + 300
    while not (latest.is_file() and latest.read_text().strip() >= step):
        assert proc.poll() is None, (logs / "stderr.log").read_text()[-3000:]
        assert time.time() < deadline
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)  # accelerate launch and both workers
    proc.wait()
    assert not (out / "privacy_report.json").exists()  # it really died mid-way
    return (logs / "stderr.log").read_text()


def _base(tmp_path):
    """A tiny model saved as a model directory (TINY's shape)."""
    from dpllm.config import ModelConfig
    from dpllm.models import load_base

    model, tok, _ = load_base(ModelConfig(tiny_hidden_size=32, tiny_num_heads=2), 48)
    model.save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    return tmp_path / "base"


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """The module's ONE launch of tests/ddp_runs.py (recipes/accelerate/fsdp.yaml, 2 processes): the worker's cases
    (``found``), then the recipe's runs, in this order: ``secret`` (full fine-tuning with secret noise, releasable),
    ``whole`` (the seeded run uninterrupted, each process reading the weights itself:
    ``FSDP_CPU_RAM_EFFICIENT_LOADING=false``, what a launcher config with fsdp_cpu_ram_efficient_loading off sets),
    ``killed`` (the same run with the shipped config: rank 0 reads, rank 1 receives its shard; the recipe test kills
    the launch once its step-2 checkpoint is written). Ended (SIGKILL) at the module's end if still running."""
    import contextlib
    import signal

    tmp = tmp_path_factory.mktemp("fsdp_bk")
    seeded = [*SEEDED, "--model_name_or_path", str(_base(tmp))]
    dirs = {name: tmp / name for name in ("secret", "whole", "killed")}
    runs = [{"fsdp_bk_cases": [str(tmp / "found.json"), str(tmp / "ghost_fsdp")]},
            (dirs["secret"], ["--finetuning", "full", "--save_every", "3"]),
            (dirs["whole"], seeded, {"FSDP_CPU_RAM_EFFICIENT_LOADING": "false"}),
            (dirs["killed"], seeded)]
    proc = _runs(runs, tmp / "logs")
    yield {"proc": proc, "tmp": tmp, "logs": tmp / "logs", "seeded": seeded, **dirs}
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _per_run(log: str) -> list[str]:
    """A ddp_runs launch's stderr, one part per run (tests/ddp_runs.py marks where each begins)."""
    import re

    return re.split(r"^ddp_runs: run \d+ of \d+\n", log, flags=re.M)[1:]


def test_the_recipe_runs_sharded_and_a_killed_run_resumes_exactly(launch, tmp_path, monkeypatch):
    """`accelerate launch --config_file recipes/accelerate/fsdp.yaml --num_processes 2` on CPU runs the recipe
    sharded with bk; its resumable checkpoints are per-process shards; killed with SIGKILL and resumed on 2
    processes it ends where the uninterrupted run ends; resumed on 1 process it restores the saved state exactly
    and draws fresh noise; `dpllm export` turns the sharded run into the usual bundle. The resumed pair runs
    quantile-adaptive clipping (bk, each process noising its own shard, the count once): C adapts through the trainer
    under FSDP2, is restored on resume, and the run is accounted as one process's (the counts and the noise per
    shard: test_quantile_clipping_counts_across_shards_once_and_moves_c_alike below; DDP, whose C equals one
    process's: tests/test_distributed.py::test_two_processes_adapt_c_as_one_process_does).

    The same runs check fsdp_cpu_ram_efficient_loading (recipes/accelerate/fsdp.yaml sets it): from a model
    directory, the killed run's rank 1 builds the model on the meta device and receives its shard (and the rotary
    buffers) from rank 0, while the uninterrupted run's processes each read the weights; the two end step for step
    alike, which they cannot if rank 1's weights differ from what it would have read (one pair of runs serves both
    checks: a wrong shard or a lost noise stream each moves the adapters far past the comparison's 1e-6).

    The secret, uninterrupted and killed runs are the module's launch (the ``launch`` fixture, after the worker's
    cases); the resume is the script's own launch (``accelerate launch ... recipes/finetune_llm.py``)."""
    import shutil

    from safetensors.torch import load_file

    from dpllm import ledger, sharded_checkpoint
    from dpllm.config import parse_config
    from dpllm.export import export
    from dpllm.train import train
    from tests.test_distributed import TINY

    seeded, whole, killed, secret = launch["seeded"], launch["whole"], launch["killed"], launch["secret"]
    stderr = _killed_after(launch["proc"], killed, "step-000002", launch["logs"])
    shutil.copytree(killed, tmp_path / "one")
    resumed = _resume(killed, *seeded)
    # the secret and the uninterrupted runs ended (their privacy lines), the killed one did not
    assert (launch["logs"] / "stdout.log").read_text().count("privacy: (ε = ") == 2
    _, _, whole_log, killed_log = _per_run(stderr)
    _done(resumed)

    # the documented command: sharded, bk, every process's own noise state written owner-only beside its shard
    report = json.loads((secret / "privacy_report.json").read_text())
    assert report["grad_sample_mode"] == "bk" and "FSDP" in report["grad_sample_mode_reason"]
    assert json.loads((secret / "run_summary.json").read_text())["world_size"] == 2
    ckpt = secret / "checkpoints" / (secret / "checkpoints" / "latest").read_text().strip()
    assert sorted(p.name for p in (ckpt / "state").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert sorted(p.name for p in (ckpt / "rng").iterdir()) == ["rank-00000.pt", "rank-00001.pt"]
    assert all((p.stat().st_mode & 0o777) == 0o600 for p in (ckpt / "rng").iterdir())
    assert not (ckpt / "rng_state.pt").exists() and not (ckpt / "model.safetensors").exists()  # nothing gathered
    # the final checkpoint/ was written from the shards: it holds the last step's weights
    final = load_file(str(secret / "checkpoint" / "model-00001-of-00001.safetensors"))
    saved = _read_dcp(ckpt / "state", tmp_path / "state.pt")["model"]
    assert final.keys() == saved.keys() and all(torch.equal(final[k], saved[k]) for k in final)
    bundle = export(secret, tmp_path / "bundle")
    assert {"model-00001-of-00001.safetensors", "model.safetensors.index.json", "config.json", "README.md",
            "privacy_report.json"} <= {p.name for p in bundle.iterdir()}

    # rank 1's "built from its config on the meta device" line is INFO, and only rank 0 logs below ERROR (issue 49);
    # rank 0 says the weights were read by it alone (the killed run, the shipped config), the equal runs below show
    # rank 1 received them
    assert killed_log.count("read by rank 0 alone") == 1 and "read by rank 0 alone" not in whole_log  # the secret
    # run builds the tiny model from its config: nothing to read
    # killed at step ≥ 2 and resumed on 2 processes: the uninterrupted run (each process reading), step for step
    r1, r2 = (json.loads((d / "privacy_report.json").read_text()) for d in (killed, whole))
    assert r1["history"] == r2["history"] and r1["epsilon"] == r2["epsilon"] and r1["steps"] == 6
    # quantile clipping under FSDP2: C adapted over the 6 steps and the resumed run moved it exactly as the
    # uninterrupted one (C is resumable state, restored from trainer_state.json); the ledger's last line holds it
    a1, a2 = r1["adaptive_clipping"], r2["adaptive_clipping"]
    assert r2["grad_sample_mode"] == "bk" and a2["steps"] == 6 and a2["initial_max_grad_norm"] == 1.0
    assert a2["final_max_grad_norm"] != 1.0 and a1 == a2
    assert [e for e in ledger.read(whole) if "adaptive_clipping" in e][-1]["adaptive_clipping"] == a2
    assert [e["kind"] for e in ledger.read(killed)].count("resume") == 1 and ledger.verify(killed).ok
    a, b = (load_file(str(d / "checkpoint" / "adapter_model.safetensors")) for d in (killed, whole))
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=0, atol=1e-6) for k in a)
    # it trained: the comparison is between trained adapters (LoRA's B starts at zero)
    lora_b = [k for k in a if "lora_B" in k]
    assert lora_b and all(a[k].abs().max() > 1e-3 for k in lora_b)

    # the same checkpoint resumed on 1 process: the shards' state restored exactly, noise fresh
    restored = {}
    real = sharded_checkpoint.load_state

    def spy(ckpt, *, model, optimizer):
        real(ckpt, model=model, optimizer=optimizer)
        restored.update({n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad})
        restored["ckpt"] = ckpt

    monkeypatch.setattr(sharded_checkpoint, "load_state", spy)
    latest = tmp_path / "one" / "checkpoints" / (tmp_path / "one" / "checkpoints" / "latest").read_text().strip()
    saved = _read_dcp(latest / "state", tmp_path / "one.pt")["model"]  # before the run prunes it
    summary = train(parse_config([*TINY, *seeded, "--output_dir", str(tmp_path / "one"), "--resume_from", "latest"]))
    assert summary["world_size"] == 1 and summary["resumed_from_step"] >= 2 and summary["steps"] == 6
    assert restored.pop("ckpt") == latest
    assert restored.keys() == saved.keys() and all(torch.equal(restored[k], saved[k]) for k in saved)
    assert ledger.verify(tmp_path / "one").ok
    one = json.loads((tmp_path / "one" / "privacy_report.json").read_text())
    assert one["history"] == r2["history"] and one["adaptive_clipping"]["steps"] == 6  # one process's accounting


def _read_dcp(directory, scratch):
    """A DCP checkpoint as one plain dict, read on this single process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(directory, scratch)
    return torch.load(scratch, weights_only=False)


def test_quantile_clipping_counts_across_shards_once_and_moves_c_alike(found):
    """clipping: quantile under FSDP2 (the same launch): the processes' centred counts sum to the one-process count
    over all the step's records; the total is noised once, by rank 0's stream right after its shard's noise (rank
    1's stream draws its shard's noise and nothing else); both processes move C to the same value; every shard of
    the sum carries noise of variance (σ_g·C)², not (σ·C)²."""
    r = found["quantile"]
    assert r["total_count"] == r["reference_count"] and r["local_count"] != r["total_count"]  # both shares counted
    assert r["noised"] == pytest.approx(r["total_count"] + r["count_noise_rank0"], abs=1e-12)
    assert r["count_noise_rank0"] != 0.0 and r["stream_replayed"]
    assert r["clips"][0] == r["clips"][1] != r["C"] and r["steps"] == 1
    n = r["coordinates"]
    assert abs(r["variance"] / r["sigma_g_C"] ** 2 - 1) < 5 * (2 / n) ** 0.5, r  # σ_g = 1.8 σ: far outside


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_quantile_clipping_under_ddp_with_opacus_hooks_and_ghost(found, mode):
    """clipping: quantile with Opacus's distributed optimizers (the same launch, DDP): the counts of both processes
    sum to the count over all records; the total is noised once, by rank 0 right after its gradient noise (rank 1
    draws nothing); C moves alike everywhere; the reduced gradient carries noise of std σ_g·C."""
    r = found["quantile_ddp"][mode]
    assert r["optimizer"] == f"QuantileDistributed{'Ghost' if mode == 'ghost' else 'DP'}Optimizer"
    assert r["total_count"] == r["reference_count"] and r["local_count"] != r["total_count"]
    assert r["noised"] == pytest.approx(r["total_count"] + r["count_noise_rank0"], abs=1e-12)
    assert r["count_noise_rank0"] != 0.0 and r["stream_replayed"]
    assert r["clips"][0] == r["clips"][1] != r["C"] and r["steps"] == 1
    n = r["coordinates"]
    assert abs(r["variance"] / r["sigma_g_C"] ** 2 - 1) < 5 * (2 / n) ** 0.5, r  # σ_g = 2.4 σ
