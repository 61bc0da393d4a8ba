"""Several multi-process training runs in one launch (the ``ddp_runs`` fixture of tests/test_distributed.py; under
FSDP2, tests/test_fsdp_bk.py's secret and killed runs).

    accelerate launch --multi_gpu --num_processes 2 tests/ddp_runs.py RUNS.json
    accelerate launch --config_file recipes/accelerate/fsdp.yaml --num_processes 2 tests/ddp_runs.py RUNS.json

RUNS.json is a list of argument lists, one per run, each with its own ``--output_dir``. Every process runs them in
order, each through recipes/finetune_llm.py's ``main`` (what ``python recipes/finetune_llm.py ARGS`` runs: the
options and paths checked, ``train``, the privacy line printed) on the one process group the launch made, and then
leaves through :func:`dpllm.distributed.finish_process`, as the recipe does. A process pays its imports (~10 CPU-s:
torch, transformers, opacus) once for all the runs instead of once per launch. A run that raises ends the launch: no
later run starts, and each finished run has its ``run_summary.json``.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dpllm.distributed import finish_process  # noqa: E402
from tests.helpers import load_recipe  # noqa: E402


def main(path: str) -> int:
    recipe = load_recipe("finetune_llm")
    with open(path) as fh:
        runs = json.load(fh)
    for argv in runs:
        recipe.main(argv)  # logging as the recipe sets it: only the first process logs below ERROR
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(finish_process(main(sys.argv[1])))
