"""``PrivacyArguments`` and the checks that keep a ``transformers.Trainer`` configuration private.

:class:`PrivacyArguments` sits beside the usual ``TrainingArguments`` (one ``HfArgumentParser`` parses
both; no option name is shared). :func:`refuse_unsafe` rejects every Trainer option that would break the
DP guarantee or that dpllm's loop would silently ignore, naming the option and the fix.
:func:`run_config` turns both into the :class:`dpllm.config.RunConfig` the run directory records.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from dpllm.config import ConfigError, DataConfig, ModelConfig, PrivacyConfig, RunConfig, TrainConfig, validate
from dpllm.privacy.plan import batches_per_epoch

log = logging.getLogger(__name__)


def _f(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass
class PrivacyArguments:
    """What DP-SGD needs beyond ``TrainingArguments``. Physical batch = ``per_device_train_batch_size``."""

    target_epsilon: Optional[float] = _f(8.0, "Calibrate the noise multiplier to reach this ε.")
    target_delta: float = _f(1e-5, "δ; must be < 1/N for N training records.")
    noise_multiplier: Optional[float] = _f(None, "Use this noise multiplier instead of calibrating.")
    per_sample_max_grad_norm: float = _f(1.0, "Per-record clipping norm C (TrainingArguments.max_grad_norm, which "
                                              "would clip the whole batch's noised gradient, is ignored).")
    accountant: str = _f("prv", "'prv', 'rdp' or 'gdp' (Opacus accountants): calibrates and reports ε.")
    clipping: str = _f("flat", "Per-sample clipping function (dpllm.privacy.clipping registry), or 'quantile': C "
                               "adapts to a quantile of the per-record norms, starting at per_sample_max_grad_norm "
                               "(dpllm.privacy.quantile).")
    clipping_r: float = _f(0.1, "r of the psac/psasc clipping functions.")
    clipping_s: float = _f(1.0, "s of psasc (sensitivity C/s).")
    target_quantile: float = _f(0.5, "clipping='quantile': the quantile γ of the per-record gradient norms C tracks.")
    quantile_lr: float = _f(0.2, "clipping='quantile': the learning rate η of C ← C·exp(−η(b̃ − γ)) (0 keeps C fixed).")
    count_noise_multiplier: Optional[float] = _f(None, "clipping='quantile': the noise σ_b of the count of records "
                                                       "under C (None: expected batch / 20); the gradient's noise "
                                                       "rises so that both together spend the planned σ.")
    grad_sample_mode: str = _f("auto", "'auto' (bk where it applies, else Opacus hooks or ghost), 'bk', 'hooks' or "
                                       "'ghost' (see dpllm's PrivacyConfig).")
    privacy_unit: str = _f("record", "The protected unit: 'record' (one row of train_dataset is one record; packed "
                                     "rows are refused), 'user' (all records of one person: rows grouped by the "
                                     "user_column; user_sampling says how) or 'sequence' (a declaration: each row is a "
                                     "packed block of tokens, as run_clm's group_texts makes them, and ε protects one "
                                     "block; a record cut across two blocks gets the ε of a group of 2, reported "
                                     "beside it).")
    user_column: str = _f("user", "privacy_unit='user': the column naming each row's user (train_dataset, and "
                                  "eval_dataset if given: held-out rows must be of other users).")
    user_sampling: str = _f("uls", "privacy_unit='user': 'uls' (Poisson-sample users; each sampled user adds one "
                                   "clipped gradient, the mean over its records; bk or hooks), 'els' (sample records "
                                   "of the max_records_per_user-capped data; σ calibrated so the user-level ε by "
                                   "tight group privacy meets target_epsilon) or 'record' (record-level DP; the report "
                                   "adds the user-level ε group privacy gives). As the recipe's privacy.user_sampling.")
    max_records_per_user: Optional[int] = _f(None, "privacy_unit='user': k, keep at most this many records of each "
                                                   "user (chosen with secret randomness); required by "
                                                   "user_sampling='els'.")
    long_records: str = _f("truncate", "A record longer than window_length: 'truncate' (rows are trained as "
                                       "tokenized) or 'split' (rows hold whole records, tokenized without truncation; "
                                       "each is cut into consecutive windows of window_length tokens, all trained, "
                                       "and stays one privacy unit: its windows are sampled together and their "
                                       "summed gradient is clipped once; the ε is the record level's).")
    window_length: Optional[int] = _f(None, "long_records='split': tokens per window (the recipe's data.max_length); "
                                            "required with split. Held-out rows are evaluated on their first "
                                            "window_length tokens.")
    max_windows: int = _f(8, "long_records='split': train on at most this many windows of a record, its first ones "
                             "(≤ per_device_train_batch_size: a record's windows go through one backward pass).")
    window_stride: int = _f(0, "long_records='split': tokens each window after a record's first repeats from the "
                               "window before (the overlap Hugging Face tokenizers call stride), as context only "
                               "(labels -100): every token's loss counts once. < window_length.")
    logical_batch_size: int = _f(64, "Expected records per optimizer step over all processes (Poisson "
                                     "sampling); replaces gradient accumulation.")
    record_text_column: str = _f("text", "Column with each record's text, kept in the run directory for audits "
                                  "(without it, input_ids are decoded with the tokenizer).")
    overwrite_output_dir: bool = _f(False, "Replace output_dir if it is an earlier dpllm run directory.")
    secure_mode: bool = _f(False, "Noise from Opacus's cryptographically secure generator (torchcsprng).")
    reproducible_noise: bool = _f(False, "Derive noise and sampling from TrainingArguments.seed (tests ONLY: "
                                         "the run is marked not releasable).")
    log_train_loss: bool = _f(False, "Also hand the un-noised training loss to callbacks (report_to integrations "
                                     "upload it) and to train()'s result. Off by default: it is a statistic of the "
                                     "sampled private records that the DP guarantee does not cover; it stays in the "
                                     "run directory's metrics.jsonl either way.")
    noise_schedule: str = _f("constant", "σ over training: 'constant', 'linear' or 'exponential' (dpllm.privacy."
                                         "schedule; σ₀ calibrated so the whole schedule meets target_epsilon).")
    noise_schedule_end: float = _f(0.5, "Last piece's σ / first piece's σ.")
    noise_schedule_pieces: int = _f(10, "Constant pieces of a linear or exponential schedule.")
    noise: str = _f("independent", "How the noise is made, as the recipe's privacy.noise: 'independent' (DP-SGD), "
                                   "'banded' (noise correlated over `bands` steps; records, or users with "
                                   "privacy_unit='user', sampled in bands cyclic groups) or 'blt' (buffered linear "
                                   "Toeplitz over `bands` cyclic groups, accounted as one Gaussian mechanism; "
                                   "docs/privacy.md).")
    bands: str = _f("auto", "noise='banded': the number of bands b, or 'auto' (the least expected error at "
                            "target_epsilon; `dpllm plan --noise banded` shows the comparison); noise='blt': the "
                            "number of cyclic groups, or 'auto'.")
    buffers: str = _f("auto", "noise='blt': the BLT buffers d (1–8) or 'auto', as the recipe's privacy.buffers.")

    def privacy_config(self) -> PrivacyConfig:
        return PrivacyConfig(
            enabled=True, target_epsilon=self.target_epsilon, target_delta=self.target_delta,
            noise_multiplier=self.noise_multiplier, max_grad_norm=self.per_sample_max_grad_norm,
            accountant=self.accountant, grad_sample_mode=self.grad_sample_mode, clipping=self.clipping,
            clipping_r=self.clipping_r, clipping_s=self.clipping_s, target_quantile=self.target_quantile,
            quantile_lr=self.quantile_lr, count_noise_multiplier=self.count_noise_multiplier,
            secure_mode=self.secure_mode,
            reproducible_noise=self.reproducible_noise, noise_schedule=self.noise_schedule,
            noise_schedule_end=self.noise_schedule_end, noise_schedule_pieces=self.noise_schedule_pieces,
            user_sampling=self.user_sampling, noise=self.noise, bands=str(self.bands), buffers=str(self.buffers))

    def data_config(self, **kw) -> DataConfig:
        """The recipe's data options these arguments set (the unit, users, long records), plus ``kw``."""
        split = self.long_records == "split"
        return DataConfig(privacy_unit=self.privacy_unit, user_column=self.user_column,
                          max_records_per_user=self.max_records_per_user, long_records=self.long_records,
                          max_windows=self.max_windows, window_stride=self.window_stride,
                          **({"max_length": self.window_length} if split and self.window_length else {}), **kw)


