"""tests/test_fsdp_bk.py::test_ghost_fsdp_refuses_a_hook_copy: what each process finds (run in
tests/fsdp_bk_worker.py's launch, or alone under torch.distributed.run, rank 0 writing the findings to argv[1]).

FSDP2 + ghost_fsdp (asked for explicitly: under FSDP ``auto`` is bk or a refusal), on CPU (gloo): a forward hook on a
layer copies its (unsharded) weight for another layer to use. Each rank records whether its first backward pass was
refused and whether its weights stayed as they were.
"""

import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dpllm.config import PrivacyConfig  # noqa: E402
from dpllm.distributed import World, finish_process, wrap_model  # noqa: E402
from dpllm.privacy.engine import PrivacyPlan, make_private  # noqa: E402
from tests.fsdp_worker import full_state_dict  # noqa: E402
from tests.test_gradient_paths import IDS, HookCopy, V, Y  # noqa: E402


def check() -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = wrap_model(HookCopy(), dp=True, world=World(rank=rank, size=2, kind="fsdp"), accelerator=None,
                       mixed_precision="no", grad_sample_mode="ghost_fsdp")
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    plan = PrivacyPlan(num_records=4, sample_rate=0.5, steps=1, noise_multiplier=0.0, delta=1e-5, accountant="rdp",
                       expected_batch_size=2)
    data = [(torch.randint(0, V, (5,)), torch.tensor(i % V)) for i in range(4)]
    pt = make_private(model=model, optimizer=opt, dataset=data, collate_fn=lambda b: b,
                      cfg=PrivacyConfig(grad_sample_mode="ghost_fsdp", max_grad_norm=1e-3), plan=plan,
                      logical_batch_size=2, rank=rank, world_size=2)
    before = {k: v.clone() for k, v in full_state_dict(model).items()}
    found = {"mode": pt.grad_sample_mode, "refused": None}
    try:
        out = pt.model(IDS)
        pt.criterion(out, Y).backward()
        pt.optimizer.step()
    except RuntimeError as err:
        found["refused"] = str(err)
    after = full_state_dict(model)  # gathered on rank 0 only
    if rank == 0:
        # lr 1, σ 0: the update is the two records' clipped sum over the expected batch of 2, at most C
        found["update_over_C"] = float(torch.cat([(after[k] - before[k]).flatten() for k in before]).norm()) / 1e-3
    return found


if __name__ == "__main__":
    dist.init_process_group("gloo")
    found = check()
    everyone = [None, None]
    dist.all_gather_object(everyone, found)
    if dist.get_rank() == 0:
        Path(sys.argv[1]).write_text(json.dumps(everyone))
    finish_process(0)
