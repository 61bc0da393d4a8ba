"""Multi-process training: 1 and 2 processes (real `accelerate launch`, gloo on CPU) give the same run.

The 2-process runs compared with one process share one launch (the ddp_runs fixture, tests/ddp_runs.py: the
workers' imports are paid once); test_one_and_two_processes_train_the_same_run launches the recipe itself.

Also: the shipped accelerate configs parse, the FSDP/ghost combinations are checked before anything is
written, and the Poisson sampler hands every process a disjoint share of one global batch.
"""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
import yaml

from dpllm.config import ConfigError, PrivacyConfig
from dpllm.distributed import check_parallelism
from dpllm.sampling import PoissonBatchSampler, ShuffledBatchSampler

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ACCELERATE = os.path.join(os.path.dirname(sys.executable), "accelerate")
TINY = ["--config", os.path.join(ROOT, "recipes", "configs", "tiny", "llama_lora_cpu.yaml"), "--max_steps", "6",
        "--logical_batch_size", "16", "--physical_batch_size", "4", "--max_length", "48", "--tiny_hidden_size", "32",
        "--tiny_num_heads", "2", "--max_records", "300", "--eval_every", "3", "--eval_max_records", "16",
        "--log_every", "2", "--progress", "false"]


@pytest.mark.parametrize("name, kind", [("single_gpu", "NO"), ("multi_gpu", "MULTI_GPU"), ("fsdp", "FSDP")])
def test_accelerate_configs_parse(name, kind):
    from accelerate.commands.config.config_args import ClusterConfig

    path = os.path.join(ROOT, "recipes", "accelerate", f"{name}.yaml")
    raw = yaml.safe_load(open(path))
    for key in ("compute_environment", "distributed_type", "num_machines", "num_processes", "mixed_precision"):
        assert key in raw, key
    cfg = ClusterConfig.from_yaml_file(path)  # accelerate's own loader refuses unknown keys
    assert cfg.distributed_type.value == kind and cfg.num_processes >= 1
    # dpllm's train.mixed_precision decides autocast; accelerate's must not contradict it
    assert cfg.mixed_precision == "no"
    if name == "fsdp":
        assert cfg.fsdp_config["fsdp_version"] == 2


@pytest.mark.parametrize("kind, mode, enabled, error", [
    ("fsdp", "ghost", True, "cannot see sharded parameters"),
    ("fsdp", "hooks", True, "cannot see sharded parameters"),
    ("ddp", "ghost_fsdp", True, "needs an FSDP launch"),
    ("none", "ghost_fsdp", True, "needs an FSDP launch"),
    ("fsdp", "ghost_fsdp", True, None),
    ("fsdp", "auto", True, None),  # auto resolves to bk on a sharded model, or refuses (test_modes)
    ("fsdp", "bk", True, None),
    ("ddp", "ghost", True, None),
    ("ddp", "hooks", True, None),
    ("fsdp", "ghost", False, None),  # non-private FSDP is accelerate's business
])
def test_parallelism_combinations(kind, mode, enabled, error):
    privacy = PrivacyConfig(enabled=enabled, grad_sample_mode=mode)
    if error:
        with pytest.raises(ConfigError, match=error):
            check_parallelism(privacy, kind, world_size=8, logical_batch_size=64)
    else:
        check_parallelism(privacy, kind, world_size=8, logical_batch_size=64)


def test_more_processes_than_batch_is_refused():
    with pytest.raises(ConfigError, match="logical_batch_size=4 is smaller than the 8 processes"):
        check_parallelism(PrivacyConfig(), "ddp", world_size=8, logical_batch_size=4)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_poisson_shares_partition_one_global_batch(world_size):
    def batches(rank, size, n=5):
        g = torch.Generator().manual_seed(7)
        it = iter(PoissonBatchSampler(num_samples=50, sample_rate=0.2, generator=g, rank=rank, world_size=size))
        return [next(it) for _ in range(n)]

    single = batches(0, 1)
    shares = [batches(r, world_size) for r in range(world_size)]
    for k, whole in enumerate(single):
        parts = [s[k] for s in shares]
        assert sorted(sum(parts, [])) == whole  # disjoint shares whose union is the global batch


