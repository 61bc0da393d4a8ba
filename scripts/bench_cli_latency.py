"""How long every entry point takes to answer ``--help``, a mistyped option and a missing path.

Each command runs as a real process; the figure is that process's CPU time (user + system, from
``resource.getrusage(RUSAGE_CHILDREN)``), which on a loaded machine stays close to what an idle core would take,
and its wall time beside it. The goal (issue 35): every answer in under 2 s of an idle core, because each typo
otherwise costs a user the import of the whole stack (torch, transformers, opacus: 5–40 s under load).

    python scripts/bench_cli_latency.py                  # table on stdout, exit 1 if any answer is over --limit
    python scripts/bench_cli_latency.py --json runs/cli_latency.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
DPLLM = [PY, "-c", "import sys; from dpllm.cli import main; sys.exit(main())"]
MISSING = "no/such/records.jsonl"

#: (entry point, arguments, exit codes that count as a correct answer)
CASES: list[tuple[list[str], list[str], tuple[int, ...]]] = []
for script in ("finetune_llm", "hf_trainer_example", "demo", "sft_study", "synthetic_study", "user_level_study",
               "noise_schedule_study", "scaling_sweep", "mlp_scaling", "mlp_privacy_cliff", "mlp_clipping",
               "mlp_membership"):
    entry = [PY, str(ROOT / "recipes" / f"{script}.py")]
    CASES += [(entry, ["--help"], (0,)), (entry, ["--no_such_option", "1"], (2,))]
CASES += [([PY, str(ROOT / "recipes" / "finetune_llm.py")], ["--dataset", MISSING], (2,)),
          ([PY, str(ROOT / "recipes" / "finetune_llm.py")], ["--config", "recipes/configs/tiny/no_such.yaml"], (2,))]
for sub in (["plan"], ["scaling", "fit"], ["scaling", "predict"], ["scaling", "plan"], ["ledger", "verify"],
            ["report"], ["export"], ["synthesize"]):
    CASES += [(DPLLM, [*sub, "--help"], (0,)), (DPLLM, [*sub, "--no_such_option", "1"], (2,))]
CASES += [(DPLLM, ["report", "runs/no_such_run"], (1, 2)), (DPLLM, ["ledger", "verify", "runs/no_such_run"], (1, 2)),
          (DPLLM, ["export", "runs/no_such_run", "--out", "runs/no_such_export"], (1, 2)),
          (DPLLM, ["synthesize", "runs/no_such_run", "--num", "2", "--out", "runs/no_such.jsonl"], (1, 2))]
for sub in ("audit", "canaries", "whitebox"):
    mia = [PY, "-m", "mia"]
    CASES += [(mia, [sub, "--help"], (0,)), (mia, [sub, "--no_such_option", "1"], (2,))]
CASES += [([PY, "-m", "mia"], ["audit", "--checkpoint", "runs/no_such_run"], (1, 2))]


def measure(cmd: list[str], args: list[str]) -> tuple[float, float, int]:
    """(CPU seconds, wall seconds, exit code) of one run of ``cmd + args``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd + args, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall, proc.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=float, default=2.0, help="CPU seconds an answer may take (default 2)")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    rows, worst = [], 0.0
    print(f"{'cpu s':>6} {'wall s':>6} {'exit':>4}  command")
    for cmd, extra, ok in CASES:
        cpu, wall, code = measure(cmd, extra)
        name = " ".join(["dpllm"] if cmd is DPLLM else [Path(c).name if c.endswith(".py") else c for c in cmd[1:]])
        shown = f"{name} {' '.join(extra)}"
        flag = "" if code in ok and cpu <= args.limit else "  <-- " + (
            f"exit {code}, expected {ok}" if code not in ok else f"over {args.limit:g} s")
        print(f"{cpu:6.2f} {wall:6.2f} {code:4d}  {shown}{flag}", flush=True)
        rows.append({"command": shown, "cpu_s": round(cpu, 3), "wall_s": round(wall, 3), "exit": code,
                     "ok": code in ok and cpu <= args.limit})
        worst = max(worst, cpu)
    bad = [r for r in rows if not r["ok"]]
    print(f"\n{len(rows)} answers, slowest {worst:.2f} s of CPU; {len(bad)} over {args.limit:g} s or with an "
          "unexpected exit code")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"limit_s": args.limit, "rows": rows}, indent=2) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
