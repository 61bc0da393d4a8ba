"""The run directory: created only after every check, locked for the life of a run, never someone else's data.

- A directory is a *dpllm run directory* if it holds the ``.dpllm_run`` marker that every run writes first
  (or, for runs made before the marker existed, ``config.yaml`` and ``splits.json`` beside a ledger).
  ``--overwrite_output_dir true`` clears only such a directory, and never one that holds the dataset
  or the model being trained from; anything else is refused with the reason.
- :class:`RunLock` holds an exclusive ``flock`` on ``OUTPUT_DIR/.lock`` from the moment the directory is
  prepared until the run ends. A second run, an overwrite or a ``--resume_from latest`` on the same
  directory is refused while the first is alive. The kernel drops the lock when its process dies (even
  by SIGKILL), so a lock left by a dead run is never in the way.

What a run writes here, and when (which files are private and which releasable: ``docs/run_directory.md``):

    when                 writer                             files
    setup_run_dir        :func:`describe` (fresh runs)      .dpllm_run, config.yaml, splits.json, canaries.json
    the loop             :class:`Progress`                  metrics.jsonl (train and eval lines), the console
                         :mod:`dpllm.run_state`             checkpoints/ and their ledger lines
    finish               :func:`write_generations` (SFT)    generations.jsonl
                         :func:`shard_final_weights`        FSDP: each process's shards of the final weights
                         :func:`write_final`                checkpoint/, privacy_report.json, the ledger's final
                                                            line, run_summary.json (:func:`summary`), runs_file
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Iterable, Optional

from dpllm import ledger, sharded_checkpoint
from dpllm.checkpoint import save_checkpoint
from dpllm.config import CLI_OPTIONS, ConfigError, OptionNames, RunConfig
from dpllm.distributed import World, barrier, is_sharded
from dpllm.io import append_jsonl, write_json_atomic, write_text_atomic
from dpllm.privacy.report import PrivacyReport
from dpllm.sft import generate_answers

MARKER = ".dpllm_run"
LOCK = ".lock"

log = logging.getLogger("dpllm.train")  # the Trainer's lines (generations): same logger name as before they moved


def is_run_dir(path: str | Path) -> bool:
    path = Path(path)
    if (path / MARKER).is_file():
        return True
    legacy = (path / "config.yaml").is_file() and (path / "splits.json").is_file()
    return legacy and ((path / "privacy_ledger.jsonl").is_file() or (path / "metrics.jsonl").is_file())


def _inside(child: Path, parent: Path) -> bool:
    try:
        child.resolve().relative_to(parent.resolve())
        return True
    except ValueError:
        return False


def check_output_dir(out: str | Path, *, overwrite: bool, protected: Iterable[Optional[str]] = (),
                     names: OptionNames = CLI_OPTIONS) -> None:
    """Refuse to start a fresh run in ``out`` unless it is new, empty, or a dpllm run we may overwrite.

    Args:
        out: the output directory.
        overwrite: ``train.overwrite_output_dir``.
        protected: paths that must survive (the dataset file, the model directory); ignored if not local.
        names: how the reader sets the options the message suggests (flags, or DPTrainer's fields).

    Raises:
        ConfigError: ``out`` is not empty and may not (or cannot safely) be cleared.
    """
    from dpllm.io import output_dir_error

    problem = output_dir_error(out)  # a file in the way, a folder where no directory can be made
    if problem:
        raise ConfigError(problem)
    out = Path(out)
    entries = [p for p in out.iterdir() if p.name != LOCK] if out.is_dir() else []
    if not entries:
        return
    if not overwrite:
        raise ConfigError(f"output_dir={out} exists and is not empty; pass {names.overwrite}, "
                          f"{names.resume} to continue it, or pick another")
    if not is_run_dir(out):
        shown = ", ".join(sorted(p.name for p in entries)[:4]) + (", ..." if len(entries) > 4 else "")
        raise ConfigError(f"refusing to overwrite output_dir={out}: it is not a dpllm run directory (no {MARKER} "
                          f"marker) and holds {len(entries)} entries ({shown}); nothing was deleted. Pick a new "
                          "or empty output_dir")
    for p in protected:
        if p and Path(p).exists() and _inside(Path(p), out):
            raise ConfigError(f"refusing to overwrite output_dir={out}: it contains {p}, which this run reads; "
                              "nothing was deleted. Move the data or model out, or pick another output_dir")


def clear(out: Path) -> None:
    """Empty a run directory that :func:`check_output_dir` allowed; the lock file stays (we hold it)."""
    for p in out.iterdir():
        if p.name == LOCK:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def mark(out: Path) -> None:
    (out / MARKER).write_text("dpllm run directory; see docs/run_directory.md\n")


class RunLock:
    """An exclusive, non-blocking lock on ``OUTPUT_DIR/.lock`` for the life of a run (rank 0 only)."""

    def __init__(self, out: str | Path):
        self.path = Path(out) / LOCK
        self.fd: Optional[int] = None

    def acquire(self) -> "RunLock":
        """Take the lock (creating the directory if needed).

        Raises:
            ConfigError: another live process holds it; the message gives its pid.
        """
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as err:  # a file in the way, a read-only or virtual file system
            raise ConfigError(f"output_dir={self.path.parent} cannot be used ({err.strerror}: {err.filename}); "
                              "choose another output_dir") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ConfigError(f"output_dir={self.path.parent} is in use by another run (pid {holder}); wait for it "
                              "to finish or stop it, or pick another output_dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


# ---- what a run writes --------------------------------------------------------------------------------

class Progress:
    """What a run records and shows as it goes (rank 0): metrics.jsonl, the held-out eval line, a progress bar."""

    def __init__(self, out: Path):
        self.path = Path(out) / "metrics.jsonl"
        self.bar = None

    def show_bar(self, *, total: int, initial: int, desc: str) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, mininterval=1.0)

    def train_line(self, row: dict) -> None:
        """A train line of metrics.jsonl (with ``epsilon`` under DP), shown on the bar."""
        append_jsonl(self.path, row)
        if self.bar is not None:
            shown = {"loss": f"{row['loss']:.3f}", **({"eps": f"{row['epsilon']:.2f}"} if "epsilon" in row else {})}
            self.bar.set_postfix(shown, refresh=False)

    def eval_line(self, step: int, ev: dict, *, records: int, final: bool) -> None:
        """An eval line of metrics.jsonl, and the console's (above the bar while it runs)."""
        append_jsonl(self.path, {"step": step, "split": "eval", **ev})
        # held-out records are private and their loss un-noised: the operator's console and metrics.jsonl only
        msg = (f"[private] eval step {step}: held-out loss {ev['loss']:.4f} nats/token (perplexity "
               f"{ev['ppl']:.4g}) on {records} records, {ev['tokens']} tokens (also in {self.path})")
        (self.bar.write if self.bar is not None and not final else log.info)(msg)

    def step(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def describe(out: Path, cfg: RunConfig, data, *, user_unit: bool, names: OptionNames = CLI_OPTIONS,
             protected: Optional[list] = None, files: Optional[dict[str, str]] = None) -> None:
    """A fresh run's directory, under the lock: checked again, cleared, marked and described (rank 0).

    Writes ``config.yaml``, ``splits.json`` (each record's split, the trained records' hashes, and for SFT
    records how audits render and score them), with canaries ``canaries.json``, and ``files`` (name → text).

    Args:
        data: the run's :class:`dpllm.run_data.RunData` (records, splits, members, canaries, SFT shape).
        protected: paths the run reads (default: the dataset file and the model directory).
        names: how the reader sets the options an error suggests (flags, or DPTrainer's fields).

    Raises:
        ConfigError: another run filled ``out`` since :func:`check_output_dir` first allowed it.
    """
    # again under the lock: another run may have filled the directory since the first check
    check_output_dir(out, overwrite=cfg.train.overwrite_output_dir, names=names,
                     protected=[cfg.data.dataset, cfg.model.model_name_or_path] if protected is None else protected)
    clear(out)
    mark(out)
    write_text_atomic(out / "config.yaml", cfg.to_yaml())
    for name, text in (files or {}).items():
        write_text_atomic(out / name, text)
    split = data.splits.to_json(data.records, cfg.data)
    split["trained_sha256"] = sorted(data.trained_hashes)
    if data.sft_format:  # how audits render and score the records (answer tokens given the prompt)
        split["sft"] = {"format": data.sft_format, "loss_on": cfg.data.loss_on, "dropped_no_answer": data.sft_dropped}
    write_json_atomic(out / "splits.json", split)
    if data.canaries:
        write_json_atomic(out / "canaries.json",
                          {"seed": cfg.data.canary_seed, "canaries": data.canaries,
                           **({"unit": "user", "records_per_user": cfg.data.canary_records_per_user}
                              if user_unit else {})})


def write_generations(out: Path, model, tokenizer, records: list[str]) -> None:
    """SFT: greedy answers to the prompts of held-out ``records``, saved in ``generations.jsonl`` (rank 0).

    Held-out prompts and their reference answers are private records (the DP guarantee does not cover them, and a
    greedy answer may repeat its prompt), so their text stays in the run directory: the console gets one
    ``[private]`` line with the file's name, never the text. Nothing when there is no record, or under FSDP (no
    process holds the whole model).
    """
    if not records or is_sharded(model):
        return
    rows = generate_answers(model, tokenizer, records)
    write_text_atomic(out / "generations.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    log.info("[private] greedy answers to %d held-out prompt(s), beside their references: %s", len(rows),
             out / "generations.jsonl")


def shard_final_weights(out: Path, model, world: World) -> Optional[Path]:
    """FSDP: every process writes its own shards of the final weights into a temporary directory beside
    ``checkpoint/`` (collective: call it on every process), which :func:`write_final` moves into place.
    None for a model no process shards (rank 0 then saves the whole model)."""
    if not is_sharded(model):
        return None
    weights_dir = sharded_checkpoint.shared_tempdir(out / "checkpoint", world)
    sharded_checkpoint.write_weights(weights_dir, model=model, world=world)
    barrier(world)
    return weights_dir


def write_final(out: Path, cfg: RunConfig, report: PrivacyReport, summary: dict, *, model, tokenizer, base_model,
                weights_dir: Optional[Path]) -> None:
    """The finished run (rank 0, after every check): ``checkpoint/`` with the report inside, ``privacy_report.json``,
    the ledger's ``final`` line, ``run_summary.json``, and the summary's line in ``runs_file`` if one is set."""
    save_checkpoint(out / "checkpoint", model=model, tokenizer=tokenizer, privacy_report=report.to_dict(),
                    config_yaml=cfg.to_yaml(), base_model=base_model, weights_dir=weights_dir)
    report.write(out / "privacy_report.json")
    ledger.append(out, kind="final", step=summary["steps"], privacy=report.as_ledger_privacy(),
                  checkpoint="checkpoint")
    write_json_atomic(out / "run_summary.json", summary)
    if cfg.train.runs_file:
        append_jsonl(cfg.train.runs_file, summary)


def summary(cfg: RunConfig, report: PrivacyReport, *, steps: int, tokens: int, params: tuple[int, int],
            initial_eval: Optional[dict], final: dict, wall: float, world_size: int, digest: Optional[str],
            resumed_from: int) -> dict:
    """The run's summary (``run_summary.json``, one row of a runs table): model, data seen, ε, losses, time."""
    t = cfg.train
    return {
        "run_dir": str(Path(t.output_dir)), "model": cfg.model.model_name_or_path,
        "finetuning": cfg.model.finetuning, "params_total": params[0],
        "params_trainable": params[1], "tokens_seen": tokens, "steps": steps,
        "logical_batch_size": t.logical_batch_size, "epsilon": report.epsilon, "delta": report.delta,
        "noise_multiplier": report.noise_multiplier, "sample_rate": report.sample_rate,
        "privacy_enabled": cfg.privacy.enabled, "noise_secret": report.noise_secret,
        # how the noise was made (privacy.noise): a sweep's fit must not mix DP-SGD's runs with correlated ones
        "noise": (report.correlated_noise or {}).get("mechanism", "independent") if cfg.privacy.enabled else None,
        "bands": (report.correlated_noise or {}).get("bands", 1) if cfg.privacy.enabled else None,
        "initial_eval_loss": initial_eval["loss"] if initial_eval else None,
        "final_eval_loss": final["loss"], "final_eval_ppl": final["ppl"], "seed": t.seed,
        "wall_time_s": round(wall, 2), "world_size": world_size, "params_sha256": digest,
        "resumed_from_step": resumed_from or None,
    }
