"""Resumable checkpoints: everything a killed run needs to continue as if it had never stopped.

Every ``save_every`` steps and at the end, ``RUN_DIR/checkpoints/step-XXXXXX/`` is written atomically
(temp directory, then one rename) with:

    model.safetensors + config.json   full fine-tuning (save_pretrained), or
    adapter_model.safetensors + adapter_config.json   LoRA
    optimizer.pt  scheduler.pt        optimizer and LR-scheduler state
    rng_state.pt                      per process: python, numpy, torch (and CUDA) generators, the
                                      Poisson sampler's generator, the noise generator. SECRET: whoever
                                      reads it can regenerate the remaining noise and batches, so
                                      checkpoints/ and this file are owner-only (0700 / 0600) and none of
                                      it is ever copied into checkpoint/, the report or ``dpllm export``
    trainer_state.json                step, tokens seen, metrics.jsonl position, the accountant's
                                      history, the privacy plan, ε at this step
    dpllm_config.yaml                 the run's config (a resume with another config is refused)
    sha256sums.json                   every other file's size and sha256, written last: a resume checks
                                      them before it reads anything (:mod:`dpllm.checksums`)

Under FSDP2 no process gathers the model: every process writes its own shards of the weights and
optimizer state and its own (secret) random state, beside rank 0's scheduler, trainer state and config
(:mod:`dpllm.sharded_checkpoint` lists the files).

Then ``checkpoints/latest`` is pointed at it (atomically), a ``checkpoint`` line goes into the privacy
ledger, and all but the newest two checkpoints are removed. A crash at any point leaves the previous
checkpoint and pointer intact: nothing is renamed into place until it is complete.

Resuming (``--resume_from latest`` or a checkpoint path) restores all of it, so the resumed run draws
the same batches and the same noise as an uninterrupted one: the accountant counts each step exactly
once, and a step re-run after a crash releases exactly what the lost attempt computed (same noise),
never a second, independent noisy sample. Lines that the lost steps wrote to metrics.jsonl are cut off.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from dpllm import checksums, ledger
from dpllm import sharded_checkpoint as sc
from dpllm.checkpoint import CheckpointError, unwrap
from dpllm.config import CLI_OPTIONS, ConfigError, OptionNames, RunConfig
from dpllm.distributed import World, barrier, gather_objects, is_sharded, reshard
from dpllm.io import atomic_directory, load_yaml, read_jsonl, write_json_atomic, write_text_atomic
from dpllm.stopping import program_of  # noqa: F401 (where it lived; the recipe reads it before torch is imported)

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
KEEP = 2
# Fields that may differ between a run and its resumption: where it writes, whether it resumes, display.
NOT_COMPARED = {"output_dir", "overwrite_output_dir", "resume_from", "progress", "runs_file",
                "save_every_minutes"}


def step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"step-{step:06d}"


# ---- finding and checking what to resume -----------------------------------------------------------

def resolve(cfg: RunConfig, *, names: OptionNames = CLI_OPTIONS) -> Optional[Path]:
    """The checkpoint directory ``cfg.train.resume_from`` names, or None for a fresh run.

    ``latest`` reads ``OUTPUT_DIR/checkpoints/latest``; with no run directory yet it starts a fresh run
    (so a preemptible job can always pass ``--resume_from latest``). A path must be a checkpoint of
    ``output_dir``: a resumed run continues in its own directory.

    Args:
        cfg: the run's config.
        names: how the reader sets the options the messages suggest (flags, or DPTrainer's fields).

    Raises:
        ConfigError: nothing resumable where there should be, or a checkpoint of another run directory.
    """
    t = cfg.train
    if not t.resume_from:
        return None
    if t.overwrite_output_dir:
        raise ConfigError(f"{names.resume} and {names.overwrite} contradict each other; drop one")
    run_dir = Path(t.output_dir)
    if t.resume_from == "latest":
        pointer = run_dir / CHECKPOINTS / "latest"
        if not pointer.is_file():
            if not run_dir.exists() or not any(run_dir.iterdir()):
                log.info("resume_from=latest: %s has no run yet; starting a new run", run_dir)
                return None
            raise ConfigError(f"{names.resume}: {run_dir} has no resumable checkpoint ({pointer} is missing; "
                              f"{names.save} writes them); start over with {names.overwrite}")
        ckpt = run_dir / CHECKPOINTS / pointer.read_text().strip()
    else:
        ckpt = Path(t.resume_from)
        if (ckpt / CHECKPOINTS / "latest").is_file():  # a run directory: its latest checkpoint
            ckpt = ckpt / CHECKPOINTS / (ckpt / CHECKPOINTS / "latest").read_text().strip()
        if ckpt.resolve().parent.parent != run_dir.resolve():
            raise ConfigError(f"resume_from={t.resume_from} is not a checkpoint of output_dir={run_dir}; a resumed run "
                              f"continues in its own directory: set {names.output_dir} "
                              f"{ckpt.resolve().parent.parent}")
    if not (ckpt / "trainer_state.json").is_file():
        raise ConfigError(f"resume_from={t.resume_from}: {ckpt} is not a complete resumable checkpoint "
                          "(no trainer_state.json)")
    if finished_summary(run_dir) is None:  # a finished run reads nothing of it: its summary is the answer
        check_intact(ckpt, run_dir, names=names)
    return ckpt


def _damage(ckpt: Path, run_dir: Path) -> Optional[str]:
    """What is damaged in ``ckpt`` (None: intact, or written before checksums and without a ledger line)."""
    if checksums.has_sums(ckpt):
        return checksums.damage(ckpt)
    try:  # an older checkpoint: the ledger's checkpoint_sha256 of its newest line
        digests = [e.get("checkpoint_sha256") for e in ledger.read(run_dir)
                   if e.get("kind") == "checkpoint" and e.get("checkpoint") == ckpt.relative_to(run_dir).as_posix()]
    except (ledger.LedgerError, ValueError):
        digests = []
    if not digests:
        log.warning("%s has no checksums and no ledger line: it cannot be checked before it is loaded", ckpt)
        return None
    if ledger.dir_sha256(ckpt) != digests[-1]:
        return "its files do not match the checkpoint_sha256 of its line in privacy_ledger.jsonl"
    return None


def check_intact(ckpt: Path, run_dir: Path, *, names: OptionNames = CLI_OPTIONS) -> None:
    """Refuse a checkpoint whose files changed since it was written, before any of it is read.

    Raises:
        ConfigError: one line naming the damaged checkpoint and what differs, and the newest earlier checkpoint
            of the run that is intact (and how to resume from it), or that none is left.
    """
    what = _damage(ckpt, run_dir)
    if what is None:
        return
    step = int(ckpt.name.rsplit("-", 1)[-1]) if ckpt.name.startswith("step-") else None
    earlier = sorted((p for p in (run_dir / CHECKPOINTS).glob("step-*") if p.is_dir() and p != ckpt
                      and (step is None or p.name < ckpt.name) and (p / "trainer_state.json").is_file()), reverse=True)
    intact = next((p for p in earlier if _damage(p, run_dir) is None), None)
    if intact is not None:
        how = names.resume.replace("latest", str(intact)).replace("True", repr(str(intact)))
        advice = f"resume from the earlier intact checkpoint {intact} instead ({how})"
    else:
        advice = f"no earlier intact checkpoint is left; start over with {names.overwrite}"
    raise ConfigError(f"cannot resume from {ckpt}: it was damaged after it was written ({what}); {advice}")


def _flat(d: dict) -> dict:
    return {f"{section}.{k}": v for section, fields in d.items() for k, v in fields.items()}


# Options added after a run may have started: absent from its saved config they mean this value, and at this value
# they are left out of the key, so a run started before them resumes with the same config and the same key.
ADDED_LATER = {"model.quantization": "none", "data.record_fraction": None, "data.long_records": "truncate",
               "data.max_windows": 8, "data.window_stride": 0, "privacy.noise": "independent",
               "privacy.bands": "auto", "privacy.buffers": "auto", "data.packing": False}


def config_key(cfg: RunConfig) -> str:
    """sha256 of the config without the fields a resumed run may change: the same run, the same key."""
    import hashlib

    kept = {k: v for k, v in _flat(cfg.to_dict()).items() if k.split(".", 1)[1] not in NOT_COMPARED
            and not (k in ADDED_LATER and v == ADDED_LATER[k])}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()


def check_config(ckpt: Path, cfg: RunConfig) -> None:
    """Refuse to resume with a config other than the checkpoint's (output and resume fields aside).

    Raises:
        ConfigError: naming every differing field with both values.
    """
    saved = {**ADDED_LATER, **_flat(load_yaml((ckpt / "dpllm_config.yaml").read_text()))}
    now = _flat(cfg.to_dict())
    diff = [f"{k} ({saved.get(k)!r} → {now.get(k)!r})" for k in sorted(set(saved) | set(now))
            if k.split(".", 1)[1] not in NOT_COMPARED and saved.get(k) != now.get(k)]
    if diff:
        raise ConfigError(f"cannot resume from {ckpt}: the config differs in {', '.join(diff)}; resume with the "
                          f"run's own config ({ckpt.parent.parent / 'config.yaml'}) or start a new run")


def clean_partial_writes(run_dir: Path) -> None:
    """Remove temp directories a killed process left mid-write (they were never renamed into place)."""
    for parent in (run_dir, run_dir / CHECKPOINTS):
        if parent.is_dir():
            for p in parent.iterdir():
                if p.name.startswith(".") and (p.name.endswith(".tmp") or ".old." in p.name) and p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)


# ---- random state -------------------------------------------------------------------------------------

def _rng_state(generators: dict[str, Optional[torch.Generator]]) -> dict:
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"name": np_state[0], "keys": torch.from_numpy(np_state[1].astype(np.int64)),
                  "pos": int(np_state[2]), "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }
    for name, g in generators.items():
        state[name] = g.get_state() if g is not None else None
    return state


def _set_rng_state(state: dict, generators: dict[str, Optional[torch.Generator]]) -> None:
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    for name, g in generators.items():
        if g is not None and state.get(name) is not None:
            g.set_state(state[name])


# ---- model and optimizer state (unsharded checkpoints; read into an FSDP model as full state dicts) -------

def _trainable_names(model) -> list[str]:
    return [n for n, p in unwrap(model).named_parameters() if p.requires_grad]


def _load_model(model, ckpt: Path, world: World) -> None:
    """Load the trainable weights of an unsharded checkpoint (``save_pretrained``: full model or LoRA adapter)."""
    from safetensors.torch import load_file

    inner = unwrap(model)
    names = _trainable_names(model)
    state: dict[str, torch.Tensor] = {}
    if world.is_main or not is_sharded(inner):
        files = sorted(ckpt.glob("adapter_model*.safetensors")) or sorted(ckpt.glob("model*.safetensors"))
        saved: dict[str, torch.Tensor] = {}
        for f in files:
            saved.update(load_file(f))
        # peft saves adapter weights without the adapter name ("lora_A.weight" for "lora_A.default.weight")
        for name in names:
            key = name if name in saved else name.replace(".default.", ".")
            if key in saved:
                state[name] = saved[key]
        missing = [n for n in names if n not in state]
        if missing:
            raise CheckpointError(f"{ckpt} lacks trainable weights {missing[:3]}{'...' if len(missing) > 3 else ''}; "
                                  "was it written by another model or finetuning mode?")
    if is_sharded(inner):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        reshard(inner)
        set_model_state_dict(inner, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                                                    strict=False))
    else:
        with torch.no_grad():
            params = dict(inner.named_parameters())
            for name, value in state.items():
                params[name].copy_(value.to(params[name].device, params[name].dtype))


def _optimizer_state(model, optimizer) -> dict:
    base = getattr(optimizer, "original_optimizer", optimizer)
    if is_sharded(unwrap(model)):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        reshard(unwrap(model))
        return get_optimizer_state_dict(unwrap(model), base,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return base.state_dict()


def _load_optimizer(model, optimizer, state: Optional[dict]) -> None:
    base = getattr(optimizer, "original_optimizer", optimizer)
    if is_sharded(unwrap(model)):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        reshard(unwrap(model))
        set_optimizer_state_dict(unwrap(model), base, optim_state_dict=state or {},
                                 options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    else:
        base.load_state_dict(state)


# ---- save and load ------------------------------------------------------------------------------------

def save(run_dir: Path, *, step: int, model, optimizer, scheduler, world: World, config_yaml: str,
         generators: dict[str, Optional[torch.Generator]], trainer_state: dict, privacy: dict) -> None:
    """Write ``checkpoints/step-XXXXXX`` atomically, point ``latest`` at it, add a ledger line, prune.

    Called on every process. One process or DDP: random states are gathered and rank 0 writes. FSDP2: every
    process writes its own shards and its own random state (:mod:`dpllm.sharded_checkpoint`), rank 0 the rest.

    Args:
        trainer_state: step, tokens_seen, metrics_bytes, accountant state, plan, ε (JSON).
        privacy: ε, δ, σ, q and accountant for the ledger line.
    """
    if is_sharded(unwrap(model)):
        return _save_sharded(run_dir, step=step, model=model, optimizer=optimizer, scheduler=scheduler, world=world,
                             config_yaml=config_yaml, generators=generators, trainer_state=trainer_state,
                             privacy=privacy)
    rng = gather_objects(_rng_state(generators), world)
    optim_state = _optimizer_state(model, optimizer)
    target = step_dir(run_dir, step)
    if not world.is_main:
        barrier(world)
        return
    (run_dir / CHECKPOINTS).mkdir(parents=True, exist_ok=True)
    os.chmod(run_dir / CHECKPOINTS, 0o700)  # generator states are secrets: owner only
    with atomic_directory(target, private=True) as tmp:
        unwrap(model).save_pretrained(tmp)
        torch.save(optim_state, tmp / "optimizer.pt")
        fd = os.open(tmp / "rng_state.pt", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            torch.save(rng, fh)
        _save_run_state(tmp, scheduler=scheduler, config_yaml=config_yaml, trainer_state=trainer_state, world=world)
    _publish(run_dir, target, step=step, privacy=privacy)
    barrier(world)


def _save_run_state(tmp: Path, *, scheduler, config_yaml: str, trainer_state: dict, world: World) -> None:
    torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    (tmp / "dpllm_config.yaml").write_text(config_yaml)
    write_json_atomic(tmp / "trainer_state.json", {**trainer_state, "world_size": world.size,
                                                   "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    checksums.write(tmp)  # last: it covers every file, and the rename makes it appear with them


def _publish(run_dir: Path, target: Path, *, step: int, privacy: dict) -> None:
    # Pointer before ledger line: a crash between them leaves a checkpoint whose line resume() adds.
    write_text_atomic(run_dir / CHECKPOINTS / "latest", target.name + "\n")
    ledger.append(run_dir, kind="checkpoint", step=step, privacy=privacy,
                  checkpoint=target.relative_to(run_dir).as_posix())
    _prune(run_dir, keep=target.name)


def _save_sharded(run_dir: Path, *, step: int, model, optimizer, scheduler, world: World, config_yaml: str,
                  generators: dict[str, Optional[torch.Generator]], trainer_state: dict, privacy: dict) -> None:
    """:func:`save` under FSDP2: every process writes its shards and its random state into one temporary
    directory; rank 0 adds the run's state and renames it into place once all are done."""
    target = step_dir(run_dir, step)
    if world.is_main:
        (run_dir / CHECKPOINTS).mkdir(parents=True, exist_ok=True)
        os.chmod(run_dir / CHECKPOINTS, 0o700)  # generator states are secrets: owner only
    tmp = sc.shared_tempdir(target, world)
    sc.save_state(tmp, model=unwrap(model), optimizer=getattr(optimizer, "original_optimizer", optimizer),
                  world=world, rng=_rng_state(generators))
    barrier(world)  # every shard and random state is on disk
    if world.is_main:
        _save_run_state(tmp, scheduler=scheduler, config_yaml=config_yaml, trainer_state=trainer_state, world=world)
        if target.exists():  # a step re-run after a crash: the new checkpoint replaces the old one
            old = target.parent / f".{target.name}.old.{os.getpid()}"
            os.replace(target, old)
            shutil.rmtree(old, ignore_errors=True)
        os.replace(tmp, target)
        _publish(run_dir, target, step=step, privacy=privacy)
    barrier(world)


def _prune(run_dir: Path, *, keep: str) -> None:
    dirs = sorted(p for p in (run_dir / CHECKPOINTS).glob("step-*") if p.is_dir())
    for p in dirs[:-KEEP]:
        if p.name != keep:
            shutil.rmtree(p, ignore_errors=True)
    clean_partial_writes(run_dir)


def load(ckpt: Path, *, model, optimizer, scheduler, world: World, generators: dict[str, Optional[torch.Generator]],
         plan: Optional[dict], accountant=None) -> dict:
    """Restore weights, optimizer, scheduler, accountant and random state from ``ckpt``; return its trainer state.

    Random state: each process gets its own saved state. With a different number of processes than
    the run was saved with, the (rank-independent) Poisson sampler state is restored but *no* noise state
    is: every process keeps the noise generator it started with (secret and new; under ``reproducible_noise``
    a stream keyed by the resume step and the process count), so no process replays noise any process of
    an earlier launch already drew. The run is then no longer bit-identical to an uninterrupted one.

    Args:
        plan: this run's privacy plan as saved in trainer_state.json (None without DP); must match.
        accountant: the Opacus accountant whose history is restored (None without DP).

    Raises:
        ConfigError: the privacy plan differs from the checkpoint's.
        CheckpointError: the checkpoint lacks some trainable weights.
    """
    state = json.loads((ckpt / "trainer_state.json").read_text())
    saved = state.get("plan")
    if saved != plan:
        why = "the data or an earlier stage changed"
        accounting = ("noise_multiplier", "accountant")  # what a change of accounting alone moves
        if saved and plan and {k: v for k, v in saved.items() if k not in accounting} == \
                {k: v for k, v in plan.items() if k not in accounting}:  # the same data, another σ for the target
            why = ("only σ differs: the accounting changed since the run started (PLD and user-level ε take the "
                   "float rounding of their composition into account since dpllm of 2026-11-25); finish the run "
                   "with the dpllm that started it, or start it again")
            if saved.get("accountant") != plan.get("accountant"):  # e.g. RDP → PLD at N = 10⁹, δ = 1e-10
                why = (f"only σ and the accountant differ ({saved.get('accountant')} → {plan.get('accountant')}): "
                       "the accounting changed since the run started (PLD runs where its FFT's rounding could reach "
                       "δ since dpllm of 2026-11-27, with that rounding bounded); finish the run with the dpllm "
                       "that started it, or start it again")
        raise ConfigError(f"cannot resume from {ckpt}: the privacy plan differs from the checkpoint's "
                          f"({saved} vs {plan}); {why}")
    if accountant is not None:
        saved = state["accountant"]
        accountant.load_state_dict({"mechanism": saved["mechanism"],
                                    "history": [tuple(h) for h in saved["history"]]})
    if sc.is_sharded_checkpoint(ckpt):  # written by an FSDP2 run: read back resharded for this launch
        sc.load_state(ckpt, model=unwrap(model), optimizer=getattr(optimizer, "original_optimizer", optimizer))
        scheduler.load_state_dict(torch.load(ckpt / "scheduler.pt", weights_only=True))
        saved = sc.saved_ranks(ckpt)  # each process reads its own file; on another count, rank 0's sampler
        own = sc.load_rng(ckpt, world.rank if saved == world.size else 0)
        past = own.get("noise_recurrence") or {}
        if saved != world.size and (past.get("history") or past.get("buffers")):  # banded's past noise, BLT's buffers
            raise ConfigError(f"cannot resume {ckpt} on {world.size} process(es): its correlated noise keeps each of "
                              f"its {saved} processes' past noise for that process's shards; resume on {saved} "
                              "processes")
        _set_rng_state(own if saved == world.size else _without_noise(own, saved, world), generators)
        return state
    _load_model(model, ckpt, world)
    # under FSDP rank 0 reads the full optimizer state and broadcasts it
    reads = world.is_main or not is_sharded(unwrap(model))
    _load_optimizer(model, optimizer, torch.load(ckpt / "optimizer.pt", weights_only=True) if reads else None)
    scheduler.load_state_dict(torch.load(ckpt / "scheduler.pt", weights_only=True))
    _set_rng_state(rng_for_process(torch.load(ckpt / "rng_state.pt", weights_only=True), world), generators)
    return state


def saved_step(ckpt: Optional[Path]) -> Optional[int]:
    """The step a resumable checkpoint was saved at (its ``trainer_state.json``), None for no checkpoint."""
    if ckpt is None:
        return None
    return int(json.loads((Path(ckpt) / "trainer_state.json").read_text())["step"])


def rng_for_process(saved: list[dict], world: World) -> dict:
    """This process's random state from a checkpoint's per-process list.

    On the same number of processes, its own. On another number, rank 0's sampler state (the same on every
    rank) and *no* noise state: each process keeps the noise generator it started with, secret and new
    (under ``reproducible_noise``: seeded by the resume step and process count as well, so it restarts no
    stream an earlier launch drew from; :func:`dpllm.privacy.randomness.privacy_generators`).
    """
    if len(saved) == world.size:
        return saved[world.rank]
    return _without_noise(saved[0], len(saved), world)


def _without_noise(state: dict, saved: int, world: World) -> dict:
    log.warning("resuming a %d-process run on %d processes: privacy accounting is unchanged; every process draws "
                "fresh noise, so the run is not bit-identical to an uninterrupted one", saved, world.size)
    return dict(state, noise=None)


def finished_summary(run_dir: Path) -> Optional[dict]:
    """The summary of a run that already finished (its ledger ends with a ``final`` line), else None."""
    summary = Path(run_dir) / "run_summary.json"
    try:
        entries = ledger.read(run_dir)
        if entries and entries[-1].get("kind") == "final" and summary.is_file():
            return json.loads(summary.read_text())
    except (ledger.LedgerError, ValueError):
        return None
    return None


def initial_eval(metrics_path: Path) -> Optional[dict]:
    """The step-0 eval line of a run being resumed (for the summary's initial_eval_loss)."""
    if not metrics_path.is_file():
        return None
    return next((row for row in read_jsonl(metrics_path) if row.get("step") == 0 and row.get("split") == "eval"), None)


def truncate_metrics(metrics_path: Path, size: int) -> None:
    """Drop metrics lines written after the checkpoint (steps that are about to be re-run)."""
    if metrics_path.is_file() and metrics_path.stat().st_size > size:
        with open(metrics_path, "r+b") as fh:
            fh.truncate(size)


def sync_ledger(run_dir: Path, ckpt: Path, *, step: int, privacy: dict) -> None:
    """Append the ``resume`` line; first the checkpoint's own line if a crash came before it was written."""
    rel = ckpt.relative_to(run_dir).as_posix()
    digest = ledger.dir_sha256(ckpt)
    if not any(e.get("kind") == "checkpoint" and e.get("checkpoint_sha256") == digest for e in ledger.read(run_dir)):
        ledger.append(run_dir, kind="checkpoint", step=step, privacy=privacy, checkpoint=rel)
    ledger.append(run_dir, kind="resume", step=step, privacy=privacy, checkpoint=rel)


# ---- Ctrl-C and SIGTERM -----------------------------------------------------------------------------------

class Interrupted(KeyboardInterrupt):
    """A run stopped by Ctrl-C (SIGINT) or a scheduler's SIGTERM: where it was, for :func:`interrupted_message`.

    Attributes:
        run_dir: the run directory; step, steps: steps done and planned (None before the plan);
        started: whether the run directory was (re)written; main: whether this is the process that reports;
        signal: the signal that stopped it (``signal.SIGINT`` or ``signal.SIGTERM``; see :mod:`dpllm.stopping`).
    """

    def __init__(self, run_dir: Path, *, step: int, steps: Optional[int], started: bool, main: bool,
                 signal: Optional[int] = None):
        import signal as signals

        super().__init__(f"interrupted at step {step}")
        self.run_dir, self.step, self.steps, self.started, self.main = Path(run_dir), step, steps, started, main
        self.signal = signal or signals.SIGINT

    def __str__(self) -> str:
        """Where the run stopped and what a resume would continue from (what a ``DPTrainer`` script shows)."""
        import signal as signals

        what = "interrupted" if self.signal == signals.SIGINT else f"stopped by {signals.Signals(self.signal).name}"
        where = (f"at step {self.step} of {self.steps}" if self.steps is not None and self.started
                 else "before training started")
        latest = latest_checkpoint(self.run_dir) if self.started else None
        if latest is not None:
            return f"{what} {where}; the last resumable checkpoint is {latest[0]} (step {latest[1]})"
        if self.started:
            return f"{what} {where}; no resumable checkpoint was written"
        return f"{what} {where}; nothing was written to {self.run_dir}"


def latest_checkpoint(run_dir: Path) -> Optional[tuple[Path, int]]:
    """``(checkpoint directory, its step)`` that ``--resume_from latest`` would resume, or None."""
    pointer = Path(run_dir) / CHECKPOINTS / "latest"
    try:
        ckpt = pointer.parent / pointer.read_text().strip()
        return ckpt, int(json.loads((ckpt / "trainer_state.json").read_text())["step"])
    except (OSError, ValueError, KeyError):
        return None


_FLAGS_DROPPED = ("--resume_from", "--train.resume_from", "--overwrite_output_dir", "--train.overwrite_output_dir")
_BOOL_WORDS = {"true", "false", "yes", "no", "1", "0", "t", "f", "y", "n"}


def resume_argv(argv: list[str]) -> list[str]:
    """``argv`` with ``--resume_from latest`` in place of any resume or overwrite option (they contradict it).

    >>> resume_argv(["--max_steps", "9", "--overwrite_output_dir", "true", "--resume_from=x"])
    ['--max_steps', '9', '--resume_from', 'latest']
    """
    out, i = [], 0
    while i < len(argv):
        name = argv[i].split("=", 1)[0]
        if name in _FLAGS_DROPPED:
            takes_value = "=" not in argv[i] and i + 1 < len(argv) and (
                "resume_from" in name or argv[i + 1].lower() in _BOOL_WORDS)
            i += 2 if takes_value else 1
            continue
        out.append(argv[i])
        i += 1
    return out + ["--resume_from", "latest"]


def interrupted_message(err: Interrupted, *, program: str, argv: list[str]) -> str:
    """One line after Ctrl-C: the checkpoint a resume continues from and the command that does it.

    Args:
        err: the interruption.
        program: how the command was started (``python recipes/finetune_llm.py``), as it is to be printed.
        argv: its options as given.
    """
    import shlex

    if err.started and latest_checkpoint(err.run_dir) is not None:
        return f"{err}; resume with: {program} {shlex.join(resume_argv(argv))}"
    if err.started:
        again = resume_argv(argv)[:-2] + ["--overwrite_output_dir", "true"]
        return (f"{err} (--save_every N writes one every N steps, for --resume_from latest); start over with: "
                f"{program} {shlex.join(again)}")
    return str(err)
