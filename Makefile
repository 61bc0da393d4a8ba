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
# suite: two workers, one test file each (module fixtures stay in one process; tests/conftest.py hands out the
# slowest files first). On the 2-core CI machine (2026-11-30): 4-7 min quiet, 5-10 min beside another job, with the
# machine's speed. How it is measured, where its time goes and what was trimmed: docs/benchmarks.md, "Test suite
# time" (each earlier day's figures: `git log -p Makefile`).
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
