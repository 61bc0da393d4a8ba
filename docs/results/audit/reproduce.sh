#!/bin/bash
# Reproduce docs/results/audit/ (tiny Llama on CPU, ~40 minutes on 2 cores). Usage:
#   bash docs/results/audit/reproduce.sh [WORK_DIR]      # default WORK_DIR=runs/audit_targets
set -euo pipefail
cd "$(dirname "$0")/../../.."
W=${1:-runs/audit_targets}
PY=${PY:-.venv/bin/python}
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
COMMON=(--max_records 60 --max_length 32 --tiny_hidden_size 64 --logical_batch_size 32 --physical_batch_size 32
        --eval_every 0 --progress false --finetuning full --overwrite_output_dir true)

train_and_audit() {  # NAME DESIGN M [recipe options...]
  local name=$1 design=$2 m=$3; shift 3
  $PY recipes/finetune_llm.py "${COMMON[@]}" --num_canaries "$m" --canary_design "$design" \
      --output_dir "$W/$name" "$@"
  $PY -m mia canaries --run "$W/$name" --no-progress || true   # exit 1 would be a privacy bug
}

# Non-private: how much the audit can see (1,000 canaries: the pipeline test's run; 10,000: the issue's scale).
train_and_audit nodp_rare_1k rare 1000 --privacy.enabled false --epochs 40 --learning_rate 0.003
train_and_audit nodp_rare_10k rare 10000 --privacy.enabled false --epochs 40 --learning_rate 0.003
train_and_audit nodp_short_10k short 10000 --privacy.enabled false --epochs 40 --learning_rate 0.003
train_and_audit nodp_new_token_10k new_token 10000 --privacy.enabled false --epochs 3 --learning_rate 0.003
# DP at ε = 8, black-box: three seeds of the 'short' design, and the other designs for comparison.
for pair in "0 1234" "1 1" "2 2" "3 3"; do
  set -- $pair
  train_and_audit dp8_short_1k_s$1 short 1000 --target_epsilon 8 --epochs 10 --learning_rate 0.01 \
      --seed $1 --canary_seed $2
done
train_and_audit dp8_rare_1k rare 1000 --target_epsilon 8 --epochs 10 --learning_rate 0.003
train_and_audit dp8_random_1k random 1000 --target_epsilon 8 --epochs 10 --learning_rate 0.003 --max_length 64
# DP at ε = 8, black-box, new-token canaries: 5,000 of them, batch 128 (q = 0.05 as above), three seeds.
for s in 0 1 2; do
  train_and_audit dp8_new_token_5k_s$s new_token 5000 --target_epsilon 8 --epochs 10 --learning_rate 0.003 \
      --logical_batch_size 128 --physical_batch_size 128 --seed $s --canary_seed $((s + 1))
done
# DP at ε = 8, white-box (every noisy update seen), and the no-noise check.
$PY -m mia whitebox --m 10000 --steps 20 --sample-rate 0.2 --target-epsilon 8 --out "$W/whitebox_eps8"
$PY -m mia whitebox --m 1000 --steps 20 --sample-rate 0.2 --noise-multiplier 1e-3 --out "$W/whitebox_nonoise"
# Blind baseline: planted topic shift vs the run's own IID split.
$PY docs/results/audit/blind_check.py "$W/nodp_rare_1k" > "$W/blind_check.json"
$PY docs/results/audit/collect.py "$W" docs/results/audit
