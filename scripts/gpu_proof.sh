#!/usr/bin/env bash
# The one command on the GPU machine (issue 47), from the repository root, with .whl/ carried beside the tree
# (made here first: bash scripts/gpu_wheels.sh):
#
#   bash scripts/gpu_proof.sh [OUT]        # OUT defaults to docs/results/gpu/<UTC date>
#   bash scripts/gpu_proof.sh --smoke [OUT]   # every phase on CPU, tiny shapes (OUT: runs/gpu_proof_smoke)
#
# Installs the wheels the machine lacks into a temporary directory (no network, no change to its Python), puts
# it and the checkout on PYTHONPATH (shared FACTS.md), then runs scripts/gpu_proof.py, which stops cleanly before
# its deadline: 510 s, inside a device command's 10 minutes with the install and start-up. The JSONs are also
# copied to $OUT when the device tool provides one, so they come back with the command.
set -uo pipefail
cd "$(dirname "$0")/.."
SMOKE=""
if [[ "${1:-}" == "--smoke" ]]; then  # the CPU check of every phase, under gpu_proof.py's --smoke deadline
    SMOKE="--smoke"
    shift
fi
OUT_DIR="${1:-$([[ -n $SMOKE ]] && echo runs/gpu_proof_smoke || echo "docs/results/gpu/$(date -u +%Y-%m-%d)")}"
DEADLINE_S="${DEADLINE_S:-$([[ -n $SMOKE ]] && echo 900 || echo 510)}"
PY="${PYTHON:-python3}"
SITE=$(mktemp -d)
if compgen -G ".whl/*.whl" > /dev/null; then
    $PY -m pip install --quiet --no-index --no-deps --target "$SITE" .whl/*.whl || echo "warning: wheel install failed"
else
    echo "warning: no .whl/ here (bash scripts/gpu_wheels.sh, then carry .whl): opacus and datasets must be installed"
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
nvidia-smi -L 2>/dev/null || true
# the hard stop behind the script's own deadline: 30 s after it
timeout --signal=TERM --kill-after=10 $((DEADLINE_S + 30)) \
    "$PY" scripts/gpu_proof.py $SMOKE --out "$OUT_DIR" --deadline-s "$DEADLINE_S"
rc=$?
if [[ -n "${OUT:-}" && -d "${OUT:-}" ]]; then
    mkdir -p "$OUT/gpu" && cp "$OUT_DIR"/*.json "$OUT/gpu/" 2>/dev/null
    cp "$OUT_DIR"/scaling/runs.jsonl "$OUT/gpu/scaling_runs.jsonl" 2>/dev/null
fi
exit $rc
