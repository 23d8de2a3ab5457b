"""Trees and their node advantages → training sequences, and the two layouts the update runs them in.

Every node's tokens must be trained in the context of its own path, but only once: each node is
"owned" by the first leaf (in id order) whose root-to-leaf path contains it, and only the owner's
sequence puts that node's policy tokens in the loss. A node's tokens carry its advantage `A` and
are counted `weight` times (see `trace_rl.core.advantage.NodeAdvantages`), so GRPO over leaves (weight =
leaves below) and TRACE (weight 1, shared prefixes once) use one code path.

Worked example: a root with one prefix node P (2 policy tokens) branching into leaves L1 and L2.
Sequences: [root, P, L1] and [root, P, L2]. P is owned by L1: its tokens sit in the first sequence
with coefficient A(P) and count weight(P); in the second sequence P is context only (mask 0).

Two layouts of the same sequences (`TrainConfig.update`):

- per leaf (`pad_batch`): every sequence is one right-padded row, so a tree's prompt and shared turns
  are recomputed as context in every leaf's row;
- packed (`pack_tree`, `pack_batch`): the sequences of one tree become one packed row holding each
  node's tokens once, nodes in id order, each node's tokens contiguous. Every token keeps the position
  it has on its own root-to-node path, and `trace_rl.training.tree_attention.packed_token_logprobs` lets it attend to
  exactly the tokens before it on that path (its own node up to itself and all of its ancestors), so it
  sees the context it was sampled in. A target token t at path position p of sequence s is predicted
  from the packed copy of the token at position p-1 of s (for a node's first token: the last token of
  its parent). Every (sequence, position) the per-leaf layout trains is a target here, with the same
  coefficient, so both layouts compute the same loss; only the redundant context is gone.

In the P example the packed row is [root, P, L1, L2] (L2 at the positions it has after P), and the
first tokens of L1 and L2 are both predicted from the last token of P, as in their own sequences.
Tokens nothing is predicted from (a path's tokens after its last target) are left out.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from trace_rl.core.advantage import NodeAdvantages
from trace_rl.core.tree import RolloutTree


@dataclass
class TrainSequence:
    """One root-to-leaf path: its tokens and, per token, what the loss needs (0 where not trained)."""

    token_ids: list[int]
    advantages: list[float]
    weights: list[float]
    """How many times each token counts in the loss (0: context only)."""
    old_logprobs: list[float]
    """The behaviour policy's log-probs, recorded at sampling time."""
    tree: int = 0
    """Index of its tree in the step's batch: the packed layout packs the sequences of one tree together."""
    nodes: list[int] = field(default_factory=list)
    """Node ids along the path, root first (empty: the sequence is one node of its own)."""
    node_starts: list[int] = field(default_factory=list)
    """Index in `token_ids` where each node of `nodes` begins (its path position)."""


@dataclass
class TokenBatch:
    """Right-padded tensors of a list of sequences; index t holds values for predicting token t+1."""

    input_ids: torch.Tensor  # (B, T) long
    attention_mask: torch.Tensor  # (B, T) long
    advantages: torch.Tensor  # (B, T-1) float
    weights: torch.Tensor  # (B, T-1) float
    old_logprobs: torch.Tensor  # (B, T-1) float


