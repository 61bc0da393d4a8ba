"""Which noise at equal ε? DP-SGD vs BandMF vs BLT on the seed-000 MLP study and the tiny Llama recipe (issue 45).

Every private row goes through the correlated-noise registry: :func:`dpllm.privacy.correlated.build` returns the
mechanism's sampler (plain Poisson for DP-SGD, cyclic Poisson over b groups for BandMF and BLT), its noise
recurrence and its accounted event together; σ is calibrated by ``CorrelatedNoise.calibrate`` to the target ε and
the ε printed is recomputed from the recorded event ``(σ, q, steps)`` by the project's accountant (PRV, falling back
to PLD then RDP, the fallback named) with δ = 1e-5. BandMF's event is DP-SGD's at the group rate q_b over ⌈T/b⌉
steps (Choquette-Choo et al. 2023, Thm 1); BLT's run is one Gaussian mechanism ``(σ/sens, q = 1, 1 step)``, no
amplification (:mod:`dpllm.privacy.correlated.blt`). Next to each measured loss is the error each mechanism
predicts: σ·(prefix-sum RMSE of its strategy) in units of the clipping norm C (σ/sens·RMSE for BLT), the MF
literature's metric, also printed by ``dpllm plan --noise``.

1. **MLP** (the seed-000 scaling-law study's setting, ``shared/seeds/000``: Gaussian clusters, 400 train / 100 test
   records, Linear-ReLU-Linear width 64, SGD lr 0.01, C = 1, seeds 42/123/789): expected batch 64 (7 steps per
   pass) over 100 epochs and over 1 epoch, and a many-steps-per-pass variant (batch 8: 50 steps per pass) over 10
   epochs and 1. The training loop is :mod:`dpllm.mlp.batched`'s arithmetic (the runs of one setting in lockstep,
   per-sample gradients, the ``flat`` clipping function, noise from each run's own generator in Opacus's order,
   divided by the public expected batch), with the registry's sampler and recurrence per run; with independent
   noise it reproduces :func:`dpllm.mlp.batched.train_mlps` (tests/test_correlated_noise_study.py checks it).
   Reported: test cross-entropy (the seed paper's metric) and accuracy.
2. **Tiny Llama** (``recipes/finetune_llm.py``'s ``dpllm.train.train``, in process): a 2-layer × 32-wide Llama built
   from a config and trained from scratch (full fine-tuning, bk, AdamW) on 800 CPython stdlib records (≈ 635 train,
   max_length 64), expected batch 32 (20 steps per pass), 5 epochs and 1, with ``privacy.noise`` independent /
   banded (``bands: auto``) / blt. A row the recipe refuses is recorded as ``not run: <its message>``.
   Reported: held-out perplexity (bytes). ``privacy.reproducible_noise`` makes a row repeatable from its seed.

    python recipes/correlated_noise_study.py --output_dir docs/results/correlated_noise          # ~25 min, 2 cores
    python recipes/correlated_noise_study.py --output_dir runs/cn_quick --quick --parts mlp      # seconds (tests)
    python recipes/correlated_noise_study.py --output_dir runs/cn_checks --parts llama_checks    # ~8 min
    python recipes/correlated_noise_study.py --output_dir docs/results/correlated_noise --replot # tables, plot
    python recipes/correlated_noise_study.py --output_dir runs/cn_llama --parts llama             # one part again
    python recipes/correlated_noise_study.py --output_dir docs/results/correlated_noise \
        --merge runs/cn_llama/results.json                                                        # ...into the study

``--parts llama_checks`` runs two side checks of the Llama result: cyclic group sampling alone (σ = 0.01) and plain
SGD instead of AdamW at ε = 8. ``--replot`` rebuilds ``summary.md`` and the plot from an existing ``results.json``.
``--merge FILE`` trains nothing: in ``--output_dir``'s ``results.json`` it replaces the rows of every part that FILE
(another run's ``results.json``) holds, keeps the other parts' rows, and records which command made each part.

Writes ``results.json`` (every run with its σ, q, steps, δ, accountant, ε and prediction; the per-cell means with
95% Student-t intervals), ``summary.md`` and ``correlated_noise.png`` into ``--output_dir``.
"""

from __future__ import annotations

import datetime
import json
import math
import platform
from pathlib import Path
from typing import NamedTuple, Optional

import numpy as np
import torch
from mlp_study import (
    Timer,
    command_line,
    environment,
    fmt,
    markdown_table,
    progress,
    quiet_warnings,
    recipe_parser,
    save_figure,
    t_interval,
    write_outputs,
)

from dpllm.privacy import accounting
from dpllm.privacy.correlated import blt as blt_math
from dpllm.privacy.correlated import build

