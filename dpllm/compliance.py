"""The compliance report: a DP deployment checklist checked against a run directory's own evidence.

``dpllm report --compliance RUN_DIR`` prints one line per item, each **met**, **not met**, **not applicable**
or **manual** (the run directory cannot show it), with the file and field that decided it. ``dpllm export``
puts the same table into the model card. The items follow the deployment checklist of the practitioners'
article this project grew from (``shared/seeds/003``), read as checks a machine can make:

==========================  ==================================================================================
item                        met when
==========================  ==================================================================================
differential_privacy        the run trained with DP (a non-private run meets none of the DP items)
epsilon_fixed               the (σ, q) committed on the ledger's first line, before any step, is the one every
                            later line (checkpoints, resumes, final) carries, and the final ε is within the
                            configured target: the budget was set before training and never reset
single_epoch                the last stage's expected passes over the data, q × steps, are at most 1
dp_gradient_checkpointing   gradient checkpointing was off, or on under ``bk`` (the one mode that clips once per
                            record with recomputed activations; reentrant checkpointing is refused there)
epsilon_logged              the ledger verifies (hash chain, ε recomputed on every line) and has a line for
                            every resumable checkpoint the run wrote and for the final checkpoint
noise_secret                noise and Poisson sampling drew from OS entropy (not ``reproducible_noise``)
sensitivity_tiers           every earlier non-private stage trained on records proven disjoint from this
                            stage's private set (by content hash, at training time), and every earlier private
                            stage is composed or proven disjoint; not applicable for a single stage; never met
                            by a study (a stage trained without DP on a public split simulated from the file a
                            private stage protects)
data_sovereignty            manual: where the data lives is outside the run directory
mia_audit                   ``RUN/audit`` holds a membership audit (``python -m mia audit``, loss or embedding
                            interface) of this run's final checkpoint, newer than it, in which no attack's AUC,
                            TPR at FPR 1% or TPR at FPR 0.1% exceeds, beyond sampling error, the most any attack
                            can reach against the mechanism as run (:mod:`dpllm.privacy.tradeoff`, from the
                            run's own history; an audit above it means an implementation bug), and a canary
                            audit, if any, found no privacy bug
==========================  ==================================================================================

**One verdict everywhere.** :func:`check` computes the checklist once, on the private run directory (given its
``checkpoint/``, it checks the run directory that holds it). ``dpllm export`` records the public view of that result
(:func:`public_items`) in the bundle's ``privacy_report.json`` (``release.compliance``, with the ledger's head hash),
and both the bundle's model card and ``dpllm report BUNDLE --compliance`` render that record: a bundle holds none of
the private evidence, so nothing is recomputed from it. A command an item recommends is written in backticks and
names its real target, a run directory (a bundle's items recommend none).

The release bundle's model card (:func:`public_table`) replaces the evidence of the items decided on private files
(the ledger's contents, earlier stages' names and composition) by a pointer to the private run directory, and for
the membership audit, whose verdict is a function of the members' scores, shows only that the final model was
audited and where the private report is, never its result: statistics of the training data are not covered by the
DP guarantee.

Example:
    >>> items = check("runs/x")  # doctest: +SKIP
    >>> print(format_table(items))  # doctest: +SKIP
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dpllm.io import load_yaml

MET, NOT_MET, NA, MANUAL = "met", "not met", "not applicable", "manual"
AUDITED = "audited (result private)"  # the model card's status of an audit whose result is withheld


@dataclass
class Item:
    """One checklist item: its status and the evidence (file and field) that decided it."""

    name: str
    requirement: str
    status: str
    evidence: str
    # (status, evidence) the model card shows instead, for an item whose status itself is a function of private
    # records (the audit's pass/fail); not part of the JSON output
    public: tuple | None = field(default=None, repr=False, compare=False)
    # why the item's evidence shows the guarantee broken (a failed membership audit), in one line for a release
    # refusal; None when it does not (an item can be not met without that: no audit yet, a stale one)
    failure: str | None = field(default=None, repr=False, compare=False)


# Every item, in the order check() returns them (the names --json prints and dpllm export --accept-unmet takes).
ITEM_NAMES = ("differential_privacy", "epsilon_fixed", "single_epoch", "dp_gradient_checkpointing", "epsilon_logged",
              "noise_secret", "sensitivity_tiers", "data_sovereignty", "mia_audit")
# Items whose evidence is computed from private files; the model card shows their status only.
PRIVATE_EVIDENCE = ("epsilon_logged", "sensitivity_tiers", "mia_audit")


def _dp(report) -> Item:
    req = "trained with differential privacy"
    if not report.enabled:
        return Item("differential_privacy", req, NOT_MET, "privacy_report.json: enabled = false")
    return Item("differential_privacy", req, MET, f"privacy_report.json: enabled = true, ε = {report.epsilon:.4g}, "
                                                  f"δ = {report.delta:g} ({report.accountant} accountant), unit: "
                                                  f"{report.privacy_unit}")


def _epsilon_fixed(report, entries) -> Item:
    req = "ε threshold defined before training and never reset"
    if not report.enabled:
        return Item("epsilon_fixed", req, NA, "privacy_report.json: enabled = false (no DP guarantee to fix)")
    if not entries:
        return Item("epsilon_fixed", req, NOT_MET, "privacy_ledger.jsonl: missing, so nothing shows the budget was "
                                                   "committed before the first step")
    first = entries[0]
    sq = (first.get("noise_multiplier"), first.get("sample_rate"))
    changed = [e["index"] for e in entries if (e.get("noise_multiplier"), e.get("sample_rate")) != sq]
    if changed:
        return Item("epsilon_fixed", req, NOT_MET, f"privacy_ledger.jsonl: line(s) {changed} carry a (σ, q) other "
                                                   f"than the (σ, q) = {sq} committed on line 1 at step 0")
    target = report.target_epsilon
    if target is not None and report.epsilon is not None and report.epsilon > target * (1 + 1e-6):
        return Item("epsilon_fixed", req, NOT_MET, f"privacy_report.json: ε = {report.epsilon:.4g} exceeds "
                                                   f"target_epsilon = {target:g}")
    what = f"target_epsilon = {target:g}" if target is not None else f"noise_multiplier = {sq[0]:.4g} given"
    return Item("epsilon_fixed", req, MET,
                f"privacy_ledger.jsonl line 1 (step 0) commits σ = {sq[0]:.4g}, q = {sq[1]:.4g}; all "
                f"{len(entries)} lines carry it; privacy_report.json: {what}, ε = {report.epsilon:.4g}")


def _single_epoch(report) -> Item:
    from dpllm.privacy.plan import passes_warning  # the plan's own test, which warned at training time

    req = "single-epoch training (each extra pass multiplies ε)"
    if not report.enabled:
        return Item("single_epoch", req, NA, "privacy_report.json: enabled = false")
    q = report.sample_rate or 0.0
    c = report.correlated_noise  # banded, BLT: a record's group is sampled (at q_b) on ⌈T/b⌉ of the T steps
    steps = c.get("accounted_steps", -(-report.steps // int(c["bands"]))) if c else report.steps
    one_pass = passes_warning(q, steps) is None
    ev = (f"privacy_report.json: sample_rate = {q:.4g} × steps = {steps}"
          + (f" (⌈{report.steps}/{c['bands']}⌉ steps of its cyclic group)" if c and c["bands"] > 1 else "")
          + f" = {q * steps:.3g} expected passes")
    return Item("single_epoch", req, MET if one_pass else NOT_MET,
                ev + ("" if one_pass else "; multi-epoch training needs a justification in the model risk "
                                          "documentation"))


def _gradient_checkpointing(report, config: dict) -> Item:
    req = "gradient checkpointing off unless DP-compatible"
    on = bool((config.get("train") or {}).get("gradient_checkpointing"))
    mode = report.grad_sample_mode
    if not on:
        return Item("dp_gradient_checkpointing", req, MET, "config.yaml: train.gradient_checkpointing = false")
    if not report.enabled:
        return Item("dp_gradient_checkpointing", req, NA, "privacy_report.json: enabled = false (no clipping to break)")
    ok = mode == "bk"
    return Item("dp_gradient_checkpointing", req, MET if ok else NOT_MET,
                f"config.yaml: train.gradient_checkpointing = true; privacy_report.json: grad_sample_mode = {mode}"
                + (" (clips once per record with recomputed activations)" if ok else ""))


def _epsilon_logged(run_dir: Path, report, entries, result) -> Item:
    req = "ε logged at every checkpoint, in a tamper-evident trail"
    if not result.ok:
        return Item("epsilon_logged", req, NOT_MET, f"privacy_ledger.jsonl: does not verify ({result.message})")
    saved = [e for e in entries if e.get("kind") == "checkpoint"]
    finals = [e for e in entries if e.get("kind") == "final"]
    if report.enabled and any(e.get("epsilon") is None for e in saved + finals):
        return Item("epsilon_logged", req, NOT_MET, "privacy_ledger.jsonl: a checkpoint line has no ε")
    on_disk = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*") if p.is_dir())
    logged = {Path(e.get("checkpoint") or "").name for e in saved}
    missing = [d for d in on_disk if d not in logged]
    if missing:
        return Item("epsilon_logged", req, NOT_MET, f"checkpoints/{missing[0]} has no ledger line")
    return Item("epsilon_logged", req, MET, f"privacy_ledger.jsonl: verifies ({len(entries)} lines: {len(saved)} "
                                            f"checkpoint, {len(finals)} final; ε recomputed on each); head "
                                            f"{result.head[:12]}…")


def _noise_secret(report) -> Item:
    req = "noise and sampling randomness secret"
    if not report.enabled:
        return Item("noise_secret", req, NA, "privacy_report.json: enabled = false")
    return Item("noise_secret", req, MET if report.noise_secret else NOT_MET,
                f"privacy_report.json: noise_secret = {report.noise_secret}"
                + ("" if report.noise_secret else " (reproducible_noise: retrain before release)"))


def _tiers(report) -> Item:
    req = "data segmented by sensitivity tier (public stages disjoint from private data)"
    study = report.study_stages()
    if study:  # its "public" records are private ones, trained on without DP: no tier separates them
        return Item("sensitivity_tiers", req, NOT_MET,
                    f"privacy_report.json: stage(s) {', '.join(repr(s) for s in study)} trained without DP on a "
                    "public split drawn from a private stage's file (simulate_public_from_private: a study); a "
                    "record of that file lands there unprotected by any ε; put public data in data.public_dataset "
                    "and retrain")
    earlier = report.stages[:-1]
    if not earlier:
        return Item("sensitivity_tiers", req, NA, "privacy_report.json: stages has one stage (no earlier stage "
                                                  "trained on any data this run knows of)")
    public = [s for s in earlier if not s.get("enabled")]
    if not report.enabled:
        return Item("sensitivity_tiers", req, NA, "privacy_report.json: this stage is not private")
    # Training refuses a DP stage whose earlier non-private stages overlap its records or cannot be checked
    # (dpllm.privacy.composition), so a finished DP run with such stages has passed the content-hash check.
    names = ", ".join(f"{s.get('name')!r} (train_on = {s.get('train_on')})" for s in public) or "none"
    return Item("sensitivity_tiers", req, MET,
                f"privacy_report.json: {len(earlier)} earlier stage(s); non-private: {names}, checked disjoint from "
                f"this stage's private records by content hash at training time; composition: {report.composition}")


def _audit(run_dir: Path, report) -> Item:
    from dpllm.privacy import tradeoff

    req = "membership-inference audit before deployment"
    audit = run_dir / "audit"
    found = [p for p in (audit / "mia_report.json", audit / "embedding_report.json") if p.is_file()]
    if not found:
        return Item("mia_audit", req, NOT_MET, f"{audit.name}/: no mia_report.json or embedding_report.json; run "
                                               f"`python -m mia audit --checkpoint {run_dir}`",
                    public=(NOT_MET, "no membership audit of the final model was in the private run directory when "
                                     "this bundle was exported"))
    ckpt = run_dir / "checkpoint"
    newest = max((p.stat().st_mtime for p in ckpt.rglob("*") if p.is_file()), default=0.0)
    stale = [p.name for p in found if p.stat().st_mtime < newest]
    if stale:
        return Item("mia_audit", req, NOT_MET, f"audit/{stale[0]} is older than checkpoint/ (audit the final model: "
                                               f"`python -m mia audit --checkpoint {run_dir}`)")
    attacks = {}
    for p in found:
        data = json.loads(p.read_text())
        attacks.update({f"{p.name}:{name}": a for name, a in data.get("attacks", {}).items()})
    worst = max(((k, float(a["auc"])) for k, a in attacks.items()), key=lambda x: x[1], default=(None, float("nan")))
    ev = f"{', '.join('audit/' + p.name for p in found)}: highest AUC {worst[1]:.3f} ({worst[0]})"
    curve = None
    if report.enabled:
        try:  # a run with users splits whole users, so its record-level audit is a test of users
            curve = tradeoff.for_report(report, unit="user" if report.user_level else "record")
        except tradeoff.TradeoffError as err:
            ev += f"; no bound to compare with ({err})"
    bad, failure = [], None
    if curve is not None:
        checked = tradeoff.check_audit(attacks, curve)
        b = checked["bounds"]
        top = {k: max((float(a[k]) for a in attacks.values() if a.get(k) is not None), default=float("nan"))
               for k in (tradeoff.tpr_key(f) for f in tradeoff.FPRS)}
        ev += (", " + ", ".join(f"TPR@{100 * f:g}%FPR {top[tradeoff.tpr_key(f)]:.3f}" for f in tradeoff.FPRS)
               + f"; the most any attack can reach against this run's mechanism ({b['unit']} level, its history's "
               f"trade-off curve): AUC {b['auc']:.4f}, "
               + ", ".join(f"TPR@{100 * f:g}%FPR {b[tradeoff.tpr_key(f)]:.4f}" for f in tradeoff.FPRS))
        bad = checked["exceeded"]
        if bad:
            name, metric, measured, allowed = bad[0]
            ev += (f"; {name} {metric} = {measured:.4f} exceeds what the mechanism allows ({allowed:.4f}) beyond "
                   f"sampling error ({checked['confidence']:.0%} confidence over all {len(attacks)} attack(s)): the "
                   "implementation does not deliver the accounted guarantee (a bug)")
            # the release's words: which attack and bound, not the measured value (a statistic of the members)
            failure = (f"the membership audit of the final model (audit/{name.replace(':', ', attack ')}) measured "
                       f"{metric} above the most any attack can reach against this run's mechanism ({allowed:.4f}), "
                       "beyond sampling error")
        else:
            ev += f" (no measured value above its bound beyond sampling error, {checked['confidence']:.0%} confidence)"
    canary = audit / "canary_report.json"
    bug = canary.is_file() and json.loads(canary.read_text()).get("privacy_bug")
    if canary.is_file():
        ev += f"; audit/canary_report.json: privacy_bug = {bool(bug)}"
    if bug and failure is None:
        failure = "the canary audit (audit/canary_report.json) found a privacy bug"
    # The verdict compares statistics of the members with the bound: a bit about the private records. The card says
    # that the final model was audited and where the private report lives, never what it found.
    where = ", ".join("audit/" + p.name for p in found + ([canary] if canary.is_file() else []))
    return Item("mia_audit", req, NOT_MET if (bug or bad) else MET, ev,
                public=(AUDITED, (f"the final model was audited; the report ({where} in the private run directory) "
                                  "is computed on the training records and stays there, its result included")),
                failure=failure)


def failed_audit(run_dir: str | Path) -> str | None:
    """Why the run's membership audit of its final model shows the guarantee broken (an attack above what the
    mechanism allows, or a canary audit's privacy bug), in one line; None when it does not or there is none.

    ``dpllm export`` and ``dpllm synthesize`` refuse such a run unless the publisher overrides it.
    """
    from dpllm.privacy.report import PrivacyReport

    run_dir = Path(run_dir)
    return _audit(run_dir, PrivacyReport.read(run_dir)).failure


def run_dir_of(path: str | Path) -> Path:
    """The run directory ``path`` names: itself, or the run holding it when it is a run's ``checkpoint/``."""
    from dpllm import ledger

    path = Path(path)
    parent = path.parent
    if path.name == "checkpoint" and (parent / ledger.LEDGER).is_file() and not (path / ledger.LEDGER).exists():
        return parent
    return path


