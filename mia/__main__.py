"""``python -m mia``: membership-inference audits and canary ε lower bounds.

Audit a training run (members = train split, non-members = heldout split)::

    python -m mia audit --checkpoint runs/x --out runs/x/audit
    python -m mia audit --unit user --checkpoint runs/x     # users of a privacy_unit=user run (mia.users)

Audit the model as an embedding API (the attacker sees only mean-pooled hidden states of layer L; mia.embedding)::

    python -m mia audit --interface embedding --layer -1 --checkpoint runs/x --reference base

Audit any checkpoint against explicit member / non-member files::

    python -m mia audit --checkpoint runs/x/checkpoint --members m.jsonl --nonmembers n.jsonl \\
        --attacks loss,zlib,mink,minkpp,ref --reference meta-llama/Llama-3.2-1B --max-length 128 \\
        --out audit/

Empirical ε lower bound from the run's canaries, next to the accountant's ε (exit code 1 when the
lower bound is larger: a privacy bug)::

    python -m mia canaries --run runs/x

White-box audit (the auditor sees every noisy update): DP-SGD on a tiny Llama through dpllm's
engine with M Dirac gradient canaries, exit code 1 when the bound exceeds the accountant's ε::

    python -m mia whitebox --m 1000 --steps 20 --sample-rate 0.2 --target-epsilon 8 --out audit/

Likelihood-ratio attack (LiRA) with shadow models trained like the run, each on half of its
members + non-members (slow: trains SHADOWS models)::

    python -m mia lira --run runs/x --shadows 8 [--offline] [--max-records N] [--out DIR]

A run directory's audit also reports the most any attack can reach against the run's mechanism (AUC, TPR at
FPR 1% and 0.1%, from its privacy history: dpllm.privacy.tradeoff) next to the measured values.

Exit codes: 0 ok, 1 privacy bug (``canaries`` or ``whitebox``; ``audit``: a measured value above what the
mechanism allows, beyond sampling error), 2 bad input.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mia.attacks import ATTACKS


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-length", type=int, default=None,
                   help="truncation length used in training (default: the run's, else none)")
    p.add_argument("--batch-size", type=int, default=8, help="records per forward pass")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on GPU), float32, bfloat16")
    p.add_argument("--reference", default=None,
                   help="reference model (path or hub id) for 'ref' and the embedding attacks; 'base' = the "
                        "LoRA target's own base model (adapters disabled)")
    p.add_argument("--seed", type=int, default=0, help="seed for subsampling, bootstrap, tie-breaking")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mia", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    a = sub.add_parser("audit", help="membership-inference attacks on members vs non-members")
    a.add_argument("--checkpoint", required=True,
                   help="run directory (has splits.json), checkpoint directory, LoRA adapter or hub id")
    a.add_argument("--members", help="JSONL of member records (not needed for a run directory)")
    a.add_argument("--nonmembers", help="JSONL of non-member records")
    a.add_argument("--text-column", default="text", help="field holding the text in the JSONL files")
    a.add_argument("--attacks", default=None,
                   # argparse %-formats help strings, and Min-K% has a literal %.
                   help="comma-separated; default loss,zlib,mink,minkpp (--interface lm) or every embedding "
                        "attack the models allow (--interface embedding). lm: " + ", ".join(
                       f"{k} ({v.help})" for k, v in ATTACKS.items()).replace("%", "%%")
                        + ". embedding: halves, halves_ref, ref_distance, classifier (see mia.embedding)")
    a.add_argument("--interface", choices=("lm", "embedding"), default="lm",
                   help="what the attacker sees: lm = token probabilities (losses); embedding = only the "
                        "mean-pooled hidden states of --layer, as an embedding API serves them")
    a.add_argument("--layer", type=int, default=-1,
                   help="with --interface embedding: hidden-state index served (0 = token embeddings, "
                        "-1 = last layer)")
    a.add_argument("--k", type=float, default=0.2, help="fraction of tokens for mink/minkpp")
    a.add_argument("--max-records", type=int, default=None,
                   help="audit at most this many members and this many non-members (random, seeded)")
    a.add_argument("--n-bootstrap", type=int, default=1000, help="bootstrap replicates for CIs")
    a.add_argument("--out", default=None, help="output directory (default: RUN_DIR/audit)")
    a.add_argument("--unit", choices=("record", "user"), default="record",
                   help="user: members and non-members are users of a privacy_unit=user run, each scored by the "
                        "mean of its records' scores (mia.users; default RUN_DIR/audit_users)")
    _common(a)

    c = sub.add_parser("canaries", help="ε lower bound from a run's canaries vs the accountant's ε")
    c.add_argument("--run", required=True, help="run directory with canaries.json and checkpoint/")
    c.add_argument("--attack", default="loss", help="attack scoring the canaries")
    c.add_argument("--confidence", type=float, default=0.95,
                   help="confidence of the lower bound over the canaries' coins")
    c.add_argument("--tokens", default="secret", choices=["secret", "all"],
                   help="with --attack loss: score only the tokens after each canary's public prefix "
                        "(secret) or the whole canary (all)")
    c.add_argument("--audit-delta", type=float, default=1e-5,
                   help="δ of the bound when the run has none (non-private runs)")
    c.add_argument("--out", default=None, help="output directory (default: RUN_DIR/audit)")
    _common(c)

    w = sub.add_parser("whitebox", help="white-box audit with Dirac gradient canaries (mia.whitebox)")
    w.add_argument("--m", type=int, default=1000, help="number of canaries (each included by a fair coin)")
    w.add_argument("--records", type=int, default=200, help="real pydoc records trained alongside")
    w.add_argument("--steps", type=int, default=20, help="DP-SGD steps")
    w.add_argument("--sample-rate", type=float, default=0.2, help="Poisson sampling rate q")
    w.add_argument("--target-epsilon", type=float, default=8.0, help="calibrate σ to this ε")
    w.add_argument("--noise-multiplier", type=float, default=None,
                   help="use this σ instead of calibrating (e.g. 1e-3: a no-noise check)")
    w.add_argument("--delta", type=float, default=1e-5, help="δ")
    w.add_argument("--accountant", default="prv", help="prv, rdp or gdp")
    w.add_argument("--score", default="lr", choices=["lr", "sum"], help="canary score from its updates")
    w.add_argument("--confidence", type=float, default=0.95, help="confidence of the bound")
    w.add_argument("--seed", type=int, default=0, help="coins, init, sampling, noise")
    w.add_argument("--out", required=True, help="output directory for whitebox_report.{json,md}")

    l_ = sub.add_parser("lira", help="LiRA (Carlini et al. 2022) with shadow models trained like the run")
    l_.add_argument("--run", required=True, help="run directory (splits.json, config.yaml, checkpoint/)")
    l_.add_argument("--shadows", type=int, default=8,
                    help="number of shadow models, even and >= 4 (trained in complementary pairs)")
    l_.add_argument("--offline", action="store_true",
                    help="offline LiRA (OUT shadows only) instead of online")
    l_.add_argument("--max-records", type=int, default=None,
                    help="use at most this many members and this many non-members (random, seeded)")
    l_.add_argument("--n-bootstrap", type=int, default=1000, help="bootstrap replicates for CIs")
    l_.add_argument("--out", default=None,
                    help="output directory for shadows/ and lira_report.* (default: RUN_DIR/audit)")
    l_.add_argument("--batch-size", type=int, default=8, help="records per forward pass")
    l_.add_argument("--device", default="cpu", help="device for scoring (training follows the run config)")
    l_.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on GPU), float32, bfloat16")
    l_.add_argument("--seed", type=int, default=0,
                    help="seed for subsampling, shadow halves, shadow training seeds, bootstrap")
    l_.add_argument("--no-progress", action="store_true", help="hide progress bars")
    return parser


def _reference(args):
    from mia.audit import load_target

    return load_target(args.reference, device=args.device, dtype=args.dtype) if args.reference else None


def cmd_audit(args) -> int:
    from mia import attacks, audit, report

    if args.unit == "user":
        if args.interface != "lm":
            raise ValueError("--unit user audits losses; drop --interface embedding (or audit records)")
        from mia.users import cmd_audit_users

        return cmd_audit_users(args)

    if args.interface == "embedding":
        from mia.embedding import parse_attacks as parse_embedding_attacks

        if args.attacks:
            parse_embedding_attacks(args.attacks)  # fail fast, before loading any model
        names = args.attacks
    else:
        names = attacks.parse_attacks(args.attacks or "loss,zlib,mink,minkpp")
    if args.interface == "lm" and args.reference == "base":
        raise ValueError("--reference base is for --interface embedding; pass --reference PATH for 'ref'")
    if args.interface == "lm" and any(attacks.ATTACKS[n].needs_reference for n in names) and not args.reference:
        raise ValueError("attack 'ref' needs --reference PATH (e.g. the base model before "
                         "fine-tuning); add it or drop 'ref' from --attacks")
    target = Path(args.checkpoint)
    run_dir = audit.is_run_dir(target)
    if args.members or args.nonmembers:
        if not (args.members and args.nonmembers):
            raise ValueError("pass both --members and --nonmembers (or a run directory alone)")
        members = audit.read_texts(args.members, text_column=args.text_column)
        nonmembers = audit.read_texts(args.nonmembers, text_column=args.text_column)
    elif run_dir:
        members, nonmembers = audit.load_run_records(target)
    else:
        raise ValueError(f"{target} is not a run directory (no splits.json); pass --members and "
                         f"--nonmembers JSONL files")
    audit.check_member_sets(members, nonmembers)
    if run_dir:
        model, tok = audit.load_run_model(target, device=args.device, dtype=args.dtype)
    else:
        model, tok = audit.load_target(target, device=args.device, dtype=args.dtype)
    max_length = args.max_length or (audit.run_max_length(target) if run_dir else None)
    bound = None
    if run_dir:
        try:
            privacy = audit.read_privacy_report(target)
            if privacy.get("enabled", True) and privacy.get("epsilon") is not None:
                bound = (float(privacy["epsilon"]), float(privacy.get("delta") or 0.0))
        except ValueError:
            pass
    out = args.out or (target / "audit" if run_dir else None)
    if out is None:
        raise ValueError("pass --out DIR for the report files")
    if args.interface == "embedding":
        return _embedding_audit(args, model, tok, members, nonmembers, max_length=max_length, bound=bound,
                                out=out, run_dir=run_dir, target=target)
    rep, scores = audit.run_audit(
        model, tok, members, nonmembers, attacks=names, reference=_reference(args),
        max_length=max_length, batch_size=args.batch_size, device=args.device,
        attack_params={"k": args.k}, n_bootstrap=args.n_bootstrap, seed=args.seed,
        max_records=args.max_records, progress=not args.no_progress,
        # a run's records are scored in the shape it trained them in (splits.json), never a guess from the texts
        **({"record_format": audit.run_sft_format(target), "max_windows": audit.run_max_windows(target),
            "window_stride": audit.run_window_stride(target)} if run_dir and not args.members else {}))
    rep = {"checkpoint": str(target), "reference": args.reference, **rep}
    return _write_audit(args, rep, scores, out=out, run_dir=run_dir, bound=bound, write=report.write_audit_report)


def _write_audit(args, rep: dict, scores: dict, *, out, run_dir: bool, bound, write) -> int:
    """Settings every audit report states (the split, the DP bound), then the files and the table."""
    from mia import report

    if run_dir and not (args.members or args.nonmembers):
        rep["split"] = ("members and non-members are the run's own random (IID) train/heldout split "
                        "(splits.json): no distribution shift by construction")
    if bound:
        rep["dp_bound"] = {"epsilon": bound[0], "delta": bound[1]}
    if run_dir:
        from mia.audit import privacy_bounds

        limits = privacy_bounds(args.checkpoint, rep["attacks"], fprs=rep.get("fprs", ()))
        if limits is not None:
            rep["privacy_bounds"] = limits
    paths = write(rep, scores, out)
    print(report.markdown_table(rep))
    if "blind" in rep:
        print(f"\nblind baseline: {rep['blind']['message']}")
    print(f"\nwrote {', '.join(str(p) for p in paths.values())}")
    return report.print_bounds(rep)


def _embedding_audit(args, model, tok, members, nonmembers, *, max_length, bound, out, run_dir, target) -> int:
    from mia import report
    from mia.embedding import run_embedding_audit

    reference = "base" if args.reference == "base" else _reference(args)
    rep, scores = run_embedding_audit(
        model, tok, members, nonmembers, layer=args.layer, attacks=args.attacks, reference=reference,
        max_length=max_length, batch_size=args.batch_size, device=args.device, n_bootstrap=args.n_bootstrap,
        seed=args.seed, max_records=args.max_records, progress=not args.no_progress)
    rep = {"checkpoint": str(target), "reference_path": args.reference, **rep}
    return _write_audit(args, rep, scores, out=out, run_dir=run_dir, bound=bound, write=report.write_embedding_report)


def cmd_canaries(args) -> int:
    from mia import audit, report

    run = Path(args.run)
    audit.read_canaries(run)  # clear errors before the (slow) model load
    audit.read_privacy_report(run)
    model, tok = audit.load_run_model(run, device=args.device, dtype=args.dtype)
    rep = audit.canary_audit(
        run, model, tok, attack=args.attack, reference=_reference(args),
        max_length=args.max_length or audit.run_max_length(run), batch_size=args.batch_size,
        device=args.device, confidence=args.confidence, tokens=args.tokens,
        audit_delta=args.audit_delta, seed=args.seed, progress=not args.no_progress)
    paths = report.write_canary_report(rep, args.out or run / "audit")
    print(f"accountant ε = {rep['accountant_epsilon']}"
          + (f" ({rep['accounted_as']})" if rep.get("accounted_as") else "") + ", empirical lower bound ε >= "
          f"{rep['epsilon_lower']:.3f} at δ = {rep['delta']:g} with {rep['confidence']:.0%} confidence "
          f"(Gaussian-DP reading: μ >= {rep['gdp']['mu_lower']:.3f}, ε = {rep['gdp']['epsilon_lower']:.3f})")
    print(f"wrote {', '.join(str(p) for p in paths.values())}")
    if rep["privacy_bug"]:
        bar = "!" * 78
        print(f"{bar}\nPRIVACY BUG: {rep['message']}\n{bar}", file=sys.stderr)
        return 1
    print(rep["message"])
    return 0


def cmd_whitebox(args) -> int:
    from mia import report
    from mia.whitebox import whitebox_audit

    rep = whitebox_audit(m=args.m, num_records=args.records, steps=args.steps, sample_rate=args.sample_rate,
                         target_epsilon=None if args.noise_multiplier else args.target_epsilon,
                         noise_multiplier=args.noise_multiplier, delta=args.delta,
                         accountant=args.accountant, score=args.score, confidence=args.confidence,
                         seed=args.seed)
    paths = report.write_whitebox_report(rep, args.out)
    print(report.whitebox_summary(rep))
    print(f"wrote {', '.join(str(p) for p in paths.values())}")
    if rep["privacy_bug"]:
        bar = "!" * 78
        print(f"{bar}\nPRIVACY BUG: {rep['message']}\n{bar}", file=sys.stderr)
        return 1
    return 0


def cmd_lira(args) -> int:
    from mia import shadows

    run = Path(args.run)
    out = Path(args.out) if args.out else run / "audit"
    rep, scores, details = shadows.lira_audit(
        run, n_shadows=args.shadows, out_dir=out, offline=args.offline,
        max_records=args.max_records, seed=args.seed, batch_size=args.batch_size,
        device=args.device, dtype=args.dtype, n_bootstrap=args.n_bootstrap,
        progress=not args.no_progress)
    paths = shadows.write_lira_report(rep, scores, out, details=details)
    lira, loss = rep["attacks"]["lira"], rep["attacks"]["loss"]
    print(f"{rep['variant']} LiRA, {rep['n_shadows']} shadows: AUC {lira['auc']:.3f} "
          f"(loss attack {loss['auc']:.3f})")
    print(f"wrote {', '.join(str(p) for p in paths.values())}")
    return 0


def _models(args) -> list[str]:
    """Every model the command loads: the checkpoint or run (whitebox trains a tiny model), and a reference model."""
    models = [getattr(args, "checkpoint", None) or getattr(args, "run", None) or "tiny-llama"]
    if getattr(args, "reference", None) not in (None, "base"):
        models.append(args.reference)
    return models


def main(argv: list[str] | None = None, *, command: bool = False) -> int:
    """Entry point; returns the exit code. ``command``: run as ``python -m mia`` (a process of its own, where a
    process-wide setting such as hiding an unused bitsandbytes is safe)."""
    args = build_parser().parse_args(argv)
    if command:  # no bitsandbytes import (peft's, and its log) unless a model needs it; no known deprecations
        from dpllm.quantization import quiet_command

        quiet_command(*_models(args), progress=not getattr(args, "no_progress", False))
    try:
        return {"audit": cmd_audit, "canaries": cmd_canaries, "whitebox": cmd_whitebox,
                "lira": cmd_lira}[args.command](args)
    except (ValueError, FileNotFoundError) as err:
        print(f"python -m mia {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(command=True))