DELTA = 1e-5
EPSILONS = (1.0, 3.0, 8.0)
SEEDS = (42, 123, 789)  # the seed-000 paper's training seeds
LLAMA_SEEDS = (0, 1, 2)
LABELS = {"independent": "DP-SGD", "banded": "BandMF (bands auto)", "banded_k": "BandMF (b = min(k, 16))",
          "blt": "BLT (auto)"}
MLP_MECHANISMS = ("independent", "banded", "banded_k", "blt")
LLAMA_MECHANISMS = ("independent", "banded", "blt")


class Setting(NamedTuple):
    """One training setting: what the rows of one panel share."""

    part: str  # "mlp" or "llama"
    name: str
    batch: int
    epochs: int
    lr: float


def mlp_settings(quick: bool) -> list[Setting]:
    if quick:
        return [Setting("mlp", "seed-000, 3 epochs", 64, 3, 0.01)]
    return [Setting("mlp", "seed-000 (B 64), 100 epochs", 64, 100, 0.01),
            Setting("mlp", "seed-000 (B 64), 1 epoch", 64, 1, 0.01),
            Setting("mlp", "B 8 (50 steps/pass), lr 0.1, 10 epochs", 8, 10, 0.1),
            Setting("mlp", "B 8 (50 steps/pass), lr 0.1, 1 epoch", 8, 1, 0.1)]


# --- the mechanism of a row: registry build, calibration, accounting, prediction ----------------------------------

def fixed_bands(noise: str, k: int, steps: int) -> str:
    """``bands`` for a row: ``auto``, or min(k, 16, T) for the fixed-band BandMF row."""
    return str(min(k, 16, steps)) if noise == "banded_k" else "auto"


def mechanism_row(noise: str, *, steps: int, num_records: int, batch: int, target_epsilon: float) -> tuple:
    """The registry's mechanism for this row, its calibrated σ and the privacy fields every row records.

    Returns:
        ``(CorrelatedNoise, fields)``; ``fields`` hold σ (the draw's std in units of C), the accounted event
        ``(σ_acc, q, steps)``, δ, the accountant that ran, ε (and ε under RDP), and the predicted error.
    """
    k = math.ceil(num_records / batch)
    key = "banded" if noise == "banded_k" else noise
    mech = build(key, fixed_bands(noise, k, steps), steps=steps, num_records=num_records, batch=batch,
                 target_epsilon=target_epsilon, delta=DELTA, accountant="prv")
    sigma = mech.calibrate(target_epsilon=target_epsilon, delta=DELTA, accountant="prv")
    event = mech.event(sigma)
    switches: list[str] = []
    used, eps = accounting.first_that_runs("prv", lambda acc: (acc, accounting.compute_epsilon_history(
        history=[event], delta=DELTA, accountant=acc, strict=True)), on_switch=switches.append)
    rmse = mech.strategy.prefix_sum_rmse(steps)  # noise std 1 (BLT: times its sensitivity)
    fields = {
        "mechanism": mech.name, "bands": mech.bands, "buffers": getattr(getattr(mech.strategy, "blt", None),
                                                                         "buffers", None),
        "accounting": mech.accounting, "group_sample_rate": mech.sample_rate, "steps": steps,
        "noise_multiplier": sigma, "sensitivity": mech.sensitivity, "accounted_event": list(event), "delta": DELTA,
        "accountant": used, "accountant_note": "; ".join(switches) or None, "target_epsilon": target_epsilon,
        "epsilon": eps, "epsilon_rdp": accounting.compute_epsilon_history(history=[event], delta=DELTA,
                                                                          accountant="rdp"),
        "prefix_sum_rmse": rmse, "predicted_error": sigma / mech.sensitivity * rmse,
    }
    if mech.accounting == "gaussian_mechanism":  # the exact ε of one Gaussian mechanism, as a cross-check
        fields["epsilon_exact_gaussian"] = blt_math.epsilon_for_mu(mech.sensitivity / sigma, DELTA)
    return mech, fields


# --- MLP: the runs of one setting in lockstep, each with its own sampler, noise and recurrence ----------------------

