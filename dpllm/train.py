"""The training loop: one loop for private and non-private runs, on one process or many (``accelerate``).

Read top to bottom: data → model → privacy plan (all checks before anything is written) → run
directory → start or resume → steps (with resumable checkpoints every ``save_every``) → final eval →
atomic checkpoint with its privacy report and the final line of the privacy ledger.

Where the rest lives: process handling in :mod:`dpllm.distributed`, samplers in :mod:`dpllm.sampling`,
resumable checkpoints in :mod:`dpllm.resume`, the ε hash chain in :mod:`dpllm.ledger`.
"""

from __future__ import annotations

import json
import logging
import math
import random
import shutil
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch.utils.data import DataLoader

from dpllm import data as D
from dpllm import ledger
from dpllm import resume as R
from dpllm.checkpoint import library_versions, save_checkpoint, unwrap
from dpllm.config import ConfigError, RunConfig
from dpllm.distributed import (World, all_max, all_sum, barrier, check_parallelism, full_state_dict, gather_objects,
                               is_sharded, make_accelerator, params_digest, reshard, world_of, wrap_model)
from dpllm.io import append_jsonl, write_json_atomic, write_text_atomic
from dpllm.models import (check_dp_layers, context_length, count_parameters, load_base, position_ids_for,
                          prepare_model)
from dpllm.privacy.engine import make_private, sequence_loss
from dpllm.privacy.plan import PrivacyPlan, plan_privacy, steps_for
from dpllm.sampling import ShuffledBatchSampler, stream_seed

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


def _prior_stages(source: dict, cfg: RunConfig) -> tuple[list, list]:
    """Stages (and their DP history) of an earlier run this one starts from."""
    if source.get("kind") != "run_checkpoint":
        return [], []
    report_path = Path(source["path"]) / "privacy_report.json"
    if not report_path.is_file():
        return [], []
    report = json.loads(report_path.read_text())
    stages = report.get("stages", [])
    # Composed whenever the dataset is the same, whatever the split: another split_seed still shares most
    # private records, and over-counting is safe where under-counting is not.
    same_data = [s for s in stages if s.get("enabled") and s.get("dataset") == cfg.data.dataset]
    history = [tuple(h) for s in same_data for h in s.get("history", [])]
    return stages, history


def _make_optimizer(params, cfg: RunConfig):
    t = cfg.train
    if t.optimizer == "sgd":
        return torch.optim.SGD(params, lr=t.learning_rate, momentum=t.momentum, weight_decay=t.weight_decay)
    return torch.optim.AdamW(params, lr=t.learning_rate, weight_decay=t.weight_decay)


def _check_output_dir(cfg: RunConfig) -> None:
    out = Path(cfg.train.output_dir)
    if out.exists() and any(out.iterdir()) and not cfg.train.overwrite_output_dir:
        raise ConfigError(f"output_dir={out} exists and is not empty; pass --overwrite_output_dir true, "
                          "--resume_from latest to continue it, or pick another")


def _prepare_output_dir(cfg: RunConfig) -> Path:
    out = Path(cfg.train.output_dir)
    _check_output_dir(cfg)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    return out