# TrainingArguments value → why it cannot run under DPTrainer and what to do instead.
_SAMPLING = ("train_sampling_strategy={v!r} fixes which records share a batch; DP-SGD's guarantee needs each "
             "record drawn independently (Poisson sampling, which DPTrainer does itself). Leave it at 'random'")


def ignored_batch_clip(max_grad_norm: float, per_sample: float) -> str:
    """The one warning for ``TrainingArguments.max_grad_norm`` (1.0 by default), which DPTrainer ignores."""
    return (f"DPTrainer ignores TrainingArguments max_grad_norm={max_grad_norm:g}: DP-SGD clips each record's "
            f"gradient (PrivacyArguments per_sample_max_grad_norm={per_sample:g}). Clipping the whole batch's "
            "gradient after the noise would cost no privacy, but that gradient is mostly noise (norm about "
            "σ·C·√(parameters)/B), so it would shrink every step instead of guarding against outliers; set "
            "max_grad_norm=0 to silence this")


def _is_set(value: Any) -> bool:
    return bool(value) and value not in ("no", "none", [])


def refuse_unsafe(args, privacy: PrivacyArguments, *, data_collator=None, compute_loss_func=None,
                  train_dataset=None) -> None:
    """Refuse Trainer options that would break DP or that DPTrainer cannot honour.

    ``max_grad_norm`` (the Trainer's clip of the whole batch's gradient, 1.0 by default) is not refused: it
    is ignored with one warning (:func:`ignored_batch_clip`).

    Raises:
        ConfigError: naming the first offending option and the fix.
    """
    def no(msg: str) -> None:
        raise ConfigError(f"DPTrainer: {msg}")

    if args.max_grad_norm not in (None, 0, 0.0):
        log.warning(ignored_batch_clip(args.max_grad_norm, privacy.per_sample_max_grad_norm))
    if args.gradient_accumulation_steps != 1:
        no(f"gradient_accumulation_steps={args.gradient_accumulation_steps}: DPTrainer accumulates itself "
           "(one Poisson logical batch per step, in physical batches of per_device_train_batch_size); set it to 1 "
           "and the records per step with PrivacyArguments logical_batch_size")
    if args.train_sampling_strategy != "random":
        no(_SAMPLING.format(v=args.train_sampling_strategy))
    if getattr(args, "group_by_length", False):
        no(_SAMPLING.format(v="group_by_length"))
    if args.dataloader_drop_last:
        no("dataloader_drop_last=True drops records from some batches, which Poisson sampling must never do; "
           "set it to False")
    if getattr(args, "packing", False) or getattr(args, "padding_free", False):
        no("packing / padding_free put several records into one row, so one row is no longer one record (the "
           "privacy unit); turn packing off")
    if args.auto_find_batch_size:
        no("auto_find_batch_size=True is not supported; set per_device_train_batch_size (the physical batch)")
    if args.label_smoothing_factor:
        no(f"label_smoothing_factor={args.label_smoothing_factor} is not supported: the loss is dpllm's per-record "
           "next-token loss (through Opacus's criterion); set it to 0")
    if args.neftune_noise_alpha is not None:
        no("neftune_noise_alpha is not supported under DP (the forward pass must be the model's own); unset it")
    if args.torch_compile or args.use_liger_kernel:
        no("torch_compile / use_liger_kernel replace the modules or the loss that Opacus's per-sample hooks and "
           "criterion rely on; turn them off")
    if args.fp16:
        no("fp16 is not supported; use bf16=True (autocast) or full precision")
    if _is_set(args.deepspeed) or _is_set(args.fsdp):
        no("DeepSpeed / the Trainer's FSDP are not supported under DP; launch with accelerate (DDP), or use "
           "recipes/finetune_llm.py with recipes/accelerate/fsdp.yaml (FSDP2, bk)")
    if args.load_best_model_at_end:
        no("load_best_model_at_end=True is not supported; DPTrainer writes the final model to OUTPUT_DIR/checkpoint")
    if args.resume_from_checkpoint:
        no("TrainingArguments resume_from_checkpoint is read by scripts, not by a Trainer; pass it to "
           "trainer.train(resume_from_checkpoint=True) (the run's latest resumable checkpoint) and unset it here")
    if str(getattr(args.save_strategy, "value", args.save_strategy)) == "best":
        no("save_strategy='best' is not supported; use 'steps' (resumable checkpoints every save_steps steps, "
           "under OUTPUT_DIR/checkpoints/) or 'no'")
    if privacy.privacy_unit not in ("record", "sequence", "user"):
        no(f"privacy_unit={privacy.privacy_unit!r}: choose 'record' (one row of train_dataset is one record), 'user' "
           "(all rows of one user, named by user_column) or 'sequence' (one row is a packed block of tokens)")
    if privacy.long_records == "split" and privacy.window_length is None:
        no("long_records='split' needs window_length=N, the tokens per window (the recipe's data.max_length); rows "
           "hold whole records and are cut into windows of N tokens")
    if compute_loss_func is not None:
        no("compute_loss_func replaces the per-record loss that Opacus clips; drop it (labels of -100 already "
           "mask tokens out of the loss)")
    _check_numbers(args, privacy, no)
    _check_collator(data_collator, no)
    if train_dataset is not None and not (hasattr(train_dataset, "__len__") and hasattr(train_dataset, "__getitem__")):
        no(f"train_dataset of type {type(train_dataset).__name__} has no length or random access; Poisson "
           "sampling draws from the whole dataset: pass a datasets.Dataset (not streaming) or a map-style Dataset")