def check(run_dir: str | Path, *, verified=None) -> list[Item]:
    """Every checklist item for a finished run directory, or the items a release bundle recorded (:func:`recorded`).

    Args:
        run_dir: the run directory (or its ``checkpoint/``), or a bundle ``dpllm export`` wrote.
        verified: its :func:`dpllm.ledger.verify` result when the caller has it (``dpllm export`` does);
            verified here otherwise.

    Raises:
        dpllm.privacy.report.ReportError: no readable privacy report (not a finished dpllm run), or a bundle that
            recorded no checklist.
    """
    from dpllm import ledger
    from dpllm.privacy.report import PrivacyReport

    run_dir = run_dir_of(run_dir)
    report = PrivacyReport.read(run_dir)
    if report.release is not None:
        return recorded(report, where=run_dir)
    try:
        entries = ledger.read(run_dir)
    except ledger.LedgerError:
        entries = []
    config_path = run_dir / "config.yaml"
    config = load_yaml(config_path.read_text()) if config_path.is_file() else {}
    if verified is None:
        verified = ledger.verify(run_dir)
    return [_dp(report), _epsilon_fixed(report, entries), _single_epoch(report),
            _gradient_checkpointing(report, config or {}), _epsilon_logged(run_dir, report, entries, verified),
            _noise_secret(report), _tiers(report),
            Item("data_sovereignty", "training data kept in jurisdiction-compliant storage", MANUAL,
                 "not visible in the run directory: document where the dataset and the run directory are stored"),
            _audit(run_dir, report)]


