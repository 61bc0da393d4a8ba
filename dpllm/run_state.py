"""A run's resumable state at step boundaries: restored at the start, saved when due, saved before a stop.

:class:`dpllm.train.Trainer` makes one :class:`ResumableState` in ``start``, once the engine has wrapped the
model and optimizer, and asks it:

    when                 call               what it does
    start (resuming)     restore            weights, optimizer, scheduler, random states, accountant; metrics.jsonl
                                            cut back to the checkpoint, the ledger's ``resume`` line
    every save_every     save               a resumable checkpoint at this step (every process takes part)
    each step boundary   save_or_stop       one all-reduce, so that all processes decide alike: a checkpoint when
                                            ``save_every_minutes`` have passed or a stop was asked for; the signal
                                            the loop must stop on (SIGTERM waits for this boundary, dpllm.stopping)
    after the loop       save_last          one more checkpoint (``save_every`` set) unless this step has one

A run that already finished is not resumed: :func:`already_finished` returns its summary instead. What a
checkpoint holds and how it is written (atomically, random states owner-only) is :mod:`dpllm.resume`; FSDP's
per-process shards are :mod:`dpllm.sharded_checkpoint`; how SIGINT and SIGTERM are caught, :mod:`dpllm.stopping`.
"""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path
from typing import Optional

from dpllm import resume
from dpllm.config import RunConfig
from dpllm.distributed import World, all_sum
from dpllm.privacy.run import RunPrivacy
from dpllm.stopping import StopRequests

log = logging.getLogger("dpllm.train")  # the Trainer's lines: same logger name in consoles and filters as before


def already_finished(run_dir: Path, resume_from: Optional[Path]) -> Optional[dict]:
    """The summary of a run being resumed that had already finished (nothing left to do), else None."""
    finished = resume.finished_summary(run_dir) if resume_from is not None else None
    if finished is not None:
        log.warning("%s already finished at step %s; nothing to do", run_dir, finished.get("steps"))
    return finished


class ResumableState:
    """Resumable checkpoints of one run configured by ``cfg``, over the objects they hold (see the module docstring).

    Args:
        model, optimizer, scheduler: as the engine wrapped them (after ``setup_privacy``).
        generators: the run's random generators (:func:`dpllm.privacy.randomness.privacy_generators`).
        privacy: the run's privacy state: its plan, accountant and ε go into each checkpoint and ledger line.
        stops: the stop requests caught while the run is on.
    """

    def __init__(self, cfg: RunConfig, *, world: World, privacy: RunPrivacy, stops: StopRequests, model, optimizer,
                 scheduler, generators: dict):
        self.cfg, self.world, self.privacy, self.stops = cfg, world, privacy, stops
        self.model, self.optimizer, self.scheduler, self.generators = model, optimizer, scheduler, generators
        self.out = Path(cfg.train.output_dir)
        self.metrics_path = self.out / "metrics.jsonl"
        self.last_saved: Optional[int] = None  # the step of the last resumable checkpoint written (or resumed from)
        self.last_saved_at = time.time()  # the training loop sets it again when it starts

    def restore(self, ckpt: Path) -> tuple[int, int, Optional[dict]]:
        """Everything ``ckpt`` holds, put back; returns ``(step, tokens seen, the step-0 eval line)``.

        Tokens are this process's count (the sum over processes is kept on rank 0); the eval line is rank 0's.
        """
        plan, dp = self.privacy.plan, self.cfg.privacy.enabled
        state = resume.load(ckpt, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                            world=self.world, generators=self.generators, plan=plan.to_json() if plan else None,
                            accountant=self.privacy.private.engine.accountant if dp else None)
        self.last_saved = state["step"]
        if dp:
            self.privacy.restore_clipping(state.get("clipping"))
        tokens_seen = state["tokens_seen"] if self.world.is_main else 0  # the sum over processes counts
        initial_eval = None
        if self.world.is_main:
            resume.truncate_metrics(self.metrics_path, state["metrics_bytes"])
            resume.sync_ledger(self.out, ckpt, step=state["step"], privacy=self.privacy.now())
            initial_eval = resume.initial_eval(self.metrics_path)
        return state["step"], tokens_seen, initial_eval

    def save(self, step: int, tokens_seen: int) -> None:
        """A resumable checkpoint at ``step`` (called on every process: tokens are summed, FSDP writes shards)."""
        self.last_saved, self.last_saved_at = step, time.time()
        tokens = int(all_sum([tokens_seen], self.world)[0])
        privacy = self.privacy.now() if self.world.is_main else {}
        plan, dp = self.privacy.plan, self.cfg.privacy.enabled
        state = {"step": step, "tokens_seen": tokens, "plan": plan.to_json() if plan else None,
                 "epsilon": privacy.get("epsilon"),
                 "metrics_bytes": self.metrics_path.stat().st_size if self.metrics_path.exists() else 0,
                 "accountant": self.privacy.private.engine.accountant.state_dict() if dp else None,
                 "clipping": self.privacy.clipping_state() if dp else None}
        resume.save(self.out, step=step, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                    world=self.world, config_yaml=self.cfg.to_yaml(), generators=self.generators,
                    trainer_state=state, privacy=privacy)

    def save_or_stop(self, step: int, steps: int, tokens_seen: int) -> int:
        """At a step boundary: a checkpoint when one is due by time or a stop was requested; the signal to stop on.

        All processes take the same decision (one all-reduce): they stop, or save, at the same step.

        Returns:
            ``signal.SIGTERM`` or ``signal.SIGINT`` when the run must stop now (after the checkpoint), else 0.
        """
        sig = self.stops.requested or 0
        minutes = self.cfg.train.save_every_minutes
        due = bool(minutes) and time.time() - self.last_saved_at >= 60 * minutes and step < steps
        if self.world.distributed:
            term, intr, due = all_sum([sig == signal.SIGTERM, sig == signal.SIGINT, due], self.world)
            sig = signal.SIGTERM if term else signal.SIGINT if intr else 0
        if (due or sig) and self.last_saved != step:
            self.save(step, tokens_seen)
        return sig

    def save_last(self, step: int, tokens_seen: int, *, start_step: int) -> None:
        """After the loop (``save_every`` set): a checkpoint at the last step, unless it has one or nothing ran."""
        if self.cfg.train.save_every and step > start_step and self.last_saved != step:
            self.save(step, tokens_seen)
