"""A generation-only forward for Llama-family decoders (`tiny`, SmolLM2, Llama), for the `hf` engine.

Why not the transformers module: a CPU decodes a few dozen rows, one token each, and at that size what
the transformers forward does around its matrix products weighs as much as they do: per layer it
builds masks, runs three projections where one would do, and with a padding mask repeats each
key/value head for every query head it serves (grouped-query attention as copies, which triples the
bytes attention reads from the cache). This module runs the same arithmetic as `LlamaForCausalLM` with:

- the q/k/v projections as one matrix product and gate/up as another (weights concatenated once);
- grouped-query attention as the model defines it: the query heads that share a key/value head are
  one batched product against that head's cache, never a copy of it;
- a dtype of its own: `bf16` (half the bytes and, on a CPU with native bf16, about twice the matrix
  rate, with the weights prepacked for oneDNN's kernel) or fp32, with RMSNorm, softmax and the logits
  in fp32 as transformers computes them. In bf16 the next-token distributions stay within 0.02 of
  fp32's in total variation on average (`tests/test_decoder.py`): close enough to sample from, not to
  stand for fp32's log-probs, so the update recomputes those (`Trainer.recompute_logprobs`);
- keys and values written straight into the engine's preallocated cache (`hf._BufferedLayer`).

It serves generation only (no gradients, no dropout); the trainer's update keeps the transformers
module. `Decoder.refresh` re-reads the weights after an update (LoRA adapters merged into the copy),
so the engine samples the trainer's current policy. Models it does not support (another architecture,
biases, sliding windows) are left to transformers: `Decoder.supports` says which.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

_ARCHITECTURES = ("llama",)


@functools.cache
def _onednn_bf16() -> bool:
    """Whether oneDNN's prepacked bf16 linear runs here and agrees with a plain product. A plain bf16
    product lays the weight out for the kernel at every call, which at a few dozen rows costs about as
    much as the product; prepacked, that is done once per weight version. It is a private torch op
    (the one torch.compile's CPU backend uses), so it is checked before use."""
    try:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(5, 64, generator=generator).to(torch.bfloat16)
        w = torch.randn(48, 64, generator=generator).to(torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return bool(torch.allclose(out.float(), (x @ w.t()).float(), atol=1e-2, rtol=1e-2))
    except (AttributeError, RuntimeError):
        return False


def _base(model: Any) -> Any:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _weight(linear: Any) -> torch.Tensor:
    """A linear layer's effective weight (out, in): a peft LoRA layer's base weight plus its active
    adapters' deltas (unless they are merged into it already, or disabled)."""
    base = getattr(linear, "base_layer", None)
    if base is None:
        return linear.weight.detach()
    weight = base.weight.detach()
    if getattr(linear, "merged", False) or getattr(linear, "disable_adapters", False):
        return weight
    for name in getattr(linear, "active_adapters", ()):
        if name in getattr(linear, "lora_A", {}):
            weight = weight + linear.get_delta_weight(name).detach().to(weight.dtype)
    return weight


class Decoder:
    """The forward of a Llama-family causal LM for generation, with its weights in `dtype`."""

    def __init__(self, model: Any, dtype: torch.dtype) -> None:
        if not self.supports(model):
            raise ValueError(f"{type(_base(model)).__name__} is not a Llama-family decoder this module runs")
        self.model = model
        self.dtype = dtype
        config = _base(model).config
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.heads)
        self.eps = float(config.rms_norm_eps)
        device = next(model.parameters()).device
        self._onednn = dtype == torch.bfloat16 and device.type == "cpu" and _onednn_bf16()
        self.layers: list[dict[str, torch.Tensor]] = []
        self.refresh()

    @staticmethod
    def supports(model: Any) -> bool:
        """Llama architecture without biases, sliding windows or a rotary embedding it cannot call."""
        base = _base(model)
        config = getattr(base, "config", None)
        inner = getattr(base, "model", None)
        return (
            getattr(config, "model_type", None) in _ARCHITECTURES
            and not getattr(config, "attention_bias", False)
            and not getattr(config, "mlp_bias", False)
            and getattr(config, "hidden_act", None) == "silu"
            and getattr(config, "sliding_window", None) is None
            and int(getattr(config, "pretraining_tp", 1) or 1) == 1
            and hasattr(inner, "rotary_emb")
            and hasattr(inner, "layers")
        )

    @property
    def released(self) -> bool:
        """Whether `release` dropped the weights (`refresh` copies them again)."""
        return not self.layers

    @property
    def nbytes(self) -> int:
        """Bytes this decoder holds beyond the model's own weights (0 once released): its transposed or
        converted copies; a tensor that shares the model's storage (the embedding in fp32) is not counted."""
        models = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        held = [t for t in (self.embed, self.lm_head, *(t for layer in self.layers for t in layer.values())) if t is not None]
        # oneDNN's prepacked weights are opaque (no storage to ask); they are always this decoder's own
        packed = sum(t.numel() * t.element_size() for t in held if t.is_mkldnn)
        own = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held if not t.is_mkldnn}
        return packed + sum(size for pointer, size in own.items() if pointer not in models)

    def release(self) -> None:
        """Drop the copy of the weights (a model's worth of memory in this decoder's dtype) until `refresh`."""
        self.layers, self.embed, self.lm_head = [], None, None

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the model's current weights (adapters merged) into this decoder's dtype."""
        base = _base(self.model)
        inner = base.model
        linear = self._prepare
        self.embed = inner.embed_tokens.weight.detach().to(self.dtype).contiguous()
        self.norm = inner.norm.weight.detach().float()
        self.rotary = inner.rotary_emb
        self.lm_head = linear(_weight(base.get_output_embeddings()))
        layers = []
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            layers.append({
                "ln1": layer.input_layernorm.weight.detach().float(),
                "qkv": linear(torch.cat([_weight(attn.q_proj), _weight(attn.k_proj), _weight(attn.v_proj)])),
                "o": linear(_weight(attn.o_proj)),
                "ln2": layer.post_attention_layernorm.weight.detach().float(),
                "gate_up": linear(torch.cat([_weight(mlp.gate_proj), _weight(mlp.up_proj)])),
                "down": linear(_weight(mlp.down_proj)),
            })
        self.layers = layers

    def _prepare(self, weight: torch.Tensor) -> torch.Tensor:
        """A linear layer's weight (out, in) as `_linear` takes it: in oneDNN's blocked layout for bf16 on
        a CPU (`_onednn_bf16`), else transposed (in, out) for a plain product."""
        weight = weight.detach().to(self.dtype)
        if self._onednn:
            return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 64)
        return weight.t().contiguous()

    def _linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self._onednn:
            return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
        return x @ weight

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (weight * x).to(self.dtype)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any) -> torch.Tensor:
        """fp32 logits (B, V) of each row's last token.

        `ids` / `positions` (B, T) are the new tokens; `mask` (B, S) marks the real columns of the cache
        after they are appended (S = the cache's length + T); `cache` is a `DynamicCache` of `_BufferedLayer`s
        that receives each layer's keys and values (B, kv heads, T, head size).
        """
        B, T = ids.shape
        H, K, D = self.heads, self.kv_heads, self.head_dim
        G = H // K
        x = F.embedding(ids, self.embed)  # (B, T, hidden)
        cos, sin = self.rotary(x, positions)  # (B, T, D)
        cos, sin = cos[:, None].to(self.dtype), sin[:, None].to(self.dtype)
        scale = D**-0.5
        allowed = None
        for index, w in enumerate(self.layers):
            h = self._rms(x, w["ln1"])
            qkv = self._linear(h, w["qkv"])  # (B, T, (H + 2K) D)
            q, k, v = qkv.split((H * D, K * D, K * D), dim=-1)
            q = q.view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
            k = k.view(B, T, K, D).transpose(1, 2)
            v = v.view(B, T, K, D).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            layer = cache.layers[index]
            layer.update(k, v)
            # Attention runs over the layer's whole buffer (B, K, C, D), its unfilled columns (zeros)
            # masked: a batched product over a slice of it would first copy the slice to a dense
            # tensor (CPU batched products take no other batch stride), which cost more than the
            # product; the buffer's spare room is at most the tokens still to come.
            keys, values = layer.buffers()
            if allowed is None:  # the same columns for every layer: made once a forward
                allowed = _allowed(mask, T, keys.shape[-2])
                if T == 1:
                    bias = torch.zeros(allowed.shape, dtype=self.dtype, device=ids.device).masked_fill_(~allowed, float("-inf"))[:, None]
            if T > 1:  # a prefill: the fused kernel, which never holds the (T, C) scores of a head
                attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed[:, None], scale=scale, enable_gqa=G > 1)
            else:  # a decode step: the G query heads of each key/value head as one (G, D) block
                attended = _decode_attention(q, keys, values, bias, scale)
            attended = attended.transpose(1, 2).reshape(B, T, H * D)
            x = x + self._linear(attended, w["o"])
            h = self._rms(x, w["ln2"])
            gate, up = self._linear(h, w["gate_up"]).chunk(2, dim=-1)
            x = x + self._linear(F.silu(gate) * up, w["down"])
        last = self._rms(x[:, -1], self.norm)  # (B, hidden)
        return self._linear(last, self.lm_head).float()


def _allowed(mask: torch.Tensor, T: int, columns: int) -> torch.Tensor:
    """(B, T, C) bool: whether new token t may see cache column c. `mask` (B, S) marks the real columns
    once the T new tokens are in (they are the last T); columns from S to C are unfilled room. A new
    token sees the real columns up to itself; a row of padding that sees none is let see column 0, so
    its softmax is not NaN (its output is never used)."""
    B, S = mask.shape
    allowed = torch.zeros((B, T, columns), dtype=torch.bool, device=mask.device)
    allowed[:, :, :S] = mask.bool()[:, None, :]
    if T > 1:
        allowed[:, :, :S] &= torch.ones((T, S), dtype=torch.bool, device=mask.device).tril(S - T)
    allowed[..., 0] |= ~allowed.any(-1)
    return allowed


def _decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of one new token a row, (B, H, 1, D), grouped-query: the G query heads of a key/value
    head as one (G, D) block against its cache (B, K, C, D); `bias` (B, 1, 1, C), in the cache's dtype,
    is 0 where a column may be seen, -inf elsewhere. At one query a head this is about twice as fast
    as the fused kernel (which handles a head's queries one block at a time), and it reads each key
    once however many query heads share it. The scores come out of the product in the cache's dtype;
    softmax computes in fp32 inside its kernel (for bf16 too) and rounds its output back, so no fp32
    copy of the scores is made; the scale is applied to the queries (exact where it is a power of 2,
    as for a head size of 64 or 256)."""
    B, H, _, D = q.shape
    K = keys.shape[1]
    scores = (q * scale).view(B, K, H // K, D) @ keys.transpose(-1, -2)  # (B, K, G, C)
    probs = torch.softmax(scores.add_(bias), dim=-1)
    return (probs @ values).view(B, H, 1, D)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)
