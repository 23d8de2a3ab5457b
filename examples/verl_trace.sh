#!/usr/bin/env bash
# TRACE with Qwen3-8B through verl's V1 trainer on one node of 8 GPUs (needs verl[verl-core] >= 0.9.1 with
# vLLM, and trace-rl installed in the same environment: pip install -e '.[verl,agent,models]').
#
#   1. Search-R1's retrieval server on :8000 (its retrieval_launch.sh) and its parquet at
#      data/search_r1/train.parquet and data/search_r1/test.parquet (the held-out split; or set
#      CONFIG to a trace-rl config of your own);
#   2. bash examples/verl_trace.sh [more verl overrides ...]
#
# It writes verl's parquet from the trace-rl config (`trace-rl verl-data`: every row carries its task),
# then starts verl with TRACE's agent-loop manager and trainer mode `trace`
# (configs/gpu/verl_qwen3_8b.overrides). TRACE's per-step figures (tree/*, predictor/*) and trees go
# to $OUT (metrics.jsonl, trees/, and the manager's state for a resume), which `trace-rl report $OUT` reads;
# verl's own logger gets them too, under trace/.
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=${CONFIG:-configs/gpu/qwen3_8b_search.yaml}
DATA=${DATA:-data/verl_trace}
OUT=${OUT:-runs/verl_qwen3_8b_search}
trace-rl verl-data --config "$CONFIG" --out "$DATA"
mapfile -t OVERRIDES < <(grep -v -E '^[[:space:]]*(#|$)' configs/gpu/verl_qwen3_8b.overrides)
exec python -m verl.trainer.main_ppo "${OVERRIDES[@]}" \
  data.train_files="$DATA/train.parquet" data.val_files="$DATA/test.parquet" \
  +trace_rl.config="$CONFIG" +trace_rl.out="$OUT" "$@"
