"""Rough edges a new user met (issue 49, item 7): messages that read right, and commands without log noise."""

import pytest

from dpllm.io import JsonlError, read_jsonl


def test_an_unterminated_string_reads_once_at(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "cut')  # the file ends inside a string
    with pytest.raises(JsonlError) as err:
        read_jsonl(path)
    assert str(err.value) == f"{path}:2: not valid JSON (Unterminated string starting at column 10)"
    path.write_text('{"text" "x"}\n')
    with pytest.raises(JsonlError, match=r"d.jsonl:1: not valid JSON \(Expecting ':' delimiter at column 9\)"):
        read_jsonl(path)


# Runs the recipe as its command does (``python recipes/finetune_llm.py``), then says which modules it imported; then,
# in the same interpreter, ``python -m mia audit`` of that run (its arguments as JSON in argv[1]), and says it again.
# One interpreter for both: a second one would add ~7 CPU-s of start-up. A module the run imported stays imported, so
# the second answer covers both commands; a warning is printed once per place, so the part of stderr before the
# marker holds the run's and the part after it what only the audit printed (each part is checked for warnings).
MARKER = "=== mia audit ==="
# Imported first (without running them): the modules of every command that hides bitsandbytes once its arguments
# are parsed (recipes, `dpllm export`, `dpllm synthesize`) must not import peft, which imports bitsandbytes, before.
ENTRY_MODULES = ("demo", "sft_study", "noise_schedule_study", "synthetic_study", "user_level_study",
                 "correlated_noise_study", "scaling_sweep", "finetune_llm", "dpllm.cli", "dpllm.export",
                 "dpllm.synthetic.cli")  # mia's: the audit below runs it
_RUN = f"""
import importlib, json, runpy, sys
sys.path.insert(0, "recipes")
for name in {ENTRY_MODULES!r}:
    importlib.import_module(name)
print("entry modules imported:", sorted(m for m in ("peft", "bitsandbytes") if m in sys.modules), flush=True)
audit = json.loads(sys.argv[1])
sys.argv = ["recipes/finetune_llm.py", *sys.argv[2:]]
try:
    runpy.run_path("recipes/finetune_llm.py", run_name="__main__")
except SystemExit as exit_:
    print("exit", exit_.code, "bitsandbytes imported:", sys.modules.get("bitsandbytes") is not None, flush=True)
print({MARKER!r}, file=sys.stderr, flush=True)
sys.argv = ["mia", *audit]
try:
    runpy.run_module("mia", run_name="__main__")
except SystemExit as exit_:
    print("audit exit", exit_.code, "bitsandbytes imported:", sys.modules.get("bitsandbytes") is not None)
"""


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A 3-step tiny LoRA run with a progress bar, a held-out eval line while the bar runs and a checkpoint at
    every step (each save would draw transformers' shard bar), then a loss audit of it (``audit_stderr``)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    base = tmp_path_factory.mktemp("rough")
    out = base / "run"
    audit = ["audit", "--checkpoint", str(out), "--attacks", "loss", "--n-bootstrap", "20", "--no-progress", "--out",
             str(base / "audit")]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    r = subprocess.run([sys.executable, "-c", _RUN, json.dumps(audit), "--max_records", "40", "--max_length", "32",
                        "--tiny_hidden_size", "32", "--logical_batch_size", "16", "--physical_batch_size", "16",
                        "--eval_every", "1", "--save_every", "1", "--max_steps", "3", "--target_epsilon", "8",
                        "--progress", "true", "--output_dir", str(out)], capture_output=True, text=True, timeout=600,
                       cwd=Path(__file__).resolve().parents[1], env=env)
    assert "\nexit 0 " in "\n" + r.stdout and MARKER in r.stderr, r.stderr[-3000:]  # the run's line, not the audit's
    r.run_dir = out
    r.stderr, r.audit_stderr = r.stderr.split(MARKER + "\n", 1)
    return r


def test_entry_modules_import_neither_peft_nor_bitsandbytes(tiny_run):
    assert "\nentry modules imported: []\n" in "\n" + tiny_run.stdout, tiny_run.stdout[:2000]


def test_a_non_quantized_run_never_imports_bitsandbytes(tiny_run):
    assert "\nexit 0 bitsandbytes imported: False" in "\n" + tiny_run.stdout
    assert "bitsandbytes" not in tiny_run.stderr and "kernels" not in tiny_run.stderr
    assert "Warning" not in tiny_run.stderr, tiny_run.stderr[-3000:]


def test_log_lines_start_their_own_line_and_saves_draw_no_bar(tiny_run):
    import re

    err = tiny_run.stderr
    assert "dp-train" in err  # the bar was drawn
    assert "Writing model shards" not in err and "\x1b[A" not in err
    # A bar redraws with a carriage return; every log line must begin a line or follow one (never "…]09:15:49 INFO").
    fragments = re.split(r"[\r\n]", err)
    logged = [f for f in fragments if re.search(r"\d\d:\d\d:\d\d (INFO|WARNING|ERROR) ", f)]
    assert len(logged) >= 5 and all(re.match(r"\d\d:\d\d:\d\d (INFO|WARNING|ERROR) ", f) for f in logged), logged


def test_other_processes_log_errors_only_with_their_rank(monkeypatch):
    import logging

    from dpllm import logs

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        root.handlers.clear()
        monkeypatch.setenv("RANK", "1")
        logs.setup_logging()
        assert root.level == logging.ERROR and "[rank 1]" in root.handlers[0].formatter._fmt
        root.handlers.clear()
        monkeypatch.setenv("RANK", "0")
        logs.setup_logging()
        assert root.level == logging.INFO and "rank" not in root.handlers[0].formatter._fmt
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])


