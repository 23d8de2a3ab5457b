"""Trees and their node advantages → padded training sequences with per-token coefficients.

Every node's tokens must be trained in the context of its own path, but only once: each node is
"owned" by the first leaf (in id order) whose root-to-leaf path contains it, and only the owner's
sequence puts that node's policy tokens in the loss. A node's tokens carry its advantage `A` and
are counted `weight` times (see `trace_rl.advantage.NodeAdvantages`), so GRPO over leaves (weight =
leaves below) and TRACE (weight 1, shared prefixes once) use one code path.

Worked example: a root with one prefix node P (2 policy tokens) branching into leaves L1 and L2.
Sequences: [root, P, L1] and [root, P, L2]. P is owned by L1: its tokens sit in the first sequence
with coefficient A(P) and count weight(P); in the second sequence P is context only (mask 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from trace_rl.advantage import NodeAdvantages
from trace_rl.tree import RolloutTree


@dataclass
class TrainSequence:
    """One root-to-leaf path: its tokens and, per token, what the loss needs (0 where not trained)."""

    token_ids: list[int]
    advantages: list[float]
    weights: list[float]
    """How many times each token counts in the loss (0: context only)."""
    old_logprobs: list[float]
    """The behaviour policy's log-probs, recorded at sampling time."""


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
    for tree, node_adv in zip(trees, advantages):
        owned = np.zeros(len(tree.nodes), dtype=bool)
        for leaf in tree.leaves():
            path = tree.path(int(leaf))
            mine = {i for i in path if not owned[i]}
            owned[list(mine)] = True
            ids: list[int] = []
            adv: list[float] = []
            weight: list[float] = []
            old: list[float] = []
            trained = False
            for i in path:
                node = tree.nodes[i]
                on = i in mine and node_adv.weight[i] > 0
                for token, mask, logprob in zip(node.token_ids, node.mask, node.logprobs):
                    ids.append(token)
                    take = on and mask == 1
                    adv.append(float(node_adv.advantage[i]) if take else 0.0)
                    weight.append(float(node_adv.weight[i]) if take else 0.0)
                    old.append(logprob if take else 0.0)
                    trained |= take
            if trained:
                sequences.append(TrainSequence(ids, adv, weight, old))
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
