"""LiRA for language models: train shadow copies of a run, score its records, evaluate.

``python -m mia lira --run RUN_DIR --shadows 8`` audits a dpllm run directory with the likelihood-ratio
attack of Carlini et al. (2022):

1. The candidate pool is the run's members (``train`` split) and non-members (``heldout`` split).
2. Shadow models are trained with the run's own configuration (DP settings included), each on a
   random half of the pool. Shadows come in pairs trained on complementary halves, so every record
   is IN for exactly half of the shadows (the balanced design of the LiRA paper).
3. Every model (target and shadows) gives each record a confidence; :func:`mia.lira.lira_online`
   (or ``lira_offline``) turns the target's confidence and the shadows' IN / OUT distributions into
   a membership score, which is evaluated against the true labels with :func:`mia.metrics.evaluate`.

The inclusion mask handed to LiRA is read back from each shadow run's ``splits.json`` (which records
it actually trained on), not from the intended halves, so a wrong mask cannot go unnoticed.

Example:
    >>> report, scores, details = lira_audit("runs/x", n_shadows=8)  # doctest: +SKIP
    >>> report["attacks"]["lira"]["auc"]  # doctest: +SKIP
    0.93
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from mia.metrics import DEFAULT_FPRS, evaluate

# The trainer always holds out >= 1 record for evaluation. We choose which: this placeholder, put at
# the position the deterministic split will hold out, so every pool record meant IN is trained on.
FILLER = "LiRA shadow placeholder: held out for evaluation, never trained on."
# Per-record variances need many shadows; below this the IN and OUT variances are pooled over
# records, as the LiRA paper recommends for few shadows.
GLOBAL_VARIANCE_BELOW = 64


MIN_SHADOWS = 4


def check_n_shadows(n_shadows: int) -> None:
    """Raise ValueError unless ``n_shadows`` is even and at least :data:`MIN_SHADOWS`.

    Even: shadows are trained in pairs on complementary halves. At least 4: with 2, every record has
    one IN and one OUT shadow, and no variance (pooled or not) can be estimated from one value per
    record, so LiRA would fail only after all shadows were trained.
    """
    if n_shadows < MIN_SHADOWS or n_shadows % 2:
        raise ValueError(f"--shadows {n_shadows}: need an even number >= {MIN_SHADOWS} (shadows are "
                         f"trained in pairs on complementary halves, so each record is IN for exactly "
                         f"half, and LiRA needs >= 2 IN and >= 2 OUT shadows per record to estimate a "
                         f"variance); try --shadows {max(MIN_SHADOWS, n_shadows + n_shadows % 2)}")


def balanced_inclusion(n_records: int, n_shadows: int, rng: np.random.Generator) -> np.ndarray:
    """Which shadow trains on which record: ``[n_shadows, n_records]`` booleans.

    Shadows ``2k`` and ``2k + 1`` get complementary random halves of the records, so each record is
    IN for exactly ``n_shadows / 2`` shadows and every shadow has (about) ``n_records / 2`` records.

    Args:
        n_records: Pool size.
        n_shadows: Even number of shadow models (>= 4).
        rng: Source of the random halves.

    Raises:
        ValueError: For an odd or too small ``n_shadows``.
    """
    check_n_shadows(n_shadows)
    mask = np.zeros((n_shadows, n_records), dtype=bool)
    for k in range(0, n_shadows, 2):
        perm = rng.permutation(n_records)
        # With an odd pool one half is a record larger; alternate which shadow gets it.
        cut = n_records // 2 + (n_records % 2) * ((k // 2) % 2)
        mask[k, perm[:cut]] = True
        mask[k + 1] = ~mask[k]
    return mask


def sequence_confidence(signals) -> np.ndarray:
    """A record's confidence: its mean token log-probability ``-loss`` (log geometric-mean prob).

    Why the mean rather than the total log-probability: LiRA fits one Gaussian per record, and with
    few shadows the variance is pooled over records; a sum grows with the record's length (and so
    does its spread), so pooled variances would be dominated by long records. The per-token mean is
    on one scale for all records. It is ``log p`` of the geometric-mean token probability ``p`` in
    (0, 1], so it is passed to LiRA with ``input_scale="logprob"``, which applies the stable logit
    ``phi = log(p / (1 - p))`` (:func:`mia.lira.logit_confidence`): near p -> 1 (memorised records)
    the logit stretches the scale, which makes the shadow distributions close to Gaussian — the same
    reason the LiRA paper uses it for classifiers. Target and shadows use this same function.
    """
    return -np.asarray(signals.loss, dtype=np.float64)


def shadow_config(run_cfg: dict, *, dataset: str | Path, output_dir: str | Path, seed: int):
    """The run's configuration, retargeted to train one shadow on ``dataset``.

    Everything that shapes training (model, optimiser, epochs, batch sizes, the privacy section) is
    kept, so shadows mimic the target; data selection and bookkeeping are overridden.

    Args:
        run_cfg: ``RunConfig.to_dict()`` of the target run.
        dataset: JSONL file (column ``text``) with the shadow's records and the filler.
        output_dir: The shadow's run directory.
        seed: Training seed of the shadow (its initialisation / batch order differs per shadow).

    Returns:
        A validated :class:`dpllm.config.RunConfig`.
    """
    from dpllm.config import config_from_dict

    cfg = json.loads(json.dumps(run_cfg))  # deep copy; the dict is plain data
    cfg["data"].update(dataset=str(dataset), text_column="text", dataset_config_name=None,
                       # Smallest non-zero fraction: the trainer then holds out exactly one record
                       # (max(1, round(f * n))), which is the filler.
                       heldout_fraction=1e-9, num_canaries=0, public_fraction=0.0,
                       max_records=None, min_chars=1, train_on="private")
    cfg["train"].update(output_dir=str(output_dir), overwrite_output_dir=True, progress=False,
                        eval_every=0, runs_file=None, save_every=None, resume_from=None, seed=seed)
    return config_from_dict(cfg)


def write_shadow_dataset(path: str | Path, texts: list[str], data_cfg) -> None:
    """Write ``texts`` plus the filler as JSONL, and set ``data_cfg``'s split so that it holds out the filler only.

    ``dpllm.data.make_splits`` holds a record out when its keyed hash under ``split_seed`` falls below
    ``heldout_fraction``; this picks the first ``split_seed`` under which the filler's hash is the smallest of
    all (expected ~len(texts) tries, each stopping at the first record below the filler) and a
    ``heldout_fraction`` between the filler's hash and the next one, before training.
    """
    from dpllm.data import keyed_draw

    if FILLER in texts:
        raise ValueError("a pool record equals the LiRA filler text; cannot place the held-out record")
    unique = list(dict.fromkeys(t.strip() for t in texts))
    for seed in range(100 * (len(unique) + 10)):
        filler = keyed_draw(FILLER, key=seed, purpose="split")
        if all(keyed_draw(t, key=seed, purpose="split") > filler for t in unique):
            nearest = min((keyed_draw(t, key=seed, purpose="split") for t in unique), default=1.0)
            data_cfg.split_seed, data_cfg.heldout_fraction = seed, (filler + nearest) / 2
            break
    else:  # probability (1 - 1/(n+1))^(100(n+10)) < e^-99
        raise ValueError("no split key holds out the LiRA filler alone")
    Path(path).write_text("".join(json.dumps({"text": t}) + "\n" for t in [*texts, FILLER]), encoding="utf-8")


def trained_on(shadow_dir: str | Path, pool: list[str]) -> np.ndarray:
    """Which pool records a finished shadow run actually trained on (from its ``splits.json``)."""
    from dpllm.data import load_split_texts

    index = {t: i for i, t in enumerate(pool)}
    mask = np.zeros(len(pool), dtype=bool)
    for text in load_split_texts(shadow_dir, "train"):
        if text == FILLER:
            continue  # a placeholder, not a candidate record
        if text not in index:
            raise ValueError(f"shadow {shadow_dir} trained on a record outside the pool "
                             f"({text[:60]!r}); a stale dataset cache? delete {shadow_dir} and rerun")
        mask[index[text]] = True
    return mask


def lira_audit(run_dir: str | Path, *, n_shadows: int = 8, out_dir: str | Path | None = None,
               offline: bool = False, max_records: int | None = None, seed: int = 0,
               batch_size: int = 8, device: str = "cpu", dtype: str = "auto",
               n_bootstrap: int = 1000, progress: bool = True) -> tuple[dict, dict]:
    """Train shadows of a run, score its members and non-members with LiRA, evaluate.

    Args:
        run_dir: The target run directory (``splits.json``, ``config.yaml``, ``checkpoint/``).
        n_shadows: Even number of shadow models (>= 4).
        out_dir: Where shadows (``shadows/shadow_XX``) and reports go; default ``RUN_DIR/audit``.
        offline: Offline LiRA (OUT shadows only) instead of online.
        max_records: Use at most this many members and this many non-members (random, seeded).
        seed: Seed of the subsampling, the shadows' halves, their training seeds and the bootstrap.
        batch_size: Records per forward pass when scoring.
        device: Where models are scored (shadows train where the run config says).
        dtype: Scoring dtype (see :func:`mia.audit.resolve_dtype`).
        n_bootstrap: Bootstrap replicates of the CIs.
        progress: tqdm bar over the shadows.

    Returns:
        ``(report, scores, details)``: the dict written to ``lira_report.json``;
        ``{"lira": (member_scores, nonmember_scores), "loss": (...)}`` (the loss attack on the same
        records, for comparison); and the raw LiRA inputs for re-analysis, over the pool (members
        first): ``{"n_members", "target_confidence" [n], "shadow_confidence" [n_shadows, n],
        "shadow_in" [n_shadows, n]}`` (the mask actually trained on).

    Raises:
        ValueError: Bad ``n_shadows``, a directory that is not a finished run, too few records.
    """
    from tqdm.auto import tqdm

    from dpllm.config import load_config_file
    from mia import audit
    from mia.lira import lira_offline, lira_online
    from mia.signals import compute_signals

    check_n_shadows(n_shadows)
    run_dir = Path(run_dir)
    if not audit.is_run_dir(run_dir):
        raise ValueError(f"{run_dir} has no splits.json; pass a dpllm run directory (LiRA retrains "
                         f"the run's configuration on its own records)")
    if not (run_dir / "config.yaml").is_file():
        raise ValueError(f"{run_dir} has no config.yaml; shadows are trained with the run's config")
    out = Path(out_dir) if out_dir is not None else run_dir / "audit"
    members, nonmembers = audit.load_run_records(run_dir)
    audit.check_member_sets(members, nonmembers)
    rng = np.random.default_rng(seed)
    members = audit._subsample(members, max_records, rng)
    nonmembers = audit._subsample(nonmembers, max_records, rng)
    pool = members + nonmembers
    n_m = len(members)
    max_length = audit.run_max_length(run_dir)
    common = {"max_length": max_length, "batch_size": batch_size, "device": device, "progress": False,
              "record_format": audit.run_sft_format(run_dir)}  # the run's record shape, as trained

    # The target first: a missing checkpoint should fail before minutes of shadow training.
    model, tok = audit.load_run_model(run_dir, device=device, dtype=dtype)
    target_sig = compute_signals(model, tok, pool, **common)
    del model
    target_conf = sequence_confidence(target_sig)

    from dpllm.train import train

    run_cfg = load_config_file(run_dir / "config.yaml").to_dict()
    intended = balanced_inclusion(len(pool), n_shadows, rng)
    # Training seeds of the shadows: distinct from each other and, by the offset, from the
    # target's seed (an attacker does not know the target's initialisation or batch order).
    base_seed = int(run_cfg["train"].get("seed", 0)) + 1 + 1000 * seed
    shadow_root = out / "shadows"
    shadow_root.mkdir(parents=True, exist_ok=True)
    shadow_conf = np.zeros((n_shadows, len(pool)))
    actual = np.zeros_like(intended)
    for s in tqdm(range(n_shadows), desc="shadows", disable=not progress):
        sdir = shadow_root / f"shadow_{s:02d}"
        data_path = shadow_root / f"shadow_{s:02d}.jsonl"
        cfg = shadow_config(run_cfg, dataset=data_path, output_dir=sdir, seed=base_seed + s)
        write_shadow_dataset(data_path, [pool[i] for i in np.flatnonzero(intended[s])], cfg.data)
        train(cfg)
        actual[s] = trained_on(sdir, pool)
        smodel, stok = audit.load_run_model(sdir, device=device, dtype=dtype)
        shadow_conf[s] = sequence_confidence(compute_signals(smodel, stok, pool, **common))
        del smodel

    global_variance = n_shadows < GLOBAL_VARIANCE_BELOW
    lira = lira_offline if offline else lira_online
    scores_all = lira(target_conf, shadow_conf, actual, global_variance=global_variance,
                      input_scale="logprob")
    scores = {"lira": (scores_all[:n_m], scores_all[n_m:]),
              "loss": (target_conf[:n_m], target_conf[n_m:])}
    losses = {"member_losses": target_sig.loss[:n_m], "nonmember_losses": target_sig.loss[n_m:]}
    report = {
        "run_dir": str(run_dir), "checkpoint": str(run_dir), "variant": "offline" if offline else "online",
        "n_shadows": n_shadows, "global_variance": global_variance,
        "confidence": "mean token log-prob, logit-scaled (phi = log(p / (1 - p)), p = exp(-loss))",
        "n_members": n_m, "n_nonmembers": len(nonmembers), "max_length": max_length,
        "fprs": list(DEFAULT_FPRS), "seed": seed, "n_bootstrap": n_bootstrap, "ci_confidence": 0.95,
        "shadow_dir": str(shadow_root),
        "in_per_record": {"min": int(actual.sum(0).min()), "max": int(actual.sum(0).max())},
        "mean_loss": {"members": float(target_sig.loss[:n_m].mean()),
                      "nonmembers": float(target_sig.loss[n_m:].mean())},
        "attacks": {name: evaluate(m, n, n_bootstrap=n_bootstrap, seed=seed, **losses)
                    for name, (m, n) in scores.items()},
    }
    details = {"n_members": n_m, "target_confidence": target_conf,
               "shadow_confidence": shadow_conf, "shadow_in": actual}
    return report, scores, details


def write_lira_report(report: dict, scores: dict, out_dir: str | Path, *, details: dict | None = None,
                      plot: bool = True) -> dict[str, Path]:
    """Write ``lira_report.json``, ``lira_scores.json``, ``lira_report.md`` and ``lira_roc.png``.

    Args:
        report: The report of :func:`lira_audit`.
        scores: ``{attack: (member_scores, nonmember_scores)}``.
        out_dir: Directory (created if missing).
        details: The raw LiRA inputs of :func:`lira_audit`, stored under ``"lira_inputs"`` in
            ``lira_scores.json`` (no texts), so other LiRA variants can be tried without retraining.
        plot: Also draw the ROC PNG.

    Returns:
        ``{"json", "scores", "md", "png"?}`` paths.
    """
    from mia.report import write_attack_report

    summary = (f"{report['variant']} LiRA with {report['n_shadows']} shadow models "
               f"({'pooled' if report['global_variance'] else 'per-record'} variances); "
               f"{report['n_members']} members, {report['n_nonmembers']} non-members; "
               f"max_length={report.get('max_length')}; confidence: {report['confidence']}. "
               f"`loss` is the plain loss attack on the same records, for comparison.")
    extra = None
    if details is not None:
        extra = {"lira_inputs": {k: np.asarray(v).tolist() for k, v in details.items()}}
    return write_attack_report(report, scores, out_dir, stem="lira", title=f"# LiRA audit of `{report['run_dir']}`",
                               summary=summary, extra_scores=extra, plot=plot, plot_title="LiRA vs loss attack ROC")
