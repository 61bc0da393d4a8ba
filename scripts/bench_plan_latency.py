"""Latency, CPU time and peak memory of ``dpllm plan``, each plan in its own process (figures, not a test).

Each case runs the real console command (``python -m dpllm.cli plan ...``) under an address-space limit and
reports wall seconds, CPU seconds (user + system, the figure that does not depend on other load on the
machine), peak resident memory, the accountant the plan used and its table. ``--pythonpath`` times another
tree, e.g. the code before this change (``git archive 061ec7a dpllm | tar -x -C /tmp/before``):

    python scripts/bench_plan_latency.py --out docs/results/plan_latency/after.json
    python scripts/bench_plan_latency.py --cases n1e6_table --pythonpath /tmp/before \\
        --out docs/results/plan_latency/before.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

CASES = {
    "n1e6_table": ["--num-records", "1000000", "--batch", "1024", "--epochs", "1", "--target-epsilon", "8",
                   "--delta", "1e-7"],
    "n1e6_target": ["--num-records", "1000000", "--batch", "1024", "--epochs", "1", "--target-epsilon", "8",
                    "--delta", "1e-7", "--epsilons", ""],
    "n1e9_table": ["--num-records", "1000000000", "--batch", "1024", "--epochs", "1", "--target-epsilon", "8",
                   "--delta", "1e-10"],
}


def run_case(args: list[str], *, pythonpath: str, limit_bytes: int, timeout: float) -> dict:
    """Run one plan; wall, CPU and peak RSS of that process alone (``os.wait4``)."""
    env = {**os.environ, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1"}

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "dpllm.cli", "plan", *args], stdout=out, stderr=err,
                                text=True, env=env, preexec_fn=cap, cwd=tempfile.gettempdir())  # not this checkout
        killer = threading.Timer(timeout, proc.kill)
        killer.start()
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own CPU time and peak RSS
        wall = time.perf_counter() - start
        killer.cancel()
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    return {"args": args, "returncode": os.waitstatus_to_exitcode(status), "wall_s": round(wall, 2),
            "cpu_s": round(usage.ru_utime + usage.ru_stime, 2), "peak_rss_mb": round(usage.ru_maxrss / 1024),
            "stdout": stdout, "stderr_tail": stderr[-2000:]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--pythonpath", default=str(Path(__file__).resolve().parents[1]),
                   help="tree whose dpllm is timed (default: this checkout)")
    p.add_argument("--limit-gb", type=float, default=4.0, help="address-space limit per plan (default 4 GB)")
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--out", help="write the results as JSON here")
    a = p.parse_args(argv)
    results = {}
    for name in a.cases.split(","):
        r = run_case(CASES[name], pythonpath=a.pythonpath, limit_bytes=int(a.limit_gb * 1e9), timeout=a.timeout)
        results[name] = r
        print(f"{name:12s} rc={r['returncode']}  wall {r['wall_s']:7.2f} s  CPU {r['cpu_s']:7.2f} s  "
              f"peak RSS {r['peak_rss_mb']:6d} MB", flush=True)
        print("\n".join("    " + line for line in r["stdout"].splitlines()), flush=True)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"limit_gb": a.limit_gb, "pythonpath": a.pythonpath,
                                           "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
