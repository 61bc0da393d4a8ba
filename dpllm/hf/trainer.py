"""``DPTrainer``: a ``transformers.Trainer`` whose ``train()`` is a dpllm run.

``train()`` checks the arguments (:func:`dpllm.hf.arguments.refuse_unsafe`), turns them into a dpllm
:class:`~dpllm.config.RunConfig`, and runs dpllm's own loop (:class:`dpllm.train.Trainer`) on the model and
datasets the Trainer was given: the privacy plan (q, steps, σ), Poisson logical batches split into physical
batches of ``per_device_train_batch_size``, Opacus's clipping and noise, the accountant, and at the end a
dpllm run directory in ``output_dir`` (config.yaml, splits.json, records.jsonl, metrics.jsonl, checkpoint/,
privacy_report.json, privacy_ledger.jsonl) that ``dpllm report``, ``dpllm export`` and
``python -m mia audit`` read. The Trainer's optimizer (``optim``, ``learning_rate``, ``weight_decay``...),
scheduler and callbacks are used; callbacks see ``epsilon`` in every ``on_log`` (the training loss only with
``PrivacyArguments.log_train_loss``), and ``on_evaluate`` with empty metrics: the held-out loss (un-noised, on
private records) and the held-out count stay in the run directory's ``metrics.jsonl`` and on the operator's
console, labelled ``[private]``.
``save_steps`` (with the default ``save_strategy="steps"``) writes dpllm's resumable checkpoints
(:mod:`dpllm.resume`) under ``OUTPUT_DIR/checkpoints/``, and ``trainer.train(resume_from_checkpoint=True)``
continues from the newest one with the same batches, noise and accountant as an uninterrupted run.

After training ``trainer.model`` is the plain model again (Opacus's hooks removed), so
``trainer.model.generate(...)`` works as on any transformers model.

The privacy unit is the recipe's, chosen in :class:`~dpllm.hf.arguments.PrivacyArguments`: one row (``record``,
the default), a declared packed block (``sequence``), a user (``user``: rows grouped by ``user_column``; ``setup_data``
hands them to the recipe's contribution bound, :meth:`dpllm.privacy.run.RunPrivacy.bound_contributions`, and the
engine samples and clips users as in a recipe run), or, with ``long_records="split"``, one record over the windows
``setup_model`` cuts from its row (:class:`dpllm.windows.WindowedRecords`). Nothing here samples, clips or accounts.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from pathlib import Path
from typing import Optional

from transformers import Trainer
from transformers.trainer_utils import TrainOutput

from dpllm import data, resume, rundir, truncation
from dpllm.config import TRAINER_OPTIONS, ConfigError, RunConfig
from dpllm.distributed import barrier, check_parallelism, warn_if_fewer_processes, world_of, wrap_model
from dpllm.hf.arguments import PrivacyArguments, refuse_unsafe, run_config, trainer_names
from dpllm.hf.records import PadRecords, Rows, rows_of, trainer_rows
from dpllm.io import looks_local
from dpllm.models import (
    check_checkpointing,
    check_dp_layers,
    count_parameters,
    one_cpu_path,
    quantization_of,
    untie_output_embeddings,
)
from dpllm.privacy.positions import check_rope_per_record
from dpllm.run_data import RunData
from dpllm.sft import SFTArguments, is_untokenized_sft
from dpllm.train import Trainer as RunTrainer
from dpllm.train import seed_everything
from dpllm.windows import WindowedRecords

log = logging.getLogger(__name__)

RECORDS = "records.jsonl"


class DPTrainer(Trainer):
    """``transformers.Trainer`` with DP-SGD: pass ``privacy_args=PrivacyArguments(...)`` beside ``args``.

    Example:
        >>> trainer = DPTrainer(model=model, args=TrainingArguments("runs/x", max_steps=50),
        ...                     privacy_args=PrivacyArguments(target_epsilon=8, logical_batch_size=64),
        ...                     train_dataset=train, eval_dataset=heldout, processing_class=tokenizer)  # doctest: +SKIP
        >>> trainer.train().metrics["epsilon"]  # doctest: +SKIP

    Raises:
        ConfigError (a ValueError): at construction, a Trainer option that would break DP or that DPTrainer
            cannot honour, naming the option and the fix; at ``train()``, anything dpllm refuses before a run
            (an unreachable ε, δ ≥ 1/N, an output_dir that is not a dpllm run...), before anything is written.
    """

    def __init__(self, model=None, args=None, data_collator=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, *, privacy_args: Optional[PrivacyArguments] = None,
                 sft_args: Optional[SFTArguments] = None, **kwargs):
        if args is None:
            raise ConfigError("DPTrainer: pass args=TrainingArguments(output_dir=..., ...)")
        self.privacy_args = privacy_args if privacy_args is not None else PrivacyArguments()
        self.sft_args = sft_args if sft_args is not None else SFTArguments()  # untokenized chat data (dpllm.sft)
        refuse_unsafe(args, self.privacy_args, data_collator=data_collator,
                      compute_loss_func=kwargs.get("compute_loss_func"), train_dataset=train_dataset)
        if kwargs.get("model_init") is not None:
            raise ConfigError("DPTrainer: model_init is not supported; pass the model")
        if processing_class is None or not hasattr(processing_class, "save_pretrained"):
            raise ConfigError("DPTrainer: pass processing_class=tokenizer; it is saved beside the trained model")
        if isinstance(eval_dataset, dict):
            raise ConfigError("DPTrainer: pass one eval_dataset (the held-out records), not a dict of them")
        quantized = quantization_of(model) if model is not None else "none"
        if quantized != "none" and not hasattr(model, "peft_config"):
            raise ConfigError(f"DPTrainer: the model's base is quantized ({quantized}) and cannot be fine-tuned in "
                              "full; attach LoRA adapters first (peft.prepare_model_for_kbit_training, then "
                              "get_peft_model: QLoRA)")
        super().__init__(model=model, args=args, data_collator=data_collator, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class, **kwargs)
        self.dp_run: Optional[HFRun] = None

    def compute_loss(self, *a, **kw):
        """The Trainer's loss, for ``evaluate()`` / ``predict()``; training never calls it (see ``train``)."""
        return super().compute_loss(*a, **kw)

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs) -> TrainOutput:
        """Run DP training as a dpllm run in ``args.output_dir``; returns the Trainer's ``TrainOutput``.

        ``metrics`` holds ``epsilon``, ``delta``, ``noise_multiplier`` and ``sample_rate``; the held-out loss is
        in the private ``run_summary.json`` and ``metrics.jsonl`` only. ``trainer.privacy_report`` is the
        :class:`~dpllm.privacy.report.PrivacyReport`.

        Args:
            resume_from_checkpoint: True continues from ``OUTPUT_DIR/checkpoints/latest`` (a new run if
                ``output_dir`` holds no run yet); a path names one resumable checkpoint of this run. The
                arguments, model and datasets must be those of the interrupted run.
        """
        if trial is not None:
            raise ConfigError("DPTrainer.train: trial (hyperparameter search) is not supported; start a new run")
        if self.dp_run is not None:
            raise ConfigError("DPTrainer.train was already called; a further stage is a new DPTrainer over the "
                              "trained model (its ε composes through the run directory)")
        if type(self).compute_loss is not DPTrainer.compute_loss:
            raise ConfigError(f"{type(self).__name__} overrides compute_loss; DP training uses dpllm's per-record "
                              "loss through Opacus's criterion (labels of -100 mask tokens out)")
        self.dp_run = run = HFRun.from_trainer(self)
        if resume_from_checkpoint:  # True: the run's latest resumable checkpoint (save_steps writes them)
            run.cfg.train.resume_from = "latest" if resume_from_checkpoint is True else str(resume_from_checkpoint)
        self.is_in_train = True
        try:
            summary = run.run()
        finally:
            self.is_in_train = False
            self.model = self.model_wrapped = release(run.model) if run.model is not None else self.model
        from dpllm.privacy.report import PrivacyReport

        if run.already_finished:  # nothing trained: no callbacks; the model is the finished run's final one
            return self._finished(run, summary)

        # the held-out loss is un-noised and computed on private records: it stays in the run directory
        # (metrics.jsonl, run_summary.json), not in what scripts log or push
        # and so is the training loss unless the user opts in (PrivacyArguments.log_train_loss)
        train_loss = run.train_loss if self.privacy_args.log_train_loss else None
        metrics = {"train_runtime": summary.get("wall_time_s")}
        if train_loss is not None:
            metrics["train_loss"] = train_loss
        if summary:
            self.privacy_report = PrivacyReport.read(run.out)
            metrics.update(epsilon=summary["epsilon"], delta=summary["delta"],
                           noise_multiplier=summary["noise_multiplier"], sample_rate=summary["sample_rate"])
        self.control = self.callback_handler.on_train_end(self.args, self.state, self.control)
        return TrainOutput(run.step, train_loss, metrics)

    def _finished(self, run: "HFRun", summary: dict) -> TrainOutput:
        """``train(resume_from_checkpoint=...)`` on a run that had finished: nothing runs, no callback fires (none
        saw a start); ``trainer.model`` becomes the run's final model, loaded from its ``checkpoint/``, so the rest
        of a re-run script (generate, save, push) works on what was trained."""
        from dpllm.checkpoint import load_model
        from dpllm.privacy.report import PrivacyReport

        device = next(self.model.parameters()).device
        self.model = self.model_wrapped = load_model(run.out)[0].to(device)
        self.privacy_report = PrivacyReport.read(run.out)
        steps = int(summary.get("steps") or 0) if summary else self.privacy_report.steps
        metrics = {"train_runtime": 0.0, "epsilon": self.privacy_report.epsilon, "delta": self.privacy_report.delta,
                   "noise_multiplier": self.privacy_report.noise_multiplier,
                   "sample_rate": self.privacy_report.sample_rate}
        return TrainOutput(steps, None, metrics)