def tree_sequences(trees: Sequence[RolloutTree], advantages: Sequence[NodeAdvantages]) -> list[TrainSequence]:
    """One sequence per leaf that owns at least one trained token, in tree then leaf order."""
    if len(trees) != len(advantages):
        raise ValueError(f"got {len(trees)} trees but {len(advantages)} advantage sets")
    sequences = []
    for index, (tree, node_adv) in enumerate(zip(trees, advantages)):
        owned = np.zeros(len(tree.nodes), dtype=bool)
        for leaf in tree.leaves():
            path = tree.path(int(leaf))
            mine = {i for i in path if not owned[i]}
            owned[list(mine)] = True
            ids: list[int] = []
            adv: list[float] = []
            weight: list[float] = []
            old: list[float] = []
            starts: list[int] = []
            trained = False
            for i in path:
                node = tree.nodes[i]
                on = i in mine and node_adv.weight[i] > 0
                starts.append(len(ids))
                for token, mask, logprob in zip(node.token_ids, node.mask, node.logprobs):
                    ids.append(token)
                    take = on and mask == 1
                    adv.append(float(node_adv.advantage[i]) if take else 0.0)
                    weight.append(float(node_adv.weight[i]) if take else 0.0)
                    old.append(logprob if take else 0.0)
                    trained |= take
            if trained:
                sequences.append(TrainSequence(ids, adv, weight, old, tree=index, nodes=list(path), node_starts=starts))
    return sequences


