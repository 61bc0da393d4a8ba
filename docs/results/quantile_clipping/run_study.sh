#!/usr/bin/env bash
# Issue 50's study: flat clipping swept over C vs clipping: quantile at one setting (γ = 0.5, η = 0.2, started at
# C = 1, σ_b = expected batch / 20), the same ε = 8, tiny Llama LoRA on pydoc (recipes/configs/tiny/llama_lora_cpu.yaml:
# 20 steps, one expected pass), plain SGD at lr 10 so that C sets the step size and the noise (AdamW is nearly blind to C, see
# first_study_adamw.json), 3 seeds each (model init and data order; the noise is secret and fresh in every run). CPU,
# ~1.5 min a run, two at a time.
# Usage: bash docs/results/quantile_clipping/run_study.sh OUT_DIR  (then python .../summarize.py OUT_DIR)
set -euo pipefail
OUT=${1:?output directory}
JOBS=${JOBS:-2}
mkdir -p "$OUT"
{
  for seed in 1 2 3; do
    for c in 0.01 0.03 0.1 0.3 1 3; do echo "flat_C${c}_s${seed} --seed $seed --max_grad_norm $c"; done
    echo "quantile_s${seed} --seed $seed --clipping quantile --max_grad_norm 1"
  done
} | xargs -P "$JOBS" -L 1 bash -c 'name=$0; python recipes/finetune_llm.py \
      --config recipes/configs/tiny/llama_lora_cpu.yaml --optimizer sgd --learning_rate 10 --eval_every 0 \
      --progress false --output_dir "'"$OUT"'/$name" "$@" > "'"$OUT"'/$name.log" 2>&1 && echo "done $name"'
