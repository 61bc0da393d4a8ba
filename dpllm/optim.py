"""The optimizer and learning-rate schedule a run's config names: SGD (with momentum) or AdamW, and one of
transformers' schedules (``constant``, ``linear``, ``cosine``, with ``warmup_steps``).

Under DP the engine wraps the optimizer afterwards (:meth:`dpllm.privacy.run.RunPrivacy.attach`); the schedule
steps the learning rate of the optimizer made here, which the wrapper shares.
"""

from __future__ import annotations

import torch
from torch import nn

from dpllm.config import TrainConfig


def make_optimizer(model: nn.Module, t: TrainConfig, *, steps: int):
    """``(optimizer, scheduler)`` over the model's trainable parameters, for a run of ``steps`` optimizer steps."""
    from transformers import get_scheduler

    params = [p for p in model.parameters() if p.requires_grad]
    if t.optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=t.learning_rate, momentum=t.momentum, weight_decay=t.weight_decay)
    else:
        opt = torch.optim.AdamW(params, lr=t.learning_rate, weight_decay=t.weight_decay)
    return opt, get_scheduler(t.lr_scheduler, opt, num_warmup_steps=t.warmup_steps, num_training_steps=steps)
