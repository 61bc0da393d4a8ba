"""The training loop: one :class:`Trainer` for private and non-private runs, on one process or many.

:meth:`Trainer.run` reads top to bottom as the stages of a run. The Trainer keeps the stages and the loop; four
collaborators own a kind of state each: ``self.data`` (:class:`~dpllm.run_data.RunData`: records, splits, members),
``self.privacy`` (:class:`~dpllm.privacy.run.RunPrivacy`: unit, plan, history, report), ``self.resumable``
(:class:`~dpllm.run_state.ResumableState`: checkpoints at step boundaries, stops) and :mod:`dpllm.rundir` (the run
directory: lock, the files written, ``self.progress`` for metrics.jsonl):

    stage           the Trainer                                   asks
    setup_process   accelerator, processes, resume target         rundir.check_output_dir; run_state.already_finished
    setup_data      records, splits, canaries, members            run_data.prepare (privacy.bound_contributions)
    setup_plan      the base model's source                       privacy.make_plan: earlier stages, q, steps, σ
    setup_model     load, LoRA/full, DP layer checks, wrapping    models.fit_to_run; privacy.modes.prepare_engine
    log_truncation  what max_length cut off (console)             dpllm.truncation (also in the privacy report)
    setup_run_dir   the lock                                      rundir.describe: config.yaml, splits.json...
    setup_privacy   secret generators (or the non-private sampler) privacy.attach: the engine wraps model, optimizer
    start           step-0 eval and the ledger's first line       resumable.restore a resumable checkpoint
    train_steps     one loop: a logical batch → micro-batches →   resumable.save / save_or_stop at step boundaries;
                    one optimizer step; train and eval lines      progress: metrics.jsonl; privacy.epsilon
    finish          final eval, replicas agree                    privacy.check_history, report; rundir.write_final

Every check (data, composition, plan, model) comes before setup_run_dir writes anything.

Where the rest lives: the held-out loss in :mod:`dpllm.evaluation`, the privacy plan in :mod:`dpllm.privacy.plan`,
composition of earlier stages in :mod:`dpllm.privacy.composition`, the report type in
:mod:`dpllm.privacy.report`, process handling in :mod:`dpllm.distributed`, the resumable checkpoint format in
:mod:`dpllm.resume` (FSDP shards: :mod:`dpllm.sharded_checkpoint`), SIGINT / SIGTERM in :mod:`dpllm.stopping`,
the ε hash chain in :mod:`dpllm.ledger`.
"""

from __future__ import annotations

import logging
import math
import random
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from dpllm import data, distributed, ledger, models, packing, resume, run_data, rundir, truncation
from dpllm.checkpoint import unwrap
from dpllm.config import ConfigError, RunConfig
from dpllm.errors import TrainingError  # raised by the loop and dpllm.privacy.run; imported from here too
from dpllm.evaluation import evaluate
from dpllm.logs import known_warnings_silenced
from dpllm.models import load_base, position_ids_for  # dpllm.train's names: tests patch them here
from dpllm.optim import make_optimizer
from dpllm.privacy import user_level
from dpllm.privacy.engine import sequence_loss
from dpllm.privacy.modes import prepare_engine
from dpllm.privacy.plan import PrivacyPlan
from dpllm.privacy.positions import check_rope_per_record
from dpllm.privacy.randomness import privacy_generators
from dpllm.privacy.run import RunPrivacy
from dpllm.run_data import RunData
from dpllm.run_state import ResumableState, already_finished
from dpllm.sampling import ShuffledBatchSampler
from dpllm.stopping import StopRequests

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def forward_loss(model, batch: dict, criterion=None, autocast=None):
    """Each record's mean next-token loss (:func:`sequence_loss`), through Opacus's criterion under ghost clipping.

    A batch without rows (a process's share of a Poisson batch can be empty) is run as one row whose
    labels are all masked: its loss and gradient are exactly zero, so it adds nothing to the clipped
    sum, while the backward pass and the optimizer step (noise, accounting, gradient all-reduce, FSDP's
    collectives) happen as on every other process.
    """
    ids = batch["input_ids"]
    if ids.shape[0] == 0:
        ids = torch.zeros((1, 2), dtype=torch.long, device=ids.device)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.full_like(ids, -100)}
    ctx = autocast() if autocast is not None else torch.autocast("cpu", enabled=False)
    with ctx:
        out = model(input_ids=ids, attention_mask=batch["attention_mask"], position_ids=position_ids_for(ids))
    return sequence_loss(out.logits, batch["labels"], criterion)


