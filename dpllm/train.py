"""The training loop: one :class:`Trainer` for private and non-private runs, on one process or many.

:meth:`Trainer.run` reads top to bottom as the stages of a run:

    setup_process   accelerator, processes, resume target
    setup_data      records, splits, canaries                      ┐ every check, nothing loaded
    setup_plan      earlier stages by content, q, steps, σ         ┘ or written yet
    setup_model     load, LoRA/full, DP layer checks, wrapping, optimizer
    setup_run_dir   lock, safe overwrite, config.yaml, splits.json
    setup_privacy   secret generators, Opacus wrapping (or the non-private sampler)
    start           step-0 eval, or restore a resumable checkpoint
    train_steps     one loop: a logical batch → micro-batches → one optimizer step
    finish          final eval, checks, checkpoint/, privacy report, ledger, summary

Where the rest lives: the privacy plan in :mod:`dpllm.privacy.plan`, composition of earlier stages in
:mod:`dpllm.privacy.composition`, the report type in :mod:`dpllm.privacy.report`, process handling in
:mod:`dpllm.distributed`, resumable checkpoints in :mod:`dpllm.resume`, run-directory safety in
:mod:`dpllm.rundir`, the ε hash chain in :mod:`dpllm.ledger`.
"""

from __future__ import annotations

import json
import logging
import math
import random
import signal
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch.utils.data import DataLoader

from dpllm import data, ledger, resume, rundir, sft, sharded_checkpoint
from dpllm.canaries import add_tokens as add_canary_tokens, added_tokens as canary_tokens
from dpllm.checkpoint import library_versions, save_checkpoint, unwrap
from dpllm.config import ConfigError, RunConfig, noise_schedule
from dpllm.distributed import (World, all_max, all_sum, barrier, check_parallelism, gather_objects, is_sharded,
                               make_accelerator, params_digest, reshard, world_of, wrap_model)
from dpllm.io import append_jsonl, write_json_atomic, write_text_atomic
from dpllm.logs import known_warnings_silenced
from dpllm.models import (check_checkpointing, check_dp_layers, context_length, count_parameters, load_base,
                          position_ids_for, prepare_model, source_of, untie_output_embeddings)
from dpllm.privacy import clipping, user_level
from dpllm.privacy.composition import Lineage, lineage, set_digest
from dpllm.privacy.engine import make_private, sequence_loss
from dpllm.privacy.accounting import PrivacyPlanError, check_delta
from dpllm.privacy.plan import PrivacyPlan, plan_privacy, sample_rate_for, steps_for
from dpllm.privacy.randomness import privacy_generators
from dpllm.privacy.report import PrivacyReport
from dpllm.sampling import ShuffledBatchSampler
from dpllm.stopping import StopRequests

