"""Several multi-process training runs in one launch (the ``ddp_runs`` fixture of tests/test_distributed.py).

    accelerate launch --multi_gpu --num_processes 2 tests/ddp_runs.py RUNS.json

RUNS.json is a list of argument lists, one per run, each with its own ``--output_dir``. Every process runs them in
order, each through :func:`dpllm.train.train` (what recipes/finetune_llm.py calls) on the one process group the
launch made, and then leaves through :func:`dpllm.distributed.finish_process`, as the recipe does. A process pays
its imports (~10 CPU-s: torch, transformers, opacus) once for all the runs instead of once per launch. A run that
raises ends the launch: no later run starts, and each finished run has its ``run_summary.json``.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dpllm.config import parse_config  # noqa: E402
from dpllm.distributed import finish_process  # noqa: E402
from dpllm.logs import setup_logging  # noqa: E402
from dpllm.train import train  # noqa: E402


def main(path: str) -> int:
    setup_logging()  # as the recipe: only the first process logs below ERROR
    with open(path) as fh:
        runs = json.load(fh)
    for argv in runs:
        train(parse_config(argv))
    return 0


if __name__ == "__main__":
    sys.exit(finish_process(main(sys.argv[1])))
