"""Processes, wrapping and collectives: the few places where training knows it may run on many processes.

Launch with ``accelerate launch``; what it sets up (configs in recipes/accelerate/) decides the wrapping
(:func:`wrap_model`):

| launch config           | private training                                                     | non-private         |
|-------------------------|----------------------------------------------------------------------|---------------------|
| single_gpu.yaml / plain | the model as is                                                      | as is               |
| multi_gpu.yaml (DDP)    | Opacus ``DifferentiallyPrivateDistributedDataParallel``              | torch DDP           |
| fsdp.yaml (FSDP2)       | :func:`shard_model` (bk, auto); Opacus ``FSDP2Wrapper`` (ghost_fsdp) | :func:`shard_model` |

Under DP the model is wrapped *before* ``make_private``. Under DDP Opacus sees a distributed module, uses its
distributed optimizer (noise added once, on rank 0) and divides the expected batch size by the number of
processes. Under FSDP2 with ``bk`` each process clips its own records over the whole model, the clipped sums
are reduce-scattered to the shards, and each process noises its own shard (:mod:`dpllm.privacy.bk`); with
``ghost_fsdp`` Opacus does the same per shard. The global logical batch, q, σ, the step count and ε do not
depend on the number of processes.

On a machine without CUDA, ``accelerate launch --multi_gpu --num_processes 2`` starts two processes
but accelerate initialises no process group unless told the run is on CPU; :func:`make_accelerator`
does that, so the same command runs (gloo) on a laptop and on GPUs (nccl). ``accelerate launch
--config_file recipes/accelerate/fsdp.yaml --num_processes 2`` likewise starts two gloo processes on a CPU
machine; accelerate then calls the run ``MULTI_CPU``, and :func:`world_of` reads its ``ACCELERATE_USE_FSDP``
to run it sharded, as on GPUs.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from dpllm.config import ConfigError, PrivacyConfig
from dpllm.errors import TrainingError
from dpllm.stopping import die_with_parent, finish_process, release_process_group  # noqa: F401 (callers import them)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class World:
    """Where this process stands: its rank, how many there are, and how the model is parallelised."""

    rank: int = 0
    size: int = 1
    kind: str = "none"  # "none" | "ddp" | "fsdp"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


def make_accelerator(mixed_precision: str):
    """An ``Accelerator``; multi-process on CPU gets ``cpu=True`` so accelerate starts a gloo group.

    A process started by a launcher (``LOCAL_RANK`` set) dies with it (:func:`die_with_parent`).
    """
    from accelerate import Accelerator

    if "LOCAL_RANK" in os.environ:
        die_with_parent()
    launched = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if launched not in ("no", mixed_precision):
        log.warning("accelerate's mixed_precision=%s is not used: dpllm autocasts per train.mixed_precision (%s here); "
                    "set it in the dpllm config", launched, mixed_precision)
    cpu = not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1
    warn_if_fewer_processes()
    return Accelerator(mixed_precision=mixed_precision, cpu=cpu)


def requested_processes(parent_cmdline: Optional[list[str]] = None) -> Optional[int]:
    """How many processes ``accelerate launch`` was asked for (``--num_processes``, or its ``--config_file``), read
    from the launcher's command line (Linux); None when not launched by accelerate or not readable.

    >>> requested_processes(["accelerate", "launch", "--num_processes", "2", "train.py"])
    2
    >>> requested_processes(["python", "train.py"]) is None
    True
    """
    import yaml

    args = parent_cmdline
    if args is None:
        if not any(k.startswith("ACCELERATE_") for k in os.environ):
            return None
        try:
            args = [a.decode() for a in open(f"/proc/{os.getppid()}/cmdline", "rb").read().split(b"\0") if a]
        except (OSError, UnicodeDecodeError):
            return None
    if "launch" not in args:
        return None
    args = args[args.index("launch") + 1:]
    found = None
    for i, a in enumerate(args):
        name, _, value = a.partition("=")
        if name in ("--num_processes", "--num-processes", "--config_file", "--config-file"):
            value = value or (args[i + 1] if i + 1 < len(args) else "")
            try:
                found = (int(value) if "num" in name else
                         int((yaml.safe_load(open(value).read()) or {}).get("num_processes") or 0) or found)
            except (OSError, ValueError, TypeError, yaml.YAMLError):
                continue
        if not a.startswith("-") and a.endswith(".py"):  # the script: what follows are its own options
            break
    return found


def warn_if_fewer_processes() -> None:
    """``accelerate launch --num_processes 2 x.py`` without ``--multi_gpu`` on a machine without GPUs starts ONE
    process, silently: say so (from :func:`make_accelerator` and DPTrainer's setup)."""
    asked, started = requested_processes(), int(os.environ.get("WORLD_SIZE", "1"))
    if asked is not None and asked > started:
        log.warning("accelerate launch was asked for %d processes but started %d: the run trains on %d process(es). "
                    "Add --multi_gpu (two CPU processes work too: accelerate launch --multi_gpu --num_processes %d), "
                    "or --config_file recipes/accelerate/multi_gpu.yaml", asked, started, started, asked)


def world_of(accelerator) -> World:
    """Read rank, size and parallelism kind from accelerate's state.

    Raises:
        ConfigError: a launch mode dpllm does not support (DeepSpeed, Megatron, XLA).
    """
    from accelerate.utils import DistributedType

    dt = accelerator.distributed_type
    # on CPU accelerate turns an FSDP launch into MULTI_CPU; its launcher still says FSDP was asked for
    fsdp_on_cpu = dt == DistributedType.MULTI_CPU and os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"
    if dt == DistributedType.NO:
        kind = "none"
    elif dt == DistributedType.FSDP or fsdp_on_cpu:
        kind = "fsdp"
    elif dt.value.startswith("MULTI_"):
        kind = "ddp"
    else:
        raise ConfigError(f"accelerate distributed_type={dt.value} is not supported; launch with "
                          "recipes/accelerate/multi_gpu.yaml (DDP) or fsdp.yaml (FSDP2)")
    return World(rank=accelerator.process_index, size=accelerator.num_processes, kind=kind)


def check_parallelism(privacy: PrivacyConfig, kind: str, *, world_size: int = 1, logical_batch_size: int = 1) -> None:
    """Refuse privacy settings that do not fit the launch, before anything is written.

    Args:
        privacy: the run's privacy section.
        kind: ``"none"``, ``"ddp"`` or ``"fsdp"`` (see :func:`world_of`).
        world_size: number of processes.
        logical_batch_size: records per optimizer step, over all processes.

    Raises:
        ConfigError: FSDP under DP with Opacus's ``ghost`` or ``hooks`` (they cannot see sharded parameters;
            ``bk``, ``auto`` and ``ghost_fsdp`` can), ``ghost_fsdp`` without FSDP, or a logical batch smaller
            than the number of processes (a non-private process would get no records).
    """
    if kind not in ("none", "ddp", "fsdp"):
        raise ConfigError(f"parallelism kind={kind!r} is not one of none, ddp, fsdp")
    mode = privacy.grad_sample_mode
    if privacy.enabled and kind == "fsdp" and mode not in ("bk", "auto", "ghost_fsdp"):
        raise ConfigError(
            f"grad_sample_mode={mode} cannot run under FSDP: Opacus's {mode} mode cannot see sharded parameters; "
            "set privacy.grad_sample_mode: auto (book-keeping, one backward pass) or ghost_fsdp, or launch with "
            "recipes/accelerate/multi_gpu.yaml (DDP)"
        )
    if privacy.enabled and mode == "ghost_fsdp" and kind != "fsdp":
        raise ConfigError(
            "grad_sample_mode=ghost_fsdp needs an FSDP launch (accelerate launch --config_file "
            "recipes/accelerate/fsdp.yaml ...); without FSDP use grad_sample_mode: auto"
        )
    if world_size > logical_batch_size:
        raise ConfigError(f"logical_batch_size={logical_batch_size} is smaller than the {world_size} processes; "
                          "raise logical_batch_size or launch fewer processes")


def wrap_model(model: nn.Module, *, dp: bool, world: World, accelerator, mixed_precision: str,
               grad_sample_mode: Optional[str] = None) -> nn.Module:
    """Wrap for the launch (see the module table). Create the optimizer *after* this: FSDP replaces parameters.

    Args:
        grad_sample_mode: the engine that will run (``auto`` resolved); ``ghost_fsdp`` needs Opacus's layout.
    """
    if world.kind == "none":
        return model
    if world.kind == "fsdp":
        if dp and grad_sample_mode == "ghost_fsdp":  # Opacus's norm samplers need every layer sharded alone
            from opacus.utils.fsdp_utils import FSDP2Wrapper

            return FSDP2Wrapper(model, mp_policy=_mixed_precision_policy(mixed_precision))
        return shard_model(model, mixed_precision=mixed_precision, reshard_after_forward=_reshard_after_forward())
    if not dp:
        return accelerator.prepare_model(model)
    from opacus.distributed import DifferentiallyPrivateDistributedDataParallel

    return DifferentiallyPrivateDistributedDataParallel(model)  # broadcasts rank 0's weights


def loads_on_rank0(world: World, source: dict, quantization: str) -> bool:
    """FSDP with accelerate's ``fsdp_cpu_ram_efficient_loading`` (``recipes/accelerate/fsdp.yaml`` sets it): rank 0
    alone reads the pretrained weights; the other processes build the model on the meta device, and every process
    receives its shard from rank 0 once the model is sharded (:func:`fill_from_rank0`). One copy of the weights in
    host memory instead of one per process (8 × 32 GB for Llama-3-8B in fp32). Hub and local models, unquantized."""
    asked = os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING", "false").lower() in ("true", "1", "yes")
    return asked and world.kind == "fsdp" and world.size > 1 and source.get("kind") == "pretrained" and \
        quantization == "none"


def full_state(model: nn.Module) -> tuple[dict, dict]:
    """Rank 0's weights and buffers (non-persistent ones included, e.g. rotary frequencies), before sharding."""
    return model.state_dict(), dict(model.named_buffers())


def fill_from_rank0(model: nn.Module, full: Optional[tuple[dict, dict]], world: World, device) -> None:
    """Give every process of a sharded ``model`` its shard of rank 0's weights (``full``: :func:`full_state` on
    rank 0, None elsewhere) and rank 0's buffers; the other processes built the model on the meta device."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    state, buffers = full if full is not None else ({}, {})
    model.to_empty(device=device)  # memory for each process's shards and buffers; filled below
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for name, buf in model.named_buffers():  # not sharded; non-persistent ones are in no state dict
        if world.is_main:
            buf.copy_(buffers[name])
        torch.distributed.broadcast(buf, src=0)
    log.info("FSDP: the weights were read by rank 0 alone and sent to the %d processes' shards", world.size)


def _mixed_precision_policy(mixed_precision: str):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    # bf16 compute with fp32 gradient reduction: per-sample norms, clipped sums and noise stay in fp32.
    return (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if mixed_precision == "bf16" else MixedPrecisionPolicy())


def _reshard_after_forward() -> bool:
    """``fsdp_reshard_after_forward`` of the accelerate config (its launcher exports it), default true."""
    return os.environ.get("FSDP_RESHARD_AFTER_FORWARD", "true").lower() not in ("false", "0", "no")


def shard_model(model: nn.Module, *, mixed_precision: str = "no", reshard_after_forward: bool = True) -> nn.Module:
    """FSDP2 as accelerate's ``TRANSFORMER_BASED_WRAP`` does it: each transformer block (the model's
    ``_no_split_modules``) is one shard group, the root holds the rest (embeddings, final norm, output head).

    A weight shared by two layers (a tied output head) stays in one group, the root's. Under ``bk`` every
    process runs the whole model on its own records, one block's parameters gathered at a time; the layers
    themselves keep their types, so bk's per-layer rules apply unchanged.

    Args:
        mixed_precision: ``"bf16"``: blocks compute in bf16, gradients are reduced in fp32.
        reshard_after_forward: free each block's gathered parameters after its forward (gathered again for
            backward): less memory, one more all-gather per block.

    Returns:
        ``model``, sharded in place (its parameters are now DTensors).
    """
    from torch.distributed.fsdp import fully_shard

    names = set(getattr(model, "_no_split_modules", None) or [])
    policy = _mixed_precision_policy(mixed_precision)
    blocks = [m for m in model.modules() if type(m).__name__ in names and m is not model]
    if not blocks:
        log.warning("FSDP: %s names no transformer blocks (_no_split_modules); the whole model is one shard group",
                    type(model).__name__)
    for block in blocks:
        fully_shard(block, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    return fully_shard(model, mp_policy=policy, reshard_after_forward=reshard_after_forward)


def unsharded_parameters(model: nn.Module) -> list[tuple[str, nn.Module, nn.Parameter]]:
    """``(name, owning module, parameter)`` for the parameter objects a forward pass of an FSDP2 model uses.

    FSDP2 registers sharded DTensors on the modules and swaps in other, unsharded parameters (the same objects
    every step, created at the first all-gather) while a group runs. A hook or an identity check that must see
    what the forward pass uses needs those. Each group is gathered and released in turn (a collective: every
    process calls this), so at most one group is unsharded at a time. A parameter shared by two layers (a tied
    head) appears once per layer.
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    found: dict[tuple[int, int], tuple[str, nn.Module, nn.Parameter]] = {}
    for root_name, group in model.named_modules():
        if not isinstance(group, FSDPModule):
            continue
        group.unshard()
        for sub_name, sub in group.named_modules():
            for pname, p in sub.named_parameters(recurse=False):
                if not isinstance(p, DTensor):  # this group's, now unsharded (other groups stay DTensors)
                    name = ".".join(x for x in (root_name, sub_name, pname) if x)
                    found.setdefault((id(p), id(sub)), (name, sub, p))
        group.reshard()
    return list(found.values())


