"""In-process generation with Hugging Face transformers, on CPU or GPU, with our own sampling loop.

Why our own loop rather than `model.generate`: log-probs, stop strings and per-sequence seeds must
be exact, and neither branching nor the next turn of a rollout may redo work.

- **Prefix cache.** The engine keeps the KV cache of every sequence it has generated (prompt +
  completion), up to a memory budget (`prefix_cache_mb`, least recently used first out). A new
  prompt reuses the longest cached prefix and prefills only the rest: the next turn of a rollout
  (its context + the new observation) prefills only the observation, and a Stage-2 continuation from
  an intermediate prefix prefills nothing the bare rollout had already computed. It is keyed by token
  ids alone, as vLLM's and SGLang's automatic prefix caching are, so the collector's requests are the
  same for every engine. New weights (`update_weights`) empty it.
- **One prefill per prompt.** A prompt's KV cache is repeated for its `n` continuations
  (`batch_repeat_interleave`). Prompts of a batch are laid out as [padding, cached prefix, padding,
  new tokens], with attention masks and positions counted from each prompt's first real token.
  Finished sequences leave the batch (`batch_select_indices`), so they stop costing compute.
- **No per-row Python per token.** Uniforms come from a counter-based generator (splitmix64 of the
  row's key and the token's position), sampling is one inverse-CDF over the batch, and stop strings
  are matched on a rolling window of each row's last bytes, all vectorised.

Reproducibility: a sample's randomness depends only on (seed, prompt tokens, how many samples of
that same prompt came before it in the call, position), never on batch composition or on what the
cache held. So `generate([p], n=4)` and `generate([p, p, p, p], n=1)` draw the same tokens, and a
prompt gives the same completions alone, in a batch, or from a cached prefix (up to float rounding,
~1e-6 in the logits, which could flip a token only when its uniform lands that close to a boundary).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import inspect
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ..models import native_bf16
from .base import Completion, FinishReason, SamplingParams, check_prompts, cut_at_stop
from .decoder import Decoder

PRECISIONS = ("auto", "fp32", "bf16")


def resolve_precision(precision: str, device: torch.device) -> str:
    """`fp32` or `bf16` for a requested generation precision (`auto`: bf16 where it is native)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    return "bf16" if device.type == "cpu" and any(native_bf16().values()) else "fp32"

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def counter_uniforms(keys: np.ndarray, position: int) -> np.ndarray:
    """One uniform in [0, 1) per row from (row key, position): splitmix64, vectorised, no state."""
    with np.errstate(over="ignore"):
        z = keys.astype(np.uint64) + np.uint64(position + 1) * _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / 2**53)


@dataclass
class _Entry:
    """One cached sequence: its token ids and, per layer, its keys and values (heads, length, dim)."""

    tokens: np.ndarray  # (L,) int64
    layers: list[tuple[torch.Tensor, torch.Tensor]]
    nbytes: int
    used: int = 0