def test_poisson_sampler_state_restores_exactly():
    g = torch.Generator().manual_seed(3)
    it = iter(PoissonBatchSampler(num_samples=40, sample_rate=0.25, generator=g))
    next(it)
    saved = g.get_state()
    expected = [next(it) for _ in range(3)]
    g2 = torch.Generator()
    g2.set_state(saved)
    it2 = iter(PoissonBatchSampler(num_samples=40, sample_rate=0.25, generator=g2))
    assert [next(it2) for _ in range(3)] == expected


def test_shuffled_batches_resume_at_a_step():
    full = ShuffledBatchSampler(num_samples=23, batch_size=5, seed=1)
    it = iter(full)
    first = [next(it) for _ in range(7)]  # crosses an epoch boundary (4 batches per epoch)
    later = ShuffledBatchSampler(num_samples=23, batch_size=5, seed=1, start=3)
    it = iter(later)
    assert [next(it) for _ in range(4)] == first[3:]
    halves = [next(iter(ShuffledBatchSampler(num_samples=23, batch_size=5, seed=1, rank=r, world_size=2)))
              for r in (0, 1)]
    assert sorted(halves[0] + halves[1]) == sorted(first[0])


def _free_port() -> int:
    with socket.socket() as s:  # other test sessions may be using accelerate's default port 29500
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(out, *launch_args, extra=()):
    cmd = [ACCELERATE, "launch", "--main_process_port", str(_free_port()), *launch_args,
           os.path.join(ROOT, "recipes", "finetune_llm.py"), *TINY, "--output_dir", str(out), *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)


def _finish(proc):
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-4000:]
    return stdout


def _one_process(out, extra=()):
    """The single-process run in this pytest process (``train``, what the recipe calls): the comparisons need one,
    and the launcher's 1-process path has its own test (test_stopping.py's SIGTERM to a launch without --multi_gpu)."""
    from dpllm.config import parse_config
    from dpllm.train import train

    return train(parse_config([*TINY, "--output_dir", str(out), *extra]))


def _trainable(run):
    from safetensors.torch import load_file

    return load_file(str(run / "checkpoint" / "adapter_model.safetensors"))


def test_one_and_two_processes_train_the_same_run(tmp_path, ddp_runs):
    """`accelerate launch --multi_gpu --num_processes 2` on CPU (the recipe's ``main`` on each process, in the
    ddp_runs fixture's launch): same batches, σ, q, steps and ε as 1 process."""
    # Seeded noise (tests only) so that the two runs can be compared at all: secret noise differs per run.
    _one_process(tmp_path / "one", DDP_RUNS["recipe"])
    (tmp_path / "two").symlink_to(ddp_runs["recipe"], target_is_directory=True)
    out2, err2 = ((ddp_runs["recipe"].parent / f"{name}.log").read_text() for name in ("stdout", "stderr"))
    # Each line once: only the first process prints and logs below ERROR (dpllm.logs.setup_logging). The launch's
    # runs before the killed one finish and print their privacy line; every private run (the killed one too) logs σ
    private = [n for n, extra in DDP_RUNS.items() if "--privacy.enabled" not in extra]
    assert out2.count("privacy: (ε = ") == len(private) - 1
    assert err2.count("INFO dpllm.privacy.run: privacy: σ=") == len(private)
    r1, r2 = (json.loads((tmp_path / n / "privacy_report.json").read_text()) for n in ("one", "two"))
    for key in ("steps", "epsilon", "noise_multiplier", "sample_rate", "logical_batch_size", "expected_batch_size",
                "history", "num_records"):
        assert r1[key] == r2[key], key
    assert r2["steps"] == 6 and r2["sample_rate"] == pytest.approx(1 / 15)
    s1, s2 = (json.loads((tmp_path / n / "run_summary.json").read_text()) for n in ("one", "two"))
    assert (s1["world_size"], s2["world_size"]) == (1, 2)
    assert s2["params_sha256"]  # the run checked that both processes ended with identical parameters
    assert s1["tokens_seen"] == s2["tokens_seen"]  # the same records were sampled, split over 2 processes
    # only rank 0 wrote: one metrics stream, one ledger
    rows1, rows2 = ([json.loads(x) for x in (tmp_path / n / "metrics.jsonl").read_text().splitlines()]
                    for n in ("one", "two"))
    assert [(r["step"], r["split"]) for r in rows1] == [(r["step"], r["split"]) for r in rows2]
    for a, b in zip(rows1, rows2):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)  # eval all-reduced over the 2 processes
        assert a.get("epsilon") == b.get("epsilon")
    # same noise (rank 0's stream), same clipped sum: the models agree up to float summation order
    p1, p2 = _trainable(tmp_path / "one"), _trainable(tmp_path / "two")
    assert p1.keys() == p2.keys()
    for name in p1:
        assert torch.allclose(p1[name], p2[name], atol=1e-5), name
    from dpllm.ledger import verify

    assert verify(tmp_path / "two").ok


