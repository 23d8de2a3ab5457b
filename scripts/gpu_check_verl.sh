#!/usr/bin/env bash
# GPU check of the verl adapter: two TRACE steps through verl's V1 trainer on ONE GPU with a small model,
# then checks that TRACE wrote its figures for both steps. Needs a CUDA machine with verl[verl-core] >= 0.9.1,
# vLLM and trace-rl in one environment (the lent H200 image has neither verl nor vLLM and reaches no
# index, so it cannot run this; a cluster node can).
#
#   bash scripts/gpu_check_verl.sh /path/to/Qwen3-0.6B        # any HF causal LM folder with a chat template
#
# Expect a few minutes (vLLM start-up dominates); prints TRACE's last metrics line and "verl adapter: OK".
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:?usage: scripts/gpu_check_verl.sh MODEL_DIR}
WORK=${WORK:-runs/gpu_check_verl}
rm -rf "$WORK" && mkdir -p "$WORK"
# 4 prompts x n 4 = 16 leaves a step on the bundled multihop task with its local BM25 search.
TRACE=(task.name=multihop task.train_tasks=64 task.test_tasks=8 prompts_per_step=4 rollout.budget=16
       rollout.max_new_tokens=256 rollout.max_context_tokens=2048 "model.name=$MODEL" model.warm_start=false)
trace-rl verl-data --config configs/smoke.yaml --out "$WORK/data" "${TRACE[@]}"
mapfile -t OVERRIDES < <(grep -v -E '^[[:space:]]*(#|$)' configs/gpu/verl_qwen3_8b.overrides)
python -m verl.trainer.main_ppo "${OVERRIDES[@]}" \
  data.train_files="$WORK/data/train.parquet" data.val_files="$WORK/data/test.parquet" \
  data.train_batch_size=4 data.max_prompt_length=1024 data.max_response_length=1536 \
  actor_rollout_ref.model.path="$MODEL" actor_rollout_ref.rollout.n=4 actor_rollout_ref.actor.ppo_mini_batch_size=4 \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2 actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
  actor_rollout_ref.rollout.gpu_memory_utilization=0.4 actor_rollout_ref.rollout.agent.num_workers=1 \
  trainer.n_gpus_per_node=1 trainer.total_training_steps=2 trainer.test_freq=-1 trainer.save_freq=-1 \
  trainer.val_before_train=False trainer.experiment_name=gpu_check \
  +trace_rl.config=configs/smoke.yaml "+trace_rl.overrides=[$(printf "'%s'," "${TRACE[@]}" | sed 's/,$//')]" +trace_rl.out="$WORK/trace" \
  2>&1 | tee "$WORK/verl.log"
python - "$WORK/trace/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
steps = [r["step"] for r in rows]
assert len(rows) == 2 and steps[0] < steps[1], f"TRACE wrote steps {steps}, expected two"
assert all(r["rollout/leaves"] == 16 for r in rows), "each step must hold 16 leaves"
print(json.dumps({k: rows[-1][k] for k in sorted(rows[-1]) if k.startswith(("tree/effective", "rollout/leaves", "predictor/brier", "critic/"))}))
print("verl adapter: OK")
PY