def release(model):
    """The bare model: Opacus's hooks and per-sample attributes removed, dpllm's gradient-path guard taken off,
    DDP/Opacus wrappers stripped."""
    from dpllm.privacy.paths import remove_guard

    m = model
    while True:
        remove_guard(m)
        if hasattr(m, "detach") and hasattr(m, "clip_weights"):  # dpllm.privacy.bk.BookKeepingModule
            m.detach()
        elif hasattr(m, "cleanup") and hasattr(m, "_module"):  # Opacus GradSampleModule (hooks, ghost)
            m.cleanup()
        inner = getattr(m, "_module", None) or getattr(m, "module", None)
        if inner is None:
            return m
        m = inner


class HFRun(RunTrainer):
    """dpllm's run stages over a model and datasets handed over by a Trainer, reporting to its callbacks."""

    def __init__(self, cfg: RunConfig, hf: DPTrainer, *, train_rows: Rows, eval_rows: Rows):
        super().__init__(cfg)
        self.hf, self.train_rows, self.eval_rows = hf, train_rows, eval_rows
        self.hf_model = hf.model
        self.model = None
        self.train_loss = 0.0
        self._loss_sum = [0.0, 0]

    @classmethod
    def from_trainer(cls, hf: DPTrainer) -> "HFRun":
        p, args = hf.privacy_args, hf.args
        train_rows, eval_rows = _rows(hf, "train_dataset"), _rows(hf, "eval_dataset")
        finetuning = "lora" if hasattr(hf.model, "peft_config") else "full"
        cfg = run_config(args, p, model_name=_model_name(hf.model), finetuning=finetuning,
                         records_path=str((Path(args.output_dir) / RECORDS).resolve()),
                         max_length=max(train_rows.max_length, eval_rows.max_length), num_records=len(train_rows),
                         has_eval=len(eval_rows) > 0, quantization=quantization_of(hf.model))
        if is_untokenized_sft(hf.train_dataset):  # recorded in config.yaml: how the records were rendered
            s = hf.sft_args
            cfg.data.loss_on, cfg.data.chat_template = s.loss_on, s.chat_template
            cfg.data.num_generations = s.num_generations
        return cls(cfg, hf, train_rows=train_rows, eval_rows=eval_rows)

    # ---- stages that differ from a config-driven run ---------------------------------------------------

    def setup_process(self) -> None:
        seed_everything(self.t.seed)
        self.mp = self.t.mixed_precision
        self.accelerator = self.hf.accelerator  # the Trainer's: one accelerate state per process
        self.world = world_of(self.accelerator)
        self.device = self.accelerator.device
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        warn_if_fewer_processes()
        if launched != self.world.size:
            raise ConfigError(f"launched as {launched} processes but the Trainer's accelerator joined "
                              f"{self.world.size}; on a machine without GPUs pass use_cpu=True (--use_cpu true) so "
                              "accelerate forms a gloo process group")
        check_parallelism(self.p, self.world.kind, world_size=self.world.size,
                          logical_batch_size=self.t.logical_batch_size)
        self.resume_from = resume.resolve(self.cfg, names=TRAINER_OPTIONS)
        if self.resume_from is not None:
            resume.check_config(self.resume_from, self.cfg)
        elif self.world.is_main:  # the data and model live in memory: no path in output_dir to protect
            rundir.check_output_dir(self.out, overwrite=self.t.overwrite_output_dir, names=TRAINER_OPTIONS)

    def setup_data(self) -> None:
        if self.cfg.data.privacy_unit == "user":
            return self._setup_users()
        train, heldout = self.train_rows.texts, self.eval_rows.texts
        records = list(dict.fromkeys(train + heldout))  # unique, in order: ids index records.jsonl
        index = {t: i for i, t in enumerate(records)}
        members = set(train)
        splits = data.Splits(public=[], train=sorted({index[t] for t in train}),
                             heldout=sorted({index[t] for t in heldout if t not in members}),
                             rule={"rule": "given: train_dataset and eval_dataset, as passed to DPTrainer"})
        self.data = RunData(records=records, splits=splits, train_texts=list(train),  # one per row: N counts rows
                            eval_texts=list(heldout), trained_hashes={data.sha256(t) for t in train},
                            heldout_hashes={data.sha256(records[i]) for i in splits.heldout},
                            sft_format=self.train_rows.fmt)  # the dataset's columns, not a vote of its rows
        if self.cfg.data.privacy_unit == "sequence":  # a public declaration: the console says what it means
            log.info("privacy unit: one sequence of %d tokens (declared: PrivacyArguments(privacy_unit='sequence')); "
                     "ε protects one sequence, and a record cut across two of them is protected as a group of 2 "
                     "(its ε is in the privacy report)", self.cfg.data.max_length)
        masked = any(bool((x["labels"] == -100).any()) for x in self.train_rows.items)
        log.info("[private] data format: %s", f"{self.data.sft_format} records, loss on {self.cfg.data.loss_on} tokens"
                 if self.data.sft_format else "token rows, loss on " + ("the tokens their labels keep (-100 elsewhere)"
                                                                        if masked else "all tokens"))

    def _setup_users(self) -> None:
        """privacy_unit='user': records are the rows' distinct (user, text) pairs; the recipe's contribution bound
        (:meth:`dpllm.privacy.run.RunPrivacy.bound_contributions`: at most k records per user, a secret choice)
        decides the training rows. Held-out rows must be of other users (the user-level audit's non-members)."""
        train, heldout = _distinct(self.train_rows), _distinct(self.eval_rows)
        shared = {self.train_rows.users[i] for i in train} & {self.eval_rows.users[i] for i in heldout}
        if shared:
            raise ConfigError(f"DPTrainer: privacy_unit='user': {len(shared)} user(s) of eval_dataset also have rows "
                              f"in train_dataset (e.g. {sorted(shared)[0]!r}); held-out rows must be of other users "
                              "(split the users, not the rows, between the two datasets)")
        records = [self.train_rows.texts[i] for i in train] + [self.eval_rows.texts[i] for i in heldout]
        users = [self.train_rows.users[i] for i in train] + [self.eval_rows.users[i] for i in heldout]
        n = len(train)
        splits = data.Splits(public=[], train=list(range(n)), heldout=list(range(n, len(records))),
                             users={"train": sorted(set(users[:n])), "heldout": sorted(set(users[n:])), "public": []},
                             rule={"rule": "given: train_dataset and eval_dataset, as passed to DPTrainer (users "
                                           "split between them)"})
        try:
            kept = self.privacy.bound_contributions(list(range(n)), users=users, texts=records, splits=splits,
                                                    canaries=[], resumed=self.resume_from is not None,
                                                    stage=resume.config_key(self.cfg), world=self.world,
                                                    user_column=self.cfg.data.user_column)
        except ConfigError as err:  # the recipe's words, DPTrainer's option names
            raise ConfigError(f"DPTrainer: {trainer_names(str(err))}") from None
        self.train_rows = self.train_rows.select([train[i] for i in kept])  # dataset position = index in kept
        train_texts = [records[i] for i in kept]
        self.data = RunData(records=records, splits=splits, train_texts=train_texts,
                            eval_texts=[records[i] for i in splits.heldout],
                            trained_hashes={data.sha256(t) for t in train_texts},
                            heldout_hashes={data.sha256(records[i]) for i in splits.heldout}, users=users)
        log.info("privacy unit: one user (PrivacyArguments(privacy_unit='user', user_sampling=%r)): %d training users",
                 self.p.user_sampling, len(self.privacy.user_records))

    def setup_plan(self) -> None:
        super().setup_plan()
        if not self.cfg.model.model_name_or_path or self.source.get("path") == IN_MEMORY:
            self.source = {"kind": "in_memory", "name": type(self.hf_model).__name__,
                           **({"quantization": self.cfg.model.quantization}
                              if self.cfg.model.quantization != "none" else {})}

    def setup_model(self) -> None:
        model, self.tokenizer = self.hf_model, self.hf.processing_class
        self.adjustments = []
        if quantization_of(model) != "none":  # a user's own from_pretrained: one computation on the CPU too
            one_cpu_path(model)
        peft = hasattr(model, "peft_config")
        self.lora_base = _base_copy(model) if peft and not _base_has_name(model) else None
        if not peft:  # bk clips a head tied to the input embedding as it is; the other engines need it untied
            from dpllm.privacy.modes import resolve_mode

            keep = self.world.kind != "fsdp" and resolve_mode(self.p.grad_sample_mode, model) == "bk"
            self.adjustments += untie_output_embeddings(model, weight=not keep)
        self.adjustments.append("position_ids passed per row and contiguous (Opacus embedding norm sampler)")
        if self.t.gradient_checkpointing:
            from dpllm.privacy.modes import resolve_mode

            if resolve_mode(self.p.grad_sample_mode, model) != "bk":
                raise ConfigError("gradient_checkpointing=True under DP needs PrivacyArguments grad_sample_mode=bk "
                                  f"(not {self.p.grad_sample_mode}): recomputed activations corrupt Opacus's "
                                  "per-sample norms; switch the mode or turn checkpointing off")
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        from dpllm.privacy.modes import resolve_mode

        # read from the model: the user (or peft's prepare_model_for_kbit_training) may have turned it on
        check_checkpointing(model, resolve_mode(self.p.grad_sample_mode, model))
        model.to(self.device).train()
        check_dp_layers(model)
        # a rotary switch that one long record flips for its whole batch (dpllm.privacy.positions)
        check_rope_per_record(model, max_length=self.cfg.data.max_length)
        self.n_params = count_parameters(model)
        self.model = wrap_model(model, dp=True, world=self.world, accelerator=self.accelerator,
                                mixed_precision=self.mp)
        # correlated noise's state (b−1 or d tensors of the trainable parameters): refused now if it cannot fit
        self.privacy.check_noise_memory(self.model, world=self.world, device=self.device)
        self.train_ds, self.eval_ds = self.train_rows, self.eval_rows
        d = self.cfg.data
        if d.long_records == "split":  # each row a window; its source record is the unit (dpllm.windows)
            rows = self.train_rows.items
            self.train_ds = WindowedRecords.of_rows([x["input_ids"] for x in rows], [x["labels"] for x in rows],
                                                    max_length=d.max_length, max_windows=d.max_windows,
                                                    stride=d.window_stride)
            self.privacy.set_windows(self.train_ds.record_of)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        self.collate = PadRecords(pad if pad is not None else 0)
        self.optimizer = self.hf.create_optimizer(model)
        self.scheduler = self.hf.create_scheduler(num_training_steps=self.steps, optimizer=self.optimizer)

    def log_truncation(self) -> None:
        """As dpllm's, with DPTrainer's names for the options a split run's line suggests."""
        s = self.truncation
        if s and s.get("long_records") == "split" and self.world.is_main:
            (log.warning if s.get("truncated_records") else log.info)("[private] data: %s",
                                                                      trainer_names(truncation.describe(s)))
        else:
            super().log_truncation()

    def setup_run_dir(self) -> None:
        """As dpllm's, plus records.jsonl: the texts splits.json indexes (members and held-out)."""
        if self.world.is_main and self.resume_from is not None:
            self.lock = rundir.RunLock(self.out).acquire()
            if (self.out / RECORDS).read_text() != self._records_jsonl():
                raise ConfigError(f"cannot resume {self.out}: train_dataset / eval_dataset differ from the run's "
                                  f"{RECORDS}; resume with the same data, or start a new run")
            resume.clean_partial_writes(self.out)
        elif self.world.is_main:  # the data live in memory (records.jsonl is written here): no path to protect
            self.lock = rundir.RunLock(self.out).acquire()
            rundir.describe(self.out, self.cfg, self.data, user_unit=self.privacy.user_unit, names=TRAINER_OPTIONS,
                            protected=[], files={RECORDS: self._records_jsonl()})
        barrier(self.world)

    def _records_jsonl(self) -> str:
        """records.jsonl: the texts splits.json indexes, with each one's user at privacy_unit='user' (so the
        user-level audit reads the run's users as it reads a recipe run's data file)."""
        users = self.data.users
        return _records_jsonl(self.data.records, users, self.cfg.data.user_column)

    # ---- the Trainer's callbacks ----------------------------------------------------------------------

    def start(self) -> None:
        hf = self.hf
        hf.state.max_steps, hf.state.global_step = self.steps, 0
        hf.state.num_train_epochs = self.steps * self.plan.sample_rate
        hf.state.logging_steps, hf.state.eval_steps = self.t.log_every, self.t.eval_every
        hf.state.train_batch_size = self.t.physical_batch_size
        handler = hf.callback_handler
        handler.model, handler.optimizer, handler.lr_scheduler = self.model, self.optimizer, self.scheduler
        hf.optimizer, hf.lr_scheduler = self.optimizer, self.scheduler
        hf.control = handler.on_train_begin(hf.args, hf.state, hf.control)
        super().start()
        hf.state.global_step = self.step  # a resumed run starts where its checkpoint left off

    def optimizer_step(self, ids: list[int]) -> None:
        hf = self.hf
        hf.control = hf.callback_handler.on_step_begin(hf.args, hf.state, hf.control)
        super().optimizer_step(ids)

    def record_loss(self, loss, n: int) -> None:
        super().record_loss(loss, n)
        if n:
            self._loss_sum[0] += float(loss.detach()) * n
            self._loss_sum[1] += n
            self.train_loss = self._loss_sum[0] / self._loss_sum[1]

    def after_step(self) -> None:
        hf = self.hf
        hf.state.global_step = self.step + 1
        hf.state.epoch = (self.step + 1) * self.plan.sample_rate  # expected passes over the data
        super().after_step()
        hf.control = hf.callback_handler.on_step_end(hf.args, hf.state, hf.control)

    def log_train(self) -> None:
        super().log_train()
        if self.world.is_main:
            row = _last_line(self.metrics_path)
            shown = {"learning_rate": row["lr"], "epsilon": row["epsilon"]}
            if self.hf.privacy_args.log_train_loss:  # opt-in: an un-noised statistic of the sampled records
                shown["loss"] = row["loss"]
            self.hf.log(shown)

    def evaluate(self, final: bool = False) -> dict:
        ev = super().evaluate(final) if len(self.eval_ds) else {"loss": None, "ppl": None, "tokens": 0}
        hf = self.hf
        # Callbacks (report_to integrations, printers) carry what they see out of the run directory: they learn
        # that an evaluation happened at this step (a public setting), nothing computed from the private held-out
        # records, neither their un-noised loss nor how many there are (both stay in metrics.jsonl and the console).
        hf.control = hf.callback_handler.on_evaluate(hf.args, hf.state, hf.control, metrics={})
        return ev


