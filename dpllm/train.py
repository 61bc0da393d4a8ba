"""The training loop: one loop for private and non-private runs, on ``accelerate``.

Read top to bottom: data → model → privacy plan (all checks before anything is written) → run
directory → steps → final eval → atomic checkpoint with its privacy report.
"""

from __future__ import annotations

import json
import logging
import math
import random
import shutil
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch.utils.data import DataLoader

from dpllm import data as D
from dpllm.checkpoint import library_versions, save_checkpoint, unwrap
from dpllm.config import ConfigError, RunConfig
from dpllm.io import append_jsonl, write_json_atomic, write_text_atomic
from dpllm.models import (check_dp_layers, context_length, count_parameters, load_base, position_ids_for,
                          prepare_model)
from dpllm.privacy.engine import PrivacyPlan, make_private, plan_privacy, sequence_loss, steps_for

log = logging.getLogger(__name__)


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. a NaN loss); nothing half-written is left behind."""


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def forward_loss(model, batch: dict, criterion=None, autocast=None):
    ids = batch["input_ids"]
    ctx = autocast() if autocast is not None else torch.autocast("cpu", enabled=False)
    with ctx:
        out = model(input_ids=ids, attention_mask=batch["attention_mask"], position_ids=position_ids_for(ids))
    return sequence_loss(out.logits, batch["labels"], criterion)


@torch.no_grad()
def evaluate(model, dataset, collate, *, batch_size: int, device) -> dict:
    """Token-weighted held-out loss (nats per token) and perplexity."""
    model = unwrap(model)
    was_training = model.training
    model.eval()
    total, tokens = 0.0, 0
    for batch in DataLoader(dataset, batch_size=batch_size, collate_fn=collate):
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
    loss = total / max(tokens, 1)
    return {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "tokens": tokens}


def _prior_stages(source: dict, cfg: RunConfig) -> tuple[list, list]:
    """Stages (and their DP history) of an earlier run this one starts from."""
    if source.get("kind") != "run_checkpoint":
        return [], []
    report_path = Path(source["path"]) / "privacy_report.json"
    if not report_path.is_file():
        return [], []
    report = json.loads(report_path.read_text())
    stages = report.get("stages", [])
    same_data = [s for s in stages if s.get("enabled") and s.get("dataset") == cfg.data.dataset
                 and s.get("split_seed") == cfg.data.split_seed]
    history = [tuple(h) for s in same_data for h in s.get("history", [])]
    return stages, history


def _make_optimizer(params, cfg: RunConfig):
    t = cfg.train
    if t.optimizer == "sgd":
        return torch.optim.SGD(params, lr=t.learning_rate, momentum=t.momentum, weight_decay=t.weight_decay)
    return torch.optim.AdamW(params, lr=t.learning_rate, weight_decay=t.weight_decay)


def _prepare_output_dir(cfg: RunConfig) -> Path:
    out = Path(cfg.train.output_dir)
    if out.exists() and any(out.iterdir()):
        if not cfg.train.overwrite_output_dir:
            raise ConfigError(f"output_dir={out} exists and is not empty; pass --overwrite_output_dir true or pick another")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    return out


def train(cfg: RunConfig) -> dict:
    """Run one training stage as configured; return the run summary (also in ``run_summary.json``).

    Raises:
        ConfigError, DataError, ModelError, PrivacyPlanError: before anything is written.
        TrainingError: a non-finite loss; no checkpoint is written for the failed run.
    """
    from accelerate import Accelerator

    t, p, dcfg = cfg.train, cfg.privacy, cfg.data
    dp = p.enabled
    seed_everything(t.seed)
    mp = t.mixed_precision
    if mp == "bf16" and not torch.cuda.is_available():
        log.warning("mixed_precision=bf16 needs a GPU here; falling back to fp32 on CPU")
        mp = "no"
    accelerator = Accelerator(mixed_precision=mp)
    device = accelerator.device

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

    train_ds = D.TokenizedRecords(train_texts, tokenizer, dcfg.max_length)
    eval_ds = D.TokenizedRecords(heldout_texts, tokenizer, dcfg.max_length)
    collate = D.make_collate(tokenizer.pad_token_id)
    batches_per_epoch = math.ceil(len(train_ds) / t.logical_batch_size)
    steps = steps_for(t.epochs, t.max_steps, batches_per_epoch)

    plan: Optional[PrivacyPlan] = None
    if dp:
        plan = plan_privacy(p, num_records=len(train_ds), num_batches_per_epoch=batches_per_epoch,
                            steps=steps, prior_history=prior_history)
    params = [q for q in model.parameters() if q.requires_grad]
    optimizer = _make_optimizer(params, cfg)
    from transformers import get_scheduler

    scheduler = get_scheduler(t.lr_scheduler, optimizer, num_warmup_steps=t.warmup_steps, num_training_steps=steps)

    # ---- run directory: only now, after every check passed --------------------------------------
    out = _prepare_output_dir(cfg) if accelerator.is_main_process else Path(t.output_dir)
    if accelerator.is_main_process:
        write_text_atomic(out / "config.yaml", cfg.to_yaml())
        write_json_atomic(out / "splits.json", splits.to_json(records, dcfg))
        if canaries:
            write_json_atomic(out / "canaries.json", {"seed": dcfg.canary_seed, "canaries": canaries})
    metrics_path = out / "metrics.jsonl"

    criterion = None
    if dp:
        pt = make_private(model=model, optimizer=optimizer, dataset=train_ds, collate_fn=collate, cfg=p, plan=plan,
                          logical_batch_size=t.logical_batch_size)
        model, optimizer, criterion, loader = pt.model, pt.optimizer, pt.criterion, pt.data_loader
        log.info("privacy: σ=%.4g q=%.4g steps=%d target ε=%s δ=%g (%s)", plan.noise_multiplier,
                 plan.sample_rate, steps, p.target_epsilon, p.target_delta, p.accountant)
    else:
        gen = torch.Generator().manual_seed(t.seed)
        loader = DataLoader(train_ds, batch_size=t.logical_batch_size, shuffle=True, generator=gen, collate_fn=collate)

    autocast = accelerator.autocast if mp != "no" else None
    bar = None
    if t.progress and accelerator.is_main_process:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps, desc="dp-train" if dp else "train", dynamic_ncols=True)
    initial = None
    if t.eval_every and accelerator.is_main_process:
        initial = evaluate(model, eval_ds, collate, batch_size=t.physical_batch_size, device=device)
        append_jsonl(metrics_path, {"step": 0, "split": "eval", **initial})
    step, tokens_seen, start = 0, 0, time.time()
    window: list[float] = []
    eps_now = 0.0 if dp else None

    def after_step(loss_value: float) -> None:
        nonlocal step, eps_now
        step += 1
        scheduler.step()
        window.append(loss_value)
        if dp and (step % t.log_every == 0 or step == steps):
            eps_now = pt.epsilon()
        if step % t.log_every == 0 or step == steps:
            row = {"step": step, "split": "train", "loss": float(np.mean(window)), "lr": scheduler.get_last_lr()[0],
                   "tokens_seen": tokens_seen, "elapsed_s": round(time.time() - start, 2)}
            if dp:
                row["epsilon"] = eps_now
            window.clear()
            if accelerator.is_main_process:
                append_jsonl(metrics_path, row)
        if t.eval_every and step % t.eval_every == 0 and step < steps and accelerator.is_main_process:
            ev = evaluate(model, eval_ds, collate, batch_size=t.physical_batch_size, device=device)
            append_jsonl(metrics_path, {"step": step, "split": "eval", **ev})
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss_value:.3f}", **({"eps": f"{eps_now:.2f}"} if dp else {}))

    def check_finite(loss) -> float:
        value = float(loss.detach() if hasattr(loss, "detach") else loss)
        if not math.isfinite(value):
            raise TrainingError(
                f"loss is {value} at step {step + 1}; no checkpoint was written. Lower learning_rate "
                f"(now {t.learning_rate}), check the data, or use mixed_precision=no"
            )
        return value

    if dp:
        from opacus.utils.batch_memory_manager import BatchMemoryManager

        while step < steps:
            with BatchMemoryManager(data_loader=loader, max_physical_batch_size=t.physical_batch_size,
                                    optimizer=optimizer) as physical_loader:
                losses: list[float] = []
                for batch in physical_loader:
                    batch = {k: v.to(device) for k, v in batch.items()}
                    optimizer.zero_grad()
                    loss = forward_loss(model, batch, criterion, autocast)
                    losses.append(check_finite(loss))
                    tokens_seen += int(batch["attention_mask"].sum())
                    loss.backward()
                    optimizer.step()
                    if not optimizer._is_last_step_skipped:
                        after_step(float(np.mean(losses)))
                        losses = []
                        if step >= steps:
                            break
    else:
        while step < steps:
            for batch in loader:
                optimizer.zero_grad()
                n = batch["input_ids"].shape[0]
                total = 0.0
                for lo in range(0, n, t.physical_batch_size):
                    chunk = {k: v[lo: lo + t.physical_batch_size].to(device) for k, v in batch.items()}
                    loss = forward_loss(model, chunk, None, autocast) * (chunk["input_ids"].shape[0] / n)
                    total += check_finite(loss)
                    tokens_seen += int(chunk["attention_mask"].sum())
                    loss.backward()
                optimizer.step()
                after_step(total)
                if step >= steps:
                    break
    if bar is not None:
        bar.close()
    wall = time.time() - start

    # ---- final eval, report, checkpoint ----------------------------------------------------------
    final = evaluate(model, eval_ds, collate, batch_size=t.physical_batch_size, device=device)
    summary: dict = {}
    if accelerator.is_main_process:
        append_jsonl(metrics_path, {"step": step, "split": "eval", **final})
        stage = {
            "name": Path(t.output_dir).name, "enabled": dp, "dataset": dcfg.dataset, "train_on": dcfg.train_on,
            "split_seed": dcfg.split_seed, "num_records": len(train_ds), "steps": step,
            "history": pt.history()[len(prior_history):] if dp else [],
        }
        report = build_report(cfg, plan=plan, pt=pt if dp else None, num_records=len(train_ds), steps=step,
                              adjustments=adjustments, stages=prior_stages + [stage], source=source)
        save_checkpoint(out / "checkpoint", model=model, tokenizer=tokenizer, privacy_report=report,
                        config_yaml=cfg.to_yaml(), base_model=lora_base)
        write_json_atomic(out / "privacy_report.json", report)
        summary = {
            "run_dir": str(out), "model": cfg.model.model_name_or_path, "finetuning": cfg.model.finetuning,
            "params_total": n_total, "params_trainable": n_trainable, "tokens_seen": tokens_seen, "steps": step,
            "logical_batch_size": t.logical_batch_size, "epsilon": report.get("epsilon"),
            "delta": report.get("delta"), "noise_multiplier": report.get("noise_multiplier"),
            "sample_rate": report.get("sample_rate"), "privacy_enabled": dp,
            "initial_eval_loss": initial["loss"] if initial else None, "final_eval_loss": final["loss"],
            "final_eval_ppl": final["ppl"], "seed": t.seed, "wall_time_s": round(wall, 2),
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
            "poisson_sampling": True, "history": [list(h) for h in history],
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