class PrefixCache:
    """KV caches of finished sequences, looked up by longest common token prefix, within a byte budget."""

    _KEY = 16  # entries are indexed by their first tokens; a prompt shorter than this is never cached

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = int(max_bytes)
        self.entries: dict[int, _Entry] = {}
        self._by_head: dict[tuple[int, ...], set[int]] = {}
        self._next_id = 0
        self._clock = 0
        self.nbytes = 0

    def clear(self) -> None:
        """Empty, and as new: entry ids and the use clock restart, so what the cache answers next
        depends only on what it holds (a resumed run's new engine and its unbroken twin agree)."""
        self.entries.clear()
        self._by_head.clear()
        self._next_id = 0
        self._clock = 0
        self.nbytes = 0

    def lookup(self, prompt: list[int]) -> tuple[_Entry | None, int]:
        """The entry sharing the longest prefix with `prompt` and that length, at most len(prompt) - 1
        (the last prompt token is always run, for its logits)."""
        if self.max_bytes <= 0 or len(prompt) <= self._KEY:
            return None, 0
        ids = self._by_head.get(tuple(prompt[: self._KEY]), ())
        best, best_length = None, 0
        query = np.asarray(prompt, dtype=np.int64)
        for entry_id in sorted(ids):  # a tie goes to the earliest entry, not to a set's hash order
            entry = self.entries[entry_id]
            n = min(entry.tokens.size, query.size - 1)
            differ = np.flatnonzero(entry.tokens[:n] != query[:n])
            length = int(differ[0]) if differ.size else n
            if length > best_length:
                best, best_length = entry, length
        if best is not None:
            self._clock += 1
            best.used = self._clock
        return best, best_length

    def insert(self, tokens: list[int], layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Cache a sequence; entries it extends (its own prefixes) are dropped as redundant."""
        if self.max_bytes <= 0 or len(tokens) <= self._KEY:
            return
        nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in layers)
        if nbytes > self.max_bytes:
            return
        array = np.asarray(tokens, dtype=np.int64)
        head = tuple(tokens[: self._KEY])
        bucket = self._by_head.setdefault(head, set())
        for entry_id in list(bucket):
            old = self.entries[entry_id].tokens
            if old.size <= array.size and np.array_equal(old, array[: old.size]):
                self._drop(entry_id)
        while self.entries and self.nbytes + nbytes > self.max_bytes:
            self._drop(min(self.entries, key=lambda i: self.entries[i].used))
        self._clock += 1
        self.entries[self._next_id] = _Entry(array, layers, nbytes, self._clock)
        self._by_head.setdefault(head, set()).add(self._next_id)
        self._next_id += 1
        self.nbytes += nbytes

    def _drop(self, entry_id: int) -> None:
        entry = self.entries.pop(entry_id)
        self.nbytes -= entry.nbytes
        bucket = self._by_head[tuple(entry.tokens[: self._KEY].tolist())]
        bucket.discard(entry_id)
        if not bucket:
            del self._by_head[tuple(entry.tokens[: self._KEY].tolist())]


class StopMatcher:
    """Which rows' newest token completed a stop string: a rolling window of each row's last bytes,
    compared with every stop string in one batched test. Needs each token's bytes (byte-level BPE)."""

    def __init__(self, token_bytes: torch.Tensor, token_lengths: torch.Tensor, stop: Sequence[str], rows: int) -> None:
        self.table, self.lengths = token_bytes, token_lengths  # (V, L) uint8 left-aligned, (V,)
        self.stops = [torch.tensor(list(s.encode("utf-8")), dtype=torch.uint8) for s in stop]
        self.width = max((len(s) for s in self.stops), default=1) - 1 + token_bytes.shape[1]
        self.window = torch.zeros((rows, self.width), dtype=torch.uint8)
        self._shift = torch.arange(self.width)

    def push(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append each row's token; True where a stop string now ends in the window."""
        tokens = tokens.cpu()
        new = self.lengths[tokens]  # (B,) bytes the newest tokens add
        joined = torch.cat([self.window, self.table[tokens]], dim=1)  # (B, W + L)
        self.window = joined.gather(1, new[:, None] + self._shift[None])
        hit = torch.zeros(tokens.shape[0], dtype=torch.bool)
        for stop in self.stops:
            m = stop.numel()
            windows = self.window.unfold(1, m, 1)  # (B, W - m + 1, m)
            ends_in_new = torch.arange(m, self.width + 1)[None] > (self.width - new)[:, None]  # match overlaps the new bytes
            hit |= ((windows == stop).all(dim=-1) & ends_in_new).any(dim=-1)
        return hit

    def select(self, keep: torch.Tensor) -> None:
        self.window = self.window[keep.cpu()]


def byte_table(tokenizer: Any, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each token id's bytes as decoding (without special tokens) produces them, for byte-level BPE
    tokenizers (GPT-2 style: `tiny`, SmolLM2); None for other tokenizers (stop strings are then
    matched by decoding a window of tokens)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.decoder).__name__ != "ByteLevel":
        return None
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    to_byte = {c: b for b, c in bytes_to_unicode().items()}
    added = getattr(tokenizer, "added_tokens_decoder", {})
    special = set(getattr(tokenizer, "all_special_ids", []))
    known = len(tokenizer)  # once: with many added tokens one len() costs milliseconds
    pieces = tokenizer.convert_ids_to_tokens(list(range(min(known, vocab_size))))
    rows: list[bytes] = []
    for token_id in range(vocab_size):
        piece = pieces[token_id] if token_id < known else None
        if piece is None or token_id in special or (token_id in added and added[token_id].special):
            rows.append(b"")
        elif token_id in added:
            rows.append(added[token_id].content.encode("utf-8"))
        elif all(c in to_byte for c in piece):
            rows.append(bytes(to_byte[c] for c in piece))
        else:
            return None  # not a pure byte-level vocabulary
    width = max(1, max(len(r) for r in rows))
    table = torch.zeros((vocab_size, width), dtype=torch.uint8)
    for token_id, data in enumerate(rows):
        table[token_id, : len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    return table, torch.tensor([len(r) for r in rows], dtype=torch.long)


MMAP_THRESHOLD = 128 * 1024
"""Bytes from which glibc serves an allocation with its own mapping, returned to the OS when freed."""


@functools.cache
def return_freed_caches_to_the_os() -> None:
    """Fix glibc's mmap threshold (once per process; nothing off glibc).

    KV caches and logits are large blocks freed every step. glibc raises its mmap threshold after the
    first such frees, so later ones come from the heap, which fragments: a long run's resident memory
    grew 25% over 100 smoke steps (`benchmarks/soak.py`); with the threshold fixed, 1.7% over 50.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_mmap_threshold = -3  # mallopt's M_MMAP_THRESHOLD; setting it also turns the dynamic threshold off
    libc.mallopt(m_mmap_threshold, MMAP_THRESHOLD)


class HFEngine:
    """`Engine` over a transformers causal LM (optionally a peft model).

    `max_batch_size` caps the sequences decoded together (prompts are grouped so that
    prompts × n stays under it; one prompt with a larger n still runs as one group).
    `eos_token_ids` end a completion; by default the tokenizer's EOS and the generation config's.
    `prefix_cache_mb` bounds the prefix cache (0 turns it off: every prompt is prefilled whole).
    `precision` is the arithmetic of generation: `fp32` (the transformers forward's numbers, to float
    rounding), `bf16` (about twice as fast on a CPU with native bf16; log-probs move by about 0.05 on
    average, see `trace_rl.engine.decoder`), or `auto` (bf16 where the hardware runs it natively).
    Llama-family models run through `trace_rl.engine.decoder` in that precision; other models run the
    transformers forward, in fp32 only.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        eos_token_ids: Sequence[int] | None = None,
        max_batch_size: int = 64,
        prefix_cache_mb: float = 1024.0,
        precision: str = "fp32",
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size!r}")
        if not prefix_cache_mb >= 0:
            raise ValueError(f"prefix_cache_mb must be >= 0, got {prefix_cache_mb!r}")
        return_freed_caches_to_the_os()
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.weight_version = 0
        self.cache = PrefixCache(int(prefix_cache_mb * 2**20))
        if eos_token_ids is None:
            eos_token_ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
            extra = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
            eos_token_ids = [*eos_token_ids, *([extra] if isinstance(extra, int) else extra or [])]
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self._eos = torch.tensor(sorted(self.eos_token_ids), dtype=torch.long)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_token_id = int(pad or 0)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self._backend = getattr(tokenizer, "backend_tokenizer", None)  # Rust decode, no Python cleanup
        self._bytes = byte_table(tokenizer, self.vocab_size)
        forward = getattr(model, "get_base_model", lambda: model)().forward
        self._cache_kwarg = "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"
        self.precision = resolve_precision(precision, self.device)
        self.decoder: Decoder | None = None
        if Decoder.supports(model):
            self.decoder = Decoder(model, torch.bfloat16 if self.precision == "bf16" else torch.float32)
        elif self.precision != "fp32":
            if precision == "bf16":
                raise ValueError(f"precision bf16 needs a Llama-family model, not {type(model).__name__}: use fp32")
            self.precision = "fp32"  # auto: this model runs the transformers forward, in fp32

    @classmethod
    def from_policy(cls, policy: Any, **kwargs: Any) -> HFEngine:
        """Engine for a `trace_rl.models.Policy`, using its EOS tokens."""
        kwargs.setdefault("eos_token_ids", policy.eos_token_ids or None)
        return cls(policy.model, policy.tokenizer, **kwargs)

    accepts_weights = True

    def update_weights(self, model: Any, *, version: int) -> None:
        """Sample from `model` from now on. The trainer's module is usually this engine's own (the
        policy is shared in-process), so nothing is copied; another module's weights are loaded.
        Either way the prefix cache, computed with the old weights, is emptied."""
        if model is not self.model:
            self.model.load_state_dict(model.state_dict())
        if self.decoder is not None:
            self.decoder.refresh()
        self.cache.clear()
        self.weight_version = int(version)

    def release_memory(self) -> int:
        """Free what the coming update makes stale, so the update's peak does not carry it: the prefix
        cache and the decoder's copy of the weights. The next `generate` rebuilds the copy from the
        model's weights of then (which `update_weights` does anyway). Returns the bytes freed."""
        freed = self.cache.nbytes + (self.decoder.nbytes if self.decoder is not None else 0)
        self.cache.clear()
        if self.decoder is not None:
            self.decoder.release()
        return freed

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of tokens without special tokens, as vLLM detokenizes by default."""
        if self._backend is not None:
            return self._backend.decode(list(token_ids), skip_special_tokens=True)
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        prompts = check_prompts(prompts, self.vocab_size)
        if self.decoder is not None and self.decoder.released:
            self.decoder.refresh()
        keys = self._row_keys(prompts, params)
        out: list[list[Completion]] = [[] for _ in prompts]
        # Group prompts of similar length (less padding), at most max_batch_size sequences a group.
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        per_group = max(1, self.max_batch_size // params.n)
        for start in range(0, len(order), per_group):
            group = order[start : start + per_group]
            completions = self._generate_group([prompts[i] for i in group], keys[group], params)
            for i, completion in zip(group, completions):
                out[i] = completion
        return out

    # ------------------------------------------------------------ internals

    def _row_keys(self, prompts: list[list[int]], params: SamplingParams) -> np.ndarray:
        """(prompts, n) uint64 keys, one per sample, from (seed, prompt tokens, occurrence)."""
        base = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little")
        seen: Counter[bytes] = Counter()
        keys = np.zeros((len(prompts), params.n), dtype=np.uint64)
        for i, prompt in enumerate(prompts):
            key = hashlib.blake2b(repr((base, prompt)).encode(), digest_size=16).digest()
            for j in range(params.n):
                occurrence = seen[key]
                seen[key] += 1
                row = hashlib.blake2b(key + occurrence.to_bytes(8, "little"), digest_size=8).digest()
                keys[i, j] = np.uint64(int.from_bytes(row, "little"))
        return keys

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any) -> torch.Tensor:
        if self.decoder is not None:
            return self.decoder.forward(ids, mask, positions, cache)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kwarg: cache},
        )
        return out.logits[:, -1].float()  # (B, V)

    def _prefill(self, prompts: list[list[int]], reserve: int) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
        """Cache (with room for `reserve` more positions), last logits (P, V), attention mask and next
        positions of each prompt, reusing cached prefixes; also how many tokens of each prompt came
        from the cache."""
        device = self.device
        found = [self.cache.lookup(prompt) for prompt in prompts]
        cached = [length for _, length in found]
        past, new = max(cached), max(len(p) - c for p, c in zip(prompts, cached))
        ids = torch.full((len(prompts), new), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), past + new), dtype=torch.long)
        positions = torch.zeros((len(prompts), new), dtype=torch.long)
        for i, (prompt, c) in enumerate(zip(prompts, cached)):
            rest = prompt[c:]  # [padding, cached prefix, padding, new tokens]
            ids[i, new - len(rest) :] = torch.tensor(rest)
            mask[i, past - c : past] = 1
            mask[i, past + new - len(rest) :] = 1
            positions[i, new - len(rest) :] = torch.arange(c, len(prompt))
        cache = buffered_cache(self.model.config, past + new + reserve)
        if past:
            sample = next(entry for entry, _ in found if entry is not None).layers
            for layer, (k0, v0) in enumerate(sample):
                target = cache.layers[layer]
                if isinstance(target, _BufferedLayer):  # the cached prefixes go straight into its buffer
                    target.allocate(k0, len(prompts), length=past)
                    keys, values = target.keys, target.values
                else:
                    keys = k0.new_zeros((len(prompts), k0.shape[0], past, k0.shape[-1]))
                    values = v0.new_zeros((len(prompts), v0.shape[0], past, v0.shape[-1]))
                for i, (entry, c) in enumerate(found):
                    if c:
                        keys[i, :, past - c :] = entry.layers[layer][0][:, :c]
                        values[i, :, past - c :] = entry.layers[layer][1][:, :c]
                if not isinstance(target, _BufferedLayer):
                    cache.update(keys, values, layer)
        ids, mask, positions = ids.to(device), mask.to(device), positions.to(device)
        logits = self._forward(ids, mask, positions, cache)
        return cache, logits, mask, positions[:, -1] + 1, cached

    def _generate_group(self, prompts: list[list[int]], keys: np.ndarray, params: SamplingParams) -> list[list[Completion]]:
        n, steps = params.n, params.max_new_tokens
        cache, logits, mask, next_position, cached = self._prefill(prompts, reserve=steps)
        if n > 1:  # one prefill per prompt, then its cache is repeated for its n continuations
            cache.batch_repeat_interleave(n)
            logits = logits.repeat_interleave(n, dim=0)
            mask = mask.repeat_interleave(n, dim=0)
            next_position = next_position.repeat_interleave(n, dim=0)
        rows = len(prompts) * n  # batch order: prompt-major
        row_prompt = [prompts[r // n] for r in range(rows)]
        row_keys = keys.reshape(-1)
        tokens_out = torch.zeros((rows, steps), dtype=torch.long)
        logps_out = torch.zeros((rows, steps), dtype=torch.float64)
        lengths = np.zeros(rows, dtype=np.int64)
        finish: list[FinishReason | None] = [None] * rows
        active = torch.arange(rows)  # the output row of each batch position
        live = torch.ones(rows, dtype=torch.bool)  # positions still generating
        matcher = StopMatcher(*self._bytes, params.stop, rows) if params.stop and self._bytes is not None else None
        for step in range(steps):
            tokens, logprobs = self._sample(logits, row_keys[active.numpy()], step, params)
            tokens_cpu = tokens.cpu()
            tokens_out[active[live], step] = tokens_cpu[live]
            logps_out[active[live], step] = logprobs.cpu().double()[live]
            eos = torch.isin(tokens_cpu, self._eos) if not params.ignore_eos else torch.zeros_like(tokens_cpu, dtype=torch.bool)
            stop = self._stops(matcher, tokens_out, active, step, params)
            done = (eos | stop if step + 1 < steps else torch.ones_like(eos)) & live
            for j in torch.nonzero(done).flatten().tolist():
                row = int(active[j])
                finish[row] = "eos" if eos[j] else "stop" if stop[j] else "length"
                lengths[row] = step + 1
                self._store(cache, mask, j, row_prompt[row] + tokens_out[row, :step].tolist())
            live &= ~done
            if not live.any():
                break
            if _COMPACT_AT * (~live).sum() >= live.numel():
                # Finished sequences leave the batch once they are half of it: each compaction
                # copies the whole cache, so doing it whenever one finishes cost more than the
                # attention itself; until then they compute along, their tokens ignored.
                keep = torch.nonzero(live).flatten()
                index = keep.to(mask.device)
                cache.batch_select_indices(index)
                mask, tokens, next_position = mask[index], tokens[index], next_position[index]
                active, live = active[keep], live[keep]
                if matcher is not None:
                    matcher.select(keep)
            mask = torch.cat([mask, mask.new_ones((active.numel(), 1))], dim=1)
            logits = self._forward(tokens[:, None], mask, next_position[:, None], cache)
            next_position = next_position + 1
        completions = []
        for i in range(len(prompts)):
            group = []
            for row in range(i * n, (i + 1) * n):
                ids = tokens_out[row, : lengths[row]].tolist()
                group.append(self._completion(ids, logps_out[row, : lengths[row]].tolist(), finish[row], params, cached[i]))
            completions.append(group)
        return completions

    def _stops(self, matcher: StopMatcher | None, tokens: torch.Tensor, active: torch.Tensor, step: int, params: SamplingParams) -> torch.Tensor:
        """Rows whose newest token completed a stop string."""
        if not params.stop:
            return torch.zeros(active.numel(), dtype=torch.bool)
        if matcher is not None:
            return matcher.push(tokens[active, step])
        window = max(len(s.encode("utf-8")) for s in params.stop) + 4  # a tokenizer without a byte table
        return torch.tensor([self._ends_in_stop(tokens[row, : step + 1].tolist(), params.stop, window) for row in active.tolist()])

    def _store(self, cache: Any, mask: torch.Tensor, index: int, tokens: list[int]) -> None:
        """Put row `index`'s keys and values (its real positions only) into the prefix cache."""
        if self.cache.max_bytes <= 0 or len(tokens) <= PrefixCache._KEY:
            return
        real = torch.nonzero(mask[index]).flatten()
        layers = []
        for layer in cache.layers:
            if not getattr(layer, "is_initialized", False) or layer.keys is None:
                return  # a layer kind we cannot slice (e.g. sliding windows): cache nothing
            layers.append((layer.keys[index][:, real].clone(), layer.values[index][:, real].clone()))
        if layers and layers[0][0].shape[1] == len(tokens):
            self.cache.insert(tokens, layers)

    def _sample(self, logits: torch.Tensor, keys: np.ndarray, position: int, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
        """Sampled token and its log softmax(logits / T) for each row (see engine.base)."""
        if params.temperature == 0.0:
            logp = torch.log_softmax(logits, dim=-1)
            tokens = logp.argmax(dim=-1)
            return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
        # Inverse-CDF sampling with one counter-based uniform per row, so the draw is the same on any
        # device and in any batch.
        uniform = torch.from_numpy(counter_uniforms(keys, position)).to(logits.device)
        if params.top_p < 1.0:
            logp = torch.log_softmax(logits / params.temperature, dim=-1)
            probs = _top_p_filter(logp.double().exp(), params.top_p)
            cdf = probs.cumsum(dim=-1)
            target = (uniform * cdf[:, -1])[:, None]
            tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)
            return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
        return inverse_cdf_sample(logits, params.temperature, uniform)

    def _ends_in_stop(self, token_ids: list[int], stop: tuple[str, ...], window: int) -> bool:
        """Whether the newest token completed a stop string (decoding only the last `window` tokens)."""
        tail = token_ids[-window:]
        before, after = self.decode(tail[:-1]), self.decode(tail)
        common = 0  # a partial UTF-8 character can change when the next byte arrives
        limit = min(len(before), len(after))
        while common < limit and before[common] == after[common]:
            common += 1
        return any(after.find(s, max(0, common - len(s) + 1)) >= 0 for s in stop)

    def _completion(self, token_ids: list[int], logprobs: list[float], finish: FinishReason | None, params: SamplingParams, cached: int) -> Completion:
        assert finish is not None
        text_ids = token_ids[:-1] if finish == "eos" else token_ids  # EOS may not be special
        text, stop_reason = self.decode(text_ids), None
        if finish == "stop":
            text, stop_reason = cut_at_stop(text, params.stop)
        return Completion(
            token_ids=token_ids,
            logprobs=logprobs,
            text=text,
            finish_reason=finish,
            stop_reason=stop_reason,
            cached_tokens=cached,
        )


_COMPACT_AT = 2
"""The batch drops its finished sequences once they are 1 / this of it (half: measured a little faster
than a quarter, and clearly faster than an eighth, on a demo step's generation calls)."""


_BLOCK = 256
"""Tokens per block of `inverse_cdf_sample`'s two-level search."""


def inverse_cdf_sample(logits: torch.Tensor, temperature: float, uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For each row of `logits` (B, V) at `temperature` > 0: the token whose cumulative softmax mass
    first exceeds `uniform` (B,) times the total, and its log softmax(logits / T).

    The same draw as one cumulative sum over the vocabulary, in two levels: the weights
    exp((logits - max) / T) in fp32, their sums per block of `_BLOCK` tokens and the cumulative sum of
    those in fp64, the block the target falls in, then the cumulative sum inside that block only. A
    full-vocabulary fp64 exp and cumsum (49k tokens a row for SmolLM2) cost several times as much; the
    fp32 weights move a draw only when its uniform lands within about 1e-6 (relative) of a token's
    boundary."""
    rows, vocab = logits.shape
    top = logits.amax(dim=-1, keepdim=True)
    weights = (logits - top).mul_(1.0 / temperature).exp_()
    blocks = -(-vocab // _BLOCK)
    if blocks * _BLOCK != vocab:
        weights = torch.nn.functional.pad(weights, (0, blocks * _BLOCK - vocab))
    weights = weights.view(rows, blocks, _BLOCK)
    block_cdf = weights.sum(dim=-1).double().cumsum(dim=-1)  # (B, blocks)
    total = block_cdf[:, -1:]
    target = uniform.to(torch.float64)[:, None] * total
    block = _first_above(block_cdf, target)
    before = torch.where(block > 0, block_cdf.gather(-1, (block - 1).clamp(min=0)), 0.0)
    inner = weights[torch.arange(rows, device=logits.device), block.squeeze(-1)].double().cumsum(dim=-1)  # (B, _BLOCK)
    tokens = (block * _BLOCK + _first_above(inner, target - before)).squeeze(-1)
    scaled = (logits.gather(-1, tokens[:, None]) - top).squeeze(-1) / temperature
    return tokens, scaled - total.squeeze(-1).log().to(logits.dtype)


def _first_above(cdf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """(B, 1) index of the first entry of each row of `cdf` above `target`; where rounding puts the
    target at or past the row's end, the first entry that reaches the end (the last one with mass)."""
    index = torch.searchsorted(cdf, target, right=True)
    past = index >= cdf.shape[-1]
    if past.any():
        index = torch.where(past, torch.searchsorted(cdf, cdf[:, -1:].contiguous(), right=False), index)
    return index


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero all but the smallest set of most likely tokens whose mass reaches top_p (not renormalised)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p * probs.sum(-1, keepdim=True), 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)



def buffered_cache(config: Any, capacity: int) -> DynamicCache:
    """A `DynamicCache` for `config` whose full-attention layers fill room for `capacity` positions
    (`_BufferedLayer`); other layer kinds (e.g. sliding windows) keep their own update."""
    cache = DynamicCache(config=config)
    for index, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer:
            cache.layers[index] = _BufferedLayer(capacity)
    return cache


class _BufferedLayer(DynamicLayer):
    """A `DynamicLayer` that writes each step's keys into spare capacity instead of `torch.cat`.

    `DynamicLayer.update` concatenates, copying the whole cache at every update (a third of a small
    model's decode step on CPU, and the prefill's copy again). Here the buffer is allocated once,
    before the prefill, with room for the prompt and every token to come, and `keys` / `values` are
    views of its filled part, so the rest of transformers (mask sizes, `get_seq_length`, attention)
    sees an ordinary layer. Past the capacity it grows as `DynamicLayer` does.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self._length = 0

    def allocate(self, like: torch.Tensor, batch: int, *, length: int = 0) -> None:
        """Room for `capacity` positions of `batch` rows (heads, head size, dtype and device of `like`,
        a (.., heads, positions, head size) tensor), the first `length` of them filled with zeros
        for the caller to overwrite. Zeros, not garbage, everywhere: the padding between cached
        prefixes and the room after `length` are masked, yet `trace_rl.engine.decoder` attends over the
        whole buffer (`buffers`), and a NaN there would still poison the attention (0 × NaN)."""
        shape = (batch, like.shape[-3], max(self.capacity, length), like.shape[-1])
        self._keys, self._values = like.new_zeros(shape), like.new_zeros(shape)
        self._length = length
        self.device, self.is_initialized = like.device, True
        self._refresh()

    def _refresh(self) -> None:
        self.keys = self._keys[:, :, : self._length]
        self.values = self._values[:, :, : self._length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not self.is_initialized:
            self.allocate(key_states, key_states.shape[0])
        new = key_states.shape[-2]
        if self._length + new > self._keys.shape[-2]:  # past the reservation: grow like DynamicLayer
            self._keys = torch.cat([self.keys, key_states], dim=-2)
            self._values = torch.cat([self.values, value_states], dim=-2)
        else:
            self._keys[:, :, self._length : self._length + new] = key_states
            self._values[:, :, self._length : self._length + new] = value_states
        self._length += new
        self._refresh()
        return self.keys, self.values

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole key and value buffers (batch, heads, capacity, head size): the filled part, then
        zeros (`trace_rl.engine.decoder` attends over them whole, its mask hiding the room)."""
        return self._keys, self._values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._keys, self._values = self._keys[indices], self._values[indices]
        self._refresh()

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._keys = self._keys.repeat_interleave(repeats, dim=0)
        self._values = self._values.repeat_interleave(repeats, dim=0)
        self._refresh()

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        self._length = self.keys.shape[-2]