def test_two_processes_without_privacy_use_ddp(ddp_runs):
    summary = json.loads((ddp_runs["ddp"] / "run_summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 6 and summary["params_sha256"]
    assert summary["tokens_seen"] > 0 and summary["epsilon"] is None


@pytest.mark.parametrize("launched", [True, False])
def test_finish_process_ends_a_launched_worker_without_teardown(launched):
    """Under a launcher (LOCAL_RANK set) the worker leaves with os._exit: output flushed, exit code kept, no
    interpreter teardown (no atexit handler runs); elsewhere the code is returned for sys.exit. The function is
    light (``dpllm.stopping``, re-exported by ``dpllm.distributed``): the process imports no torch."""
    import dpllm.distributed
    import dpllm.stopping

    assert dpllm.distributed.finish_process is dpllm.stopping.finish_process
    script = ("import atexit, logging, sys\n"
              "from dpllm.stopping import finish_process\n"
              "atexit.register(lambda: print('teardown ran'))\n"
              "logging.basicConfig(stream=sys.stderr)\n"
              "print('result written'); logging.getLogger('x').warning('logged')\n"
              "code = finish_process(3)\n"
              "print('torch imported:', 'torch' in sys.modules)\n"
              "sys.exit(code)\n")
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
    if launched:
        env["LOCAL_RANK"] = "0"
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=120)
    assert res.returncode == 3
    assert "result written" in res.stdout and "logged" in res.stderr
    assert ("teardown ran" in res.stdout) is not launched
    assert ("torch imported: False" in res.stdout) is not launched  # a launched worker is gone before the line


@pytest.mark.parametrize("mode", ["ghost", "hooks"])
@pytest.mark.parametrize("how", ["padding_record", "add_empty_share"])
def test_an_empty_share_is_a_counted_step_that_adds_nothing(mode, how):
    """Both ways of stepping on an empty share add exactly zero to the clipped sum and count the step."""
    from dpllm.data import TokenizedRecords, make_collate
    from dpllm.privacy.engine import PrivacyPlan, add_empty_share, make_private
    from dpllm.train import forward_loss
    from tests.helpers import TEXTS, batch_of, tiny_model

    model, tok = tiny_model("tiny-llama", "lora")
    dataset = TokenizedRecords(TEXTS, tok, 48)
    plan = PrivacyPlan(num_records=6, sample_rate=0.5, steps=2, noise_multiplier=0.0, delta=1e-5, accountant="rdp",
                       expected_batch_size=3)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    pt = make_private(model=model, optimizer=opt, dataset=dataset, collate_fn=make_collate(tok.pad_token_id),
                      cfg=PrivacyConfig(grad_sample_mode=mode), plan=plan, logical_batch_size=3)
    empty = {k: torch.zeros((0, 1), dtype=torch.long) for k in ("input_ids", "attention_mask", "labels")}
    real = batch_of(tok, TEXTS[:2])
    sums = []
    for extra in (False, True):  # one physical batch of 2 records, then (maybe) an empty one, then the step
        parts = [real] + ([empty] if extra else [])
        for i, part in enumerate(parts):
            pt.optimizer.signal_skip_step(do_skip=i < len(parts) - 1)
            pt.optimizer.zero_grad()
            if part is empty and how == "add_empty_share":
                add_empty_share(pt.optimizer)
            else:
                loss = forward_loss(pt.model, part, pt.criterion)
                loss.backward()
            if part is empty and how == "padding_record":
                assert float(loss.detach()) == 0.0
            pt.optimizer.pre_step()
        sums.append([p.grad.detach().clone() for p in pt.optimizer.params])
    assert all(torch.equal(a, b) for a, b in zip(*sums))
    assert pt.engine.accountant.history == [(0.0, 0.5, 2)]


# Plain SGD makes the update the noised clipped sum itself (AdamW's per-coordinate normalisation would hide
# a noise scaled by a constant): noise added on both processes, or a process's clipped share lost, moves the
# weights by ~lr·σC/B ≈ 0.03 per coordinate, far above the comparison's 1e-5.
SGD = ("--optimizer", "sgd", "--learning_rate", "0.5")
NOISES = {"independent": (), "banded": ("--noise", "banded", "--bands", "2"),
          "blt": ("--noise", "blt", "--bands", "2", "--buffers", "1")}
BK = ("--reproducible_noise", "true", "--grad_sample_mode", "bk", "--finetuning", "full", *SGD)
QUANTILE = ("--reproducible_noise", "true", "--clipping", "quantile", "--grad_sample_mode", "bk",
            "--max_grad_norm", "0.05", "--count_noise_multiplier", "2")
KILLED = ("--save_every", "2", "--finetuning", "full", "--eval_every", "0")
# The 2-process runs that the tests below compare with one process (TINY plus these options), in the order that
# the ddp_runs fixture runs them; the last is killed mid-run.
DDP_RUNS = {"ddp": ("--privacy.enabled", "false", "--eval_every", "0"),
            **{f"bk-{name}": (*BK, *noise) for name, noise in NOISES.items()},
            "quantile": QUANTILE,
            "recipe": ("--reproducible_noise", "true"),  # the recipe as configured, compared with one process
            "killed": KILLED}


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    """Each run of :data:`DDP_RUNS` on 2 gloo processes, in order, in ONE `accelerate launch --multi_gpu
    --num_processes 2` of tests/ddp_runs.py (each run through recipes/finetune_llm.py's ``main``; the processes'
    imports paid once, not once per run; the script's own 2-process launches are in tests/test_fsdp_bk.py).
    The last run, ``killed``, is killed with SIGKILL (the launcher and both workers) once its step-2 checkpoint
    is written. Returns each run's directory by name."""
    import contextlib
    import signal
    import time

    root = tmp_path_factory.mktemp("ddp_runs")
    dirs = {name: root / name for name in DDP_RUNS}
    spec = root / "runs.json"
    spec.write_text(json.dumps([[*TINY, "--output_dir", str(dirs[n]), *extra] for n, extra in DDP_RUNS.items()]))
    # output to files: a pipe that nobody reads while the runs go on would fill up and stop the workers
    with open(root / "stdout.log", "w") as out, open(root / "stderr.log", "w") as log:
        proc = subprocess.Popen([ACCELERATE, "launch", "--main_process_port", str(_free_port()), "--multi_gpu",
                                 "--num_processes", "2", os.path.join(ROOT, "tests", "ddp_runs.py"), str(spec)],
                                stdout=out, stderr=log, cwd=ROOT, start_new_session=True)
        latest, deadline = dirs["killed"] / "checkpoints" / "latest", time.time() + 900
        try:
            while not (latest.is_file() and latest.read_text().strip() >= "step-000002"):
                assert proc.poll() is None, (root / "stderr.log").read_text()[-4000:]
                assert time.time() < deadline, (root / "stderr.log").read_text()[-4000:]
                time.sleep(0.01)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # accelerate launch and both workers
            proc.wait()
    for name in list(DDP_RUNS)[:-1]:  # run in order: every run before the killed one finished
        assert (dirs[name] / "run_summary.json").is_file(), name
    return dirs


@pytest.mark.parametrize("noise", list(NOISES))
def test_bookkeeping_under_ddp_matches_one_process(tmp_path, ddp_runs, noise):
    """grad_sample_mode=bk on 2 gloo processes (Opacus's distributed ghost optimizer all-reduces bk's clipped
    sums, rank 0 adds the noise once): same history and ε as one process, weights equal up to summation order.
    Banded and BLT noise: rank 0 keeps the recurrence and noises the sum once, as one process does."""
    _one_process(tmp_path / "one", (*BK, *NOISES[noise]))
    two = ddp_runs[f"bk-{noise}"]
    r1, r2 = (json.loads((d / "privacy_report.json").read_text()) for d in (tmp_path / "one", two))
    assert r1["grad_sample_mode"] == r2["grad_sample_mode"] == "bk"
    assert r1["history"] == r2["history"] and r1["epsilon"] == r2["epsilon"]
    if noise == "banded":  # 6 steps over 2 cyclic groups: 3 accounted steps at q_b = 2/15
        assert r2["correlated_noise"]["bands"] == 2 and r2["history"][0][1:] == [2 / 15, 3]
    if noise == "blt":  # the whole run one Gaussian mechanism (σ/sens, q = 1, one step), no sampling credited
        assert r2["correlated_noise"]["buffers"] == 1 and len(r2["history"]) == 1 and r2["history"][0][1:] == [1.0, 1]
    from safetensors.torch import load_file

    p1, p2 = (load_file(str(d / "checkpoint" / "model.safetensors")) for d in (tmp_path / "one", two))
    for name in p1:
        assert torch.allclose(p1[name], p2[name], atol=1e-5), name


def test_a_two_process_run_resumed_on_one_process_draws_fresh_noise_and_keeps_counting(ddp_runs, monkeypatch):
    """Killed on 2 processes after its step-2 checkpoint (the ddp_runs fixture's last run), resumed on 1 (issue
    #21, item 5): the accountant continues from the checkpoint (every step counted once, the ledger verifies), and
    the resumed process's noise generator starts from none of the saved noise states (secret noise: nothing is
    replayed)."""
    from dpllm import ledger, resume
    from dpllm.config import parse_config
    from dpllm.privacy.accounting import compute_epsilon_history
    from dpllm.train import train

    out, args = ddp_runs["killed"], list(KILLED)
    latest = out / "checkpoints" / "latest"
    assert not (out / "privacy_report.json").exists()
    ckpt = out / "checkpoints" / latest.read_text().strip()
    saved = torch.load(ckpt / "rng_state.pt", weights_only=True)
    assert len(saved) == 2 and json.loads((ckpt / "trainer_state.json").read_text())["world_size"] == 2

    started = []
    real = resume._set_rng_state

    def spy(state, generators):
        real(state, generators)
        started.append(generators["noise"].get_state())

    monkeypatch.setattr(resume, "_set_rng_state", spy)
    summary = train(parse_config([*TINY, "--output_dir", str(out), *args, "--resume_from", "latest"]))
    assert summary["world_size"] == 1 and summary["resumed_from_step"] >= 2 and summary["steps"] == 6
    assert len(started) == 1 and not any(torch.equal(started[0], s["noise"]) for s in saved)
    report = json.loads((out / "privacy_report.json").read_text())
    assert report["history"] == [[report["noise_multiplier"], report["sample_rate"], 6]]
    assert report["epsilon"] == pytest.approx(compute_epsilon_history(history=report["history"],
                                                                      delta=report["delta"], accountant="prv"))
    kinds = [e["kind"] for e in ledger.read(out)]
    assert kinds.count("resume") == 1 and kinds[-1] == "final"
    assert ledger.verify(out).ok, ledger.verify(out).message


def test_two_processes_adapt_c_as_one_process_does(tmp_path, ddp_runs):
    """clipping: quantile on 2 gloo processes, bk: the count of each process is summed and noised once, on rank 0,
    after the gradient, from rank 0's stream: with seeded noise the 2-process run's C equals the 1-process run's
    (the same Poisson batches and noise; norms differ by float rounding only). The FSDP2 launch:
    tests/test_quantile_clipping.py; hooks and ghost under DDP: tests/fsdp_bk_worker.py."""
    _one_process(tmp_path / "one", QUANTILE)
    r1, r2 = (json.loads((d / "privacy_report.json").read_text()) for d in (tmp_path / "one", ddp_runs["quantile"]))
    a1, a2 = r1["adaptive_clipping"], r2["adaptive_clipping"]
    assert a1["steps"] == a2["steps"] == 6 and a1["final_max_grad_norm"] != 0.05
    assert a2["final_max_grad_norm"] == pytest.approx(a1["final_max_grad_norm"], rel=1e-9)
    assert r1["history"] == r2["history"]
    p1, p2 = _trainable(tmp_path / "one"), _trainable(ddp_runs["quantile"])
    for name in p1:
        assert torch.allclose(p1[name], p2[name], atol=1e-5), name
