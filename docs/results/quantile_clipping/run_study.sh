#!/usr/bin/env bash
# Issue 50's small study: flat clipping at several C vs clipping: quantile (γ = 0.5, η = 0.2) at the same ε = 8,
# tiny Llama LoRA on pydoc (recipes/configs/tiny/llama_lora_cpu.yaml, 20 steps, one expected pass), CPU.
# Usage: bash docs/results/quantile_clipping/run_study.sh OUT_DIR  (then summarize.py OUT_DIR)
set -euo pipefail
OUT=${1:?output directory}
CFG=recipes/configs/tiny/llama_lora_cpu.yaml
run() { python recipes/finetune_llm.py --config "$CFG" --output_dir "$OUT/$1" --progress false "${@:2}" > "$OUT/$1.log" 2>&1; }
for c in 0.03 0.1 0.3 1 3; do run "flat_C$c" --max_grad_norm "$c"; done
for c in 1 0.1; do run "quantile_from$c" --clipping quantile --max_grad_norm "$c"; done
