"""The held-out loss of a run: token-weighted, over every process's share of the held-out records.

What ``metrics.jsonl`` records for the held-out split; private (the held-out records are private data and
their loss is not noised), so no log line carries it.
"""

from __future__ import annotations

import math

import torch
from torch.utils.data import DataLoader

from dpllm.checkpoint import unwrap
from dpllm.distributed import World, all_sum, is_sharded, reshard
from dpllm.models import position_ids_for


@torch.no_grad()
def evaluate(model, dataset, collate, *, batch_size: int, device, world: World | None = None) -> dict:
    """Token-weighted held-out loss (nats per token) and perplexity.

    Called on every process: each evaluates every W-th record and the sums are all-reduced (under
    FSDP, where a forward pass needs all processes, each evaluates everything).
    """
    world = world or World()
    model = unwrap(model)
    was_training = model.training
    model.eval()
    total, tokens = 0.0, 0
    share = world if not is_sharded(model) else World()
    ids = list(range(share.rank, len(dataset), share.size))
    for batch in DataLoader(torch.utils.data.Subset(dataset, ids), batch_size=batch_size, collate_fn=collate):
        batch = {k: v.to(device) for k, v in batch.items()}
        ids = batch["input_ids"]
        logits = model(input_ids=ids, attention_mask=batch["attention_mask"], position_ids=position_ids_for(ids)).logits
        labels = batch["labels"][:, 1:]
        nll = torch.nn.functional.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="sum"
        )
        total += nll.item()
        tokens += int((labels != -100).sum())
    model.train(was_training)
    if is_sharded(model):
        reshard(model)  # FSDP: no backward follows these forwards to reshard the root's parameters
    total, tokens = all_sum([total, tokens], share)
    loss = total / max(tokens, 1)
    return {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "tokens": int(tokens)}