class Trainer:
    """One training stage as configured. ``Trainer(cfg).run()`` returns the run summary (rank 0; {} elsewhere).

    Raises (from :meth:`run`):
        ConfigError, DataError, ModelError, PrivacyPlanError: before anything is written.
        TrainingError: a non-finite loss; no checkpoint is written for the failed run.
    """

    def __init__(self, cfg: RunConfig):
        self.cfg, self.t, self.p = cfg, cfg.train, cfg.privacy
        self.dp = cfg.privacy.enabled
        self.out = Path(cfg.train.output_dir)
        self.progress = rundir.Progress(self.out)  # metrics.jsonl, the console's eval lines, the progress bar
        self.metrics_path = self.progress.path
        self.lock: Optional[rundir.RunLock] = None
        self.privacy = RunPrivacy(cfg)  # unit, users, plan, the engine's history, the report (dpllm.privacy.run)
        self.data: Optional[RunData] = None  # records, splits, members (dpllm.run_data), by setup_data
        self.criterion = None
        self.step = self.start_step = self.tokens_seen = 0
        self.resumable: Optional[ResumableState] = None  # checkpoints at step boundaries (dpllm.run_state), by start
        self.stops = StopRequests()  # SIGINT / SIGTERM while run() is on (dpllm.stopping)
        self.already_finished = False  # resume_from on a run that had finished: run() returned its summary
        self.window = [0.0, 0]  # record-weighted loss sum and record count since the last train log line
        self.initial_eval: Optional[dict] = None
        self.packed = cfg.data.packing  # several records per row (dpllm.packing): (mask dtype, stats) by setup_model
        self.packed_mask_dtype: Optional[torch.dtype] = None
        self.packed_stats = {"tokens_per_row": cfg.data.max_length, "rows": 0, "records": 0, "real_tokens": 0,
                             "row_tokens": 0} if self.packed else None
        self.packed_checked = False

    # ---- the stages ---------------------------------------------------------------------------------

    def run(self) -> dict:
        with known_warnings_silenced(), StopRequests() as self.stops:
            try:
                self.setup_process()
                finished = already_finished(self.out, self.resume_from)
                if finished is not None:  # resume_from on a run that had finished: its summary, nothing run
                    self.already_finished = True
                    return finished if self.world.is_main else {}
                self.setup_data()
                self.setup_plan()
                self.setup_model()
                self.log_truncation()
                self.setup_run_dir()
                self.setup_privacy()
                self.start()
                self.train_steps()
                return self.finish()
            except resume.Interrupted:  # stopped at a step boundary (SIGTERM), checkpoint written
                raise
            except KeyboardInterrupt:  # Ctrl-C: the command prints where to resume from, not a traceback
                raise self.interrupted(self.stops.requested) from None
            finally:
                self.progress.close()
                if self.lock is not None:
                    self.lock.release()

    def setup_process(self) -> None:
        seed_everything(self.t.seed)
        self.mp = self.t.mixed_precision
        if self.mp == "bf16" and not torch.cuda.is_available():
            log.warning("mixed_precision=bf16 needs a GPU here; falling back to fp32 on CPU")
            self.mp = "no"
        self.accelerator = distributed.make_accelerator(self.mp)
        self.world = distributed.world_of(self.accelerator)
        self.device = self.accelerator.device
        distributed.check_parallelism(self.p, self.world.kind, world_size=self.world.size,
                                      logical_batch_size=self.t.logical_batch_size)
        if self.packed and self.world.size > 1:
            raise ConfigError(f"data.packing on {self.world.size} processes ({self.world.kind}) is not tested yet; "
                              "run it on one process, or set data.packing: false")
        self.resume_from = resume.resolve(self.cfg)  # read-only, so every process reaches the same answer
        if self.resume_from is not None:
            resume.check_config(self.resume_from, self.cfg)
        elif self.world.is_main:
            rundir.check_output_dir(self.out, overwrite=self.t.overwrite_output_dir,
                                    protected=[self.cfg.data.dataset, self.cfg.model.model_name_or_path])

    def setup_data(self) -> None:
        """The records, splits, canaries and members (:mod:`dpllm.run_data`), from the data and config alone."""
        self.data = run_data.prepare(self.cfg, privacy=self.privacy, world=self.world,
                                     stage=resume.config_key(self.cfg), resume_from=self.resume_from)

    def setup_plan(self) -> None:
        """Earlier stages, steps and σ: all decided from the data alone, before any model is loaded."""
        self.source = models.source_of(self.cfg.model)
        d = self.data
        self.steps = self.privacy.make_plan(source=self.source, num_records=len(d.train_texts),
                                            trained=d.trained_hashes, heldout=d.heldout_hashes, data_notes=d.notes)

    @property
    def plan(self) -> Optional[PrivacyPlan]:
        return self.privacy.plan

    @property
    def private(self):
        """The engine (:class:`dpllm.privacy.engine.PrivateTraining`) under DP, after setup_privacy."""
        return self.privacy.private

    def setup_model(self) -> None:
        cfg, main = self.cfg, self.world.is_main  # fsdp_cpu_ram_efficient_loading: rank 0 reads, the rest build on meta
        from_rank0 = distributed.loads_on_rank0(self.world, self.source, cfg.model.quantization)
        model, self.tokenizer, _ = load_base(cfg.model, cfg.data.max_length, on_meta=from_rank0 and not main)
        models.fit_to_run(model, self.tokenizer, max_length=cfg.data.max_length, canaries=self.data.canaries)
        if self.dp:  # a rotary switch that one long record flips for its whole batch (dpllm.privacy.positions)
            check_rope_per_record(model, max_length=cfg.data.max_length)
        self.lora_base = models.base_to_keep(model, cfg.model, self.source)  # saved beside LoRA adapters, or None
        # bk clips an output head tied to the input embedding exactly; every other engine needs it untied
        keep_tie = self.dp and self.p.grad_sample_mode in ("auto", "bk")
        model, self.adjustments = models.prepare_model(model, cfg.model, dp=self.dp, keep_tie=keep_tie)
        # the engine, before anything is written; the head untied where it needs it, checkpointing (dpllm.privacy.modes)
        mode, untied = prepare_engine(model, cfg, sharded=self.world.kind == "fsdp", keep_tie=keep_tie)
        self.adjustments += untied
        # FSDP moves each block to the device as it shards it: the whole model never sits on one device
        (model if self.world.kind == "fsdp" else model.to(self.device)).train()  # from_pretrained gives eval mode
        if self.dp:
            models.check_dp_layers(model)
        self.n_params = models.count_parameters(model)
        full = distributed.full_state(model) if from_rank0 and main else None
        # DDP / FSDP wrapping comes before the optimizer (FSDP replaces parameters) and before make_private.
        self.model = distributed.wrap_model(model, dp=self.dp, world=self.world, accelerator=self.accelerator,
                                            mixed_precision=self.mp, grad_sample_mode=mode)
        if from_rank0:
            distributed.fill_from_rank0(self.model, full, self.world, self.device)
        if self.dp:  # correlated noise's state (b−1 or d model-sized tensors): refused now if it cannot fit
            self.privacy.check_noise_memory(self.model, world=self.world, device=self.device)
        self.train_ds, self.eval_ds, self.collate = self.data.datasets(self.tokenizer, cfg.data)
        if cfg.data.long_records == "split":  # each row a window; its source record is the unit (dpllm.windows)
            self.privacy.set_windows(self.train_ds.record_of)
        if self.packed:  # the 4-D mask this model's attention takes (refused: one it would not read)
            try:
                _, self.packed_mask_dtype = packing.attention_of(model)
            except ValueError as err:
                raise ConfigError(str(err)) from None
        self.optimizer, self.scheduler = make_optimizer(self.model, self.t, steps=self.steps)

    @property
    def truncation(self) -> Optional[dict]:
        """What ``max_length`` cut off the training records (:mod:`dpllm.truncation`), None where not counted."""
        return getattr(self.train_ds, "truncation", None)

    def log_truncation(self) -> None:
        """One console line on what ``max_length`` cut off the training records: a WARNING when it cut any."""
        s = self.truncation
        if s and self.world.is_main:
            (log.warning if s.get("truncated_records") else log.info)("[private] data: %s", truncation.describe(s))

    def setup_run_dir(self) -> None:
        """Lock, then (fresh runs) clear and describe the run directory. Only rank 0 writes."""
        if self.world.is_main:
            self.lock = rundir.RunLock(self.out).acquire()
            if self.resume_from is None:  # checked again under the lock, cleared; config.yaml, splits.json...
                rundir.describe(self.out, self.cfg, self.data, user_unit=self.privacy.user_unit)
            else:
                resume.clean_partial_writes(self.out)
        distributed.barrier(self.world)

    def setup_privacy(self) -> None:
        self.generators = privacy_generators(reproducible=self.p.reproducible_noise, seed=self.t.seed,
                                             stage=resume.config_key(self.cfg), world=self.world,
                                             device=self.device, secure_mode=self.p.secure_mode,
                                             resumed_at=resume.saved_step(self.resume_from))
        if self.dp:
            self.model, self.optimizer, self.criterion, self.batches = self.privacy.attach(
                model=self.model, optimizer=self.optimizer, dataset=self.train_ds, collate_fn=self.collate,
                generators=self.generators, world=self.world, texts=self.data.train_texts)
        else:
            self.batches = ShuffledBatchSampler(num_samples=len(self.train_ds), batch_size=self.t.logical_batch_size,
                                                seed=self.t.seed, rank=self.world.rank, world_size=self.world.size)

    def start(self) -> None:
        """A fresh run's first ledger line and step-0 eval, or everything a resumable checkpoint holds."""
        self.resumable = ResumableState(self.cfg, world=self.world, privacy=self.privacy, stops=self.stops,
                                        model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                                        generators=self.generators)
        if self.resume_from is not None:
            self.step, self.tokens_seen, self.initial_eval = self.resumable.restore(self.resume_from)
            self.start_step = self.step
            log.warning("resumed %s from step %d of %d (%s)", self.out, self.step, self.steps, self.resume_from.name)
        else:
            if self.world.is_main:
                ledger.append(self.out, kind="stage", step=0, privacy=self.privacy.now(), name=self.out.name,
                              previous_stage=ledger.previous_stage(self.source))
            if self.t.eval_every:
                self.initial_eval = self.evaluate()
        if not self.dp or hasattr(self.batches, "start"):  # non-private batches, and whose turn it is under cyclic
            self.batches.start = self.step  # sampling (dpllm.privacy.correlated), are functions of the step

    def train_steps(self) -> None:
        """The loop: this process's share of the next logical batch → one optimizer step, until done."""
        if self.t.progress and self.world.is_main:
            self.progress.show_bar(total=self.steps, initial=self.step, desc="dp-train" if self.dp else "train")
        self.started = self.resumable.last_saved_at = time.time()
        batches = iter(self.batches)  # endless; Poisson under DP, fixed-size shuffled batches otherwise
        self.stops.defer_term = True  # SIGTERM: finish the step, checkpoint, stop (dpllm.stopping)
        while self.step < self.steps:
            self.optimizer_step(next(batches))
            self.after_step()
            # all processes alike: a checkpoint when due by time or asked to stop (dpllm.run_state), then stop
            if sig := self.resumable.save_or_stop(self.step, self.steps, self.tokens_seen):
                raise self.interrupted(sig)
        self.stops.defer_term = False
        self.resumable.save_last(self.step, self.tokens_seen, start_step=self.start_step)
        self.wall = time.time() - self.started

    def interrupted(self, sig: Optional[int]) -> resume.Interrupted:
        """What the command reports when a signal stopped the run (see :class:`dpllm.resume.Interrupted`)."""
        return resume.Interrupted(self.out, step=self.step, steps=getattr(self, "steps", None),
                                  started=self.lock is not None or getattr(self, "resume_from", None) is not None,
                                  main=self.world.is_main if hasattr(self, "world") else True, signal=sig)

    def finish(self) -> dict:
        final = self.evaluate(final=True)
        if self.data.sft_format and self.world.is_main:  # SFT: greedy answers to the first held-out prompts
            rundir.write_generations(self.out, unwrap(self.model), self.tokenizer,
                                     self.data.eval_texts[: self.cfg.data.num_generations])
        tokens = int(distributed.all_sum([self.tokens_seen], self.world)[0])
        digest = distributed.agreed_digest(self.model, self.world)  # replicas that differ: a TrainingError
        self.privacy.check_history(self.step)
        weights_dir = rundir.shard_final_weights(self.out, unwrap(self.model), self.world)  # FSDP; None otherwise
        summary: dict = {}
        if self.world.is_main:
            report = self.privacy.report(num_records=getattr(self.train_ds, "num_records", len(self.train_ds)),
                                         steps=self.step,
                                         trained=self.data.trained_hashes, adjustments=self.adjustments,
                                         base_model=self.source,
                                         public_data=data.split_rule(self.cfg.data)["public"],
                                         data_summary=self.truncation, packing=self.packed_stats)
            summary = rundir.summary(self.cfg, report, steps=self.step, tokens=tokens, params=self.n_params,
                                     initial_eval=self.initial_eval, final=final, wall=self.wall,
                                     world_size=self.world.size, digest=digest, resumed_from=self.start_step)
            rundir.write_final(self.out, self.cfg, report, summary, model=self.model, tokenizer=self.tokenizer,
                               base_model=self.lora_base, weights_dir=weights_dir)
        self.accelerator.wait_for_everyone()
        return summary

    # ---- one step ------------------------------------------------------------------------------------

    def micro_batches(self, ids: list[int]) -> list[list]:
        """Physical batches of this process's share; under FSDP as many as the busiest process has. Packed: each
        batch a list of rows of record ids, at most ``physical_batch_size`` rows (:func:`dpllm.packing.plan_batches`:
        this step's sampled records, a split record's windows in one batch)."""
        size = self.t.physical_batch_size
        if self.packed:
            units = [self.privacy.record_user[j] for j in ids] if self.privacy.per_unit else None
            lengths = [packing.piece_length(self.train_ds[j]) for j in ids]
            plan = packing.plan_batches(lengths, max_length=self.cfg.data.max_length, rows_per_batch=size, units=units)
            return [[[ids[i] for i in row] for row in rows] for rows in plan] or [[]]
        if self.privacy.per_unit:  # a unit's rows stay together: its gradient is clipped once
            parts = user_level.whole_user_batches(ids, self.batches.user_of, size) or [[]]
        else:
            parts = [ids[i: i + size] for i in range(0, len(ids), size)] or [[]]
        if distributed.is_sharded(unwrap(self.model)):  # FSDP's collectives need equal pass counts
            parts += [[]] * (int(distributed.all_max(len(parts), self.world)) - len(parts))
        return parts

    def optimizer_step(self, ids: list[int]) -> None:
        """Forward/backward over the micro-batches, then one update.

        Under DP each micro-batch is clipped and accumulated (``signal_skip_step``); noise, accounting and
        the all-reduce happen once, at the last. Without DP the gradients of the micro-batches add up and
        sync at the last; scaling each by W·m/B makes the update the mean over the global batch of B.
        """
        parts = self.micro_batches(ids)
        self.optimizer.zero_grad()
        if self.dp and self.plan.schedule:  # Opacus noises and accounts with the optimizer's σ of this step
            self.optimizer.noise_multiplier = self.plan.sigma_at(self.step)
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            packed = self.packed and bool(part)  # an empty share runs the unpacked masked stand-in row
            rows = part if packed else None
            part = [j for row in part for j in row] if packed else part  # records in segment order
            if packed:
                batch = packing.collate_packed([[self.train_ds[j] for j in row] for row in rows],
                                               pad_token_id=self.tokenizer.pad_token_id)
            else:
                items = [self.train_ds[j] for j in part]
                batch = self.collate(items) if items else _EMPTY
            batch = {k: v.to(self.device) for k, v in batch.items()}
            if self.dp:
                self.optimizer.signal_skip_step(do_skip=not last)
            if self.packed and self.dp:  # bk clips each record's segment of the rows alone (the stand-in: a row)
                if packed and not self.packed_checked:  # the first packed batch: the model keeps records apart
                    packing.check_records_apart(unwrap(self.model), batch, mask_dtype=self.packed_mask_dtype)
                    self.packed_checked = True
                self.private.set_segments(batch["segments"] if packed else None)
            if self.privacy.per_unit:  # an empty share's masked stand-in row is a unit of its own, zero gradient
                self.private.set_users([self.privacy.record_user[j] for j in part] or [-1],
                                       reduction=self.privacy.unit_reduction)
            if self.dp and not part:  # the masked stand-in row is no record: it must not enter any count of records
                self.private.stand_in_row()
            sync = nullcontext() if last or self.dp else self.accelerator.no_sync(self.model)
            with sync:
                if packed:
                    loss = packing.packed_forward_loss(self.model, batch, mask_dtype=self.packed_mask_dtype,
                                                       autocast=self.autocast)
                    self.count_packed(batch)
                else:
                    loss = forward_loss(self.model, batch, self.criterion, self.autocast)
                    self.tokens_seen += int(batch["attention_mask"].sum())
                self.record_loss(loss, len(part))
                if self.dp:
                    loss.backward()
                    self.optimizer.step()
                    self.optimizer.zero_grad()
                else:
                    (loss * (len(part) * self.world.size / self.batches.batch_size)).backward()
        if not self.dp:
            self.optimizer.step()

    def count_packed(self, batch: dict) -> None:
        """The report's packing figures: rows run, records (segments) in them, real tokens, row positions."""
        seg, k = batch["segments"], self.packed_stats
        self.tokens_seen += int((seg >= 0).sum())
        k["rows"] += int(seg.shape[0])
        k["records"] += int(seg.max()) + 1
        k["real_tokens"] += int((seg >= 0).sum())
        k["row_tokens"] += int(seg.numel())

    @property
    def autocast(self):
        return self.accelerator.autocast if self.mp != "no" else None

    def record_loss(self, loss, n: int) -> None:
        if n == 0:
            return
        value = float(loss.detach() if hasattr(loss, "detach") else loss)
        if not math.isfinite(value):
            raise TrainingError(f"loss is {value} at step {self.step + 1}; no checkpoint was written. Lower "
                                f"learning_rate (now {self.t.learning_rate}), check the data, or use "
                                "mixed_precision=no")
        self.window[0] += value * n
        self.window[1] += n

    def after_step(self) -> None:
        self.step += 1
        self.scheduler.step()
        t, step = self.t, self.step
        if step % t.log_every == 0 or step == self.steps:
            self.log_train()
        if t.eval_every and step % t.eval_every == 0 and step < self.steps:
            self.evaluate()
        if t.save_every and step % t.save_every == 0 and step < self.steps:
            self.resumable.save(step, self.tokens_seen)
        self.progress.step()

    def log_train(self) -> None:
        loss_sum, n, tokens = distributed.all_sum([self.window[0], self.window[1], self.tokens_seen], self.world)
        self.window = [0.0, 0]
        row = {"step": self.step, "split": "train", "loss": loss_sum / max(n, 1),
               "lr": self.scheduler.get_last_lr()[0], "tokens_seen": int(tokens),
               "elapsed_s": round(time.time() - self.started, 2)}
        if self.world.is_main:
            if self.dp:
                row["epsilon"] = self.privacy.epsilon()[0]
            self.progress.train_line(row)

    def evaluate(self, final: bool = False) -> dict:
        ev = evaluate(self.model, self.eval_ds, self.collate, batch_size=self.t.physical_batch_size,
                      device=self.device, world=self.world)
        if self.world.is_main:  # held-out loss: private, un-noised; the console and metrics.jsonl only
            self.progress.eval_line(self.step, ev, records=len(self.eval_ds), final=final)
        return ev


_EMPTY = {k: torch.zeros((0, 1), dtype=torch.long) for k in ("input_ids", "attention_mask", "labels")}


def train(cfg: RunConfig) -> dict:
    """Run one training stage as configured; return the run summary (also in ``run_summary.json``).

    Runs on one process or many (``accelerate launch``, see :mod:`dpllm.distributed`); only rank 0
    writes the run directory and the summary is returned on rank 0 only ({} elsewhere).
    """
    return Trainer(cfg).run()