def train(cfg: RunConfig) -> dict:
    """Run one training stage as configured; return the run summary (also in ``run_summary.json``).

    Runs on one process or many (``accelerate launch``, see :mod:`dpllm.distributed`); only rank 0
    writes the run directory and the summary is returned on rank 0 only ({} elsewhere).

    Raises:
        ConfigError, DataError, ModelError, PrivacyPlanError: before anything is written.
        TrainingError: a non-finite loss; no checkpoint is written for the failed run.
    """
    t, p, dcfg = cfg.train, cfg.privacy, cfg.data
    dp = p.enabled
    seed_everything(t.seed)
    mp = t.mixed_precision
    if mp == "bf16" and not torch.cuda.is_available():
        log.warning("mixed_precision=bf16 needs a GPU here; falling back to fp32 on CPU")
        mp = "no"
    accelerator = make_accelerator(mp)
    world = world_of(accelerator)
    device = accelerator.device
    check_parallelism(p, world.kind, world_size=world.size, logical_batch_size=t.logical_batch_size)
    resume_from = R.resolve(cfg)  # read-only, so every process reaches the same answer
    if resume_from is not None:
        R.check_config(resume_from, cfg)

    # ---- data (errors here cost nothing) -------------------------------------------------------
    records = D.load_records(dcfg)
    splits = D.make_splits(len(records), dcfg)
    if dcfg.train_on == "public" and not splits.public:
        raise D.DataError("train_on=public but public_fraction=0 leaves no public records; raise public_fraction")
    train_ids = splits.public if dcfg.train_on == "public" else splits.train
    train_texts = D.select(records, train_ids)
    canaries = D.make_canaries(dcfg) if dcfg.train_on == "private" else []
    train_texts += [c["text"] for c in canaries if c["included"]]
    heldout_texts = D.select(records, splits.heldout)
    if t.eval_max_records is not None:
        heldout_texts = heldout_texts[: t.eval_max_records]

    # ---- model -----------------------------------------------------------------------------------
    model, tokenizer, source = load_base(cfg.model, dcfg.max_length)
    ctx = context_length(model)
    if ctx is not None and dcfg.max_length > ctx:
        raise ConfigError(f"max_length={dcfg.max_length} exceeds the model's context of {ctx} tokens; lower max_length")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    lora_base = model if cfg.model.finetuning == "lora" and source["kind"] != "pretrained" else None
    if lora_base is not None:
        import copy

        lora_base = copy.deepcopy(lora_base)
    prior_stages, prior_history = _prior_stages(source, cfg)
    model, adjustments = prepare_model(model, cfg.model, dp=dp)
    if t.gradient_checkpointing:
        if dp:
            raise ConfigError(
                "gradient_checkpointing=true is refused under DP: recomputed activations re-run Opacus's "
                "forward hooks and corrupt per-sample norms; turn it off or lower physical_batch_size"
            )
        unwrap(model).gradient_checkpointing_enable()
    if dp:
        check_dp_layers(model)
    model.to(device).train()
    n_total, n_trainable = count_parameters(model)
    # DDP / FSDP wrapping comes before the optimizer (FSDP replaces parameters) and before make_private.
    model = wrap_model(model, dp=dp, world=world, accelerator=accelerator, mixed_precision=mp)

    train_ds = D.TokenizedRecords(train_texts, tokenizer, dcfg.max_length)
    eval_ds = D.TokenizedRecords(heldout_texts, tokenizer, dcfg.max_length)
    collate = D.make_collate(tokenizer.pad_token_id)
    empty = {k: torch.zeros((0, 1), dtype=torch.long) for k in ("input_ids", "attention_mask", "labels")}
    batches_per_epoch = math.ceil(len(train_ds) / t.logical_batch_size)
    steps = steps_for(num_records=len(train_ds), batch=t.logical_batch_size, epochs=t.epochs,
                      steps=None if t.epochs is not None else t.max_steps)

    plan: Optional[PrivacyPlan] = None
    if dp:
        plan = plan_privacy(num_records=len(train_ds), logical_batch_size=t.logical_batch_size, steps=steps,
                            target_epsilon=p.target_epsilon, delta=p.target_delta, accountant=p.accountant,
                            noise_multiplier=p.noise_multiplier, prior_history=prior_history)
    params = [q for q in model.parameters() if q.requires_grad]
    optimizer = _make_optimizer(params, cfg)
    from transformers import get_scheduler

    scheduler = get_scheduler(t.lr_scheduler, optimizer, num_warmup_steps=t.warmup_steps, num_training_steps=steps)

    # ---- run directory: only now, after every check passed --------------------------------------
    out = Path(t.output_dir)
    if resume_from is None:
        _check_output_dir(cfg)
        barrier(world)  # every process checked before rank 0 clears or creates anything
        if world.is_main:
            _prepare_output_dir(cfg)
            write_text_atomic(out / "config.yaml", cfg.to_yaml())
            write_json_atomic(out / "splits.json", splits.to_json(records, dcfg))
            if canaries:
                write_json_atomic(out / "canaries.json", {"seed": dcfg.canary_seed, "canaries": canaries})
    elif world.is_main:
        R.clean_partial_writes(out)
    metrics_path = out / "metrics.jsonl"

    # Separate random streams, so that resuming restores each exactly: Poisson draws (the same on every
    # process), noise (one stream per process: under FSDP each adds noise to its own shard).
    sampling_gen = torch.Generator().manual_seed(stream_seed(t.seed, "poisson"))
    noise_gen = None if p.secure_mode else torch.Generator(device=device).manual_seed(
        stream_seed(t.seed, f"noise:{world.rank}"))
    generators = {"sampling": sampling_gen, "noise": noise_gen}
    criterion, pt = None, None
    if dp:
        pt = make_private(model=model, optimizer=optimizer, dataset=train_ds, collate_fn=collate, cfg=p, plan=plan,
                          logical_batch_size=t.logical_batch_size, noise_generator=noise_gen,
                          sampling_generator=sampling_gen, rank=world.rank, world_size=world.size)
        model, optimizer, criterion = pt.model, pt.optimizer, pt.criterion
        log.info("privacy: σ=%.4g q=%.4g steps=%d target ε=%s δ=%g (%s), %d process(es)", plan.noise_multiplier,
                 plan.sample_rate, steps, p.target_epsilon, p.target_delta, p.accountant, world.size)
    else:
        batches = ShuffledBatchSampler(num_samples=len(train_ds), batch_size=t.logical_batch_size, seed=t.seed,
                                       rank=world.rank, world_size=world.size)
        loader = DataLoader(train_ds, batch_sampler=batches, collate_fn=collate)
    plan_state = R.plan_state(plan)

    def privacy_now() -> dict:
        """ε so far (earlier stages on the same data included) and the parameters behind it."""
        if not dp:
            return {}
        return {"epsilon": pt.epsilon(), "delta": plan.delta, "noise_multiplier": plan.noise_multiplier,
                "sample_rate": plan.sample_rate, "accountant": plan.accountant}

    # ---- start, or continue a checkpoint --------------------------------------------------------
    step, tokens_seen, initial = 0, 0, None
    if resume_from is not None:
        state = R.load(resume_from, model=model, optimizer=optimizer, scheduler=scheduler, world=world,
                       generators=generators, plan=plan_state, accountant=pt.engine.accountant if dp else None)
        step = state["step"]
        tokens_seen = state["tokens_seen"] if world.is_main else 0  # the sum over processes is what counts
        if world.is_main:
            R.truncate_metrics(metrics_path, state["metrics_bytes"])
            R.sync_ledger(out, resume_from, step=step, privacy=privacy_now())
            initial = R.initial_eval(metrics_path)
        log.info("resumed from %s at step %d of %d", resume_from, step, steps)
    else:
        if world.is_main:
            ledger.append(out, kind="stage", step=0, privacy=privacy_now(), name=out.name,
                          previous_stage=ledger.previous_stage(source))
        if t.eval_every:
            initial = evaluate(model, eval_ds, collate, batch_size=t.physical_batch_size, device=device, world=world)
            if world.is_main:
                append_jsonl(metrics_path, {"step": 0, "split": "eval", **initial})
    if not dp:
        batches.start = step  # non-private batches are a function of the step: no state to restore
    start_step = step

    def save_resumable() -> None:
        tokens = int(all_sum([tokens_seen], world)[0])
        privacy = privacy_now() if world.is_main else {}
        state = {"step": step, "tokens_seen": tokens, "plan": plan_state, "epsilon": privacy.get("epsilon"),
                 "metrics_bytes": metrics_path.stat().st_size if metrics_path.exists() else 0,
                 "accountant": pt.engine.accountant.state_dict() if dp else None}
        R.save(out, step=step, model=model, optimizer=optimizer, scheduler=scheduler, world=world,
               config_yaml=cfg.to_yaml(), generators=generators, trainer_state=state, privacy=privacy)

    autocast = accelerator.autocast if mp != "no" else None
    bar = None
    if t.progress and world.is_main:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps, initial=step, desc="dp-train" if dp else "train", dynamic_ncols=True)
    start = time.time()
    window = [0.0, 0]  # record-weighted loss sum and record count since the last train log line
    shown: dict = {}  # progress bar postfix

    def after_step() -> None:
        nonlocal step
        step += 1
        scheduler.step()
        if step % t.log_every == 0 or step == steps:
            loss_sum, n, tokens = all_sum([window[0], window[1], tokens_seen], world)
            row = {"step": step, "split": "train", "loss": loss_sum / max(n, 1), "lr": scheduler.get_last_lr()[0],
                   "tokens_seen": int(tokens), "elapsed_s": round(time.time() - start, 2)}
            if dp and world.is_main:
                row["epsilon"] = pt.epsilon()
            window[:] = [0.0, 0]
            if world.is_main:
                append_jsonl(metrics_path, row)
                shown.update(loss=f"{row['loss']:.3f}", **({"eps": f"{row['epsilon']:.2f}"} if dp else {}))
        if t.eval_every and step % t.eval_every == 0 and step < steps:
            ev = evaluate(model, eval_ds, collate, batch_size=t.physical_batch_size, device=device, world=world)
            if world.is_main:
                append_jsonl(metrics_path, {"step": step, "split": "eval", **ev})
        if t.save_every and step % t.save_every == 0 and step < steps:
            save_resumable()
        if bar is not None:
            bar.update(1)
            bar.set_postfix(**shown)

    def record_loss(loss, n: int) -> None:
        if n == 0:
            return
        value = float(loss.detach() if hasattr(loss, "detach") else loss)
        if not math.isfinite(value):
            raise TrainingError(
                f"loss is {value} at step {step + 1}; no checkpoint was written. Lower learning_rate "
                f"(now {t.learning_rate}), check the data, or use mixed_precision=no"
            )
        window[0] += value * n
        window[1] += n

    # ---- steps ------------------------------------------------------------------------------------
    if dp and step < steps:
        sharded = is_sharded(unwrap(model))
        for ids in pt.sampler:  # endless; this process's share of the next Poisson batch (maybe empty)
            parts = [ids[i: i + t.physical_batch_size] for i in range(0, len(ids), t.physical_batch_size)] or [[]]
            if sharded:  # FSDP: every process runs as many forward/backward passes as the busiest one
                parts += [[]] * (int(all_max(len(parts), world)) - len(parts))
            for i, part in enumerate(parts):
                # Clip and accumulate after each physical batch; noise, accounting and the all-reduce
                # happen once, at the step after the last one.
                optimizer.signal_skip_step(do_skip=i < len(parts) - 1)
                optimizer.zero_grad()
                items = [train_ds[j] for j in part]
                batch = {k: v.to(device) for k, v in (collate(items) if items else empty).items()}
                loss = forward_loss(model, batch, criterion, autocast)
                record_loss(loss, len(part))
                tokens_seen += int(batch["attention_mask"].sum())
                loss.backward()
                optimizer.step()
            after_step()
            if step >= steps:
                break
    elif step < steps:
        for batch in loader:  # endless; this process's share of global batch number `step`
            optimizer.zero_grad()
            n = batch["input_ids"].shape[0]
            chunks = list(range(0, n, t.physical_batch_size))
            for lo in chunks:
                chunk = {k: v[lo: lo + t.physical_batch_size].to(device) for k, v in batch.items()}
                m = chunk["input_ids"].shape[0]
                # Gradients sync once per step (last chunk). DDP averages over processes, so scaling by
                # W·m/B makes the update the mean over the whole global batch of B records.
                with accelerator.no_sync(model) if lo != chunks[-1] else nullcontext():
                    loss = forward_loss(model, chunk, None, autocast)
                    record_loss(loss, m)
                    tokens_seen += int(chunk["attention_mask"].sum())
                    (loss * (m * world.size / batches.batch_size)).backward()
            optimizer.step()
            after_step()
            if step >= steps:
                break
    if bar is not None:
        bar.close()
    if t.save_every and step > start_step:
        save_resumable()
    wall = time.time() - start

    # ---- final eval, report, checkpoint ----------------------------------------------------------
    final = evaluate(model, eval_ds, collate, batch_size=t.physical_batch_size, device=device, world=world)
    tokens_seen = int(all_sum([tokens_seen], world)[0])
    digests = gather_objects(params_digest(model), world)
    if len(set(digests)) > 1:
        raise TrainingError(f"model replicas differ across the {world.size} processes after training; this is a "
                            "dpllm bug (no checkpoint was written)")
    weights = full_state_dict(unwrap(model))  # FSDP: every process takes part in the gather
    summary: dict = {}
    if world.is_main:
        append_jsonl(metrics_path, {"step": step, "split": "eval", **final})
        stage = {
            "name": out.name, "enabled": dp, "dataset": dcfg.dataset, "train_on": dcfg.train_on,
            "split_seed": dcfg.split_seed, "num_records": len(train_ds), "steps": step,
            "history": pt.history()[len(prior_history):] if dp else [],
        }
        report = build_report(cfg, plan=plan, pt=pt, num_records=len(train_ds), steps=step,
                              adjustments=adjustments, stages=prior_stages + [stage], source=source)
        save_checkpoint(out / "checkpoint", model=model, tokenizer=tokenizer, privacy_report=report,
                        config_yaml=cfg.to_yaml(), base_model=lora_base, state_dict=weights)
        write_json_atomic(out / "privacy_report.json", report)
        ledger.append(out, kind="final", step=step, privacy=report, checkpoint="checkpoint")
        summary = {
            "run_dir": str(out), "model": cfg.model.model_name_or_path, "finetuning": cfg.model.finetuning,
            "params_total": n_total, "params_trainable": n_trainable, "tokens_seen": tokens_seen, "steps": step,
            "logical_batch_size": t.logical_batch_size, "epsilon": report.get("epsilon"),
            "delta": report.get("delta"), "noise_multiplier": report.get("noise_multiplier"),
            "sample_rate": report.get("sample_rate"), "privacy_enabled": dp,
            "initial_eval_loss": initial["loss"] if initial else None, "final_eval_loss": final["loss"],
            "final_eval_ppl": final["ppl"], "seed": t.seed, "wall_time_s": round(wall, 2),
            "world_size": world.size, "params_sha256": digests[0], "resumed_from_step": start_step or None,
        }
        write_json_atomic(out / "run_summary.json", summary)
        if t.runs_file:
            append_jsonl(t.runs_file, summary)
    accelerator.wait_for_everyone()
    return summary


