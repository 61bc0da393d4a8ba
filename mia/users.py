"""User-level membership inference: members and non-members are *users*, each scored over its records.

A user-level guarantee bounds what an attacker learns about whether a person's data was used at all, so the
audit that matches it asks exactly that: given all of a user's records, was this user trained on? Each
user's score is an aggregate (the mean, by default) of the per-record scores of any record-level attack
(:mod:`mia.attacks`) over the user's records; the metrics (:func:`mia.metrics.evaluate`) then compare
member users with non-member users.

From a run directory (``privacy_unit: user``): members are the users in ``splits.json: users.train`` with
the records they were trained on; non-members are the held-out users, each cut to the same number of
records a member keeps (at most ``max_records_per_user``, chosen with ``seed``), so that the aggregate is
over comparably many records on both sides.

    python -m mia audit --unit user --checkpoint runs/x --out runs/x/audit_users
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from mia import attacks as attacks_mod
from mia.metrics import DEFAULT_FPRS, evaluate
from mia.signals import GUESS, compute_signals

AGGREGATES: dict[str, Callable[[np.ndarray], float]] = {"mean": np.mean, "max": np.max, "median": np.median}


def load_run_users(run_dir: str | Path, *, seed: int = 0) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """``({member user: [trained texts]}, {held-out user: [texts]})`` of a user-level run, hash-checked.

    Raises:
        ValueError: the run is not user-level (no ``users`` in splits.json) or its data changed.
    """
    from dpllm.config import load_config_file
    from dpllm.data import load_records_and_users, sha256

    run_dir = Path(run_dir)
    splits = json.loads((run_dir / "splits.json").read_text())
    if not splits.get("users"):
        raise ValueError(f"{run_dir} was not trained with privacy_unit: user (splits.json lists no users); "
                         "audit it per record (python -m mia audit without --unit user)")
    cfg = load_config_file(run_dir / "config.yaml").data
    records, users = load_records_and_users(cfg)

    def grouped(ids):
        out: dict[str, list[str]] = {}
        for i in ids:
            if i >= len(records) or sha256(records[i]) != splits["sha256"][str(i)]:
                raise ValueError(f"record {i} of {cfg.dataset} changed since the run; the audit needs the original "
                                 "data")
            out.setdefault(users[i], []).append(records[i])
        return out

    members, nonmembers = grouped(splits["train"]), grouped(splits["heldout"])
    k = cfg.max_records_per_user or max(len(v) for v in members.values())
    rng = np.random.default_rng(seed)
    nonmembers = {u: [t[j] for j in sorted(rng.choice(len(t), size=k, replace=False))] if len(t) > k else t
                  for u, t in nonmembers.items()}
    return members, nonmembers


def user_scores(record_scores: np.ndarray, owners: list[int], n_users: int, aggregate: str = "mean") -> np.ndarray:
    """One score per user: ``aggregate`` of the scores of its records (``owners[i]``: user of record i).

    >>> user_scores(np.array([1.0, 3.0, 5.0]), [0, 0, 1], 2).tolist()
    [2.0, 5.0]
    """
    fn = AGGREGATES[aggregate]
    by_user: list[list[float]] = [[] for _ in range(n_users)]
    for s, u in zip(record_scores, owners):
        by_user[u].append(float(s))
    return np.array([fn(np.array(v)) for v in by_user])


def user_audit(model, tokenizer, members: dict[str, list[str]], nonmembers: dict[str, list[str]], *,
               attacks=("loss", "zlib", "mink"), aggregate: str = "mean", max_length: Optional[int] = None,
               batch_size: int = 8, device=None, n_bootstrap: int = 1000, seed: int = 0,
               progress: bool = False, record_format: Optional[str] = GUESS) -> tuple[dict, dict]:
    """Score every record once, aggregate per user, and evaluate each attack on users.

    ``record_format`` is the records' shape as trained (a run's ``splits.json``; :data:`mia.signals.GUESS` by
    default guesses it from the texts).

    Returns:
        ``(report, scores)`` as :func:`mia.audit.run_audit` returns them, with users in place of records.

    Raises:
        ValueError: unknown attack or aggregate, a user on both sides, or an empty side.
    """
    names = attacks_mod.parse_attacks(attacks)
    if aggregate not in AGGREGATES:
        raise ValueError(f"aggregate={aggregate!r}: choose one of {', '.join(AGGREGATES)}")
    if set(members) & set(nonmembers):
        raise ValueError(f"{len(set(members) & set(nonmembers))} users are both members and non-members")
    if not members or not nonmembers:
        raise ValueError("need at least one member user and one non-member user")
    users = list(members) + list(nonmembers)
    texts, owners = [], []
    for j, u in enumerate(users):
        recs = members[u] if j < len(members) else nonmembers[u]
        texts += recs
        owners += [j] * len(recs)
    sig = compute_signals(model, tokenizer, texts, max_length=max_length, batch_size=batch_size, device=device,
                          progress=progress, desc="records", record_format=record_format)
    n_m = len(members)
    report = {"unit": "user", "aggregate": aggregate, "n_members": n_m, "n_nonmembers": len(nonmembers),
              "records_members": sum(len(v) for v in members.values()),
              "records_nonmembers": sum(len(v) for v in nonmembers.values()), "max_length": max_length,
              "fprs": list(DEFAULT_FPRS), "seed": seed, "n_bootstrap": n_bootstrap, "ci_confidence": 0.95,
              "attacks": {}}
    scores = {}
    for name in names:
        per_user = user_scores(attacks_mod.score(name, sig), owners, len(users), aggregate)
        scores[name] = (per_user[:n_m], per_user[n_m:])
        report["attacks"][name] = evaluate(per_user[:n_m], per_user[n_m:], n_bootstrap=n_bootstrap, seed=seed)
    return report, scores


def cmd_audit_users(args) -> int:
    """``python -m mia audit --unit user --checkpoint RUN_DIR``: the user-level audit of a run directory."""
    from mia import audit, report

    run = Path(args.checkpoint)
    if not audit.is_run_dir(run):
        raise ValueError("--unit user audits a run directory (splits.json lists its users)")
    members, nonmembers = load_run_users(run, seed=args.seed)
    model, tok = audit.load_run_model(run, device=args.device, dtype=args.dtype)
    rep, scores = user_audit(model, tok, members, nonmembers, attacks=args.attacks, max_length=args.max_length or
                             audit.run_max_length(run), batch_size=args.batch_size, device=args.device,
                             n_bootstrap=args.n_bootstrap, seed=args.seed, progress=not args.no_progress,
                             record_format=audit.run_sft_format(run))
    privacy = audit.read_privacy_report(run)
    if privacy.get("enabled", True) and privacy.get("epsilon") is not None:
        rep["dp_bound"] = {"epsilon": float(privacy["epsilon"]), "delta": float(privacy.get("delta") or 0.0),
                           "privacy_unit": privacy.get("privacy_unit", "record")}
    rep["checkpoint"] = str(run)
    rep["split"] = (f"users: {rep['n_members']} member users ({rep['records_members']} trained records) vs "
                    f"{rep['n_nonmembers']} held-out users ({rep['records_nonmembers']} records), score = "
                    f"{rep['aggregate']} of per-record scores")
    limits = audit.privacy_bounds(run, rep["attacks"], fprs=rep["fprs"], unit="user")
    if limits is not None:
        rep["privacy_bounds"] = limits
    paths = report.write_audit_report(rep, scores, args.out or run / "audit_users")
    print(report.markdown_table(rep))
    print(f"\nwrote {', '.join(str(p) for p in paths.values())}")
    return report.print_bounds(rep)
