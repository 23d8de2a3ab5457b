"""scripts/gpu_check.py, the prepared GPU check: its SmolLM2-shaped model, and the whole check on a CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from repo_files import REPO, load

gpu_check = load("scripts/gpu_check.py")


def test_the_random_model_has_smollm2s_shape_and_a_tokenizer_for_every_id(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    folder = gpu_check.smollm2_shaped(tmp_path / "m", layers=2, seed=0)
    config, tokenizer = AutoConfig.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    assert len(tokenizer) == config.vocab_size == 49152 and config.num_hidden_layers == 2
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.intermediate_size) == (576, 9, 3, 1536)
    assert tokenizer.convert_ids_to_tokens(49151).startswith("<|unused_")  # the padding decodes, so a sampled id is text
    real = sorted(Path.home().glob(".cache/trace-rl/smollm2-135m-instruct-*/config.json"))
    if real:  # the converted SmolLM2, where this machine has made it: every shape field agrees
        theirs = json.loads(real[0].read_text())
        for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size", "tie_word_embeddings"):
            assert theirs[key] == gpu_check.SMOLLM2[key], key
        assert theirs["num_hidden_layers"] == gpu_check.SMOLLM2["num_hidden_layers"]


@pytest.mark.slow
def test_the_gpu_check_runs_on_a_cpu_without_bm25s(tmp_path: Path) -> None:
    """The whole check, on the CPU, with bm25s unimportable as on the lent machine: both models train,
    the update runs, and the log-probs agree (on one device the fp32 comparison is exact)."""
    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text("import sys\nsys.modules['bm25s'] = None\n")
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--device", "cpu", "--layers", "1", "--steps", "1",
                           "--quick", "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out.json")],
                          env={"PYTHONPATH": str(blocker), "PATH": "/usr/bin:/bin", "TRACE_RL_CACHE": str(tmp_path / "cache")},
                          capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads((tmp_path / "out.json").read_text())
    assert found["ok"] and set(found["models"]) == {"tiny", "smollm2_shaped"}
    for model in found["models"].values():
        assert model["steps"][0]["update_tokens_per_s"] > 0 and model["steps"][0]["gen_tokens_per_s"] > 0
    assert found["models"]["smollm2_shaped"]["logprobs"]["fp32_max_abs"] == 0.0