def build_report(cfg: RunConfig, *, plan, pt, num_records: int, steps: int, adjustments: list, stages: list,
                 source: dict) -> dict:
    """The privacy report: ε with everything needed to recompute it, and library versions."""
    p, t = cfg.privacy, cfg.train
    report = {
        "enabled": p.enabled, "privacy_unit": "record", "num_records": num_records, "steps": steps,
        "logical_batch_size": t.logical_batch_size, "physical_batch_size": t.physical_batch_size,
        "model_adjustments": adjustments, "base_model": source, "versions": library_versions(),
    }
    if p.enabled:
        from dpllm.privacy import clipping

        history = pt.history()
        report.update({
            "epsilon": pt.epsilon(), "delta": plan.delta, "accountant": plan.accountant,
            "target_epsilon": p.target_epsilon, "noise_multiplier": plan.noise_multiplier,
            "sample_rate": plan.sample_rate, "expected_batch_size": plan.expected_batch_size,
            "max_grad_norm": p.max_grad_norm, "clipping": p.clipping,
            "sensitivity": clipping.get(p.clipping).sensitivity(p), "grad_sample_mode": p.grad_sample_mode,
            "poisson_sampling": True, "secure_mode": p.secure_mode, "history": [list(h) for h in history],
            "composition": "stages on the same private data are composed by the accountant over their full history"
            if len(history) > 1 else "single stage",
        })
    else:
        report.update({"epsilon": None, "delta": None, "accountant": None, "noise_multiplier": None,
                       "sample_rate": None, "max_grad_norm": None, "clipping": None, "history": []})
    report["stages"] = stages
    other = [s for s in stages[:-1] if s.get("enabled") and s.get("dataset") != cfg.data.dataset]
    if other:
        report["note"] = ("earlier private stages used other data; their ε applies to their own records and is "
                          "not composed into this ε")
    return report
