"""In-process generation with Hugging Face transformers, on CPU or GPU, with our own sampling loop.

Why our own loop rather than `model.generate`: log-probs, stop strings and per-sequence seeds must
be exact, and branching must not redo work. Each prompt is prefilled ONCE; its KV cache is then
repeated for the `n` continuations (`DynamicCache.batch_repeat_interleave`), so Stage-2 branches
from a long prefix cost one prefill, not `n`. Prompts of different lengths share a batch, left
padded, with attention masks and positions counted from each prompt's first real token. Finished
sequences leave the batch (`batch_select_indices`), so they stop costing compute.

Reproducibility: a sample's randomness depends only on (seed, prompt tokens, how many samples of
that same prompt came before it in the call), never on batch composition. So `generate([p], n=4)`
and `generate([p, p, p, p], n=1)` draw the same tokens, and a prompt gives the same completions
alone or in a batch (up to float rounding in padded batches, which could flip a token only when
its uniform draw lands within ~1e-6 of a probability boundary).
"""

from __future__ import annotations

import hashlib
import inspect
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .base import Completion, FinishReason, SamplingParams, check_prompts, cut_at_stop


@dataclass
class _Row:
    """One sequence being generated: its own random stream and what it has produced so far."""

    generator: torch.Generator
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: FinishReason | None = None