def test_bitsandbytes_stays_for_a_run_that_quantizes_or_starts_from_a_qlora_run(tmp_path, monkeypatch):
    import sys

    from dpllm.quantization import hide_unused_bitsandbytes

    qlora = tmp_path / "qlora_run" / "checkpoint"
    qlora.mkdir(parents=True)
    (qlora / "dpllm_config.yaml").write_text("model:\n  quantization: nf4\n")
    prequantized = tmp_path / "prequantized"  # a model saved quantized: transformers needs bitsandbytes to load it
    prequantized.mkdir()
    (prequantized / "config.json").write_text('{"quantization_config": {"load_in_4bit": true}}')
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text('{"model_type": "llama"}')
    cases = [("nf4", "tiny-llama"), ("none", str(qlora.parent)), ("none", str(qlora)), ("none", str(prequantized)),
             ("none", "org/not-in-the-cache"), ("none", str(plain))]  # the last one alone is hidden
    # as in a fresh process: bitsandbytes not imported yet (whatever this one imported, restored afterwards)
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    del sys.modules["bitsandbytes"]
    assert [hide_unused_bitsandbytes(q, m) for q, m in cases] == [False] * 5 + [True]
    assert "bitsandbytes" in sys.modules and sys.modules["bitsandbytes"] is None


def test_an_audit_of_a_non_quantized_run_never_imports_bitsandbytes(tiny_run):
    assert "audit exit 0 bitsandbytes imported: False" in tiny_run.stdout, tiny_run.audit_stderr[-3000:]
    assert "Warning" not in tiny_run.audit_stderr, tiny_run.audit_stderr[-3000:]  # transformers' FutureWarning
    # (is_gradient_checkpointing) was one
    assert "Loading weights" not in tiny_run.audit_stderr  # --no-progress: transformers' loading bar too


class _Hidden(Exception):
    """Raised by the spy below right after the real ``quiet_command``: the command stops before any work."""


@pytest.mark.parametrize("entry", ["demo", "sft_study", "noise_schedule_study", "synthetic_study", "user_level_study",
                                   "correlated_noise_study", "scaling_sweep", "export", "synthesize",
                                   "synthesize_hub_embedder"])
