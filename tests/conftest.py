"""Shared test fixtures. Tests never touch the network: the Hub is forced offline."""

import gc
import os
import sys

# Cyclic garbage collection less often: a test process holds millions of long-lived objects (torch, transformers,
# scipy, matplotlib), and Python's default (a young collection every 700 net allocations) ran 28 full collections of
# ~0.5 s each in the two workers, 20.3 CPU-s of collection in all; at 10,000 it was 9.1 CPU-s (2026-11-29, whole
# suite, gc.callbacks timing). Garbage is still collected, in larger batches.
gc.set_threshold(10_000, 10, 10)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tiny models: one thread avoids oversubscription on the 2-core CI machine (10 ms vs >1 s per step
# when another process is busy). Subprocesses inherit this through the environment.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """One intra-op thread in every process that runs tests, whatever OMP_NUM_THREADS the caller set (a fixture, not
    an import here: xdist's controller process, which runs no test, would import torch for nothing, ~3 CPU-s)."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture
def root():
    return ROOT


# The files that take longest (seconds of one worker, 2-core machine, 2026-11-29: 66 down to 15), heaviest first.
# `make test` hands whole files to its two workers in collection order (`--dist loadfile --no-loadscope-reorder`);
# these go out first, so that the run ends on small files and both workers finish together. xdist's own order (most
# tests first) left three of them (audit pipeline, scaling sweep, GPU proof smoke: 1-8 tests, ~33 s each) to the
# end, where one worker ran them while the other waited (~40 s). The other files follow, most tests first. A file
# missing here is only scheduled later; nothing else depends on this order.
SLOWEST_FIRST = ["test_fsdp_bk.py", "test_resume.py", "test_distributed.py", "test_scripts_smoke.py",
                 "test_audit_pipeline.py", "test_stopping.py", "test_scaling_sweep.py", "test_gpu_proof.py",
                 "test_prv.py", "test_bad_input.py", "test_train.py", "test_sft.py", "test_privacy_guarantees.py",
                 "test_user_level.py", "test_shipped_configs_compliance.py", "test_rough_edges.py",
                 "test_pld_fallback.py"]


def pytest_collection_modifyitems(config, items):
    count: dict[str, int] = {}
    for item in items:
        count[item.path.name] = count.get(item.path.name, 0) + 1
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    # a stable sort: each file's tests stay together and in their order
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), -count[item.path.name]))


# Files whose tests share something that lives in the test process, and so go to the same worker (as one file's tests
# do): the fork server of tests.helpers.forked_recipe, which imports the training stack once (~13 CPU-s) for every
# `python recipes/finetune_llm.py` process that these files start and then kill or signal. Apart, each worker that
# ran one of them would import it again.
SAME_WORKER = {"test_resume.py": "forked recipe processes", "test_stopping.py": "forked recipe processes"}


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` as xdist has it (a file's tests to one worker, files handed out in turn), with the files of
    :data:`SAME_WORKER` handed out together."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = super()._split_scope(nodeid)
            return SAME_WORKER.get(os.path.basename(file), file)

    return Scheduling(config, log)


def pytest_sessionfinish(session):
    helpers = sys.modules.get("tests.helpers")  # loaded by the tests that use it; this import would cost seconds
    if helpers is not None:
        helpers.stop_fork_server()  # ends the server of forked_recipe, if one was started