def is_sharded(model: nn.Module) -> bool:
    """True for an FSDP2 (``fully_shard``) model, whose parameters are DTensors."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def _collective_device() -> torch.device:
    # nccl reduces CUDA tensors only; gloo CPU tensors
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def all_sum(values: list[float], world: World) -> list[float]:
    """Sum a few numbers over processes (float64 on CPU for gloo, on the device for nccl)."""
    if not world.distributed:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=_collective_device())
    torch.distributed.all_reduce(t)
    return t.tolist()


def all_max(value: float, world: World) -> float:
    """The largest ``value`` over processes."""
    if not world.distributed:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=_collective_device())
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return t.item()


def gather_objects(obj: Any, world: World) -> list[Any]:
    """Every process's ``obj``, in rank order, on every process."""
    if not world.distributed:
        return [obj]
    out: list[Any] = [None] * world.size
    torch.distributed.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, world: World) -> Any:
    """Rank 0's ``obj`` on every process."""
    if not world.distributed:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def barrier(world: World) -> None:
    if world.distributed:
        torch.distributed.barrier()


def reshard(model: nn.Module) -> None:
    """Put FSDP2 modules back in their sharded state.

    The root module keeps its parameters unsharded after a forward pass that no backward follows (an
    evaluation); state-dict and optimizer-state functions then see other tensors than the optimizer's.
    """
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def agreed_digest(model: nn.Module, world: World) -> Optional[str]:
    """:func:`params_digest`, checked equal on every process (replicas that differ after training are a bug).

    Raises:
        TrainingError: the processes' replicas differ.
    """
    digests = gather_objects(params_digest(model), world)
    if len(set(digests)) > 1:
        raise TrainingError(f"model replicas differ across the {world.size} processes after training; this is a "
                            "dpllm bug (no checkpoint was written)")
    return digests[0]


def params_digest(model: nn.Module) -> Optional[str]:
    """sha256 of the trainable parameters' bytes (None for sharded models, whose ranks hold different shards)."""
    if is_sharded(model):
        return None
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        if p.requires_grad:
            h.update(name.encode())
            h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()
