"""The privacy ledger: an append-only, hash-chained record of the ε a run has spent.

``RUN_DIR/privacy_ledger.jsonl`` gets one JSON line (written and fsync'ed whole) when a stage starts,
at every resumable checkpoint, when a run resumes, and at the end::

    {"index": 3, "kind": "checkpoint", "step": 20, "epsilon": 1.87, "delta": 1e-05, "noise_multiplier": 0.93,
     "sample_rate": 0.0092, "accountant": "prv", "checkpoint": "checkpoints/step-000020",
     "checkpoint_sha256": "…", "time": "2025-01-01T12:00:00+00:00", "prev_hash": "…", "hash": "…"}

``hash`` is the sha256 of the line's canonical JSON without ``hash``; ``prev_hash`` is the previous
line's ``hash`` (``"0" * 64`` on the first line). Editing, removing or inserting a line breaks the
chain at that line; cutting the file leaves it without its ``final`` line. ``checkpoint_sha256``
(:func:`dir_sha256`) ties a line to the exact files of its checkpoint.

Kinds: ``stage`` (first line of every run; a run started from an earlier run directory records that
run's ledger head in ``previous_stage``, so the chain spans stages), ``checkpoint``, ``resume`` (names
the checkpoint training continued from: an earlier line must have recorded it with the same hash and
ε), ``final`` (the run's ``checkpoint/``; its ε is privacy_report.json's).

``dpllm ledger verify RUN_DIR`` checks all of this and exits non-zero at the first problem.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import secrets
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

LEDGER = "privacy_ledger.jsonl"
GENESIS = "0" * 64
KINDS = ("stage", "checkpoint", "resume", "final")


class LedgerError(ValueError):
    """A ledger that cannot be appended to or does not verify; the message names the line."""


def dir_sha256(path: str | Path) -> str:
    """sha256 over every file under ``path``: relative name, size and bytes, in sorted name order."""
    path = Path(path)
    h = hashlib.sha256()
    for f in sorted((p for p in path.rglob("*") if p.is_file()), key=lambda p: p.relative_to(path).as_posix()):
        h.update(f"{f.relative_to(path).as_posix()}\0{f.stat().st_size}\0".encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def line_hash(entry: dict) -> str:
    """sha256 of the canonical JSON of ``entry`` without its ``hash`` field."""
    body = {k: v for k, v in entry.items() if k != "hash"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _parse(run_dir: Path) -> list[dict]:
    """All lines of the ledger; raises :class:`LedgerError` naming the first unreadable line."""
    path = run_dir / LEDGER
    if not path.is_file():
        raise LedgerError(f"{path}: no ledger")
    raw = path.read_bytes()
    if raw and not raw.endswith(b"\n"):
        n = raw.count(b"\n") + 1
        raise LedgerError(f"line {n}: incomplete (the file ends mid-line: cut or interrupted while writing)")
    entries = []
    for i, line in enumerate(raw.split(b"\n")[:-1] if raw else [], start=1):
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as err:
            raise LedgerError(f"line {i}: not UTF-8 text (byte {err.start}): the ledger was damaged or "
                              "edited") from None
        try:
            entry = json.loads(text)
        except json.JSONDecodeError as err:
            raise LedgerError(f"line {i}: not valid JSON ({err.msg})") from err
        if not isinstance(entry, dict):
            raise LedgerError(f"line {i}: not a JSON object")
        entries.append(entry)
    return entries


def read(run_dir: str | Path) -> list[dict]:
    """The ledger's entries, or [] when the run has none yet."""
    run_dir = Path(run_dir)
    return _parse(run_dir) if (run_dir / LEDGER).exists() else []


def head(run_dir: str | Path) -> Optional[str]:
    """Hash of the last line (the value a later stage records), or None without a ledger."""
    entries = read(run_dir)
    return entries[-1]["hash"] if entries else None


