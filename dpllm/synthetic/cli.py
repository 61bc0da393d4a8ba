"""``dpllm synthesize RUN --num N --out synth.jsonl``: sample, write the card, then the private report.

    dpllm synthesize runs/dp --num 1000 --out synth/synth.jsonl
    dpllm synthesize runs/dp --num 1000 --out synth/synth.jsonl --labels json,argparse --temperature 0.8
    dpllm synthesize runs/dp --num 200 --out s.jsonl --prompt "def " --prompt "class " --no-report
    dpllm synthesize runs/dp --num 1000 --out synth/synth.jsonl --release-dir release --push-to-hub me/synth

Rerunning the same command continues an interrupted file (from the same run and checkpoint only: the private
synth.source.json beside it records them). Exit status 1 when the run is refused.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DROPPED_SHARE = 0.1  # warn when more than 10% of the samples drawn were dropped as not valid text


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dpllm synthesize", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", help="a finished dpllm run directory")
    ap.add_argument("--num", type=int, required=True, help="records wanted in --out (existing ones are kept)")
    ap.add_argument("--out", required=True, help="JSONL file; its card (*.card.json/md) and report are written beside")
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0: off)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="tokens sampled per record at most")
    ap.add_argument("--batch-size", type=int, default=32, help="records sampled together")
    ap.add_argument("--seed", type=int, default=0, help="seeds the sampling only (it reads nothing private)")
    ap.add_argument("--prompt", action="append", default=[], help="a public prompt (repeatable; used in turn)")
    ap.add_argument("--prompts-file", help="public prompts, one per line")
    ap.add_argument("--labels", help="comma-separated classes (runs trained with data.label_column); default: all")
    ap.add_argument("--allow-non-private", action="store_true", help="sample from a run trained without DP")
    ap.add_argument("--allow-unreleasable", action="store_true",
                    help="sample from a run dpllm export refuses (seeded noise, ledger fails, a study run, a failed "
                         "audit); the card says so")
    ap.add_argument("--no-report", action="store_true", help="skip the private leakage and fidelity report")
    ap.add_argument("--embedder", default="auto",
                    help="report's embedding model: auto (the run's local base model, else lsa), lsa, or a model dir")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--license", help="the data card's license, a Hub license id (e.g. cc-by-4.0, other)")
    ap.add_argument("--release-dir", metavar="DIR",
                    help="also write the releasable files into this new folder: the data, its JSON card and the data "
                         "card as README.md (datasets.load_dataset(DIR) reads it); never the private report")
    ap.add_argument("--push-to-hub", metavar="REPO_ID",
                    help="upload exactly the release folder to this Hugging Face Hub dataset repository "
                         "(needs HF_TOKEN or `hf auth login`); refused for a file that is not releasable")
    ap.add_argument("--private", action="store_true", help="with --push-to-hub: create the repository private")
    return ap


def cli_main(argv: list[str], *, command: bool = False) -> int:
    """``dpllm synthesize RUN --num N --out FILE ...``; the exit code. ``command``: the ``dpllm`` command's own
    process (:func:`dpllm.quantization.quiet_command` for the run and a named embedder model)."""
    try:
        args = parser().parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    if command:  # before anything imports peft: bitsandbytes stays unimported unless a model it loads needs it
        from dpllm.quantization import quiet_command

        quiet_command(args.run_dir, *([] if args.no_report or args.embedder in ("auto", "lsa") else [args.embedder]),
                      progress=not args.no_progress)
    from dpllm.synthetic.generate import SynthesisError, synthesize

    prompts = list(args.prompt)
    if args.prompts_file:
        if not Path(args.prompts_file).is_file():
            print(f"dpllm synthesize: --prompts-file {args.prompts_file}: no such file", file=sys.stderr)
            return 2
        prompts += [p for p in Path(args.prompts_file).read_text().splitlines() if p.strip()]
    labels = [x.strip() for x in args.labels.split(",") if x.strip()] if args.labels else None
    from dpllm import hub

    if args.private and not args.push_to_hub:
        print("dpllm synthesize: --private applies to --push-to-hub REPO_ID; add it or drop --private", file=sys.stderr)
        return 2
    if args.push_to_hub and args.allow_unreleasable:
        print("dpllm synthesize: --push-to-hub with --allow-unreleasable: a file sampled from a run the release checks "
              "refuse is not releasable; drop one of them", file=sys.stderr)
        return 2
    release = Path(args.release_dir) if args.release_dir else None
    if release is not None and release.exists() and (not release.is_dir() or any(release.iterdir())):
        print(f"dpllm synthesize: --release-dir {release} exists and is not empty; pick a new folder", file=sys.stderr)
        return 2
    try:
        if args.push_to_hub:  # before sampling: a missing token is fixed and the same command rerun
            hub.require_token()
        card = synthesize(args.run_dir, num=args.num, out=args.out, temperature=args.temperature, top_p=args.top_p,
                          max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, seed=args.seed,
                          prompts=prompts or None, labels=labels, allow_non_private=args.allow_non_private,
                          allow_unreleasable=args.allow_unreleasable, progress=not args.no_progress,
                          license=args.license)
    except (SynthesisError, hub.PushError) as err:
        print(f"dpllm synthesize: {err}", file=sys.stderr)
        return 1
    print(f"{args.out}: {card['num_records']} records; {card['statement']}")
    dropped, drawn = card.get("samples_dropped_not_valid_text") or 0, card.get("samples_drawn") or 0
    if drawn and dropped > DROPPED_SHARE * drawn:
        print(f"warning: {dropped} of {drawn} samples were not valid text (NUL or control characters, bytes that are "
              "not UTF-8, an empty sample or turn) and were replaced: the model writes poor text")
    if not args.no_report:
        from dpllm.synthetic.report import evaluate, quality_warnings, write_report

        result = evaluate(args.out, args.run_dir, embedder=args.embedder)
        paths = write_report(result, args.out)
        print(f"report (private: it is computed on the training records): {paths['md']}")
        for line in quality_warnings(result):
            print(f"warning: {line}")
    if release is not None or args.push_to_hub:
        return _release(args, card, release)
    return 0


def _release(args, card: dict, release) -> int:
    """Write the release folder (a temporary one for a push alone) and push it."""
    import tempfile

    from dpllm import hub
    from dpllm.synthetic.card import release_folder

    with tempfile.TemporaryDirectory(prefix="dpllm-synth-") as tmp:
        folder = release_folder(args.out, release if release is not None else Path(tmp) / "release")
        if release is not None:
            print(f"release folder: {folder} ({', '.join(sorted(p.name for p in folder.iterdir()))})")
        if not args.push_to_hub:
            return 0
        if not card["source"]["releasable"]:
            print("dpllm synthesize: not pushed: the card says NOT RELEASABLE", file=sys.stderr)
            return 1
        try:
            retry = None if release is not None else (
                "Rerun the same command when the Hub is reachable (the file is complete: nothing is sampled again), "
                "or add --release-dir DIR to keep the folder and upload it later")
            pushed = hub.push_folder(folder, args.push_to_hub, private=args.private, repo_type="dataset",
                                     commit_message="dpllm synthesize", retry=retry)
        except hub.PushError as err:
            print(f"dpllm synthesize: {err}", file=sys.stderr)
            return 1
    print(f"pushed {len(pushed['files'])} files to https://huggingface.co/datasets/{args.push_to_hub}"
          + (" (private)" if args.private else ""))
    return 0
