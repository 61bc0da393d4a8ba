# Fresh machine, Python 3.11 + pip only. `make demo` and `make test` create .venv and install into it.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# torch first and pinned: the range in pyproject admits it, and a bare `torch` could pull a CUDA build.
TORCH  ?= torch==2.13.0

.PHONY: demo test test-slow style bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $@

demo: $(VENV)/.installed
	$(BIN)/python recipes/demo.py --output_dir runs/demo

# Lint and the layers first (ruff and import-linter, configured in pyproject.toml; a few seconds), then the
# suite: two workers, one test file each (module fixtures stay in one process): 6-19 min on 2 cores, with the
# machine's speed (5:45 on 2026-11-24; 10:32 to 13:51 on 2026-11-25; 15:37 and, in a clean clone, 18:18 for 941 tests on 2026-11-27).
# Later on 2026-11-27 the slowest tests were trimmed (RDP orders cached per (σ, q); 1-process sides of DDP comparisons
# and CLI calls in-process): four of the files went from 990 to 502 s of test time under load 6-9 (other jobs); the
# whole suite was not re-timed then (at load 8-11 it would have taken over an hour). After the trimming and that day's
# new tests: 16:00 for 1081 tests (quiet machine) and 16:31 for 1082 in a clean-clone CI run.
# Then launches that added only start-up (~13 s of CPU each: torch, opacus, transformers) were folded: recipe,
# `python -m mia` and `dpllm` calls whose process is not what a test checks go through their entry points in the
# test process, and test_fsdp_bk's rank-0 loading shares the recipe test's launches. CPU-s per file, before -> after,
# back to back under load 4-9: audit_pipeline 137 -> 79, fsdp_bk's two recipe tests 193 -> 122, mia_embedding
# 79 -> 28, compliance 92 -> 49, mia_lira_lm 57 -> 32, scaling_sweep 74 -> 55, its two-stage test 48 -> 35, the
# demo test 45 -> 31 (about 300 CPU-s in all). With that and the day's correlated-noise tests: 14:51 for 1169 tests
# (2026-11-27 16:16-16:31 UTC, a few single tests running beside it).
# Then (2026-11-27 evening) the accountants' hot loops were vectorised (the user-level mixture PLD's inversion,
# dpllm.privacy.mixture, 15-30x; RDP calibration's search, dpllm.privacy.rdp_series, ~5x; the trade-off curve
# cached per history), test_distributed's 2-process runs share one launch (tests/ddp_runs.py), the SIGKILL cases
# fork from one process that imported the stack (tests.helpers.forked_recipe), and runs that do not test the
# accountant use PRV: clean-clone CI of 2e70c24, 1197 tests in 10:20 (test time ~1650 -> ~1230 s).
# 2026-11-29: six process starts folded into processes that already run (FSDP hook-copy guard into the FSDP worker's
# launch, quantile clipping under FSDP2 into the killed/resumed pair, the secret and killed FSDP runs into one launch,
# the 2-process recipe run into ddp_runs, the accelerate smoke into the --multi_gpu warning launch, the rough-edges
# audit into its run's interpreter), the byte tokenizer's ids by arithmetic: 1077 -> 837 CPU-s; on this machine quiet
# 9:58 -> 8:00 (1207 tests), clean-clone CI of 74daa84 9:09, beside a one-core busy loop 12:59.
# Later on 2026-11-29 (this machine ran the same suite 8:16-8:46 that day): test_fsdp_bk's four launches -> two (its
# worker's cases and three recipe runs in one), runs that do not test an accountant on PRV instead of Opacus's RDP,
# the quick scaling sweep at 5-40 steps, the slowest files scheduled first, bytecode caching: system-wide CPU (from
# /proc/stat) 997 -> 931 CPU-s, quiet 7:59; clean-clone CI of be208fe beside a one-core busy loop (`yes`) 11:07.
# Later still (the machine ran faster by then): the GPU proof smoke in the test process, one fork server per
# worker for the recipe processes that tests signal or kill (tests/conftest.py's SAME_WORKER), the built-in
# corpora read once per process: back to back, quiet, 795.5 -> 746.9 CPU-s, 6:47 -> 6:27; beside `yes` in a
# clean clone, 11:49 and 12:04 before, 10:34 and 11:51 after (2026-11-29 08:58-10:53 UTC): beside a busy loop the
# spread between runs is as large as the change.
# 2026-11-29 afternoon (the machine ~20% slower than that morning): the scaling planner's RDP screen searching with
# the stand-in, the trade-off curve's δ(ε) read in one pass: back to back, quiet, 954.7 -> 912.4 CPU-s, 8:09 -> 7:52;
# a clean clone beside `yes` 11:32.
# 2026-11-29 evening (found with a sampling profiler over every process of the suite): config types read once per
# process, YAML through libyaml, the trade-off curve's bound from the lower envelope of its lines, the byte tokenizer
# copied, the bench smoke runs' measurement processes in the test process, bitsandbytes hidden in the launches and the
# fork server as the recipe hides it: back to back, quiet, 904.9 -> 837.2 CPU-s, 7:42 -> 7:09; a clean clone beside
# `yes` 10:54 with the first of these, 10:26 with all (11:32 in the afternoon, before them).
# 2026-11-29 night: the byte tokenizer's arithmetic for every text without an added token, a .jsonl dataset parsed
# once, finish_process without torch, the SIGKILL/resume and LiRA tests shorter (16 steps, 15 epochs): back to back,
# quiet, 861.4 -> 823.5 CPU-s, 7:25 -> 7:01; then xdist's controller without torch (~2.6 CPU-s), young garbage
# collections every 10,000 allocations (the workers' GC 20.3 -> 9.1 CPU-s) and the memorising audit model's MLP
# halved: a clean clone beside `yes` 10:13 (72e6322, 18:07 UTC) and 10:45 (5cc66a8, 18:36 UTC); quiet 6:55.
# 2026-11-29 late: the max_records cut ranked by draw alone (a tuple sort of 53,000 records was 0.1-0.3 s per capped
# load of the stdlib corpus), the shipped-config compliance test's 200,000-record files written once, the bootstrap's
# batched Newton up to 200 iterations (the scaling interval, extrapolation and bootstrap tests ~2-4 CPU-s less).
# Quiet, the code before them measured 828.7 CPU-s (19:13 UTC) and 730.0 (20:04): the machine's speed moves more than
# they do (the first two, with a bootstrap warm start since taken back as dpllm/scaling/fit.py says, 760.3 right
# after 730.0). Beside `yes` in a clean clone: 10:35 (19:46 UTC) and 10:04 (20:21) with those, 10:55 (21:09) at
# 793b9af.
# 2026-11-29 night, later: the SFT study's and the demo's quick modes (tests only) at batch 16 and 8, test_prv's
# fractional-order case at ε ≈ 116 (100 steps, not 500), the launcher-death test's child without torch, the
# single-process launch test folded into the SIGTERM one (one launch fewer), the record-independence check seeding
# a CPU model's dropout on the CPU generator alone, test_mia_cli's memorising model at 80 steps: ~40 CPU-s less by
# single-test measurements, again below the machine's own swing (quiet back to back 798.6 -> 796.7 CPU-s without
# the last two). Beside `yes` in a clean clone: 10:42 (de28402, 22:31 UTC), 10:38 (051e60e, 23:10 UTC).
# 2026-11-30: the scaling plots without minor log ticks (plot_fit 4.8 -> 3.0 CPU-s on three groups), a PLD
# reference at interval 2.5e-4 (not 1e-4), one test more (stdlib_qa in a second process, 3.7 CPU-s). Quiet:
# 770.0 CPU-s, 6:39 (3d0ad42, 00:27 UTC, under a per-test CPU plugin); a clean clone of 37133b1 6:34. Beside
# `yes` in clean clones: 9:00 (737cab3, 00:51 UTC), 10:15 (737cab3, 01:10), 10:37 (37133b1, 01:47): the
# machine's speed swings by more than any trim left.
# Later on 2026-11-30: PLD calibration by false position on the grid (5-8 PLD evaluations, not 18-19; four accounting
# files 61.9/66.4 -> 54.7/56.4 CPU-s back to back). The same code measured quiet 688.8 and 735.5 CPU-s (02:18, 02:28
# UTC) and 768.5 (03:20, with the change): the machine slowed by ~10-50% within the hour (bench_accounting's
# figures ~1.5x the day before's). Beside `yes` in clean clones: 10:17 (df28165, 02:42 UTC), 9:56 (3da4bf4, 03:28).
# Bytecode caching on for the suite (PYTHONDONTWRITEBYTECODE emptied, should the environment set it): its ~40
# processes (two workers, launches, signal tests) otherwise each compile dpllm, the recipes and the rewritten test
# modules again (a worker's collection: 24 -> 18 CPU-s); the caches go to the git-ignored __pycache__ folders.
test: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder

# What ruff can fix by itself (import order, unused imports).
style: $(VENV)/.installed
	$(BIN)/ruff check --fix .

test-slow: $(VENV)/.installed
	$(BIN)/python -m pytest -m slow

bench: $(VENV)/.installed
	$(BIN)/python scripts/bench_overhead.py --out runs/bench/overhead.json

clean:
	rm -rf runs .pytest_cache
