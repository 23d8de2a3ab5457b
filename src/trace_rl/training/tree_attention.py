"""Exact tree attention for packed rollout trees: the per-token log-probs of `token_logprobs` on each
root-to-leaf path, computed with every shared node once.

`packed_token_logprobs` runs a packed row (nodes one after another, positions along their own paths)
through the model with an attention function registered with transformers' `AttentionInterface`, in
which each node's queries see only its ancestors' tokens and its own (causally). The trainer's packed
update (`trace_rl.training.sequences` builds the rows) and the warm start use it; `supports_packed`
checks a model against the plain per-path computation once.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from trace_rl.models.policy import token_logprobs
from trace_rl.training.sequences import in_loss, micro_batches, pack_batch, pack_tree, pad_batch, tree_groups

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


def loss_token_logprobs(
    model: Any,
    sequences: Sequence[Any],
    *,
    packed: bool,
    temperature: float = 1.0,
    max_len: int | None = None,
    dtype: torch.dtype | None = None,
    rows: int = 8,
    pack_tokens: int = 16384,
) -> torch.Tensor:
    """Every trained token's log-prob (zero advantages included, as a KL term trains them), per leaf
    (`token_logprobs` on `rows` padded sequences at a time) or packed (`packed_token_logprobs` on
    micro-batches of at most `pack_tokens` tokens), in one order, so the two layouts, two dtypes or two
    devices can be compared token by token. No gradients; on the model's device, under autocast to
    `dtype` there when given; returned as fp32 on the CPU. `sequences` are `TrainSequence`s."""
    device = next(model.parameters()).device
    out = []
    with torch.no_grad(), torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
        if packed:
            packs = [p for group in tree_groups(sequences) for p in pack_tree(group, max_len=max_len, zero_advantage=True)]
            for group in micro_batches(packs, pack_tokens):
                b = pack_batch(group)
                lp = packed_token_logprobs(model, b.input_ids.to(device), b.position_ids, b.nodes, b.sources, b.targets, temperature=temperature)
                out.append(lp.float().cpu())
        else:
            for first in range(0, len(sequences), rows):
                b = pad_batch(sequences[first : first + rows], max_len=max_len)
                lp = token_logprobs(model, b.input_ids.to(device), b.attention_mask.to(device), temperature=temperature).float().cpu()
                out.extend(lp[r][in_loss(b.weights[r], b.advantages[r], zero_advantage=True)] for r in range(lp.shape[0]))
    return torch.cat(out)


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