def train_mlp_runs(runs: list[dict], data, *, setting: Setting, width: int = 64) -> list[dict]:
    """Train ``runs`` (dicts with ``seed`` and ``mech``: a CorrelatedNoise, or None for non-private) together.

    Each run: init from ``torch.manual_seed(seed)``, batches from its mechanism's sampler over its own
    ``mlp:sampling`` stream (cyclic groups keyed by the seed), noise N(0, σ²C²) per parameter from its own
    ``mlp:noise`` stream turned into this step's correlated noise by its recurrence, the sum divided by the public
    expected batch ⌊N/⌈N/B⌉⌋ (every mechanism alike), plain SGD. Returns test/train loss and accuracy per run.
    """
    from dpllm.mlp.batched import padded_batches, per_sample_grads, per_sample_norms, weighted_sums
    from dpllm.mlp.train import MLPRun, evaluate, make_mlp, record_texts
    from dpllm.privacy import clipping
    from dpllm.privacy.plan import batches_per_epoch
    from dpllm.sampling import PoissonBatchSampler, stream_seed

    x_all, y_all, n = data.x_train, data.y_train, data.n_train
    k = batches_per_epoch(n, setting.batch)
    steps = setting.epochs * k
    expected = float(int(n / k))  # dpllm.privacy.plan's expected_batch_size (banded too: ≈ N/b records at b·q)
    texts = record_texts(x_all, y_all)
    cfg = MLPRun(width=width, max_grad_norm=1.0).privacy_config()
    flat = clipping.get("flat")
    models, samplers, gens, recs = [], [], [], []
    for run in runs:
        torch.manual_seed(run["seed"])
        models.append(make_mlp(data.n_features, width, data.n_classes))
        sampling = torch.Generator().manual_seed(stream_seed(run["seed"], "mlp:sampling"))
        gens.append(torch.Generator().manual_seed(stream_seed(run["seed"], "mlp:noise")))
        mech = run["mech"]
        if mech is None:
            samplers.append(iter(PoissonBatchSampler(num_samples=n, sample_rate=1.0 / k, generator=sampling)))
            recs.append(None)
        else:
            samplers.append(iter(mech.sampler(texts=texts, key=run["seed"], generator=sampling)))
            recs.append(mech.recurrence())
    r_count = len(runs)
    params = [torch.stack([list(m.parameters())[i].detach() for m in models]).clone() for i in range(4)]
    private = torch.tensor([run["mech"] is not None for run in runs])
    rows = [r for r in range(r_count) if runs[r]["mech"] is not None]
    sens = flat.sensitivity(cfg)
    with torch.no_grad():
        for _ in range(steps):
            idx, mask = padded_batches([next(s) for s in samplers])
            factors = per_sample_grads(params, x_all[idx], y_all[idx])
            weights = flat.weights(per_sample_norms(*factors), cfg)
            counts = mask.sum(1)
            weights = torch.where(private.unsqueeze(1), weights, 1.0 / counts.clamp_min(1).unsqueeze(1)) * mask
            sums = weighted_sums(weights, *factors)
            for r in rows:  # Opacus's order: one draw per parameter; the recurrence turns it into x_t
                std = runs[r]["noise_multiplier"] * sens
                for i, p in enumerate(sums):
                    z = torch.normal(0.0, std, size=p.shape[1:], generator=gens[r])
                    x = z if recs[r] is None else recs[r].apply(i, z)
                    p[r] = (p[r] + x) / expected
                if recs[r] is not None:
                    recs[r].end_step()
            step = torch.tensor([runs[r]["lr"] for r in range(r_count)]) * (private | (counts > 0))
            for p, g in zip(params, sums):
                p -= step.view(-1, *([1] * (p.dim() - 1))) * g
    out = []
    for r, model in enumerate(models):
        with torch.no_grad():
            for p, stacked in zip(model.parameters(), params):
                p.copy_(stacked[r])
        m = {f"test_{a}": b for a, b in evaluate(model, data.x_test, data.y_test).items()}
        m.update({f"train_{a}": b for a, b in evaluate(model, x_all, y_all).items()})
        out.append(m)
    return out


def run_mlp(quick: bool, no_progress: bool) -> list[dict]:
    from dpllm.mlp.data import load_dataset
    from dpllm.privacy.plan import batches_per_epoch

    data = load_dataset("gaussian")
    seeds = SEEDS[:1] if quick else SEEDS
    epsilons = (1.0, 8.0) if quick else EPSILONS
    rows: list[dict] = []
    settings = mlp_settings(quick)
    bar = progress(len(settings), "MLP settings", no_progress)
    for s in settings:
        k = batches_per_epoch(data.n_train, s.batch)
        steps = s.epochs * k
        runs = [{"seed": seed, "mech": None, "noise_multiplier": 0.0, "lr": s.lr,
                 "row": {"mechanism_key": "non-private", "label": "non-private", "target_epsilon": None,
                         "epsilon": None}} for seed in seeds]
        for eps in epsilons:
            for noise in MLP_MECHANISMS:
                mech, fields = mechanism_row(noise, steps=steps, num_records=data.n_train, batch=s.batch,
                                             target_epsilon=eps)
                runs += [{"seed": seed, "mech": mech, "noise_multiplier": fields["noise_multiplier"], "lr": s.lr,
                          "row": {"mechanism_key": noise, "label": LABELS[noise], **fields}} for seed in seeds]
        metrics = train_mlp_runs(runs, data, setting=s)
        for run, m in zip(runs, metrics):
            rows.append({"part": "mlp", "setting": s.name, "batch": s.batch, "epochs": s.epochs,
                         "steps_per_pass": k, "total_steps": steps, "lr": s.lr, "seed": run["seed"],
                         "status": "ran", **run["row"], "metrics": m, "metric": m["test_loss"]})
        bar.update()
    bar.close()
    return rows


