"""One process of a launch that runs the recipe, then every case of tests/fsdp_bk_worker.py (tests/test_fsdp_bk.py).

    accelerate launch --config_file CONFIG --num_processes 2 tests/fsdp_recipe_then_cases.py FOUND GHOST_DIR ARGS...

First what ``recipes/finetune_llm.py ARGS...`` does in its process (``follow_launcher``, then ``cli(command=True)``):
the uninterrupted run the module's recipe test compares the killed and resumed run with. Then, once the recipe
has released its process group and only if it succeeded, a new gloo group over the same processes and the
module's FSDP cases (rank 0 writes them to FOUND). One 2-process launch fewer: its start-up (the launcher, and
transformers, opacus and torch imported in each process) cost ~20 CPU-s, about what all the cases cost together.
The process ends as the recipe's command does, with the recipe's exit code.
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "recipes", "finetune_llm.py")
sys.path[:0] = [os.path.join(ROOT, "recipes"), ROOT]

from dpllm.stopping import follow_launcher  # noqa: E402

if __name__ == "__main__":
    found, ghost_dir, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
    sys.argv = [RECIPE, *argv]  # as `python recipes/finetune_llm.py ARGS...` sees it (its messages name the program)
    follow_launcher()
    import finetune_llm

    code = finetune_llm.cli(argv, command=True)
    if code == 0:
        import torch.distributed as dist

        from tests import fsdp_bk_worker

        dist.init_process_group("gloo")
        fsdp_bk_worker.run_cases(found, ghost_dir)
    sys.exit(finetune_llm.finish(code))