def format_table(items: list[Item]) -> str:
    """A markdown table: item, status, evidence."""
    lines = ["| item | status | evidence |", "|---|---|---|"]
    for it in items:
        status = f"**{it.status}**" if it.status == NOT_MET else it.status
        lines.append(f"| {it.requirement} | {status} | {it.evidence.replace('|', '/')} |")
    return "\n".join(lines)


def public_items(items: list[Item]) -> list[Item]:
    """The items as a release shows them: the evidence of :data:`PRIVATE_EVIDENCE` items replaced, and an item's
    :attr:`Item.public` view (status and evidence) where its status itself is private (the audit's result). No
    evidence names a command: the bundle's reader has no run directory to run it on."""
    return [Item(it.name, it.requirement, *it.public) if it.public else
            Item(it.name, it.requirement, it.status, "checked on the private run directory when this bundle was "
                 "exported") if it.name in PRIVATE_EVIDENCE else it for it in items]


def public_table(items: list[Item]) -> str:
    """:func:`format_table` of :func:`public_items` (for a release)."""
    return format_table(public_items(items))


def recorded(report, *, where: str | Path = "the bundle") -> list[Item]:
    """The checklist a release bundle's report recorded at export (``release.compliance``), as :class:`Item` s.

    Raises:
        dpllm.privacy.report.ReportError: the bundle recorded none (exported before dpllm recorded it).
    """
    from dpllm.privacy.report import ReportError

    items = (report.release or {}).get("compliance")
    if not items:
        raise ReportError(f"{where} is a release bundle that recorded no compliance checklist (exported before dpllm "
                          "recorded it, or a synthetic data release), and a bundle holds none of the checklist's "
                          "evidence; check the private run directory it came from, or export it again")
    return [Item(it["name"], it["requirement"], it["status"], it["evidence"]) for it in items]