# --- tiny Llama through the recipe ---------------------------------------------------------------------------------

LLAMA_ARGS = ["--model_name_or_path", "tiny-llama", "--finetuning", "full", "--tiny_hidden_size", "32",
              "--tiny_num_layers", "2", "--tiny_num_heads", "2", "--tiny_intermediate_size", "64",
              "--dataset", "pystdlib", "--max_records", "800", "--max_length", "64", "--heldout_fraction", "0.2",
              "--logical_batch_size", "32", "--physical_batch_size", "32", "--learning_rate", "0.01",
              "--eval_every", "0", "--target_delta", "1e-5", "--grad_sample_mode", "bk", "--accountant", "prv",
              "--reproducible_noise", "true", "--progress", "false", "--overwrite_output_dir", "true"]
LLAMA_QUICK = ["--max_records", "200", "--eval_max_records", "16"]


def llama_settings(quick: bool) -> list[Setting]:
    if quick:
        return [Setting("llama", "tiny Llama, 2 epochs", 32, 2, 0.01)]
    return [Setting("llama", "tiny Llama (B 32), 5 epochs", 32, 5, 0.01),
            Setting("llama", "tiny Llama (B 32), 1 epoch", 32, 1, 0.01)]


def llama_prefix_sum_rmse(noise: str, *, bands: int, steps: int, num_records: int, batch: int) -> float:
    """The prefix-sum RMSE (noise std 1) of the strategy a recipe run used: DP-SGD, BandMF with the b it chose
    (the registry's deterministic optimum for (b, T)), or the registry's BLT for the run's N, B and T, divided by
    its sensitivity (the recipe's σ is the draw's std, so σ·this is the error in units of C)."""
    from dpllm.privacy.correlated import BandMF, Independent

    if noise == "blt":
        mech = build("blt", "auto", steps=steps, num_records=num_records, batch=batch)
        return mech.strategy.prefix_sum_rmse(steps) / mech.sensitivity
    strategy = Independent() if bands == 1 else BandMF.optimized(bands=bands, steps=steps)
    return strategy.prefix_sum_rmse(steps)


