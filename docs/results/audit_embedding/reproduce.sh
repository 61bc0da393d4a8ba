#!/usr/bin/env bash
# Embedding-interface membership audits (issue #28): a tiny Llama pretrained on public pydoc text, fine-tuned on
# 200 pystdlib records for 30 epochs (full and LoRA), without DP and with DP at ε = 8, then audited as an
# embedding API (last layer, mean-pooled) and, for comparison, through its losses.
#   bash docs/results/audit_embedding/reproduce.sh [WORK_DIR]     (about 10 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/../../.."
W=${1:-runs/audit_embedding}
PY=${PYTHON:-python}
$PY recipes/finetune_llm.py --config recipes/configs/tiny/demo_pretrain.yaml --tiny_hidden_size 64 --max_steps 200 \
    --eval_every 0 --progress false --output_dir "$W/pretrain" --overwrite_output_dir true
common=(--model_name_or_path "$W/pretrain" --dataset pystdlib --max_records 250 --max_length 64 --heldout_fraction 0.2
        --epochs 30 --logical_batch_size 32 --physical_batch_size 32 --eval_every 0 --progress false
        --overwrite_output_dir true)
for ft in full lora; do
  lr=$([ $ft = full ] && echo 0.003 || echo 0.01)
  $PY recipes/finetune_llm.py "${common[@]}" --finetuning $ft --learning_rate $lr --privacy.enabled false \
      --output_dir "$W/${ft}_nodp"
  $PY recipes/finetune_llm.py "${common[@]}" --finetuning $ft --learning_rate $lr --target_epsilon 8 \
      --output_dir "$W/${ft}_dp8"
done
for run in full_nodp full_dp8 lora_nodp lora_dp8; do
  ref=$([[ $run = lora* ]] && echo base || echo "$W/pretrain/checkpoint")
  $PY -m mia audit --checkpoint "$W/$run" --interface embedding --layer -1 --reference "$ref" --no-progress
  $PY -m mia audit --checkpoint "$W/$run" --attacks loss,ref --reference "$W/pretrain/checkpoint" --no-progress
done
$PY docs/results/audit_embedding/collect.py "$W"
