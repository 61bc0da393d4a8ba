"""The ``dpllm`` command. Each sub-command lives in its own module and is imported only when used.

    dpllm plan ...            privacy planning (noise for a target ε, ε for a noise, NSR table)
    dpllm scaling fit|plan    scaling-law fits and compute planning
    dpllm ledger verify RUN   check a run's tamper-evident ε ledger
    dpllm report RUN          print a run's privacy report (--compliance: the deployment checklist)
    dpllm export RUN --out D  write the releasable part of a run (model, tokenizer, report, model card)
    dpllm synthesize RUN ...  sample a synthetic data set from a run, with its data card and a private report
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "plan": ("dpllm.privacy.planning", "privacy planning: noise multiplier, ε and NSR tables"),
    "scaling": ("dpllm.scaling.cli", "fit scaling laws to a runs table and plan N, D for a target"),
    "ledger": ("dpllm.ledger", "verify a run's privacy ledger (hash chain)"),
    "report": ("dpllm.compliance", "print a run's privacy report"),
    "export": ("dpllm.export", "write a run's release bundle: model, tokenizer, privacy report, model card"),
    "synthesize": ("dpllm.synthetic.cli", "sample a synthetic data set from a run: JSONL, data card, private report"),
}


# The commands that load a model: as the ``dpllm`` command (a process of their own) they hide an unused
# bitsandbytes once they know which models they load (dpllm.quantization.quiet_command).
LOADS_MODELS = ("export", "synthesize")


def main(argv: list[str] | None = None, *, command: bool = False) -> int:
    """``dpllm NAME ...``; returns the exit code. ``command``: run as the ``dpllm`` command, a process of its own
    (never a caller's process: what a command sets for its process lasts as long as the process)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        print("\ncommands:")
        for name, (_, help_) in COMMANDS.items():
            print(f"  {name:<10} {help_}")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"dpllm: unknown command {name!r}; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.cli_main(rest, **({"command": True} if command and name in LOADS_MODELS else {})) or 0)


def command() -> int:
    """The installed ``dpllm`` command (``[project.scripts]``): :func:`main` in a process of its own."""
    return main(command=True)


if __name__ == "__main__":
    sys.exit(command())