def pad_right(rows: Sequence[Sequence[float]], length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, length) tensor of `rows` right-padded with 0 and cut at `length`, and its (B, length) long
    mask of real entries: the one padding routine of the RL update and the SFT warm start."""
    values = torch.zeros(len(rows), length, dtype=dtype)
    present = torch.zeros(len(rows), length, dtype=torch.long)
    for row, items in enumerate(rows):
        n = min(len(items), length)
        values[row, :n] = torch.tensor(list(items[:n]), dtype=dtype)
        present[row, :n] = 1
    return values, present


def pad_batch(sequences: Sequence[TrainSequence], *, max_len: int | None = None) -> TokenBatch:
    """Right-pad to the longest sequence (cut at `max_len`); per-token fields shift by one to align
    with next-token log-probs: position t of `advantages` belongs to token t+1."""
    if not sequences:
        raise ValueError("pad_batch needs at least one sequence")
    length = max(len(s.token_ids) for s in sequences)
    if max_len is not None:
        length = min(length, max_len)
    ids, attention = pad_right([s.token_ids for s in sequences], length, torch.long)
    adv, _ = pad_right([s.advantages for s in sequences], length, torch.float32)
    weight, _ = pad_right([s.weights for s in sequences], length, torch.float32)
    old, _ = pad_right([s.old_logprobs for s in sequences], length, torch.float32)
    weight[:, 0] = 0.0  # the first token has no context to be predicted from (it is always the prompt's)
    return TokenBatch(ids, attention, adv[:, 1:], weight[:, 1:], old[:, 1:])


def loss_denominator(sequences: Sequence[TrainSequence]) -> float:
    """Total weight of the sequences' trained tokens: the token mean's denominator. Token 0 never
    counts (nothing predicts it); tokens that are skipped (zero advantage) or cut by `max_len` do."""
    return float(sum(sum(s.weights[1:]) for s in sequences))


def in_loss(weights: torch.Tensor, advantages: torch.Tensor, *, zero_advantage: bool) -> torch.Tensor:
    """Mask of the tokens in the loss: weight > 0, and a nonzero advantage unless `zero_advantage`
    (with a KL term every trained token is in the loss; without, a zero-advantage token adds nothing)."""
    trained = weights > 0
    return trained if zero_advantage else trained & (advantages != 0)


# ---------------------------------------------------------------- the packed layout


@dataclass
class TreePack:
    """Some sequences of one tree as one packed stretch of tokens (see the module docstring).

    `nodes[k] = (start, end, parent)`: packed node k holds tokens `start:end` of this pack and is a
    child of packed node `parent` (-1: none); parents come first. `positions` are path positions.
    Target j is the token `targets[j]`, predicted from the logits at pack index `sources[j]`, with
    its sequence's advantage, weight and behaviour log-prob.
    """

    token_ids: list[int]
    positions: list[int]
    nodes: list[tuple[int, int, int]]
    sources: list[int]
    targets: list[int]
    advantages: list[float]
    weights: list[float]
    old_logprobs: list[float]

    @property
    def size(self) -> int:
        return len(self.token_ids)


@dataclass
class PackedBatch:
    """Packs side by side in one row: the input of `trace_rl.training.tree_attention.packed_token_logprobs`."""

    input_ids: torch.Tensor  # (1, N) long
    position_ids: torch.Tensor  # (1, N) long
    nodes: list[tuple[int, int, int]]
    """(start, end, parent) per packed node, in row coordinates; parent indexes this list (-1: none)."""
    sources: torch.Tensor  # (K,) long: row index whose logits predict target j
    targets: torch.Tensor  # (K,) long: token id of target j
    advantages: torch.Tensor  # (K,) float
    weights: torch.Tensor  # (K,) float
    old_logprobs: torch.Tensor  # (K,) float


def tree_groups(sequences: Sequence[TrainSequence]) -> list[list[TrainSequence]]:
    """The sequences of each tree, trees in order of first appearance (leaf order kept inside).
    A sequence without node ids is a group of its own."""
    groups: dict[object, list[TrainSequence]] = {}
    for index, seq in enumerate(sequences):
        key: object = seq.tree if seq.nodes else ("alone", index)
        groups.setdefault(key, []).append(seq)
    return list(groups.values())


def _path(seq: TrainSequence) -> tuple[list[int], list[int]]:
    """(node ids, start of each node and the end of the last) of a sequence."""
    if seq.nodes:
        if len(seq.node_starts) != len(seq.nodes):
            raise ValueError(f"a sequence has {len(seq.nodes)} nodes but {len(seq.node_starts)} node starts")
        return list(seq.nodes), [*seq.node_starts, len(seq.token_ids)]
    return [0], [0, len(seq.token_ids)]


def _targets(seq: TrainSequence, *, max_len: int | None, zero_advantage: bool) -> list[int]:
    """Path positions this sequence trains, exactly those of `pad_batch` + the in-loss rule."""
    end = len(seq.token_ids) if max_len is None else min(len(seq.token_ids), max_len)
    return [
        p
        for p in range(1, end)
        if seq.weights[p] > 0 and (zero_advantage or seq.advantages[p] != 0.0)
    ]


def pack_tree(
    sequences: Sequence[TrainSequence],
    *,
    max_len: int | None = None,
    zero_advantage: bool = False,
    max_tokens: int | None = None,
) -> list[TreePack]:
    """The sequences of one tree (`tree_groups`) as packs of at most `max_tokens` tokens each.

    A token is a target when `pad_batch` would give it a weight (position 1 to `max_len` - 1, weight
    > 0) and it is in the loss (`in_loss`); a sequence without targets adds nothing. Each sequence
    needs the tokens of its path before its last target; a node holds the tokens any of the pack's
    sequences need. Sequences go into one pack in order while it stays within `max_tokens` (a single
    sequence always fits); a tree that does not fit is split between sequences, and a node two packs
    share is context in both (its targets are those of its own sequences, so nothing is trained twice).
    """
    items = []
    for seq in sequences:
        targets = _targets(seq, max_len=max_len, zero_advantage=zero_advantage)
        if targets:
            items.append((seq, *_path(seq), targets))
    pieces: list[list[tuple]] = []
    held: dict[int, int] = {}  # node id → end (path position) of the tokens the current pack holds
    size = 0
    for item in items:
        spans = _needed(item)
        extra = sum(max(0, end - max(held.get(node, begin), begin)) for node, (begin, end) in spans.items())
        if pieces and max_tokens is not None and size + extra > max_tokens:
            pieces.append([])
            held, size = {}, 0
            extra = sum(end - begin for begin, end in spans.values())
        if not pieces:
            pieces.append([])
        pieces[-1].append(item)
        for node, (_, end) in spans.items():
            held[node] = max(held.get(node, end), end)
        size += extra
    return [_build_pack(piece) for piece in pieces]


def _needed(item: tuple) -> dict[int, tuple[int, int]]:
    """Node id → (begin, end) path positions of the tokens a sequence needs: those before its last
    target (the last target is predicted from the token before it), so trailing tokens are left out."""
    _, nodes, bounds, targets = item
    need = targets[-1]
    spans = {}
    for k, node in enumerate(nodes):
        if bounds[k] >= need:
            break
        spans[node] = (bounds[k], min(bounds[k + 1], need))
    return spans


def _build_pack(items: list[tuple]) -> TreePack:
    held: dict[int, tuple[int, int]] = {}  # node id → (begin, end) path positions held
    parent_of: dict[int, int] = {}
    tokens_of: dict[int, list[int]] = {}
    for item in items:
        seq, nodes, _, _ = item
        for k, (node, (begin, end)) in enumerate(_needed(item).items()):
            if node in held:
                held[node] = (begin, max(end, held[node][1]))
            else:
                held[node] = (begin, end)
                parent_of[node] = nodes[k - 1] if k else -1
                tokens_of[node] = seq.token_ids  # every path through a node holds the same tokens there
    order = sorted(held)  # id order: a parent's id is smaller than its children's
    index = {node: k for k, node in enumerate(order)}
    offset: dict[int, int] = {}
    token_ids: list[int] = []
    positions: list[int] = []
    packed_nodes: list[tuple[int, int, int]] = []
    for node in order:
        begin, end = held[node]
        offset[node] = len(token_ids)
        token_ids.extend(tokens_of[node][begin:end])
        positions.extend(range(begin, end))
        parent = parent_of[node]
        packed_nodes.append((offset[node], len(token_ids), index[parent] if parent >= 0 else -1))
    sources: list[int] = []
    targets_out: list[int] = []
    advantages: list[float] = []
    weights: list[float] = []
    old: list[float] = []
    for seq, nodes, bounds, targets in items:
        for p in targets:
            node = nodes[bisect.bisect_right(bounds, p - 1) - 1]  # the path node holding position p - 1
            sources.append(offset[node] + p - 1 - held[node][0])
            targets_out.append(seq.token_ids[p])
            advantages.append(seq.advantages[p])
            weights.append(seq.weights[p])
            old.append(seq.old_logprobs[p])
    return TreePack(token_ids, positions, packed_nodes, sources, targets_out, advantages, weights, old)


def pack_batch(packs: Sequence[TreePack]) -> PackedBatch:
    """Packs side by side in one row; node parents and target sources shift to row coordinates."""
    if not packs:
        raise ValueError("pack_batch needs at least one pack")
    ids: list[int] = []
    positions: list[int] = []
    nodes: list[tuple[int, int, int]] = []
    sources: list[int] = []
    for pack in packs:
        shift, base = len(ids), len(nodes)
        ids.extend(pack.token_ids)
        positions.extend(pack.positions)
        nodes.extend((start + shift, end + shift, parent + base if parent >= 0 else -1) for start, end, parent in pack.nodes)
        sources.extend(s + shift for s in pack.sources)

    def floats(name: str) -> torch.Tensor:
        return torch.tensor([v for pack in packs for v in getattr(pack, name)], dtype=torch.float32)

    return PackedBatch(
        input_ids=torch.tensor([ids], dtype=torch.long),
        position_ids=torch.tensor([positions], dtype=torch.long),
        nodes=nodes,
        sources=torch.tensor(sources, dtype=torch.long),
        targets=torch.tensor([t for pack in packs for t in pack.targets], dtype=torch.long),
        advantages=floats("advantages"),
        weights=floats("weights"),
        old_logprobs=floats("old_logprobs"),
    )


def micro_batches(packs: Sequence[TreePack], max_tokens: int) -> list[list[TreePack]]:
    """Consecutive packs grouped while a group holds at most `max_tokens` tokens (a pack never splits)."""
    groups: list[list[TreePack]] = []
    size = 0
    for pack in packs:
        if groups and size + pack.size <= max_tokens:
            groups[-1].append(pack)
            size += pack.size
        else:
            groups.append([pack])
            size = pack.size
    return groups