IN_MEMORY = "(in-memory model)"


def _records_jsonl(texts, users=None, user_column: str = "user") -> str:
    if users is None:
        return "".join(json.dumps({"text": t}) + "\n" for t in texts)
    return "".join(json.dumps({"text": t, user_column: u}) + "\n" for t, u in zip(texts, users))


def _distinct(rows: Rows) -> list[int]:
    """Positions of the first row of each distinct (user, text): one user's repeated text is one record (the cap
    counts distinct records, as the recipe's user-level deduplication does)."""
    first: dict = {}
    for i, key in enumerate(zip(rows.users or [], rows.texts)):
        first.setdefault(key, i)
    if len(first) < len(rows):
        log.info("privacy_unit='user': %d row(s) repeat a text of the same user and are dropped (one record)",
                 len(rows) - len(first))
    return sorted(first.values())


def _rows(hf: DPTrainer, name: str) -> Rows:
    """A dataset's rows: tokenized by the user, or chat / instruction records rendered by dpllm.sft (held-out
    labels always on the answer only: the held-out metric is the answer's loss)."""
    dataset, p = getattr(hf, name), hf.privacy_args
    if dataset is None:
        return Rows([], [])
    if is_untokenized_sft(dataset):
        if p.privacy_unit == "sequence":
            raise ConfigError(f"DPTrainer: privacy_unit='sequence' declares each row a packed block of tokens, but "
                              f"{name} holds untokenized chat / instruction records (one conversation per row); use "
                              "privacy_unit='record'")
        if p.privacy_unit == "user" or p.long_records == "split":
            raise ConfigError(f"DPTrainer: {name} holds untokenized chat / instruction records; privacy_unit='user' "
                              "and long_records='split' with them are not yet supported by DPTrainer: use "
                              "recipes/finetune_llm.py (privacy_unit: user), or privacy_unit='record' with "
                              "long_records='truncate'")
        loss_on = hf.sft_args.loss_on if name == "train_dataset" else "answer"
        return trainer_rows(dataset, hf.processing_class, hf.sft_args, name=name, loss_on=loss_on)
    split = p.long_records == "split"
    rows = rows_of(dataset, hf.processing_class, text_column=p.record_text_column, name=name, unit=p.privacy_unit,
                   user_column=p.user_column if p.privacy_unit == "user" else None,
                   whole=split and name == "train_dataset")
    if split and name == "eval_dataset":  # held-out loss on each record's first window, as the recipe's
        for x in rows.items:
            x["input_ids"], x["labels"] = x["input_ids"][: p.window_length], x["labels"][: p.window_length]
    return rows


def _model_name(model) -> str:
    name = getattr(model, "name_or_path", "") or ""
    return name if name else IN_MEMORY


def _base_has_name(model) -> bool:
    """A PEFT model whose base can be loaded again by name (Hub id or existing directory)."""
    for cfg in getattr(model, "peft_config", {}).values():
        name = getattr(cfg, "base_model_name_or_path", None)
        if name and (Path(name).is_dir() or not looks_local(name)):
            return True
    return False


def _base_copy(model):
    """The base under a PEFT model, without adapters (saved as checkpoint/base_model/ for audits and export)."""
    return copy.deepcopy(model).unload()


def _last_line(path: Path) -> dict:
    with open(path, "rb") as fh:
        fh.seek(0, 2)
        fh.seek(max(0, fh.tell() - 65536))
        return json.loads(fh.read().rstrip(b"\n").rsplit(b"\n", 1)[-1])
