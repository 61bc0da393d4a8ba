"""The ghost_fsdp half of tests/test_fsdp_bk.py::test_fsdp_private_path_on_cpu (run by tests/fsdp_bk_worker.py).

:func:`check` drives dpllm's FSDP pieces directly on CPU (gloo): Opacus's FSDP2 wrapping with ghost_fsdp,
uneven and empty shares of a Poisson batch, evaluation, resumable save/load of sharded weights and
optimizer state, and the final checkpoint's gathered weights. It returns its findings (rank 0's count).
"""

import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dpllm import resume as R  # noqa: E402
from dpllm.checkpoint import load_model, save_checkpoint, unwrap  # noqa: E402
from dpllm.config import PrivacyConfig  # noqa: E402
from dpllm.data import TokenizedRecords, make_collate  # noqa: E402
from dpllm.distributed import World, is_sharded, reshard, wrap_model  # noqa: E402
from dpllm.privacy.engine import PrivacyPlan, make_private  # noqa: E402
from dpllm.train import evaluate, forward_loss  # noqa: E402
from tests.helpers import TEXTS, tiny_model  # noqa: E402


def full_state_dict(model) -> dict:
    """The full (unsharded, CPU) state dict, gathered by every process: what the checks compare."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    reshard(model)
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def check(finetuning: str, workdir: Path) -> dict:
    rank = dist.get_rank()
    world = World(rank=rank, size=dist.get_world_size(), kind="fsdp")
    found: dict = {}
    model, tok = tiny_model("tiny-llama", finetuning)
    model = wrap_model(model, dp=True, world=world, accelerator=None, mixed_precision="no",
                       grad_sample_mode="ghost_fsdp")
    found["sharded"] = is_sharded(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    dataset = TokenizedRecords(TEXTS * 10, tok, 48)
    plan = PrivacyPlan(num_records=len(dataset), sample_rate=0.25, steps=4, noise_multiplier=1.0, delta=1e-5,
                       accountant="rdp", expected_batch_size=15)
    sampling, noise = torch.Generator().manual_seed(1), torch.Generator().manual_seed(100 + rank)
    pt = make_private(model=model, optimizer=optimizer, dataset=dataset, collate_fn=make_collate(tok.pad_token_id),
                      cfg=PrivacyConfig(grad_sample_mode="ghost_fsdp"), plan=plan, logical_batch_size=15,
                      noise_generator=noise, sampling_generator=sampling, rank=rank, world_size=world.size)
    found["optimizer"] = type(pt.optimizer).__name__
    found["expected_batch_size"] = pt.optimizer.expected_batch_size
    collate = make_collate(tok.pad_token_id)
    empty = {k: torch.zeros((0, 1), dtype=torch.long) for k in ("input_ids", "attention_mask", "labels")}
    # step 1: rank 0 has two physical batches, rank 1 one real and one empty (padding) batch;
    # step 2: rank 1's whole share is empty. Collectives must stay in step, or this hangs.
    for shares in ([[[0, 1, 2], [3, 4]], [[5, 6, 7], []]], [[[0, 1], [2]], [[], []]]):
        parts = shares[rank]
        for i, part in enumerate(parts):
            pt.optimizer.signal_skip_step(do_skip=i < len(parts) - 1)
            pt.optimizer.zero_grad()
            forward_loss(pt.model, collate([dataset[j] for j in part]) if part else empty, pt.criterion).backward()
            pt.optimizer.step()
    found["history"] = [list(h) for h in pt.engine.accountant.history]
    found["eval"] = evaluate(pt.model, TokenizedRecords(TEXTS, tok, 48), collate, batch_size=4, device="cpu",
                             world=world)["loss"]
    from transformers import get_scheduler

    scheduler = get_scheduler("constant", pt.optimizer.original_optimizer, num_warmup_steps=0, num_training_steps=4)
    gens = {"sampling": sampling, "noise": noise}
    R.save(workdir, step=2, model=pt.model, optimizer=pt.optimizer, scheduler=scheduler, world=world,
           config_yaml="x: 1\n", generators=gens, privacy={},
           trainer_state={"step": 2, "plan": None, "accountant": pt.engine.accountant.state_dict()})
    names = R._trainable_names(pt.model)
    weights = full_state_dict(unwrap(pt.model))
    optim_state = R._optimizer_state(pt.model, pt.optimizer)
    with torch.no_grad():
        for p in pt.model.parameters():
            if p.requires_grad:
                p.add_(1.0)
    R.load(workdir / "checkpoints" / "step-000002", model=pt.model, optimizer=pt.optimizer, scheduler=scheduler,
           world=world, generators=gens, plan=None)
    again = full_state_dict(unwrap(pt.model))
    optim_again = R._optimizer_state(pt.model, pt.optimizer)
    if rank == 0:
        found["weights_restored"] = all(torch.equal(weights[k], again[k]) for k in names)
        found["optimizer_restored"] = all(
            torch.equal(a["exp_avg"], optim_again["state"][k]["exp_avg"]) for k, a in optim_state["state"].items())
        if finetuning == "full":
            save_checkpoint(workdir / "checkpoint", model=pt.model, tokenizer=tok, privacy_report={}, config_yaml="",
                            state_dict=dict(again))
            reloaded = dict(load_model(workdir / "checkpoint")[0].named_parameters())
            found["final_checkpoint_matches"] = all(torch.equal(reloaded[k], weights[k]) for k in names)
    dist.barrier()
    return found