def to_json(items: list[Item]) -> list[dict]:
    """The items as JSON-ready dicts."""
    return [{k: v for k, v in asdict(it).items() if k != "public"} for it in items]


# ---- dpllm report ------------------------------------------------------------------------------------------

def _report_parser():
    import argparse

    parser = argparse.ArgumentParser(
        prog="dpllm report", description="Print a run's privacy report: ε with δ, the accountant, σ, q and steps "
        "behind it, then the whole report as JSON.",
        epilog="exit status: 0 printed (with --compliance: every item met or not applicable), 1 an item not met or "
               "an unreadable report, 2 bad options. Example: dpllm report runs/x --compliance")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (or its checkpoint/ or an exported bundle)")
    parser.add_argument("--compliance", action="store_true",
                        help="print the deployment checklist instead (dpllm.compliance): each item met, not met or "
                             "not applicable, with the evidence")
    parser.add_argument("--json", action="store_true", help="with --compliance: the checklist items as JSON")
    return parser


def cli_main(argv: list[str]) -> int:
    """``dpllm report RUN_DIR``: print a run's privacy report; ``--compliance``: the deployment checklist
    (this module), exit 1 when an item is not met; ``--json`` with it prints the items as JSON."""
    from dpllm.privacy.report import NOT_RELEASABLE, PrivacyReport, ReportError

    parser = _report_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help (0) or a bad option (2): argparse printed why
        return int(exit_.code or 0)
    if args.json and not args.compliance:
        parser.print_usage(sys.stderr)
        print("dpllm report: error: --json goes with --compliance", file=sys.stderr)
        return 2
    from dpllm.io import missing_path_error

    missing = missing_path_error(args.run_dir, option="RUN_DIR", local=True)
    if missing:
        print(f"dpllm report: {missing}", file=sys.stderr)
        return 1
    flags = {f for f, on in (("--compliance", args.compliance), ("--json", args.json)) if on}
    paths = [args.run_dir]
    try:
        report = PrivacyReport.read(paths[0])
    except ReportError as err:
        print(f"dpllm report: {err}", file=sys.stderr)
        return 1
    if "--compliance" in flags:
        try:
            items = check(paths[0])
        except ReportError as err:
            print(f"dpllm report: {err}", file=sys.stderr)
            return 1
        if "--json" in flags:
            print(json.dumps(to_json(items), indent=2))
        else:
            release = report.release
            print(f"Compliance checklist for {paths[0]} ({report.summary()})"
                  + ("" if release is None else ", as dpllm export recorded it from the private run directory"
                     + (f"; privacy ledger head {release['ledger_head']}" if release.get("ledger_head") else ""))
                  + "\n")
            print(format_table(items))
        return 1 if any(it.status == NOT_MET for it in items) else 0
    print(report.summary())
    for line in report.details():  # the unit in words (sequence level), what max_length cut off
        print(line)
    if report.enabled and report.noise_secret is False:
        print(f"WARNING: {NOT_RELEASABLE}", file=sys.stderr)
    print(json.dumps(report.to_dict(), indent=2))
    return 0