def _check_numbers(args, privacy: PrivacyArguments, no) -> None:
    """dpllm's own range checks (:func:`dpllm.config.validate`) on the numbers a run takes from these arguments,
    at construction: a negative learning rate would otherwise fail in torch's optimizer, inside ``train()``."""
    try:
        validate(RunConfig(train=TrainConfig(learning_rate=args.learning_rate, weight_decay=args.weight_decay,
                                             logical_batch_size=privacy.logical_batch_size,
                                             physical_batch_size=args.per_device_train_batch_size),
                           data=privacy.data_config(), privacy=privacy.privacy_config()))
    except ConfigError as err:
        no(trainer_names(f"{err}"))


def trainer_names(message: str) -> str:
    """A recipe message with DPTrainer's names for the options it mentions."""
    message = message.replace("physical_batch_size", "per_device_train_batch_size")
    if "window" in message:  # the window length of long_records: split is DPTrainer's window_length
        message = message.replace("max_length", "window_length")
    return message


def _check_collator(collator, no) -> None:
    """Packing collators are refused; padding collators are replaced by dpllm's own (same padding and labels)."""
    if collator is None:
        return
    name = getattr(collator, "__name__", None) or type(collator).__name__
    if "Flattening" in name or "Packing" in name:
        no(f"data_collator={name} packs several records into one row; the privacy unit is one record: drop it")
    if name == "DataCollatorForLanguageModeling" and getattr(collator, "mlm", False):
        no("DataCollatorForLanguageModeling(mlm=True) is masked language modelling; DPTrainer trains causal LMs "
           "(next-token loss): use mlm=False or no data_collator")
    if name not in ("default_data_collator", "DataCollatorWithPadding", "DataCollatorForLanguageModeling",
                    "DefaultDataCollator"):
        no(f"data_collator={name} is not used by DPTrainer, which pads each record itself (labels -100 on "
           "padding); drop it, or put the labels you need in a 'labels' column")