def run_llama(work: Path, quick: bool, no_progress: bool) -> list[dict]:
    """Every Llama row through ``dpllm.train.train`` (the recipe's trainer), run directories under ``work``."""
    from dpllm.config import ConfigError, parse_config
    from dpllm.privacy.accounting import PrivacyPlanError
    from dpllm.train import train

    seeds = LLAMA_SEEDS[:1] if quick else LLAMA_SEEDS
    epsilons = (8.0,) if quick else EPSILONS
    settings = llama_settings(quick)
    cells = [(s, None, "non-private", seed) for s in settings for seed in seeds]
    cells += [(s, eps, noise, seed) for s in settings for eps in epsilons for noise in LLAMA_MECHANISMS
              for seed in seeds]
    rows: list[dict] = []
    bar = progress(len(cells), "tiny Llama runs", no_progress)
    for s, eps, noise, seed in cells:
        run_dir = work / f"{s.epochs}ep_eps{eps or 0:g}_{noise}_{seed}"
        privacy = (["--enabled", "false"] if eps is None else
                   ["--target_epsilon", str(eps), "--noise", noise])
        argv = [*LLAMA_ARGS, *(LLAMA_QUICK if quick else []), "--epochs", str(s.epochs), "--seed", str(seed),
                *privacy, "--output_dir", str(run_dir)]
        row = {"part": "llama", "setting": s.name, "batch": s.batch, "epochs": s.epochs, "lr": s.lr, "seed": seed,
               "mechanism_key": noise, "label": LABELS.get(noise, noise), "target_epsilon": eps,
               "recipe_args": argv}
        try:
            summary = train(parse_config(argv))
        except (ConfigError, PrivacyPlanError, ValueError, NotImplementedError) as err:
            rows.append({**row, "status": f"not run: {err}", "metric": None})
            bar.update()
            continue
        if eps is None:  # the non-private reference: same model, data, batches per pass and steps
            rows.append({**row, "status": "ran", "epsilon": None, "total_steps": summary["steps"],
                         "metrics": {"heldout_ppl": summary["final_eval_ppl"],
                                     "heldout_loss": summary["final_eval_loss"]}, "metric": summary["final_eval_ppl"]})
            bar.update()
            continue
        report = json.loads((run_dir / "privacy_report.json").read_text())
        n, steps = report["num_records"], report["steps"]
        k = math.ceil(n / s.batch)
        cn = report.get("correlated_noise") or {}
        chosen = int(cn.get("bands", 1))
        rmse = llama_prefix_sum_rmse(noise, bands=chosen, steps=steps, num_records=n, batch=s.batch)
        predicted = {"prefix_sum_rmse": rmse, "predicted_error": report["noise_multiplier"] * rmse}
        history = [tuple(h) for h in report["history"]]
        rows.append({**row, "status": "ran", "steps_per_pass": k, "total_steps": steps, "num_records": n,
                     "mechanism": cn.get("mechanism", "independent"), "bands": chosen, "buffers": cn.get("buffers"),
                     "sensitivity": cn.get("sensitivity"), "group_sample_rate": report["sample_rate"],
                     "noise_multiplier": report["noise_multiplier"], "accounted_event": list(history[0]),
                     "history": [list(h) for h in history], "delta": report["delta"],
                     "accountant": report["accountant"], "epsilon": report["epsilon"],
                     "epsilon_recomputed": accounting.compute_epsilon_history(
                         history=history, delta=report["delta"], accountant=report["accountant"]),
                     "prefix_sum_rmse": predicted["prefix_sum_rmse"], "predicted_error": predicted["predicted_error"],
                     "metrics": {"heldout_ppl": summary["final_eval_ppl"], "heldout_loss": summary["final_eval_loss"]},
                     "metric": summary["final_eval_ppl"]})
        bar.update()
    bar.close()
    return rows


def step_noise_std(row: dict) -> float | None:
    """The std of the noise ONE update carries, σ·‖row T of C⁻¹‖ in units of C (DP-SGD: σ). Correlated noise
    cancels in the prefix sums, but every single step carries more of it than DP-SGD's at the same ε."""
    from scipy.signal import lfilter

    from dpllm.privacy.correlated import BandMF, blt_strategy

    mech, sigma, steps = row.get("mechanism"), row.get("noise_multiplier"), row.get("steps") or row.get("total_steps")
    if mech is None or sigma is None:
        return None
    if mech == "independent" or row.get("bands") == 1:
        return float(sigma)
    if mech == "banded":
        c = np.asarray(BandMF.optimized(bands=int(row["bands"]), steps=int(steps)).coefficients)
        inverse = lfilter([1.0], c, np.eye(1, int(steps))[0])
    else:
        inverse = blt_strategy(steps=int(steps), groups=int(row["bands"]), buffers=row.get("buffers")).blt \
            .inverse().coefs(int(steps))
    return float(sigma * np.linalg.norm(inverse))


# Two side checks of why BandMF loses on the tiny Llama (docs/results/correlated_noise/README.md): (1) cyclic group
# sampling alone, with negligible noise (σ = 0.01, ε not meaningful, RDP); (2) plain SGD instead of AdamW at ε = 8.
LLAMA_CHECKS = (
    ("sampling only (σ = 0.01)", None,
     ["--noise_multiplier", "0.01", "--target_epsilon", "1e12", "--accountant", "rdp"],
     (("independent", "auto"), ("banded", "4"), ("banded", "16"))),
    ("SGD lr 0.5, ε = 8", 8.0, ["--optimizer", "sgd", "--learning_rate", "0.5", "--target_epsilon", "8"],
     (("independent", "auto"), ("banded", "auto"))),
)


def run_llama_checks(work: Path, no_progress: bool) -> list[dict]:
    """The side checks above, 5 epochs, seeds 0–2, through ``dpllm.train.train``."""
    from dpllm.config import parse_config
    from dpllm.train import train

    todo = [(name, eps, extra, noise, bands, seed) for name, eps, extra, mechs in LLAMA_CHECKS
            for noise, bands in mechs for seed in LLAMA_SEEDS]
    rows, bar = [], progress(len(todo), "tiny Llama checks", no_progress)
    for i, (name, eps, extra, noise, bands, seed) in enumerate(todo):
        argv = [*LLAMA_ARGS, "--epochs", "5", "--seed", str(seed), *extra, "--noise", noise, "--bands", bands,
                "--output_dir", str(work / f"check{i}")]
        summary = train(parse_config(argv))
        report = json.loads((work / f"check{i}" / "privacy_report.json").read_text())
        chosen = int((report.get("correlated_noise") or {}).get("bands", 1))
        key = noise if bands == "auto" else f"{noise}_{bands}"
        rows.append({"part": "llama_checks", "setting": name, "target_epsilon": eps, "mechanism_key": key,
                     "label": LABELS.get(key, f"BandMF (b = {bands})"), "seed": seed, "status": "ran",
                     "recipe_args": argv, "mechanism": "banded" if chosen > 1 else "independent", "bands": chosen,
                     "total_steps": report["steps"], "noise_multiplier": report["noise_multiplier"],
                     "history": report["history"], "epsilon": report["epsilon"], "accountant": report["accountant"],
                     "metrics": {"heldout_ppl": summary["final_eval_ppl"]}, "metric": summary["final_eval_ppl"]})
        bar.update()
    bar.close()
    return rows


