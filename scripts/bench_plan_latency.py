"""Latency, CPU time and peak memory of ``dpllm plan``, each plan in its own process (figures, not a test).

Each case runs the real console command (``python -m dpllm.cli plan ...``) under an address-space limit and
reports wall seconds, CPU seconds (user + system, the figure that does not depend on other load on the
machine), peak resident memory, the accountant the plan used and its table. ``--pythonpath`` times another
tree, e.g. the code before this change (``git archive 061ec7a dpllm | tar -x -C /tmp/before``):

    python scripts/bench_plan_latency.py --out docs/results/plan_latency/after.json
    python scripts/bench_plan_latency.py --cases n1e6_table --pythonpath /tmp/before \\
        --out docs/results/plan_latency/before.json

``--blt-steps`` adds BLT's strategy optimisation (``privacy.noise: blt``): for each T and b in {1, T/10, T/100}, in
its own process with cold caches, the CPU seconds of ``build("blt", b, buffers="auto")`` (one b, the buffer chain)
and of ``build("blt", "auto")`` at ⌈N/B⌉ = b (the four group counts b, b/2, b/4, b/8), where the time goes (L-BFGS
runs, loss evaluations, seconds inside the loss) and the prefix-sum RMSE each returns; ``--blt-plan`` also times
``dpllm plan --noise blt`` (which adds banded noise's own optimisation and the accountants):

    python scripts/bench_plan_latency.py --cases "" --blt-steps 100 1000 10000 100000 --blt-plan \\
        --out docs/results/plan_latency/blt_after.json
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


def blt_groups(steps: int) -> list[int]:
    """b ∈ {1, T/10, T/100} (distinct, at least 1), largest first."""
    return sorted({1, max(1, steps // 10), max(1, steps // 100)}, reverse=True)


def blt_worker(steps: int, groups: int, bands: str) -> dict:
    """One cold BLT build in this process: CPU seconds, L-BFGS runs and loss evaluations, the strategy's RMSE."""
    import scipy.optimize

    from dpllm.privacy import correlated
    from dpllm.privacy.correlated import blt

    counts = {"lbfgs_runs": 0, "loss_evaluations": 0, "loss_cpu_s": 0.0}
    minimize = scipy.optimize.minimize

    def counted_minimize(fun, x0, **kw):
        def timed(u):
            t = time.process_time()
            try:
                return fun(u)
            finally:
                counts["loss_evaluations"] += 1
                counts["loss_cpu_s"] += time.process_time() - t
        counts["lbfgs_runs"] += 1
        return minimize(timed, x0, **kw)

    blt.sp_optimize.minimize = counted_minimize
    start = time.process_time()
    noise = correlated.build("blt", bands, steps=steps, num_records=groups * 100, batch=100, buffers="auto")
    cpu = time.process_time() - start
    return {"steps": steps, "groups": groups, "bands": bands, "cpu_s": round(cpu, 3), **counts,
            "loss_cpu_s": round(counts["loss_cpu_s"], 3), "picked_bands": noise.bands,
            "buffers": noise.strategy.blt.buffers, "prefix_sum_rmse": noise.strategy.prefix_sum_rmse(steps),
            "auto": [dict(r) for r in noise.choice]}


def run_blt(steps: int, groups: int, bands: str, *, pythonpath: str, timeout: float) -> dict:
    env = {**os.environ, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1"}
    try:
        res = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--blt-worker", str(steps), str(groups),
                              bands], capture_output=True, text=True, env=env, timeout=timeout,
                             cwd=tempfile.gettempdir())
    except subprocess.TimeoutExpired:
        return {"steps": steps, "groups": groups, "bands": bands, "error": f"over {timeout} s"}
    if res.returncode != 0:
        return {"steps": steps, "groups": groups, "bands": bands, "error": res.stderr[-2000:]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def blt_plan_args(steps: int, groups: int) -> list[str]:
    """``dpllm plan --noise blt`` at ⌈N/B⌉ = b batches per epoch and T/b epochs (T steps)."""
    records = groups * 100
    return ["--num-records", str(records), "--batch", "100", "--epochs", str(steps // groups),
            "--target-epsilon", "8", "--delta", f"{min(1e-6, 0.1 / records):.3g}", "--noise", "blt", "--epsilons", ""]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--pythonpath", default=str(Path(__file__).resolve().parents[1]),
                   help="tree whose dpllm is timed (default: this checkout)")
    p.add_argument("--limit-gb", type=float, default=4.0, help="address-space limit per plan (default 4 GB)")
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--blt-steps", type=int, nargs="*", default=[], help="time BLT's optimisation at these T")
    p.add_argument("--blt-plan", action="store_true", help="with --blt-steps: also time dpllm plan --noise blt")
    p.add_argument("--blt-worker", nargs=3, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.blt_worker:
        print(json.dumps(blt_worker(int(a.blt_worker[0]), int(a.blt_worker[1]), a.blt_worker[2])))
        return
    results, blt_rows = {}, []
    for steps in a.blt_steps:
        for groups in blt_groups(steps):
            for bands in (str(groups), "auto"):
                r = run_blt(steps, groups, bands, pythonpath=a.pythonpath, timeout=a.timeout)
                blt_rows.append(r)
                print(f"blt T={steps:<7d} b={groups:<6d} bands={bands:5s} " + (r["error"] if "error" in r else
                      f"CPU {r['cpu_s']:7.2f} s  ({r['lbfgs_runs']} L-BFGS runs, {r['loss_evaluations']} loss "
                      f"evaluations, {r['loss_cpu_s']:.2f} s in the loss)  picked b={r['picked_bands']} "
                      f"d={r['buffers']}  RMSE {r['prefix_sum_rmse']:.6g}"), flush=True)
            if a.blt_plan:
                name = f"blt_plan_T{steps}_b{groups}"
                r = run_case(blt_plan_args(steps, groups), pythonpath=a.pythonpath,
                             limit_bytes=int(a.limit_gb * 1e9), timeout=a.timeout)
                results[name] = r
                print(f"{name:24s} rc={r['returncode']}  wall {r['wall_s']:7.2f} s  CPU {r['cpu_s']:7.2f} s",
                      flush=True)
    for name in filter(None, a.cases.split(",")):
        r = run_case(CASES[name], pythonpath=a.pythonpath, limit_bytes=int(a.limit_gb * 1e9), timeout=a.timeout)
        results[name] = r
        print(f"{name:12s} rc={r['returncode']}  wall {r['wall_s']:7.2f} s  CPU {r['cpu_s']:7.2f} s  "
              f"peak RSS {r['peak_rss_mb']:6d} MB", flush=True)
        print("\n".join("    " + line for line in r["stdout"].splitlines()), flush=True)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"limit_gb": a.limit_gb, "pythonpath": a.pythonpath,
                                           "results": results, "blt": blt_rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