def _steps_or_ratio(value: float, steps: int) -> int:
    """Trainer's convention: a value below 1 is a fraction of the run."""
    return max(1, math.ceil(value * steps)) if 0 < value < 1 else int(value)


def run_config(args, privacy: PrivacyArguments, *, model_name: str, finetuning: str, records_path: str,
               max_length: int, num_records: int, has_eval: bool, quantization: str = "none") -> RunConfig:
    """The dpllm configuration equivalent to these arguments (written to OUTPUT_DIR/config.yaml).

    Raises:
        ConfigError: an optimizer or scheduler dpllm's config cannot describe, or values dpllm refuses.
    """
    from dpllm.privacy.plan import steps_for

    optim = str(getattr(args.optim, "value", args.optim))
    if optim.startswith("adamw"):
        optimizer = "adamw"
    elif optim == "sgd":
        optimizer = "sgd"
    else:
        raise ConfigError(f"DPTrainer: optim={optim!r} is not supported; use adamw_torch(_fused) or sgd")
    sched = str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type))
    scheduler = {"linear": "linear", "cosine": "cosine", "constant": "constant",
                 "constant_with_warmup": "constant"}.get(sched)
    if scheduler is None:
        raise ConfigError(f"DPTrainer: lr_scheduler_type={sched!r} is not supported; use linear, cosine, constant "
                          "or constant_with_warmup")
    by_steps = args.max_steps is not None and args.max_steps > 0
    epochs = None if by_steps else float(args.num_train_epochs)
    steps = steps_for(num_records=num_records, batch=privacy.logical_batch_size, epochs=epochs,
                      steps=args.max_steps if by_steps else None)
    epoch_steps = batches_per_epoch(num_records, privacy.logical_batch_size)

    def every(strategy, value) -> int:
        strategy = str(getattr(strategy, "value", strategy))
        if strategy == "epoch":
            return epoch_steps
        if strategy == "steps" and value:
            return _steps_or_ratio(value, steps)
        return 0

    log_every = every(args.logging_strategy, args.logging_steps) or steps
    save_every = every(args.save_strategy, args.save_steps)  # the Trainer's checkpoint-N, as resumable checkpoints
    eval_every = every(args.eval_strategy, args.eval_steps or args.logging_steps) if has_eval else 0
    cfg = RunConfig(
        model=ModelConfig(model_name_or_path=model_name, finetuning=finetuning, quantization=quantization),
        data=privacy.data_config(dataset=records_path, text_column="text", min_chars=0,
                                 **({} if privacy.long_records == "split" else {"max_length": max(2, max_length)})),
        train=TrainConfig(output_dir=args.output_dir, overwrite_output_dir=privacy.overwrite_output_dir,
                          max_steps=args.max_steps if by_steps else None, epochs=epochs,
                          logical_batch_size=privacy.logical_batch_size,
                          physical_batch_size=args.per_device_train_batch_size, optimizer=optimizer,
                          learning_rate=args.learning_rate, weight_decay=args.weight_decay, lr_scheduler=scheduler,
                          warmup_steps=int(args.get_warmup_steps(steps)), eval_every=eval_every,
                          eval_max_records=None, log_every=log_every, seed=args.seed,
                          mixed_precision="bf16" if args.bf16 else "no",
                          gradient_checkpointing=bool(args.gradient_checkpointing), progress=False,
                          save_every=save_every or None,
                          # save_strategy="no" asks for no checkpoints, time-based ones (preemption) included
                          **({} if str(getattr(args.save_strategy, "value", args.save_strategy)) != "no"
                             else {"save_every_minutes": 0})),
        privacy=privacy.privacy_config())
    validate(cfg)
    return cfg