# --- summary: per-cell means with t-intervals, paired differences against DP-SGD -----------------------------------

def cells(rows: list[dict]) -> list[dict]:
    out = []
    keys = list(dict.fromkeys((r["part"], r["setting"], r["target_epsilon"], r["mechanism_key"]) for r in rows))
    for part, setting, eps, key in keys:
        rs = [r for r in rows if (r["part"], r["setting"], r["target_epsilon"], r["mechanism_key"])
              == (part, setting, eps, key)]
        ran = [r for r in rs if r["status"] == "ran"]
        cell = {"part": part, "setting": setting, "target_epsilon": eps, "mechanism_key": key,
                "label": rs[0]["label"], "runs": len(ran), "status": rs[0]["status"] if not ran else "ran"}
        if ran:
            m, lo, hi = t_interval(r["metric"] for r in ran)
            cell.update(mean=m, ci=[lo, hi], epsilon_max=max((r["epsilon"] or 0.0) for r in ran) if eps else None,
                        noise_multiplier=ran[0].get("noise_multiplier"), bands=ran[0].get("bands"),
                        buffers=ran[0].get("buffers"), predicted_error=ran[0].get("predicted_error"),
                        step_noise_std=step_noise_std(ran[0]))
            base = [r for r in rows if (r["part"], r["setting"], r["target_epsilon"], r["mechanism_key"])
                    == (part, setting, eps, "independent") and r["status"] == "ran"]
            if key not in ("independent", "non-private") and base:
                by_seed = {r["seed"]: r["metric"] for r in base}
                diffs = [r["metric"] - by_seed[r["seed"]] for r in ran if r["seed"] in by_seed]
                if diffs:
                    d, dlo, dhi = t_interval(diffs)
                    cell.update(diff_vs_dpsgd=d, diff_ci=[dlo, dhi])
        out.append(cell)
    return out


PARTS = ("mlp", "llama", "llama_checks")


def provenance(res: dict) -> dict[str, dict]:
    """Which command made each part's rows, with its date, machine and wall time: ``res["parts"]``, or, for a
    results.json written by one command, that command for every part its rows hold."""
    if "parts" in res:
        return res["parts"]
    made = {"command": res["command"], "date": res["date"], "machine": res["machine"],
            "wall_s": (res.get("timing") or {}).get("wall_s"), "environment": res.get("environment")}
    return {part: made for part in dict.fromkeys(r["part"] for r in res["rows"])}


