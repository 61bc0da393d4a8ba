"""Shared test fixtures. Tests never touch the network: the Hub is forced offline."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tiny models: one thread avoids oversubscription on the 2-core CI machine (10 ms vs >1 s per step
# when another process is busy). Subprocesses inherit this through the environment.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def root():
    return ROOT