log = logging.getLogger(__name__)


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. a NaN loss); nothing half-written is left behind."""


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


@torch.no_grad()
def evaluate(model, dataset, collate, *, batch_size: int, device, world: World = World()) -> dict:
    """Token-weighted held-out loss (nats per token) and perplexity.

    Called on every process: each evaluates every W-th record and the sums are all-reduced (under
    FSDP, where a forward pass needs all processes, each evaluates everything).
    """
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


def _make_optimizer(params, cfg: RunConfig):
    t = cfg.train
    if t.optimizer == "sgd":
        return torch.optim.SGD(params, lr=t.learning_rate, momentum=t.momentum, weight_decay=t.weight_decay)
    return torch.optim.AdamW(params, lr=t.learning_rate, weight_decay=t.weight_decay)


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
        self.metrics_path = self.out / "metrics.jsonl"
        self.lock: Optional[rundir.RunLock] = None
        self.plan: Optional[PrivacyPlan] = None
        self.private = None  # dpllm.privacy.engine.PrivateTraining under DP
        self.user_unit = False  # privacy_unit=user (set by setup_data; subclasses with their own data keep records)
        self.data_notes: list[str] = []  # what loading removed, for the plan's warnings (set by setup_data)
        self.sft_format: Optional[str] = None  # the record shape of instruction / chat data (dpllm.sft), None for text
        self.criterion = None
        self.step = self.start_step = self.tokens_seen = 0
        self.last_saved: Optional[int] = None  # the step of the last resumable checkpoint written by this process
        self.stops = StopRequests()  # SIGINT / SIGTERM while run() is on (dpllm.stopping)
        self.already_finished = False  # resume_from on a run that had finished: run() returned its summary
        self.window = [0.0, 0]  # record-weighted loss sum and record count since the last train log line
        self.initial_eval: Optional[dict] = None
        self.bar = None

    # ---- the stages ---------------------------------------------------------------------------------

    def run(self) -> dict:
        with known_warnings_silenced(), StopRequests() as self.stops:
            try:
                self.setup_process()
                finished = resume.finished_summary(self.out) if self.resume_from is not None else None
                if finished is not None:
                    log.warning("%s already finished at step %s; nothing to do", self.out, finished.get("steps"))
                    self.already_finished = True
                    return finished if self.world.is_main else {}
                self.setup_data()
                self.setup_plan()
                self.setup_model()
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
                if self.bar is not None:
                    self.bar.close()
                if self.lock is not None:
                    self.lock.release()

    def setup_process(self) -> None:
        seed_everything(self.t.seed)
        self.mp = self.t.mixed_precision
        if self.mp == "bf16" and not torch.cuda.is_available():
            log.warning("mixed_precision=bf16 needs a GPU here; falling back to fp32 on CPU")
            self.mp = "no"
        self.accelerator = make_accelerator(self.mp)
        self.world = world_of(self.accelerator)
        self.device = self.accelerator.device
        check_parallelism(self.p, self.world.kind, world_size=self.world.size,
                          logical_batch_size=self.t.logical_batch_size)
        self.resume_from = resume.resolve(self.cfg)  # read-only, so every process reaches the same answer
        if self.resume_from is not None:
            resume.check_config(self.resume_from, self.cfg)
        elif self.world.is_main:
            rundir.check_output_dir(self.out, overwrite=self.t.overwrite_output_dir,
                                    protected=[self.cfg.data.dataset, self.cfg.model.model_name_or_path])

    def setup_data(self) -> None:
        d = self.cfg.data
        loaded = data.load_records_counted(d)
        self.records, self.users, self.data_notes = loaded.records, loaded.users, loaded.notes(d)
        try:
            self.splits = data.make_splits(self.records, d, self.users, loaded.public)
        except data.DataError as err:  # say why so few are left: duplicates are easy to miss in a file
            raise data.DataError(f"{err}" + (f" ({loaded.duplicates:,} of {loaded.read:,} records read were exact "
                                             "duplicates and were removed)" if loaded.duplicates else "")) from None
        self.sft_format = sft.format_of(self.records)
        log.info("[private] data format: %s", f"{self.sft_format} records, loss on {d.loss_on} tokens" if self.sft_format
                 else "plain text, loss on all tokens")  # detected from the private file: the console only
        if self.sft_format:  # before the plan: N counts only records that keep an answer token
            self.sft_dropped = sft.drop_cut_answers(self.records, self.splits, sft.load_tokenizer(self.cfg.model),
                                                    max_length=d.max_length, chat_template=d.chat_template)
        if d.train_on == "public" and not self.splits.public:
            raise data.DataError("train_on=public but no record is public; declare public records with "
                                 "public_dataset: FILE")
        train_ids = self.splits.public if d.train_on == "public" else self.splits.train
        self.canaries = data.make_canaries(d) if d.train_on == "private" else []
        self.user_unit = self.users is not None and d.train_on == "private"
        if self.user_unit:
            train_ids = self.bound_contributions(train_ids)
        # a canary user (privacy_unit=user) writes its canary in canary_records_per_user records
        m = d.canary_records_per_user if self.user_unit else 1
        self.train_texts = data.select(self.records, train_ids) + [
            sft.canary_record(c, self.sft_format) if self.sft_format else c["text"]  # SFT: the secret is the answer
            for c in self.canaries if c["included"] for _ in range(m)]
        heldout = data.select(self.records, self.splits.heldout)
        self.heldout_hashes = {data.sha256(x) for x in heldout}
        self.eval_texts = heldout if self.t.eval_max_records is None else heldout[: self.t.eval_max_records]
        self.trained_hashes = {data.sha256(x) for x in self.train_texts}
        if self.resume_from is not None:  # the same file and config must still give the same members
            data.check_resumed_split(self.out / "splits.json", self.trained_hashes)
        if self.world.is_main:  # where every record went, on the operator's console only (issue 35)
            log.info("%s", data.split_summary(loaded, self.splits, d, canaries=self.canaries,
                                              sft_dropped=len(getattr(self, "sft_dropped", None) or ())))

    def bound_contributions(self, train_ids: list[int]) -> list[int]:
        """privacy_unit=user: keep at most k records per user (secret random choice); return the kept ids.

        A resumed run trains on the records its splits.json lists: the choice was secret and is not redrawn.
        """
        d, p = self.cfg.data, self.p
        if self.resume_from is not None and (self.out / "splits.json").is_file():
            import json

            kept = json.loads((self.out / "splits.json").read_text())["train"]
            if not set(kept) <= set(train_ids):
                raise data.DataError(f"{self.out}/splits.json lists records outside this run's training users")
            cap = user_level.cap_users(kept, self.users, None, None)
            dropped = sorted(set(train_ids) - set(kept))
            cap.update(users_trimmed=len({self.users[i] for i in dropped}), records_dropped=len(dropped),
                       largest_user=max(len(r) for r in user_level.group_by_user(train_ids, self.users).values()))
        else:
            gen = user_level.cap_generator(reproducible=p.reproducible_noise, seed=self.t.seed,
                                           stage=resume.config_key(self.cfg), world=self.world)
            cap = user_level.cap_users(train_ids, self.users, d.max_records_per_user, gen, texts=self.records)
        # splits.json lists the kept records as the trained ones; dropped records are neither member nor held out
        self.splits.users["dropped_records"] = sorted(set(train_ids) - set(cap["kept"]))
        self.splits.train = cap["kept"]
        self.user_cap = cap
        names = sorted(cap["by_user"]) + [f"canary#{i}" for i, c in enumerate(self.canaries) if c["included"]]
        index = {u: j for j, u in enumerate(names)}
        self.record_user = [index[self.users[i]] for i in cap["kept"]]
        self.record_user += [index[f"canary#{i}"] for i, c in enumerate(self.canaries) if c["included"]
                             for _ in range(d.canary_records_per_user)]
        self.user_records = [[] for _ in names]  # dataset positions of each user's records
        for pos, u in enumerate(self.record_user):
            self.user_records[u].append(pos)
        uls = self.dp and p.user_sampling == "uls"
        largest = max(len(r) for r in self.user_records)
        if uls and largest > self.t.physical_batch_size:
            raise ConfigError(
                f"user_sampling=uls keeps a user's records in one physical batch, but a user keeps {largest} records > "
                f"physical_batch_size={self.t.physical_batch_size}; set max_records_per_user ≤ "
                f"{self.t.physical_batch_size} or raise physical_batch_size")
        log.info("users: %d training users, %d records kept (k=%s, %s users trimmed, %s records dropped)",
                 len(names), len(self.record_user), d.max_records_per_user, cap["users_trimmed"],
                 cap["records_dropped"])
        return cap["kept"]

    @property
    def uls(self) -> bool:
        return self.dp and self.user_unit and self.p.user_sampling == "uls"

    @property
    def els(self) -> bool:
        return self.dp and self.user_unit and self.p.user_sampling == "els"

    @property
    def group_size(self) -> Optional[int]:
        """k of the group-privacy accounting (ELS, record): the declared cap ``max_records_per_user``, never a
        statistic of the data (a neighbour may add a user of k records, whatever the largest user here keeps).
        None for ``record`` without a cap (unbounded; ELS without one is refused by the config); 1 otherwise."""
        if self.dp and self.user_unit and self.p.user_sampling in ("els", "record"):
            return self.cfg.data.max_records_per_user
        return 1

    def setup_plan(self) -> None:
        """Earlier stages, steps and σ: all decided from the data alone, before any model is loaded."""
        t, p = self.t, self.p
        self.source = source_of(self.cfg.model)
        self.lineage: Lineage = lineage(self.source, private=self.trained_hashes, heldout=self.heldout_hashes,
                                        dp=self.dp, declared_disjoint=self.cfg.data.earlier_stages_disjoint)
        if self.dp and self.user_unit and self.lineage.history:
            raise PrivacyPlanError("privacy_unit=user cannot yet compose with earlier private stages on the same "
                                   "records (their ε is record-level); start from a model that never saw them")
        n, batch = len(self.train_texts), t.logical_batch_size
        target, delta = p.target_epsilon, p.target_delta
        if self.dp and self.user_unit:
            check_delta(delta, len(self.user_records))  # δ < 1/U: the unit is the user
        if self.uls:
            # ULS samples users: B_u users per step so that a step holds B records in expectation.
            n, batch = len(self.user_records), max(1, round(batch * len(self.user_records) / n))
            self.users_per_batch = batch
        self.steps = steps_for(num_records=n, batch=batch, epochs=t.epochs,
                               steps=None if t.epochs is not None else t.max_steps)
        sigma = p.noise_multiplier
        if self.els and self.group_size > 1 and (sigma is not None or target is not None):
            # σ from the user-level target by the tight mixture accounting; the record-level plan below then
            # carries δ/k (< 1/N, as δ < 1/U) only to state a record-level ε beside the user-level one.
            k, q = self.group_size, sample_rate_for(n, batch)
            if sigma is None:  # calibrated: meets the target by construction
                sigma = user_level.calibrate_mixture(target_epsilon=target, delta=delta, sample_rate=q,
                                                     steps=self.steps, group_size=k)
            elif target is not None:  # a given σ must still meet a given target
                eps_u = user_level.mixture_epsilon(history=[(sigma, q, self.steps)], delta=delta, group_size=k)
                if eps_u > target:
                    raise PrivacyPlanError(f"noise_multiplier={sigma:g} gives user-level ε={eps_u:.4g} > "
                                           f"target_epsilon={target:g} for users of {k} records; raise the noise or "
                                           "unset it")
            target, delta = None, delta / k
        if self.dp:
            self.plan = plan_privacy(num_records=n, logical_batch_size=batch, steps=self.steps,
                                     target_epsilon=target, delta=delta, accountant=p.accountant,
                                     noise_multiplier=sigma, prior_history=self.lineage.history,
                                     data_notes=self.data_notes, schedule=noise_schedule(p))
        for note in self.lineage.notes:
            log.info("stages: %s", note)

    def setup_model(self) -> None:
        cfg, dlen = self.cfg, self.cfg.data.max_length
        model, self.tokenizer, _ = load_base(cfg.model, dlen)
        ctx = context_length(model)
        if ctx is not None and dlen > ctx:
            raise ConfigError(f"max_length={dlen} exceeds the model's context of {ctx} tokens; lower max_length")
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        added = add_canary_tokens(model, self.tokenizer, canary_tokens(self.canaries))
        if added:
            log.info("canaries: added %d new tokens to the vocabulary (%s)", added, cfg.data.canary_design)
        # LoRA over a base that has no path of its own (tiny, or merged from a run) keeps a copy to save.
        keep_base = cfg.model.finetuning == "lora" and self.source["kind"] != "pretrained"
        self.lora_base = _copy(model) if keep_base else None
        # bk clips an output head tied to the input embedding exactly; every other engine needs it untied
        keep_tie = self.dp and self.p.grad_sample_mode in ("auto", "bk")
        model, self.adjustments = prepare_model(model, cfg.model, dp=self.dp, keep_tie=keep_tie)
        from dpllm.privacy.bk import resolve_mode

        # the engine, decided before anything is written (under FSDP auto is bk or a refusal: dpllm.privacy.modes)
        mode = resolve_mode(self.p.grad_sample_mode, model, sharded=self.world.kind == "fsdp") if self.dp else None
        if keep_tie and cfg.model.finetuning == "full" and mode != "bk":
            self.adjustments += untie_output_embeddings(model)
        if self.t.gradient_checkpointing:
            if self.dp and mode != "bk":
                raise ConfigError(
                    f"gradient_checkpointing=true under DP needs grad_sample_mode: bk (or auto on a model bk fully "
                    f"supports), not {self.p.grad_sample_mode}: recomputed activations re-run Opacus's forward hooks "
                    "and corrupt per-sample norms; switch the mode, or turn checkpointing off")
            # non-reentrant: book-keeping reads activations from autograd's saved tensors, recorded once
            unwrap(model).gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.dp:  # however checkpointing got turned on (a model's own code may): only bk clips under it
            check_checkpointing(model, mode)
        model.to(self.device).train()  # from_pretrained returns eval mode; Opacus validates training mode
        if self.dp:
            check_dp_layers(model)
        self.n_params = count_parameters(model)
        # DDP / FSDP wrapping comes before the optimizer (FSDP replaces parameters) and before make_private.
        self.model = wrap_model(model, dp=self.dp, world=self.world, accelerator=self.accelerator,
                                mixed_precision=self.mp, grad_sample_mode=mode)
        if self.sft_format:  # labels -100 on prompt tokens; the template is set on the tokenizer saved with the model
            self.train_ds, self.eval_ds, self.collate = sft.make_datasets(self.train_texts, self.eval_texts,
                                                                          self.tokenizer, cfg.data)
        else:
            self.train_ds = data.TokenizedRecords(self.train_texts, self.tokenizer, dlen)
            self.eval_ds = data.TokenizedRecords(self.eval_texts, self.tokenizer, dlen)
            self.collate = data.make_collate(self.tokenizer.pad_token_id)
        self.optimizer = _make_optimizer([q for q in self.model.parameters() if q.requires_grad], cfg)
        from transformers import get_scheduler

        self.scheduler = get_scheduler(self.t.lr_scheduler, self.optimizer, num_warmup_steps=self.t.warmup_steps,
                                       num_training_steps=self.steps)

    def setup_run_dir(self) -> None:
        """Lock, then (fresh runs) clear and describe the run directory. Only rank 0 writes."""
        if self.world.is_main:
            self.lock = rundir.RunLock(self.out).acquire()
            if self.resume_from is None:
                # again under the lock: another run may have filled the directory since the first check
                rundir.check_output_dir(self.out, overwrite=self.t.overwrite_output_dir,
                                        protected=[self.cfg.data.dataset, self.cfg.model.model_name_or_path])
                rundir.clear(self.out)
                rundir.mark(self.out)
                write_text_atomic(self.out / "config.yaml", self.cfg.to_yaml())
                splits = self.splits.to_json(self.records, self.cfg.data)
                splits["trained_sha256"] = sorted(self.trained_hashes)
                if self.sft_format:  # how audits render and score the records (answer tokens given the prompt)
                    splits["sft"] = {"format": self.sft_format, "loss_on": self.cfg.data.loss_on,
                                     "dropped_no_answer": self.sft_dropped}
                write_json_atomic(self.out / "splits.json", splits)
                if self.canaries:
                    write_json_atomic(self.out / "canaries.json",
                                      {"seed": self.cfg.data.canary_seed, "canaries": self.canaries,
                                       **({"unit": "user", "records_per_user": self.cfg.data.canary_records_per_user}
                                          if self.user_unit else {})})
            else:
                resume.clean_partial_writes(self.out)
        barrier(self.world)

    def setup_privacy(self) -> None:
        self.generators = privacy_generators(reproducible=self.p.reproducible_noise, seed=self.t.seed,
                                             stage=resume.config_key(self.cfg), world=self.world,
                                             device=self.device, secure_mode=self.p.secure_mode)
        if self.dp:
            self.private = make_private(
                model=self.model, optimizer=self.optimizer, dataset=self.train_ds, collate_fn=self.collate,
                cfg=self.p, plan=self.plan, logical_batch_size=self.t.logical_batch_size,
                noise_generator=self.generators["noise"], sampling_generator=self.generators["sampling"],
                rank=self.world.rank, world_size=self.world.size, physical_batch_size=self.t.physical_batch_size,
                **({"user_records": self.user_records} if self.uls else {}))
            self.model, self.optimizer = self.private.model, self.private.optimizer
            self.criterion = self.private.criterion
            self.batches = self.private.sampler
            log.info("privacy: σ=%.4g q=%.4g steps=%d target ε=%s δ=%g (%s), %d process(es)",
                     self.plan.noise_multiplier, self.plan.sample_rate, self.steps, self.p.target_epsilon,
                     self.p.target_delta, self.p.accountant, self.world.size)
        else:
            self.batches = ShuffledBatchSampler(num_samples=len(self.train_ds), batch_size=self.t.logical_batch_size,
                                                seed=self.t.seed, rank=self.world.rank, world_size=self.world.size)

    def start(self) -> None:
        """A fresh run's first ledger line and step-0 eval, or everything a resumable checkpoint holds."""
        if self.resume_from is not None:
            state = resume.load(self.resume_from, model=self.model, optimizer=self.optimizer,
                                scheduler=self.scheduler, world=self.world, generators=self.generators,
                                plan=self.plan.to_json() if self.plan else None,
                                accountant=self.private.engine.accountant if self.dp else None)
            self.step = self.start_step = self.last_saved = state["step"]
            self.tokens_seen = state["tokens_seen"] if self.world.is_main else 0  # the sum over processes counts
            if self.world.is_main:
                resume.truncate_metrics(self.metrics_path, state["metrics_bytes"])
                resume.sync_ledger(self.out, self.resume_from, step=self.step, privacy=self.privacy_now())
                self.initial_eval = resume.initial_eval(self.metrics_path)
            log.warning("resumed %s from step %d of %d (%s)", self.out, self.step, self.steps, self.resume_from.name)
        else:
            if self.world.is_main:
                ledger.append(self.out, kind="stage", step=0, privacy=self.privacy_now(), name=self.out.name,
                              previous_stage=ledger.previous_stage(self.source))
            if self.t.eval_every:
                self.initial_eval = self.evaluate()
        if not self.dp:
            self.batches.start = self.step  # non-private batches are a function of the step: no state to restore

    def train_steps(self) -> None:
        """The loop: this process's share of the next logical batch → one optimizer step, until done."""
        if self.t.progress and self.world.is_main:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.steps, initial=self.step, desc="dp-train" if self.dp else "train",
                            dynamic_ncols=True, mininterval=1.0)
        self.started = self.last_saved_at = time.time()
        batches = iter(self.batches)  # endless; Poisson under DP, fixed-size shuffled batches otherwise
        self.stops.defer_term = True  # SIGTERM: finish the step, checkpoint, stop (dpllm.stopping)
        while self.step < self.steps:
            self.optimizer_step(next(batches))
            self.after_step()
            self.stop_or_save()
        self.stops.defer_term = False
        if self.t.save_every and self.step > self.start_step and self.last_saved != self.step:
            self.save_resumable()
        self.wall = time.time() - self.started

    def stop_or_save(self) -> None:
        """At a step boundary: a resumable checkpoint when one is due by time or a stop was requested, then stop.

        All processes take the same decision (one all-reduce): they stop, or save, at the same step.
        """
        sig = self.stops.requested or 0
        minutes = self.t.save_every_minutes
        due = bool(minutes) and time.time() - self.last_saved_at >= 60 * minutes and self.step < self.steps
        if self.world.distributed:
            term, intr, due = all_sum([sig == signal.SIGTERM, sig == signal.SIGINT, due], self.world)
            sig = signal.SIGTERM if term else signal.SIGINT if intr else 0
        if (due or sig) and self.last_saved != self.step:
            self.save_resumable()
        if sig:
            raise self.interrupted(sig)

    def interrupted(self, sig: Optional[int]) -> resume.Interrupted:
        """What the command reports when a signal stopped the run (see :class:`dpllm.resume.Interrupted`)."""
        return resume.Interrupted(self.out, step=self.step, steps=getattr(self, "steps", None),
                                  started=self.lock is not None or getattr(self, "resume_from", None) is not None,
                                  main=self.world.is_main if hasattr(self, "world") else True, signal=sig)

    def finish(self) -> dict:
        final = self.evaluate(final=True)
        self.write_generations()
        tokens = int(all_sum([self.tokens_seen], self.world)[0])
        digests = gather_objects(params_digest(self.model), self.world)
        if len(set(digests)) > 1:
            raise TrainingError(f"model replicas differ across the {self.world.size} processes after training; this "
                                "is a dpllm bug (no checkpoint was written)")
        self.check_history_is_plan()
        weights_dir = None
        if is_sharded(unwrap(self.model)):  # every process writes its own shards of the final weights
            weights_dir = sharded_checkpoint.shared_tempdir(self.out / "checkpoint", self.world)
            sharded_checkpoint.write_weights(weights_dir, model=unwrap(self.model), world=self.world)
            barrier(self.world)
        summary: dict = {}
        if self.world.is_main:
            report = self.report()
            save_checkpoint(self.out / "checkpoint", model=self.model, tokenizer=self.tokenizer,
                            privacy_report=report.to_dict(), config_yaml=self.cfg.to_yaml(),
                            base_model=self.lora_base, weights_dir=weights_dir)
            report.write(self.out / "privacy_report.json")
            ledger.append(self.out, kind="final", step=self.step, privacy=report.as_ledger_privacy(),
                          checkpoint="checkpoint")
            summary = self.summary(report, final, tokens, digests[0])
            write_json_atomic(self.out / "run_summary.json", summary)
            if self.t.runs_file:
                append_jsonl(self.t.runs_file, summary)
        self.accelerator.wait_for_everyone()
        return summary

    def write_generations(self) -> None:
        """SFT: greedy answers to the first ``num_generations`` held-out prompts, printed and saved (rank 0;
        held-out prompts are private data, so generations.jsonl stays in the run directory)."""
        n = self.cfg.data.num_generations if self.sft_format else 0
        if not n or not self.world.is_main or is_sharded(unwrap(self.model)) or not self.eval_texts:
            return
        rows = sft.generate_answers(unwrap(self.model), self.tokenizer, self.eval_texts[:n])
        write_text_atomic(self.out / "generations.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
        for r in rows:
            log.info("held-out prompt %r\n  reference: %r\n  generated: %r", r["prompt"][-120:], r["reference"][:120],
                     r["generated"][:120])

    # ---- one step ------------------------------------------------------------------------------------

    def micro_batches(self, ids: list[int]) -> list[list[int]]:
        """Physical batches of this process's share; under FSDP as many as the busiest process has."""
        size = self.t.physical_batch_size
        if self.uls:  # a user's records stay together: its mean gradient is clipped once
            parts = user_level.whole_user_batches(ids, self.batches.user_of, size) or [[]]
        else:
            parts = [ids[i: i + size] for i in range(0, len(ids), size)] or [[]]
        if is_sharded(unwrap(self.model)):  # FSDP's collectives need equal pass counts
            parts += [[]] * (int(all_max(len(parts), self.world)) - len(parts))
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
            items = [self.train_ds[j] for j in part]
            batch = {k: v.to(self.device) for k, v in (self.collate(items) if items else _EMPTY).items()}
            if self.dp:
                self.optimizer.signal_skip_step(do_skip=not last)
            if self.uls:  # the masked stand-in row of an empty share is a user of its own, with zero gradient
                self.private.set_users([self.record_user[j] for j in part] or [-1])
            sync = nullcontext() if last or self.dp else self.accelerator.no_sync(self.model)
            with sync:
                loss = forward_loss(self.model, batch, self.criterion, self.autocast)
                self.record_loss(loss, len(part))
                self.tokens_seen += int(batch["attention_mask"].sum())
                if self.dp:
                    loss.backward()
                    self.optimizer.step()
                    self.optimizer.zero_grad()
                else:
                    (loss * (len(part) * self.world.size / self.batches.batch_size)).backward()
        if not self.dp:
            self.optimizer.step()

    @property
    def autocast(self):
        return self.accelerator.autocast if self.mp != "no" else None

    def record_loss(self, loss, n: int) -> None:
        if n == 0:
            return
        value = float(loss.detach() if hasattr(loss, "detach") else loss)
        if not math.isfinite(value):
            raise TrainingError(f"loss is {value} at step {self.step + 1}; no checkpoint was written. Lower "
                                f"learning_rate (now {self.t.learning_rate}), check the data, or use mixed_precision=no")
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
            self.save_resumable()
        if self.bar is not None:
            self.bar.update(1)

    def log_train(self) -> None:
        loss_sum, n, tokens = all_sum([self.window[0], self.window[1], self.tokens_seen], self.world)
        self.window = [0.0, 0]
        row = {"step": self.step, "split": "train", "loss": loss_sum / max(n, 1),
               "lr": self.scheduler.get_last_lr()[0], "tokens_seen": int(tokens),
               "elapsed_s": round(time.time() - self.started, 2)}
        if self.world.is_main:
            if self.dp:
                row["epsilon"] = self.unit_privacy()[0]
            append_jsonl(self.metrics_path, row)
            if self.bar is not None:
                shown = {"loss": f"{row['loss']:.3f}", **({"eps": f"{row['epsilon']:.2f}"} if self.dp else {})}
                self.bar.set_postfix(shown, refresh=False)

    def evaluate(self, final: bool = False) -> dict:
        ev = evaluate(self.model, self.eval_ds, self.collate, batch_size=self.t.physical_batch_size,
                      device=self.device, world=self.world)
        if self.world.is_main:
            append_jsonl(self.metrics_path, {"step": self.step, "split": "eval", **ev})
            # held-out records are private and their loss un-noised: the operator's console and metrics.jsonl only
            msg = (f"[private] eval step {self.step}: held-out loss {ev['loss']:.4f} nats/token (perplexity "
                   f"{ev['ppl']:.4g}) on {len(self.eval_ds)} records, {ev['tokens']} tokens (also in {self.metrics_path})")
            (self.bar.write if self.bar is not None and not final else log.info)(msg)
        return ev

    # ---- privacy state, checkpoints, report -------------------------------------------------------------

    def unit_privacy(self) -> tuple[float, float]:
        """(ε, δ) so far for the privacy unit: a record, or a user (ULS directly; ELS by the mixture accounting)."""
        if self.els and self.group_size > 1:
            return user_level.mixture_epsilon(history=self.private.history(), delta=self.p.target_delta,
                                              group_size=self.group_size), self.p.target_delta
        return self.private.epsilon(), self.plan.delta

    def user_level_info(self) -> Optional[dict]:
        """The user-level part of the report and the ledger lines (None for record-level runs)."""
        if not (self.dp and self.user_unit):
            return None
        cap, k = self.user_cap, self.group_size
        info = {"unit": "user", "sampling": self.p.user_sampling, "num_users": len(self.user_records),
                "users_per_batch": self.users_per_batch if self.uls else None,
                "max_records_per_user": self.cfg.data.max_records_per_user, "group_size": k,
                "largest_user_records": cap["largest_user"], "users_trimmed": cap["users_trimmed"],
                "users_dropped": cap["users_dropped"], "records_dropped": cap["records_dropped"],
                "user_column": None if self.cfg.data.dataset in data.BUILTIN else self.cfg.data.user_column,
                "group_privacy": user_level.ULS_UNIT if self.uls else
                "k = 1: the user-level guarantee is the record-level one" if k == 1 else user_level.GROUP_PRIVACY}
        if self.p.user_sampling == "record":  # the guarantee is per record; the user level only by group privacy
            eps_u = (math.inf if k is None else
                     user_level.mixture_epsilon(history=self.private.history(), delta=self.p.target_delta, group_size=k))
            info.update(user_epsilon=eps_u if math.isfinite(eps_u) else None, user_delta=self.p.target_delta,
                        group_privacy=user_level.UNCAPPED if k is None else user_level.GROUP_PRIVACY + (
                            "" if math.isfinite(eps_u) else "; unbounded at this δ (user_epsilon = null)"))
        elif k > 1:  # ELS: the record-level ε at δ/k, for comparison only (the guarantee is the user-level one)
            info.update(record_epsilon=self.private.epsilon(), record_delta=self.plan.delta)
        return info

    def privacy_now(self) -> dict:
        """ε so far (earlier stages on the same records included) and the parameters behind it."""
        if not self.dp:
            return {}
        eps, delta = self.unit_privacy()
        out = {"epsilon": eps, "delta": delta, "noise_multiplier": self.plan.noise_multiplier,
               "sample_rate": self.plan.sample_rate, "accountant": self.plan.accountant,
               "history": [list(h) for h in self.private.history()]}
        info = self.user_level_info()
        if info is not None:
            out["user_level"] = info
        return out

    def save_resumable(self) -> None:
        self.last_saved, self.last_saved_at = self.step, time.time()
        tokens = int(all_sum([self.tokens_seen], self.world)[0])
        privacy = self.privacy_now() if self.world.is_main else {}
        state = {"step": self.step, "tokens_seen": tokens, "plan": self.plan.to_json() if self.plan else None,
                 "epsilon": privacy.get("epsilon"),
                 "metrics_bytes": self.metrics_path.stat().st_size if self.metrics_path.exists() else 0,
                 "accountant": self.private.engine.accountant.state_dict() if self.dp else None}
        resume.save(self.out, step=self.step, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                    world=self.world, config_yaml=self.cfg.to_yaml(), generators=self.generators,
                    trainer_state=state, privacy=privacy)

    def check_history_is_plan(self) -> None:
        """The accountant must hold exactly the planned (σ, q) for exactly the steps taken."""
        if not self.dp:
            return
        got = [(float(s), float(q), int(n)) for s, q, n in self.private.history()]
        want = list(self.lineage.history) + self.plan.stage_history(self.step)
        merged: list = []
        for h in got:  # Opacus records one entry per (σ, q) run of steps
            if merged and merged[-1][:2] == h[:2] and len(merged) > len(self.lineage.history):
                merged[-1] = (h[0], h[1], merged[-1][2] + h[2])
            else:
                merged.append(h)
        if merged != [(float(s), float(q), int(n)) for s, q, n in want] or self.step != self.steps:
            raise TrainingError(f"the accountant recorded {merged}, the plan says {want} over {self.steps} steps; "
                                "this is a dpllm bug (no checkpoint was written)")

    def report(self) -> PrivacyReport:
        """The privacy report: ε with everything needed to recompute it."""
        p, t = self.p, self.t
        stage = {"name": self.out.name, "run_dir": str(self.out.resolve()), "enabled": self.dp,
                 "dataset": self.cfg.data.dataset, "train_on": self.cfg.data.train_on,
                 "public_data": data.split_rule(self.cfg.data)["public"],  # which records were declared public, how
                 "num_records": len(self.train_ds), "steps": self.step,
                 "records_sha256": set_digest(self.trained_hashes),
                 "history": [list(h) for h in self.private.history()[len(self.lineage.history):]] if self.dp else []}
        common = dict(enabled=self.dp, num_records=len(self.train_ds), steps=self.step,
                      logical_batch_size=t.logical_batch_size, physical_batch_size=t.physical_batch_size,
                      model_adjustments=self.adjustments, base_model=self.source, versions=library_versions(),
                      stages=self.lineage.stages + [stage])
        if not self.dp:
            return PrivacyReport(**common)
        history = self.private.history()
        eps, delta = self.unit_privacy()
        return PrivacyReport(
            **common, epsilon=eps, delta=delta, accountant=self.plan.accountant,
            privacy_unit="user" if self.user_unit and self.p.user_sampling != "record" else "record",
            user_level=self.user_level_info(),
            target_epsilon=p.target_epsilon, noise_multiplier=self.plan.noise_multiplier,
            sample_rate=self.plan.sample_rate, expected_batch_size=self.plan.expected_batch_size,
            max_grad_norm=p.max_grad_norm, clipping=p.clipping, sensitivity=clipping.get(p.clipping).sensitivity(p),
            grad_sample_mode=self.private.grad_sample_mode,
            grad_sample_mode_reason=self.private.grad_sample_mode_reason or None,
            poisson_sampling=True, secure_mode=p.secure_mode,
            noise_secret=not p.reproducible_noise, history=[list(h) for h in history],
            noise_schedule=({**self.plan.schedule, "pieces_sigma_steps": [[s, n] for s, _, n in self.plan.stage_history()]}
                            if self.plan.schedule else None),
            composition=("; ".join(self.lineage.notes) if self.lineage.notes else "single stage"),
            warnings=list(self.plan.warnings))

    def summary(self, report: PrivacyReport, final: dict, tokens: int, digest: Optional[str]) -> dict:
        t = self.t
        return {
            "run_dir": str(self.out), "model": self.cfg.model.model_name_or_path,
            "finetuning": self.cfg.model.finetuning, "params_total": self.n_params[0],
            "params_trainable": self.n_params[1], "tokens_seen": tokens, "steps": self.step,
            "logical_batch_size": t.logical_batch_size, "epsilon": report.epsilon, "delta": report.delta,
            "noise_multiplier": report.noise_multiplier, "sample_rate": report.sample_rate,
            "privacy_enabled": self.dp, "noise_secret": report.noise_secret,
            "initial_eval_loss": self.initial_eval["loss"] if self.initial_eval else None,
            "final_eval_loss": final["loss"], "final_eval_ppl": final["ppl"], "seed": t.seed,
            "wall_time_s": round(self.wall, 2), "world_size": self.world.size, "params_sha256": digest,
            "resumed_from_step": self.start_step or None,
        }


_EMPTY = {k: torch.zeros((0, 1), dtype=torch.long) for k in ("input_ids", "attention_mask", "labels")}


def _copy(model):
    import copy

    return copy.deepcopy(model)


def train(cfg: RunConfig) -> dict:
    """Run one training stage as configured; return the run summary (also in ``run_summary.json``).

    Runs on one process or many (``accelerate launch``, see :mod:`dpllm.distributed`); only rank 0
    writes the run directory and the summary is returned on rank 0 only ({} elsewhere).
    """
    return Trainer(cfg).run()