def merge_results(base: dict, new: dict, *, command: str) -> dict:
    """``base`` with the rows of every part that ``new`` holds replaced by ``new``'s; the other parts' rows kept.

    Raises:
        ValueError: ``new`` holds no rows, or the two were run at different ``--quick`` or δ (their rows would not
            belong in one table).
    """
    parts = list(dict.fromkeys(r["part"] for r in new["rows"]))
    if not parts:
        raise ValueError("the results.json to merge holds no rows; run a part first (--parts llama)")
    for key in ("quick", "delta"):
        if base.get(key) != new.get(key):
            raise ValueError(f"cannot merge: {key} is {new.get(key)} in the file to merge and {base.get(key)} in "
                             "--output_dir's results.json; rerun the part with the same setting")
    rows = [r for r in base["rows"] if r["part"] not in parts] + new["rows"]
    rows.sort(key=lambda r: PARTS.index(r["part"]))  # stable: each part's rows keep their order
    made = {**provenance(base), **provenance(new)}
    present = dict.fromkeys(r["part"] for r in rows)
    res = {**base, "rows": rows, "cells": cells(rows), "parts": {p: made[p] for p in present},
           "merged": {"command": command,
                      "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                      "replaced_parts": parts}}
    return res


def header(res: dict) -> list[str]:
    """The command(s) that made the rows: one, or one per part after ``--merge``."""
    if "parts" not in res:
        return [f"Command: `{res['command']}`  ", f"Date: {res['date']}; machine: {res['machine']}; wall time "
                f"{res['timing']['wall_s']} s.", ""]
    lines = ["Commands, by the part whose rows each made (wall time: the whole command):", ""]
    for part, made in res["parts"].items():
        lines.append(f"- {part}: `{made['command']}`; {made['date']}; {made['machine']}; wall time "
                     f"{made['wall_s']} s.")
    m = res["merged"]
    return [*lines, f"- merged by `{m['command']}` ({m['date']}; replaced: {', '.join(m['replaced_parts'])}).", ""]


def summary(res: dict) -> str:
    lines = ["# Correlated noise at equal ε: DP-SGD vs BandMF vs BLT (issue 45)", "", *header(res),
             f"δ = {DELTA:g}; ε from the PRV accountant on each row's recorded event (σ, q, steps); the prediction is "
             "σ·RMSE of the prefix-sum workload in units of C (BLT: σ/sens·RMSE). Intervals: 95% Student-t over "
             "seeds; Δ is paired by seed against DP-SGD (negative = better).", ""]
    titles = {"mlp": "MLP (seed-000 setting)", "llama": "Tiny Llama (recipes/finetune_llm.py)",
              "llama_checks": "Tiny Llama, side checks (5 epochs; b as given or auto)"}
    ppl = "held-out perplexity"
    for part, metric in (("mlp", "test loss"), ("llama", ppl), ("llama_checks", ppl)):
        cs = [c for c in res["cells"] if c["part"] == part]
        if not cs:
            continue
        lines += [f"## {titles[part]}", ""]
        table = []
        for c in cs:
            if c["status"] != "ran":
                table.append([c["setting"], fmt(c["target_epsilon"]), c["label"], "", "", "", "", "",
                              c["status"][:90], ""])
                continue
            diff = (f"{c['diff_vs_dpsgd']:+.4f} [{c['diff_ci'][0]:+.4f}, {c['diff_ci'][1]:+.4f}]"
                    if "diff_vs_dpsgd" in c else "")
            table.append([c["setting"], fmt(c["target_epsilon"]), c["label"], c.get("bands") or "",
                          fmt(c.get("noise_multiplier")), fmt(c.get("epsilon_max"), 4), fmt(c.get("predicted_error")),
                          fmt(c.get("step_noise_std")),
                          f"{c['mean']:.4f} [{c['ci'][0]:.4f}, {c['ci'][1]:.4f}]", diff])
        lines += [markdown_table(["setting", "target ε", "noise", "b", "σ", "ε (max over seeds)",
                                  "predicted error σ·RMSE", "noise std per step", f"{metric} [95% CI]",
                                  "Δ vs DP-SGD [95% CI]"], table), ""]
    if res.get("plot"):
        lines += [f"Plot: ![{res['plot']}]({res['plot']})", ""]
    return "\n".join(lines)


def plot(res: dict, path: Path) -> str:
    """Top: each mechanism's metric minus DP-SGD's, paired by seed (mean and 95% t-interval; below 0 is better).
    Bottom: its predicted error σ·RMSE over DP-SGD's. One column per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    panels = list(dict.fromkeys((c["part"], c["setting"]) for c in res["cells"] if c["part"] != "llama_checks"))
    if not panels:
        return ""
    fig, axes = plt.subplots(2, len(panels), figsize=(3.4 * len(panels), 6.2), squeeze=False)
    for j, (part, setting) in enumerate(panels):
        cs = [c for c in res["cells"] if (c["part"], c["setting"]) == (part, setting)]
        base = {c["target_epsilon"]: c for c in cs if c["mechanism_key"] == "independent" and c["status"] == "ran"}
        keys = [k for k in dict.fromkeys(c["mechanism_key"] for c in cs) if k not in ("non-private", "independent")]
        for key in keys:
            i = MLP_MECHANISMS.index(key)  # one colour per mechanism in every panel (the legend is the first's)
            pts = [c for c in cs if c["mechanism_key"] == key and c["status"] == "ran" and "diff_vs_dpsgd" in c]
            if not pts:
                continue
            xs = np.array([c["target_epsilon"] for c in pts]) * (1 + 0.05 * (i - 2))
            ys = np.array([c["diff_vs_dpsgd"] for c in pts])
            err = np.array([[c["diff_vs_dpsgd"] - c["diff_ci"][0], c["diff_ci"][1] - c["diff_vs_dpsgd"]]
                            for c in pts]).T
            axes[0, j].errorbar(xs, ys, yerr=err, fmt="o-", capsize=3, color=f"C{i}", label=LABELS[key], ms=4)
            axes[1, j].plot(xs, [c["predicted_error"] / base[c["target_epsilon"]]["predicted_error"] for c in pts],
                            "o-", color=f"C{i}", label=LABELS[key], ms=4)
        not_run = [c for c in cs if c["status"] != "ran"]
        if not_run:
            axes[0, j].text(0.02, 0.02, f"{LABELS[not_run[0]['mechanism_key']]}: not run (recipe refuses)",
                            transform=axes[0, j].transAxes, fontsize=7)
        axes[0, j].axhline(0.0, color="C0", lw=1, label="DP-SGD")
        axes[1, j].axhline(1.0, color="C0", lw=1, label="DP-SGD")
        for row in range(2):
            ax = axes[row, j]
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_xticks(list(EPSILONS), [f"{e:g}" for e in EPSILONS])
            ax.set_xlabel("ε (δ = 1e-5)")
        axes[0, j].set_title(setting, fontsize=9)
        axes[0, j].set_ylabel(("test loss" if part == "mlp" else "held-out perplexity") + " − DP-SGD's")
        axes[1, j].set_ylabel("predicted σ·RMSE / DP-SGD's")
    axes[0, 0].legend(fontsize=7)
    fig.suptitle("Equal ε: measured difference to DP-SGD, paired by seed (top; below 0 is better) and predicted "
                 "prefix-sum error relative to DP-SGD (bottom)", fontsize=9)
    return save_figure(fig, path)


def main(argv: Optional[list[str]] = None, *, command: bool = False) -> dict:
    parser = recipe_parser(__doc__, default_output="runs/correlated_noise", dataset=None)
    parser.add_argument("--parts", nargs="+", choices=["mlp", "llama", "llama_checks"], default=["mlp", "llama"],
                        help="which settings to run (llama_checks: the side checks of why BandMF loses on the Llama)")
    parser.add_argument("--replot", action="store_true",
                        help="only rebuild summary.md and the plot from --output_dir's results.json (no training)")
    parser.add_argument("--merge", metavar="RESULTS_JSON", default=None,
                        help="no training: replace the rows of the parts RESULTS_JSON holds (another run's "
                             "results.json) in --output_dir's results.json, keep the rest, rebuild tables and plot")
    args = parser.parse_args(argv)
    if command:  # a process of its own, and every model it trains or loads is a tiny one built from a config
        from dpllm.quantization import quiet_command

        quiet_command("tiny-llama")
    out = Path(args.output_dir)
    if args.merge:
        target, source = out / "results.json", Path(args.merge)
        for path in (target, source):
            if not path.is_file():
                raise SystemExit(f"--merge: {path} does not exist; --output_dir must hold the study's results.json "
                                 "and --merge name the results.json of a --parts run")
        res = merge_results(json.loads(target.read_text()), json.loads(source.read_text()),
                            command=command_line(__file__, argv))
        res["plot"] = plot(res, out / "correlated_noise.png")
        write_outputs(out, res, summary(res))
        return res
    if args.replot:
        res = json.loads((out / "results.json").read_text())
        res["cells"] = cells(res["rows"])
        res["plot"] = plot(res, out / "correlated_noise.png")
        write_outputs(out, res, summary(res))
        return res
    quiet_warnings()
    torch.set_num_threads(1)
    timer = Timer()
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    if "mlp" in args.parts:
        rows += run_mlp(args.quick, args.no_progress)
    if "llama" in args.parts:
        from dpllm.logs import setup_logging

        setup_logging()
        import tempfile

        # the run directories (checkpoints, private held-out losses, noise state) stay out of --output_dir
        with tempfile.TemporaryDirectory(prefix="correlated_noise_llama_") as work:
            rows += run_llama(Path(work), args.quick, args.no_progress)
    if "llama_checks" in args.parts:
        import tempfile

        from dpllm.logs import setup_logging

        setup_logging()
        with tempfile.TemporaryDirectory(prefix="correlated_noise_checks_") as work:
            rows += run_llama_checks(Path(work), args.no_progress)
    res = {"study": "correlated_noise", "command": command_line(__file__, argv), "quick": args.quick,
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "machine": f"{platform.machine()}, {environment()['cpus']} CPUs, torch threads 1",
           "environment": environment(), "delta": DELTA, "rows": rows, "cells": cells(rows)}
    res["plot"] = plot(res, out / "correlated_noise.png")
    res["timing"] = {"wall_s": timer.seconds(), "cpu_s": timer.cpu_seconds()}
    write_outputs(out, res, summary(res))
    print(summary(res))
    return res


if __name__ == "__main__":
    main(command=True)  # quiet_command: for this process only, never a caller's
