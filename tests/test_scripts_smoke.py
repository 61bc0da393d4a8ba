"""Every script and recipe that the docs cite runs, on tiny shapes (issue 49.9: a figure can always be reproduced
by the command beside it).

``bench_fsdp.py --interleave 3``, the command docs cite for the FSDP figures, failed with ``AttributeError:
'Namespace' object has no attribute 'quantization'`` once the shared shape builder grew an option: nothing ran it.
Here each cited command runs once with tiny arguments (in this process where the script has a ``main(argv)``,
so torch is imported once), or is listed with the test that already runs it. ``test_every_cited_script_is_covered``
reads docs/ and README.md, so a newly cited script without a smoke run fails the suite.

The slowest (several processes each: bitsandbytes' CPU path, four gloo loaders, the guard's cost over three
models) are marked ``slow`` and run by ``make test-slow``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# script -> arguments ({tmp} is the test's temporary directory); each run on tiny shapes in seconds
SMOKE = {
    "scripts/bench_overhead.py": "--shape llama-tiny --seq 16 --batch 2 --steps 1 --warmup 0 --modes bk "
                                 "--out {tmp}/overhead.json",
    "scripts/bench_fsdp.py": "--processes 1 --modes nodp,bk --hidden 32 --layers 1 --heads 2 --vocab 256 --seq 16 "
                             "--batch 2 --interleave 1 --warmup 0 --memory-steps 0 --out {tmp}/fsdp.json",
    "scripts/profile_bk.py": "--shape llama-tiny --seq 16 --batch 2 --steps 1 --out {tmp}/profile.json",
    "scripts/fsdp_memory.py": "--shape llama-tiny --gpus 2 --batch 2 --seq 32",
    "scripts/split_moves.py": "--sizes 40",
    "scripts/scaling_example.py": "--out {tmp}/example --n-boot 5 --sweeps 0 --n-boot-replicates 5",
    "scripts/scaling_extrapolation.py": "--sweeps 1 --n-boot 5",
    "scripts/bench_scaling_fit.py": "--rows 20 --n-boot 5",
    "scripts/bench_plan_latency.py": "--cases n1e6_target --blt-steps 5 --out {tmp}/plan.json",
    "scripts/bench_packing.py": "--smoke --out {tmp}/packing.json",
    "scripts/bench_correlated_noise.py": "--params 20000 --bands 1 3 --repeats 1 --json {tmp}/correlated.json",
    "scripts/bench_correlated_step.py": "--smoke --out {tmp}/correlated_step.json",
    "scripts/bench_accounting.py": "--smoke --out {tmp}/accounting.json",
    "scripts/gpu_proof.py": None,  # its own test: tests/test_gpu_proof.py
}
SLOW = {
    "scripts/bench_qlora.py": "--hidden 32 --layers 1 --heads 2 --seq 16 --batch 2 --steps 1 --modes bk "
                              "--interleave 1 --out {tmp}/qlora.json",
    "scripts/bench_fsdp_loading.py": "--layers 1 --hidden 64 --vocab 256 --processes 2 --json {tmp}/loading.json",
    "scripts/measure_guards.py": "cost --rounds 1 --hidden 32 --layers 1 --seq 16",
}
# run as their own process: their workers are spawned by multiprocessing, which imports the script by its name
OWN_PROCESS = {"scripts/bench_fsdp_loading.py"}
# measure in processes of their own: `python script ... --mode M` (bench_overhead, for each mode's peak memory),
# `python -m torch.distributed.run --nproc_per_node 1 ... script ...` (bench_fsdp's worker, with --processes 1). Here
# those run in this process too, through the same main(argv), which is all the smoke checks (each process would add
# ~8 CPU-s of imports; torch.distributed.run's worker would add a launcher too): the worker's process group of one
# on the environment the launcher would give it
CHILDREN_HERE = {"scripts/bench_overhead.py", "scripts/bench_fsdp.py"}
# cited, and already run by another test (not repeated here)
COVERED = {
    "scripts/fft_rounding.py": "tests/test_pld_fallback.py (spread, prv_error)",
    "scripts/mf_errors.py": "tests/test_correlated_blt.py (--smoke, checks the table's order)",
    "scripts/qlora_memory.py": "tests/test_qlora_runs.py (the 4-bit term)",
    "recipes/finetune_llm.py": "tests/test_train.py and a dozen others",
    "recipes/demo.py": "tests/test_train.py (--quick)",
    "recipes/correlated_noise_study.py": "tests/test_correlated_noise_study.py (--quick)",
    "recipes/hf_trainer_example.py": "tests/test_hf_trainer.py",
    "recipes/scaling_sweep.py": "tests/test_scaling_sweep.py, tests/test_scaling_sweep_twostage.py",
    "recipes/mlp_clipping.py": "tests/test_mlp_clipping_recipe.py",
    "recipes/mlp_membership.py": "tests/test_mlp_membership_recipe.py",
    "recipes/mlp_privacy_cliff.py": "tests/test_mlp_privacy_cliff_recipe.py",
    "recipes/mlp_scaling.py": "tests/test_mlp_scaling_recipe.py",
    "recipes/mlp_study.py": "tests/test_mlp_privacy_cliff_recipe.py (the MLP recipes' shared helpers)",
    "recipes/noise_schedule_study.py": "tests/test_noise_schedule.py",
    "recipes/sft_study.py": "tests/test_sft.py",
    "recipes/synthetic_study.py": "tests/test_synthetic_study.py",
    "recipes/user_level_study.py": "tests/test_user_level_study.py",
}


def _cited() -> set[str]:
    """``scripts/x.py`` and ``recipes/x.py`` named anywhere in docs/ (text files) and README.md."""
    found = set()
    files = [ROOT / "README.md", *(p for p in (ROOT / "docs").rglob("*") if p.suffix in (".md", ".sh", ".json"))]
    for path in files:
        found |= set(re.findall(r"\b((?:scripts|recipes)/[a-z0-9_]+\.py)\b", path.read_text(errors="replace")))
    return found


def test_every_cited_script_is_covered():
    cited = _cited()
    assert "scripts/bench_fsdp.py" in cited  # the reader sees the docs this test means to read
    missing = sorted(c for c in cited if c not in SMOKE and c not in SLOW and c not in COVERED)
    assert not missing, f"cited in docs/ or README.md without a smoke run: {missing}; add it to SMOKE here"
    assert all((ROOT / c).exists() for c in cited), [c for c in cited if not (ROOT / c).exists()]


def _run(script: str, argv: str, tmp_path, monkeypatch) -> None:
    """``main(argv)`` of ``script`` in this process, as ``python script ...`` runs it from the repository root."""
    args = argv.format(tmp=tmp_path)
    if script in OWN_PROCESS:
        res = subprocess.run([sys.executable, script, *args.split()], cwd=ROOT, capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=900)
        assert res.returncode == 0, res.stderr[-3000:]
        print(res.stdout)
        return
    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(ROOT / Path(script).parent))
    monkeypatch.syspath_prepend(str(ROOT))
    name = Path(script).stem
    spec = importlib.util.spec_from_file_location(f"smoke_{name}", ROOT / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # a script's own imports (bench_overhead from profile_bk) resolve from scripts/, fresh for each script
    monkeypatch.setattr(sys, "argv", [script, *args.split()])
    here = _children_here(module, subprocess.run)
    if script in CHILDREN_HERE:
        monkeypatch.setattr(subprocess, "run", here)
    module.main(args.split())
    assert (script in CHILDREN_HERE) == bool(here.ran), here.ran  # its measurements ran here, not as processes


def _children_here(module, run):
    """``subprocess.run`` that runs ``[python, <module's script>, ARGS]``, and ``[python, -m, torch.distributed.run,
    --nproc_per_node, 1, --master_port, P, <module's script>, ARGS]`` in a process group of one (the launcher's
    environment: rank 0 of 1, at 127.0.0.1:P), as ``module.main(ARGS)`` in this process (its stdout and stderr
    captured, SystemExit and exceptions as a return code, ``check=True`` honoured), and anything else as ``run``."""
    import contextlib
    import io
    import traceback
    from unittest import mock

    script = module.__file__

    def here(cmd, *args, **kwargs):
        cmd = [str(c) for c in cmd]
        env = {}
        if cmd[:2] == [sys.executable, script]:
            argv = cmd[2:]
        elif cmd[:6] == [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port"] \
                and cmd[7] == script:
            argv = cmd[8:]
            env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": cmd[6], "RANK": "0", "WORLD_SIZE": "1"}
        else:
            return run(cmd, *args, **kwargs)
        here.ran.append(argv)
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), mock.patch.dict(os.environ, env):
            os.environ.pop("LOCAL_RANK", None)  # set, dpllm's finish_process would end this process
            try:
                module.main(argv)
                code = 0
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else 1
            except Exception:
                traceback.print_exc()
                code = 1
            finally:
                from dpllm.stopping import release_process_group

                release_process_group()  # a worker that failed half-way leaves no group for the next test
        if kwargs.get("check") and code:
            raise subprocess.CalledProcessError(code, cmd, out.getvalue(), err.getvalue())
        return subprocess.CompletedProcess(cmd, code, out.getvalue(), err.getvalue())

    here.ran = []
    return here


@pytest.mark.parametrize("script", sorted(s for s, a in SMOKE.items() if a))
def test_script_smoke(script, tmp_path, monkeypatch, capsys):
    _run(script, SMOKE[script], tmp_path, monkeypatch)
    out = capsys.readouterr().out
    assert out.strip(), f"{script} printed nothing"
    for written in re.findall(r"\{tmp\}/(\S+\.json)", SMOKE[script]):
        data = json.loads((tmp_path / written).read_text())
        assert data and not _failures(data), (written, _failures(data))


def _failures(data) -> list:
    """Rows a script recorded as failed: a dict with an ``error`` or a non-zero ``returncode``, anywhere."""
    if isinstance(data, list):
        return [f for x in data for f in _failures(x)]
    if not isinstance(data, dict):
        return []
    own = [data] if "error" in data or data.get("returncode", 0) != 0 else []
    return own + [f for v in data.values() for f in _failures(v)]


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(SLOW))
def test_script_smoke_slow(script, tmp_path, monkeypatch, capsys):
    _run(script, SLOW[script], tmp_path, monkeypatch)
    assert capsys.readouterr().out.strip()