def test_every_command_that_trains_or_loads_hides_an_unused_bitsandbytes(entry, tmp_path, monkeypatch):
    """Issue 49, item 7: `make demo` printed bitsandbytes' missing-`kernels` line although nothing quantizes. Each
    command's own process (``command=True``) hides bitsandbytes as soon as its arguments are parsed, and only when
    every model it loads needs none; a synthesize with an embedder model that is not known keeps it. (That the recipes'
    and commands' modules import neither peft nor bitsandbytes before that point is checked where a fresh process is:
    ``test_entry_modules_import_neither_peft_nor_bitsandbytes``.)"""
    import os
    import sys
    import warnings

    import dpllm.quantization as quantization
    from dpllm.cli import main as dpllm_main
    from tests.helpers import load_recipe

    real, answers = quantization.quiet_command, []

    def spy(*models, **options):
        answers.append(real(*models, **options))
        raise _Hidden

    monkeypatch.setattr(quantization, "quiet_command", spy)
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as in a fresh process: not imported yet (the real
    del sys.modules["bitsandbytes"]  # module, if this process imported it, comes back afterwards)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text('{"model_type": "llama"}')  # a run whose model loads without bitsandbytes
    out = str(tmp_path / "out")
    argv = {"demo": ["--output_dir", out], "sft_study": ["--output_dir", out],
            "noise_schedule_study": ["--output_dir", out], "synthetic_study": ["--out", out, "--work", out + "_w"],
            "user_level_study": ["--out", out], "correlated_noise_study": ["--output_dir", out],
            "scaling_sweep": ["--config", os.path.join("recipes", "configs", "tiny", "scaling_sweep_cpu.yaml"),
                              "--output_dir", out, "--quick"],
            "export": ["export", str(run), "--out", out],
            "synthesize": ["synthesize", str(run), "--num", "2", "--out", out + ".jsonl"],
            "synthesize_hub_embedder": ["synthesize", str(run), "--num", "2", "--out", out + ".jsonl", "--embedder",
                                        "org/not-in-the-cache"]}[entry]
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with warnings.catch_warnings(), pytest.raises(_Hidden):  # the deprecation filters it adds stay in the block
        if entry in ("export", "synthesize", "synthesize_hub_embedder"):
            dpllm_main(argv, command=True)
        else:
            load_recipe(entry).main(argv, command=True)
    hidden = entry != "synthesize_hub_embedder"
    assert answers == [hidden] and (sys.modules.get("bitsandbytes", "absent") is None) == hidden
    if entry == "export":  # called from Python (a caller's process), the command changes nothing process-wide
        del sys.modules["bitsandbytes"]
        assert dpllm_main(argv) == 1 and answers == [True] and "bitsandbytes" not in sys.modules


def test_synthesize_no_progress_turns_off_the_loading_bars_of_its_own_process_only(tmp_path, monkeypatch):
    import warnings

    from transformers.utils import logging as hf_logging

    import dpllm.quantization as quantization
    from dpllm.cli import main as dpllm_main

    monkeypatch.setattr(quantization, "hide_unused_bitsandbytes", lambda quantization, *models: False)  # this process
    # keeps its modules; quiet_command's deprecation filters stay in the catch_warnings block below
    run = tmp_path / "not_a_run"
    run.mkdir()
    argv = ["synthesize", str(run), "--num", "2", "--out", str(tmp_path / "s.jsonl"), "--no-progress"]
    hf_logging.enable_progress_bar()  # as a fresh process starts
    try:
        with warnings.catch_warnings():
            assert dpllm_main(argv) == 1 and hf_logging.is_progress_bar_enabled()  # a caller's process: unchanged
            assert dpllm_main(argv, command=True) == 1  # refused (not a run) after the command set up its process
            assert not hf_logging.is_progress_bar_enabled()
    finally:
        hf_logging.enable_progress_bar()


def _launch_commands(text: str, *, fenced: bool):
    """``accelerate launch ...`` commands of a text, continuation lines joined: in a Markdown file those inside code
    fences, in a recipe's source the indented copy-paste lines of its docstring."""
    out, inside, cur = [], not fenced, ""
    for line in text.splitlines():
        if fenced and line.lstrip().startswith("```"):
            inside, cur = not inside, ""
            continue
        if not inside:
            continue
        cur += line.strip()
        if cur.endswith("\\"):
            cur = cur.rstrip("\\") + " "
            continue
        if cur.startswith("accelerate launch"):
            out.append(cur)
        cur = ""
    return out


def test_every_launch_command_in_the_docs_names_an_accelerate_config():
    """Issue 49, item 7: `accelerate launch` without a config file prints a block of "values were not passed"
    before every run. Every launch command the README, the docs and the recipes give names one of the shipped
    configs (recipes/accelerate/*.yaml; on a machine without GPUs they run on CPU, one or two gloo processes)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    files = [root / "README.md", *sorted((root / "docs").glob("*.md")), *sorted((root / "recipes").glob("*.py"))]
    commands = {f"{f.relative_to(root)}: {c}" for f in files
                for c in _launch_commands(f.read_text(), fenced=f.suffix == ".md")}
    assert len(commands) >= 15, commands  # the shipped docs hold more than that: the scan reads them
    configs = {c: re.search(r"--config_file (\S+)", c) for c in commands}
    assert [c for c, m in configs.items() if m is None] == []
    assert all((root / m.group(1)).is_file() for m in configs.values()), configs
