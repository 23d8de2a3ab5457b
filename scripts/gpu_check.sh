#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py): on a CUDA machine with torch and transformers (the lent one: no
# vLLM, Ray, verl or bm25s, no hub), the native trainer for a few steps with `tiny` and with a
# SmolLM2-135M-shaped model of random weights, tokens per second of rollouts and of the update, and
# log-probs on the GPU against the CPU within stated tolerances. At most 8 minutes.
#
#   bash scripts/gpu_check.sh               # JSON to $OUT/gpu_check.json ($OUT: the device tool's folder, else runs/)
#
# Exits 0 when every check passed; the JSON's `ok` and each model's `ok` say which did not.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs}
WORK=$(mktemp -d)
export TRACE_RL_CACHE=$WORK/cache  # a bare machine: the warm start and the random model are made here
PYTHON=$(command -v python3 || command -v python)
timeout 480 "$PYTHON" scripts/gpu_check.py --work "$WORK" --out "$OUT/gpu_check.json" "$@"