class HFEngine:
    """`Engine` over a transformers causal LM (optionally a peft model).

    `max_batch_size` caps the sequences decoded together (prompts are grouped so that
    prompts × n stays under it; one prompt with a larger n still runs as one group).
    `eos_token_ids` end a completion; by default the tokenizer's EOS and the generation config's.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        eos_token_ids: Sequence[int] | None = None,
        max_batch_size: int = 64,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size!r}")
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.weight_version = 0
        if eos_token_ids is None:
            eos_token_ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
            extra = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
            eos_token_ids = [*eos_token_ids, *([extra] if isinstance(extra, int) else extra or [])]
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_token_id = int(pad or 0)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self._backend = getattr(tokenizer, "backend_tokenizer", None)  # Rust decode, no Python cleanup
        forward = getattr(model, "get_base_model", lambda: model)().forward
        self._cache_kwarg = "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"

    @classmethod
    def from_policy(cls, policy: Any, **kwargs: Any) -> HFEngine:
        """Engine for a `trace_rl.models.Policy`, using its EOS tokens."""
        kwargs.setdefault("eos_token_ids", policy.eos_token_ids or None)
        return cls(policy.model, policy.tokenizer, **kwargs)

    accepts_weights = True

    def update_weights(self, model: Any, *, version: int) -> None:
        """Sample from `model` from now on. The trainer's module is usually this engine's own (the
        policy is shared in-process), so nothing is copied; another module's weights are loaded."""
        if model is not self.model:
            self.model.load_state_dict(model.state_dict())
        self.weight_version = int(version)

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
        rows = self._rows(prompts, params)
        # Group prompts of similar length (less padding), at most max_batch_size sequences a group.
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        per_group = max(1, self.max_batch_size // params.n)
        for start in range(0, len(order), per_group):
            group = order[start : start + per_group]
            self._generate_group([prompts[i] for i in group], [rows[i] for i in group], params)
        return [[self._completion(row, params) for row in prompt_rows] for prompt_rows in rows]

    # ------------------------------------------------------------ internals

    def _rows(self, prompts: list[list[int]], params: SamplingParams) -> list[list[_Row]]:
        """One row per sample, each with a generator seeded from (seed, prompt tokens, occurrence)."""
        base = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little")
        seen: Counter[bytes] = Counter()
        rows = []
        for prompt in prompts:
            key = hashlib.blake2b(repr((base, prompt)).encode(), digest_size=16).digest()
            prompt_rows = []
            for _ in range(params.n):
                occurrence = seen[key]
                seen[key] += 1
                row_seed = hashlib.blake2b(key + occurrence.to_bytes(8, "little"), digest_size=8).digest()
                generator = torch.Generator().manual_seed(int.from_bytes(row_seed, "little") >> 1)
                prompt_rows.append(_Row(generator=generator))
            rows.append(prompt_rows)
        return rows

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any) -> torch.Tensor:
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kwarg: cache},
        )
        return out.logits[:, -1].float()  # (B, V)

    def _generate_group(self, prompts: list[list[int]], rows: list[list[_Row]], params: SamplingParams) -> None:
        device = self.device
        length = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), length), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), length), dtype=torch.long)
        for i, prompt in enumerate(prompts):  # left padding: every prompt ends at the last column
            ids[i, length - len(prompt) :] = torch.tensor(prompt)
            mask[i, length - len(prompt) :] = 1
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)

        # One prefill per prompt, then the cache is repeated for its n continuations.
        cache = DynamicCache(config=self.model.config)
        logits = self._forward(ids, mask, positions, cache)  # (P, V)
        next_position = positions[:, -1] + 1  # (P,)
        if params.n > 1:
            cache.batch_repeat_interleave(params.n)
            logits = logits.repeat_interleave(params.n, dim=0)
            mask = mask.repeat_interleave(params.n, dim=0)
            next_position = next_position.repeat_interleave(params.n, dim=0)
        _reserve(cache, params.max_new_tokens)
        active = [row for prompt_rows in rows for row in prompt_rows]  # batch order: prompt-major

        stop_window = max((len(s.encode("utf-8")) for s in params.stop), default=0) + 4
        for step in range(params.max_new_tokens):
            tokens, logprobs = self._sample(logits, [row.generator for row in active], params)
            for row, token, logprob in zip(active, tokens.tolist(), logprobs.tolist()):
                row.token_ids.append(token)
                row.logprobs.append(logprob)
                if token in self.eos_token_ids and not params.ignore_eos:
                    row.finish = "eos"
                elif params.stop and self._ends_in_stop(row.token_ids, params.stop, stop_window):
                    row.finish = "stop"
                elif step + 1 == params.max_new_tokens:
                    row.finish = "length"
            keep = [i for i, row in enumerate(active) if row.finish is None]
            if not keep:
                break
            if len(keep) < len(active):  # finished sequences leave the batch
                index = torch.tensor(keep, device=device)
                cache.batch_select_indices(index)
                mask, tokens, next_position = mask[index], tokens[index], next_position[index]
                active = [active[i] for i in keep]
            mask = torch.cat([mask, mask.new_ones((len(active), 1))], dim=1)
            logits = self._forward(tokens[:, None], mask, next_position[:, None], cache)
            next_position = next_position + 1

    def _sample(
        self, logits: torch.Tensor, generators: list[torch.Generator], params: SamplingParams
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sampled token and its log softmax(logits / T) for each row (see engine.base)."""
        if params.temperature == 0.0:
            logp = torch.log_softmax(logits, dim=-1)
            tokens = logp.argmax(dim=-1)
        else:
            logp = torch.log_softmax(logits / params.temperature, dim=-1)
            probs = logp.double().exp()
            if params.top_p < 1.0:
                probs = _top_p_filter(probs, params.top_p)
            # Inverse-CDF sampling with one uniform per row from that row's own CPU generator, so
            # the draw is the same on any device and in any batch.
            uniform = torch.tensor([torch.rand((), generator=g, dtype=torch.float64).item() for g in generators])
            cdf = probs.cumsum(dim=-1)
            target = (uniform.to(cdf.device) * cdf[:, -1])[:, None]
            tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)

    def _ends_in_stop(self, token_ids: list[int], stop: tuple[str, ...], window: int) -> bool:
        """Whether the newest token completed a stop string (decoding only the last `window` tokens)."""
        tail = token_ids[-window:]
        before, after = self.decode(tail[:-1]), self.decode(tail)
        common = 0  # a partial UTF-8 character can change when the next byte arrives
        limit = min(len(before), len(after))
        while common < limit and before[common] == after[common]:
            common += 1
        return any(after.find(s, max(0, common - len(s) + 1)) >= 0 for s in stop)

    def _completion(self, row: _Row, params: SamplingParams) -> Completion:
        assert row.finish is not None
        text_ids = row.token_ids[:-1] if row.finish == "eos" else row.token_ids  # EOS may not be special
        text, stop_reason = self.decode(text_ids), None
        if row.finish == "stop":
            text, stop_reason = cut_at_stop(text, params.stop)
        return Completion(
            token_ids=row.token_ids,
            logprobs=row.logprobs,
            text=text,
            finish_reason=row.finish,
            stop_reason=stop_reason,
        )


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero all but the smallest set of most likely tokens whose mass reaches top_p (not renormalised)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p * probs.sum(-1, keepdim=True), 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)



def _reserve(cache: Any, extra: int) -> None:
    """Give every full-attention layer room for `extra` more positions (see `_BufferedLayer`)."""
    for index, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer and layer.is_initialized:  # other layer kinds keep their own update
            cache.layers[index] = _BufferedLayer.take_over(layer, extra)


class _BufferedLayer(DynamicLayer):
    """A `DynamicLayer` that writes each step's keys into spare capacity instead of `torch.cat`.

    `DynamicLayer.update` concatenates, copying the whole cache every decode step (a third of a
    small model's step time on CPU). Here the buffer is sized once after the prefill, and `keys` /
    `values` are views of its filled part, so the rest of transformers (mask sizes,
    `get_seq_length`, attention) sees an ordinary layer.
    """

    @classmethod
    def take_over(cls, layer: DynamicLayer, extra: int) -> _BufferedLayer:
        new = cls()
        batch, heads, length, _ = layer.keys.shape
        new._keys = layer.keys.new_empty((batch, heads, length + extra, layer.keys.shape[-1]))
        new._values = layer.values.new_empty((batch, heads, length + extra, layer.values.shape[-1]))
        new._keys[:, :, :length] = layer.keys
        new._values[:, :, :length] = layer.values
        new._length = length
        new.device, new.is_initialized = layer.keys.device, True
        new._refresh()
        return new

    def _refresh(self) -> None:
        self.keys = self._keys[:, :, : self._length]
        self.values = self._values[:, :, : self._length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
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
