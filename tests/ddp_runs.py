"""Several multi-process training runs in one launch (the ``ddp_runs`` fixture of tests/test_distributed.py; under
FSDP2, tests/test_fsdp_bk.py's launch).

    accelerate launch --multi_gpu --num_processes 2 tests/ddp_runs.py RUNS.json
    accelerate launch --config_file recipes/accelerate/fsdp.yaml --num_processes 2 tests/ddp_runs.py RUNS.json

RUNS.json is a list of runs, in order. A run is an argument list with its own ``--output_dir``, or
``{"argv": [...], "env": {...}}``: the same with environment variables set for that run alone (what the launcher
sets from its config file, e.g. ``FSDP_CPU_RAM_EFFICIENT_LOADING``), or ``{"fsdp_bk_cases": [FOUND.json, SCRATCH]}``:
tests/fsdp_bk_worker.py's cases. Every process runs them in order, each recipe run through recipes/finetune_llm.py's
``main`` (what ``python recipes/finetune_llm.py ARGS`` runs: the options and paths checked, ``train``, the privacy
line printed) on the one process group the launch made, and then leaves through
:func:`dpllm.distributed.finish_process`, as the recipe does. A process pays its imports (~10 CPU-s: torch,
transformers, opacus) once for all the runs instead of once per launch. Before each run the first process writes
``ddp_runs: run I of N`` to stderr, so that a test can tell the runs' log lines apart. A run that raises ends the
launch: no later run starts, and each finished run has its ``run_summary.json``.
"""

import json
import logging
import os
import sys
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dpllm.distributed import finish_process  # noqa: E402
from dpllm.logs import main_process  # noqa: E402
from tests.helpers import load_recipe  # noqa: E402

MARKER = "ddp_runs: run {} of {}"


def main(path: str) -> int:
    recipe = load_recipe("finetune_llm")
    with open(path) as fh:
        runs = json.load(fh)
    _hide_unused_bitsandbytes(runs)
    for i, run in enumerate(runs, 1):
        if main_process():
            print(MARKER.format(i, len(runs)), file=sys.stderr, flush=True)
        if isinstance(run, dict) and "fsdp_bk_cases" in run:
            import torch.distributed as dist

            from tests.fsdp_bk_worker import run_cases

            if not dist.is_initialized():
                dist.init_process_group("gloo")  # the recipe's Accelerator finds it started and keeps it
            run_cases(*run["fsdp_bk_cases"])
            # what the cases' libraries configured (a root handler from logging.basicConfig) would turn the recipe's
            # own logging setup into a no-op: the runs after them start from logging as a fresh process has it
            for handler in logging.root.handlers[:]:
                logging.root.removeHandler(handler)
            logging.root.setLevel(logging.WARNING)
            continue
        argv, env = (run, {}) if isinstance(run, list) else (run["argv"], run.get("env", {}))
        with mock.patch.dict(os.environ, env):  # that run's variables, the launch's again after it
            recipe.main(argv)  # logging as the recipe sets it: only the first process logs below ERROR
        sys.stdout.flush()
    return 0


def _hide_unused_bitsandbytes(runs: list) -> None:
    """bitsandbytes unimportable in this process when no run quantizes, as ``python recipes/finetune_llm.py`` makes it
    for its one run (:func:`dpllm.quantization.hide_unused_bitsandbytes`): the launch then imports what the recipe's
    processes import, and peft does not import bitsandbytes (through torch.compile: ~2.7 CPU-s per process)."""
    from dpllm.config import parse_config
    from dpllm.quantization import hide_unused_bitsandbytes

    models = [parse_config(run if isinstance(run, list) else run["argv"]).model
              for run in runs if not (isinstance(run, dict) and "fsdp_bk_cases" in run)]
    if all(m.quantization in (None, "none") for m in models):  # the cases never quantize: tiny models
        hide_unused_bitsandbytes("none", *([m.model_name_or_path for m in models] or ["tiny-llama"]))


if __name__ == "__main__":
    sys.exit(finish_process(main(sys.argv[1])))