def append(run_dir: str | Path, *, kind: str, step: int, privacy: dict, checkpoint: Optional[str] = None,
           **extra: Any) -> dict:
    """Append one chained line and fsync it; return the entry.

    Args:
        run_dir: the run directory holding the ledger.
        kind: one of ``stage``, ``checkpoint``, ``resume``, ``final``.
        step: optimizer steps of this run at this point.
        privacy: ``epsilon, delta, noise_multiplier, sample_rate, accountant`` and the full ``history`` of
            ``(σ, q, steps)`` that ε was computed from (None values for a non-private run).
        checkpoint: checkpoint directory relative to ``run_dir``; its :func:`dir_sha256` is recorded.
        extra: further JSON fields (e.g. ``previous_stage``).

    Raises:
        LedgerError: the existing ledger ends with a damaged line (nothing is chained onto it).
    """
    if kind not in KINDS:
        raise LedgerError(f"kind={kind!r} is not one of {', '.join(KINDS)}")
    run_dir = Path(run_dir)
    entries = read(run_dir)
    entry: dict[str, Any] = {"index": len(entries) + 1, "kind": kind, "step": int(step)}
    for key in ("epsilon", "delta", "noise_multiplier", "sample_rate", "accountant", "history"):
        entry[key] = privacy.get(key)
    if privacy.get("user_level"):  # privacy_unit=user: U, k, how ε became user-level (dpllm.privacy.user_level)
        entry["user_level"] = privacy["user_level"]
    if privacy.get("adaptive_clipping"):  # clipping: quantile: γ, η, σ_b, σ_g and C so far (dpllm.privacy.quantile)
        entry["adaptive_clipping"] = privacy["adaptive_clipping"]
    entry["checkpoint"] = checkpoint
    entry["checkpoint_sha256"] = dir_sha256(run_dir / checkpoint) if checkpoint else None
    entry.update(extra)
    if kind == "stage":  # a secret the chain hashes first: its hashes then commit to the lines without revealing
        entry["salt"] = secrets.token_hex(32)  # them, so a release may publish the head (dpllm.export)
    entry["time"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    entry["prev_hash"] = entries[-1]["hash"] if entries else GENESIS
    entry["hash"] = line_hash(entry)
    with open(run_dir / LEDGER, "a") as fh:
        fh.write(json.dumps(entry) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    return entry


def previous_stage(source: dict) -> Optional[dict]:
    """For a stage ``line``: the earlier run a model came from (``load_base``'s source) and its ledger head."""
    if source.get("kind") != "run_checkpoint":
        return None
    run_dir = Path(source["path"]).parent
    return {"run_dir": str(run_dir.resolve()), "ledger_head": head(run_dir)}


@dataclass
class Verified:
    """Outcome of :func:`verify`: ``ok`` and a message naming the first problem or summing up."""

    ok: bool
    message: str
    lines: int = 0
    final_epsilon: Optional[float] = None
    head: Optional[str] = None
    notes: list[str] = field(default_factory=list)


def _same_eps(a: Optional[float], b: Optional[float]) -> bool:
    if a is None or b is None:
        return a is b
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-12)


def _check_chain(entries: list[dict]) -> None:
    prev = GENESIS
    last_step, last_eps = 0, None
    recorded: dict[tuple[int, str], Optional[float]] = {}  # (step, checkpoint hash) -> ε of checkpoint lines
    for i, e in enumerate(entries, start=1):
        if e.get("index") != i:
            raise LedgerError(f"line {i}: index is {e.get('index')}, expected {i}: a line before it is missing "
                              "or lines were reordered")
        if e.get("prev_hash") != prev:
            raise LedgerError(f"line {i}: prev_hash does not match line {i - 1}'s hash: a line before it was "
                              "removed, inserted or edited")
        if e.get("hash") != line_hash(e):
            raise LedgerError(f"line {i}: content does not match its hash (edited after it was written)")
        prev = e["hash"]
        kind, step, eps = e.get("kind"), e.get("step"), e.get("epsilon")
        if kind not in KINDS:
            raise LedgerError(f"line {i}: unknown kind {kind!r}")
        if (i == 1) != (kind == "stage"):
            raise LedgerError(f"line {i}: a ledger starts with exactly one 'stage' line, found {kind!r}")
        if kind == "resume":
            key = (step, e.get("checkpoint_sha256"))
            if key not in recorded or not _same_eps(recorded[key], eps):
                raise LedgerError(f"line {i}: resumes from step {step} ({e.get('checkpoint')}), but no earlier "
                                  "checkpoint line recorded that checkpoint with this hash and ε")
        elif kind in ("checkpoint", "final"):
            if step < last_step or (eps is not None and last_eps is not None and eps < last_eps - 1e-12):
                raise LedgerError(f"line {i}: step {step} / ε {eps} goes back from step {last_step} / ε {last_eps} "
                                  "without a 'resume' line")
            if kind == "checkpoint":
                recorded[(step, e.get("checkpoint_sha256"))] = eps
        last_step, last_eps = step, eps


def _check_epsilons(entries: list[dict]) -> int:
    """Recompute every line's ε from its own history with its accountant; return how many were checked.

    A rewrite that lowers ε must now also change σ, q or steps, which the report, the checkpoint's report
    and the plan in the resumable checkpoints record too.
    """
    from dpllm.privacy.accounting import compute_epsilon_history

    cache: dict = {}
    checked = 0
    for i, e in enumerate(entries, start=1):
        eps = e.get("epsilon")
        if eps is None:
            continue
        history = e.get("history")
        if not isinstance(history, list):
            raise LedgerError(f"line {i}: ε={eps} without the (σ, q, steps) history it was computed from")
        key = (json.dumps(history), e.get("delta"), e.get("accountant"))
        user = e.get("user_level") or {}
        if user.get("sampling") in ("els", "record") and user.get("group_size") != user.get("max_records_per_user"):
            raise LedgerError(f"line {i}: user-level ε over groups of k={user.get('group_size')} records, but the "
                              f"declared cap is max_records_per_user={user.get('max_records_per_user')}; k must be the "
                              "cap (a neighbour may add a user of that many records): retrain with a current dpllm")
        group = user.get("group_size", 1) if "record_delta" in user else 1
        if group > 1:  # ELS: the user-level ε of the record-level history, users of k records (mixture accounting)
            key += (group,)
        if key not in cache:
            try:
                if group > 1:
                    from dpllm.privacy.user_level import mixture_epsilon

                    cache[key] = mixture_epsilon(history=[tuple(h) for h in history], delta=e["delta"],
                                                 group_size=group)
                else:
                    cache[key] = compute_epsilon_history(history=[tuple(h) for h in history], delta=e["delta"],
                                                         accountant=e["accountant"])
            except (ValueError, TypeError, KeyError) as err:
                raise LedgerError(f"line {i}: its history, δ or accountant cannot be accounted ({err})") from None
        if not math.isclose(cache[key], eps, rel_tol=1e-6, abs_tol=1e-9) and not _before_margin(e, history, group, eps):
            how = f"user-level mixture accounting (k={group})" if group > 1 else f"{e.get('accountant')} accountant"
            raise LedgerError(f"line {i}: ε={eps:.6g} but its history {history} gives ε={cache[key]:.6g} with the "
                              f"{how} at δ={e.get('delta'):g}")
        if e.get("kind") in ("checkpoint", "final") and history and int(history[-1][2]) > int(e.get("step", 0)):
            raise LedgerError(f"line {i}: its history counts {history[-1][2]} steps in the last stage, but the line "
                              f"is at step {e.get('step')}")
        checked += 1
    return checked


def _before_margin(e: dict, history: list, group: int, eps: float) -> bool:
    """A PRV, PLD or user-level (mixture) ε written by a dpllm from before 2026-11-25, which read it at δ itself
    rather than at δ less the composition's float rounding (:data:`dpllm.privacy.prv.ROUNDING`): the line still
    verifies against that reading, a value within the rounding of today's."""
    from dpllm.privacy.accounting import AccountantUnavailable, pld_epsilon
    from dpllm.privacy.prv import prv_epsilon
    from dpllm.privacy.user_level import mixture_epsilon

    steps = [tuple(h) for h in history]
    try:
        if group > 1:
            old = mixture_epsilon(history=steps, delta=e["delta"], group_size=group, rounding_margin=False)
        elif e.get("accountant") == "pld":
            old = pld_epsilon(history=steps, delta=e["delta"], rounding_margin=False)
        elif e.get("accountant") == "prv":
            old = prv_epsilon(history=steps, delta=e["delta"], rounding_margin=False)
        else:
            return False
    except (AccountantUnavailable, ValueError, TypeError, KeyError):
        return False
    return math.isclose(old, eps, rel_tol=1e-6, abs_tol=1e-9)


def _read_report(path: Path):
    from dpllm.privacy.report import PrivacyReport, ReportError

    try:
        return PrivacyReport.read(path)
    except ReportError as err:
        raise LedgerError(str(err)) from None


def verify(run_dir: str | Path, *, _depth: int = 0) -> Verified:
    """Check a run's ledger: chain, order, resumes, final line against privacy_report.json and checkpoint/.

    Also checks intermediate checkpoints still on disk against the last line that recorded them, and the
    previous stage's ledger when the stage line names one that exists.
    """
    run_dir = Path(run_dir)
    try:
        entries = _parse(run_dir)
        if not entries:
            raise LedgerError(f"{run_dir / LEDGER} is empty")
        _check_chain(entries)
        recomputed = _check_epsilons(entries)
    except LedgerError as err:
        return Verified(False, str(err))
    n, last = len(entries), entries[-1]
    notes: list[str] = []
    if last["kind"] != "final":
        return Verified(False, f"line {n + 1}: missing; the ledger ends at line {n} ({last['kind']}, step "
                               f"{last['step']}) without a 'final' line (file truncated, or the run has not "
                               "finished)", lines=n)
    report_path = run_dir / "privacy_report.json"
    if not report_path.is_file():
        return Verified(False, f"{report_path} is missing; cannot check the final line's ε", lines=n)
    try:
        report = _read_report(report_path)
        inner = _read_report(run_dir / last.get("checkpoint", "checkpoint") / "privacy_report.json")
    except LedgerError as err:
        return Verified(False, str(err), lines=n)
    if not _same_eps(report.epsilon, last.get("epsilon")) or report.steps != last.get("step"):
        return Verified(False, f"line {n}: final ε={last.get('epsilon')} at step {last.get('step')} does not match "
                               f"privacy_report.json (ε={report.epsilon}, steps={report.steps})", lines=n)
    if report.enabled and [list(h) for h in report.history] != last.get("history"):
        return Verified(False, f"line {n}: final history {last.get('history')} does not match privacy_report.json's "
                               f"{report.history}", lines=n)
    if inner.to_dict() != report.to_dict():
        return Verified(False, f"{last.get('checkpoint')}/privacy_report.json differs from privacy_report.json "
                               "(one of them was changed after the run)", lines=n)
    notes.append(f"ε recomputed from the history on {recomputed} line(s)")
    if report.enabled and report.noise_secret is False:
        from dpllm.privacy.report import NOT_RELEASABLE

        notes.append(f"WARNING: {NOT_RELEASABLE}")
    latest: dict[str, tuple[int, str]] = {}
    for i, e in enumerate(entries, start=1):
        if e.get("checkpoint"):
            latest[e["checkpoint"]] = (i, e["checkpoint_sha256"])
    final_dir = run_dir / last["checkpoint"]
    if not final_dir.is_dir() or dir_sha256(final_dir) != last["checkpoint_sha256"]:
        return Verified(False, f"line {n}: {last['checkpoint']}/ on disk does not match the final line's "
                               "checkpoint_sha256 (missing or changed after the run)", lines=n)
    checked = 0
    for rel, (i, digest) in latest.items():
        if rel == last["checkpoint"] or not (run_dir / rel).is_dir():
            continue
        if dir_sha256(run_dir / rel) != digest:
            return Verified(False, f"line {i}: {rel}/ on disk does not match its checkpoint_sha256", lines=n)
        checked += 1
    notes.append(f"{checked} intermediate checkpoint(s) on disk match their lines")
    prev_stage = entries[0].get("previous_stage") or {}
    if prev_stage.get("run_dir") and prev_stage.get("ledger_head") and _depth < 16:
        prev_dir = Path(prev_stage["run_dir"])
        if (prev_dir / LEDGER).is_file():
            sub = verify(prev_dir, _depth=_depth + 1)
            if not sub.ok:
                return Verified(False, f"previous stage {prev_dir}: {sub.message}", lines=n)
            if sub.head != prev_stage["ledger_head"]:
                return Verified(False, f"line 1: previous stage {prev_dir} has ledger head {sub.head}, not the "
                                       f"recorded {prev_stage['ledger_head']}", lines=n)
            notes.append(f"previous stage {prev_dir} verified ({sub.lines} lines)")
        else:
            notes.append(f"previous stage {prev_dir} not found; chain checked from this stage on")
    eps = last.get("epsilon")
    summary = (f"{n} lines, hash chain intact; final ε = {eps:.6g} (δ = {last.get('delta'):g}, "
               f"{last.get('accountant')}) at step {last['step']} matches privacy_report.json"
               if eps is not None else f"{n} lines, hash chain intact; non-private run, {last['step']} steps")
    return Verified(True, summary + f"; {last['checkpoint']}/ matches; " + "; ".join(notes),
                    lines=n, final_epsilon=eps, head=last["hash"], notes=notes)


def cli_main(argv: list[str]) -> int:
    """``dpllm ledger verify RUN_DIR``: print OK with the line count and final ε, or the first problem."""
    import argparse

    parser = argparse.ArgumentParser(prog="dpllm ledger", description="The run's append-only, hash-chained ε ledger "
                                     "(privacy_ledger.jsonl).")
    sub = parser.add_subparsers(dest="action", required=True, metavar="verify")
    check = sub.add_parser(
        "verify", description="Check the hash chain, the order of stages, checkpoints and resumes, recompute every "
        "line's ε from the (σ, q, steps) history it carries, and compare the last line with privacy_report.json and "
        "the checkpoint files' hashes. Prints OK with the head hash (record it: a chain cannot stop someone who "
        "rewrites everything consistently), or the first problem.",
        help="check the ledger of a run", epilog="exit status: 0 OK, 1 a problem (printed), 2 bad options. "
        "Example: dpllm ledger verify runs/x")
    check.add_argument("run_dir", metavar="RUN_DIR", help="the run directory")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help (0) or a bad option (2): argparse printed why
        return int(exit_.code or 0)
    from dpllm.io import missing_path_error

    missing = missing_path_error(args.run_dir, option="RUN_DIR", local=True)
    if missing:
        print(f"FAIL {missing}", file=sys.stderr)
        return 1
    argv = [args.action, args.run_dir]
    result = verify(argv[1])
    if result.ok:
        print(f"OK {argv[1]}: {result.message}\nhead {result.head}")
        for note in result.notes:
            if note.startswith("WARNING"):
                print(note, file=sys.stderr)
        return 0
    print(f"FAIL {argv[1]}: {result.message}", file=sys.stderr)
    return 1
