"""``dpllm synthesize RUN --num N --out synth.jsonl``: sample, write the card, then the private report.

    dpllm synthesize runs/dp --num 1000 --out synth/synth.jsonl
    dpllm synthesize runs/dp --num 1000 --out synth/synth.jsonl --labels json,argparse --temperature 0.8
    dpllm synthesize runs/dp --num 200 --out s.jsonl --prompt "def " --prompt "class " --no-report

Rerunning the same command continues an interrupted file. Exit status 1 when the run is refused.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


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
                    help="sample from a run dpllm export refuses (seeded noise, ledger fails); the card says so")
    ap.add_argument("--no-report", action="store_true", help="skip the private leakage and fidelity report")
    ap.add_argument("--embedder", default="auto",
                    help="report's embedding model: auto (the run's local base model, else lsa), lsa, or a model dir")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def cli_main(argv: list[str]) -> int:
    from dpllm.synthetic.generate import SynthesisError, synthesize

    try:
        args = parser().parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    prompts = list(args.prompt)
    if args.prompts_file:
        if not Path(args.prompts_file).is_file():
            print(f"dpllm synthesize: --prompts-file {args.prompts_file}: no such file", file=sys.stderr)
            return 2
        prompts += [p for p in Path(args.prompts_file).read_text().splitlines() if p.strip()]
    labels = [x.strip() for x in args.labels.split(",") if x.strip()] if args.labels else None
    try:
        card = synthesize(args.run_dir, num=args.num, out=args.out, temperature=args.temperature, top_p=args.top_p,
                          max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, seed=args.seed,
                          prompts=prompts or None, labels=labels, allow_non_private=args.allow_non_private,
                          allow_unreleasable=args.allow_unreleasable, progress=not args.no_progress)
    except SynthesisError as err:
        print(f"dpllm synthesize: {err}", file=sys.stderr)
        return 1
    print(f"{args.out}: {card['num_records']} records; {card['statement']}")
    if not args.no_report:
        from dpllm.synthetic.report import evaluate, write_report

        paths = write_report(evaluate(args.out, args.run_dir, embedder=args.embedder), args.out)
        print(f"report (private: it is computed on the training records): {paths['md']}")
    return 0
