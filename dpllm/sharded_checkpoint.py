"""Checkpoints of an FSDP2 run, written by every process, each its own shard: no process gathers the model.

Resumable checkpoints (:mod:`dpllm.resume`) of a sharded run hold, under ``checkpoints/step-XXXXXX/``:

| file                         | written by | holds                                                                  |
|------------------------------|------------|------------------------------------------------------------------------|
| ``state/__R_0.distcp``       | rank R     | its shards of the trainable parameters and of their optimizer state    |
| ``state/.metadata``          | rank 0     | where each shard lives (``torch.distributed.checkpoint``'s index)      |
| ``rng/rank-RRRRR.pt`` (0600) | rank R     | SECRET: its noise generator, Poisson sampler, python/numpy/torch state |
| ``scheduler.pt``             | rank 0     | as for one process                                                     |
| ``trainer_state.json``       | rank 0     | as for one process                                                     |
| ``dpllm_config.yaml``        | rank 0     | as for one process                                                     |

Every process writes into one temporary directory that rank 0 created (on one machine, or a filesystem all
processes share); rank 0 renames it into place only after every process has finished, so a crash leaves the
previous checkpoint whole. A process's noise state never leaves it: it is written by that process, to its own
owner-only file.

Resuming reads the shards back with ``torch.distributed.checkpoint``, which reshards: the same number of
processes restores everything exactly (each rank its own generators); another number of processes, or one
unsharded process, restores the weights, optimizer state, sampler and accountant exactly and lets every
process keep the fresh secret noise generator it started with (:func:`dpllm.resume.rng_for_process`).

The final ``checkpoint/`` of a sharded full fine-tune is written in the usual Hugging Face layout straight from
the shards (:func:`write_weights`): every process writes its rows, then rank 0 merges them file by file into
full tensors through memory maps (``torch.distributed.checkpoint.HuggingFaceStorageWriter``), so
``from_pretrained`` and ``dpllm export`` read it as any other checkpoint. A LoRA adapter is small: it is
gathered and saved by ``save_pretrained``.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from dpllm.distributed import World, broadcast_object, is_sharded, reshard

log = logging.getLogger(__name__)

STATE = "state"
RNG = "rng"
# safetensors files of the final checkpoint: HF's usual 5 GB shards
MAX_FILE_BYTES = 5 * 2**30


def is_sharded_checkpoint(ckpt: Path) -> bool:
    """True for a resumable checkpoint written by this module."""
    return (Path(ckpt) / STATE / ".metadata").is_file()


def shared_tempdir(target: Path, world: World) -> Path:
    """A private (0700) temporary directory beside ``target``, made by rank 0, its path sent to every process.

    Named as :func:`dpllm.io.atomic_directory` names its own, so a crash's leftovers are cleaned the same way.
    """
    path = None
    if world.is_main:
        target.parent.mkdir(parents=True, exist_ok=True)
        path = tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    return Path(broadcast_object(path, world))


def _trainable(model: nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


def _state_dicts(model: nn.Module, optimizer) -> tuple[dict, dict]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if is_sharded(model):
        reshard(model)  # an evaluation leaves the root unsharded; the optimizer holds the sharded parameters
    msd, osd = get_state_dict(model, optimizer)
    keep = _trainable(model)
    return {k: v for k, v in msd.items() if k in keep}, osd


def save_state(directory: Path, *, model: nn.Module, optimizer, world: World, rng: dict) -> None:
    """Write this process's shards of the trainable weights and optimizer state, and its random state (collective).

    Args:
        directory: the checkpoint's temporary directory (:func:`shared_tempdir`).
        model: the bare FSDP model (no bk or Opacus wrapper).
        optimizer: the base torch optimizer.
        rng: this process's generator states (secret; written owner-only).
    """
    import torch.distributed.checkpoint as dcp

    msd, osd = _state_dicts(model, optimizer)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(Path(directory) / STATE))
    (Path(directory) / RNG).mkdir(mode=0o700, exist_ok=True)
    fd = os.open(Path(directory) / RNG / f"rank-{world.rank:05d}.pt", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        torch.save(rng, fh)


def load_state(ckpt: Path, *, model: nn.Module, optimizer) -> None:
    """Read the trainable weights and optimizer state back, resharded for this launch (collective if distributed).

    Works on any number of processes, sharded or not (one process reads whole tensors from the shards).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    msd, osd = _state_dicts(model, optimizer)
    state = {"model": msd, "optimizer": osd}
    dcp.load(state, checkpoint_id=str(Path(ckpt) / STATE))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=StateDictOptions(strict=False))


def saved_ranks(ckpt: Path) -> int:
    """How many processes wrote ``ckpt``'s random states."""
    return len(list((Path(ckpt) / RNG).glob("rank-*.pt")))


def load_rng(ckpt: Path, rank: int) -> dict:
    """The random state rank ``rank`` saved (owner-only file)."""
    return torch.load(Path(ckpt) / RNG / f"rank-{rank:05d}.pt", weights_only=True)


def _file_index(state: dict) -> dict[str, int]:
    """Tensor name → safetensors file number (1, 2, ...), at most :data:`MAX_FILE_BYTES` per file."""
    index, size, mapping = 1, 0, {}
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if size and size + nbytes > MAX_FILE_BYTES:
            index, size = index + 1, 0
        mapping[name] = index
        size += nbytes
    return mapping


def write_weights(directory: Optional[Path], *, model: nn.Module, world: World) -> None:
    """The weights of a sharded model as a Hugging Face checkpoint in ``directory`` (collective).

    Full fine-tuning: every process writes its shards under ``directory/sharded``, rank 0 merges them into
    ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json`` and removes the shards, then writes
    ``config.json`` (and the generation config). LoRA: the trainable (adapter) tensors are gathered on every
    process and rank 0 calls ``save_pretrained``.

    Args:
        directory: where rank 0's checkpoint is being assembled (every process must be able to write there);
            the same path on every process.
        model: the bare FSDP model.
    """
    import shutil

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    reshard(model)
    if hasattr(model, "peft_config"):  # LoRA: a few MB even for a 70B base
        trainable = _trainable(model)
        state = {n: p.full_tensor().cpu() if hasattr(p, "full_tensor") else p.detach().cpu()
                 for n, p in model.named_parameters() if n in trainable}
        if world.is_main:
            model.save_pretrained(directory, state_dict=state)
        return
    state = get_model_state_dict(model)
    writer = HuggingFaceStorageWriter(str(directory), save_distributed=True, enable_consolidation=True,
                                      fqn_to_index_mapping=_file_index(state))
    dcp.save(state, storage_writer=writer)
    if world.is_main:
        shutil.rmtree(Path(directory) / "sharded", ignore_errors=True)
        model.config.save_pretrained(directory)
        if getattr(model, "generation_config", None) is not None and model.can_generate():
            model.generation_config.save_pretrained(directory)
