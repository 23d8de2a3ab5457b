"""Every figure computed over a batch of rollout trees, under the one name the trainer, the
benchmark and the report all use.

- `tree/*` (`tree_metrics`): where the budget went and how much of it can teach (DESIGN §2 Metrics).
- verl-style rollout figures (`rollout_metrics`): `critic/score/mean`, `response_length/mean`,
  `num_turns/mean`.
- `predictor/*` (`predictor_metrics`): how well the estimates the allocator acted on matched what the
  rollouts it then started showed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from trace_rl.predictor.base import brier_score, expected_calibration_error
from trace_rl.tree import RolloutTree, subtree_rewards

FIGURES = ("effective_ratio", "effective_per_candidate", "mixed_budget_share", "anchor_mixed_ratio")
"""The `tree/*` figures tables lead with, reported together because each alone can flatter: filtering
prompts raises effective_ratio while effective_per_candidate falls; mixed_budget_share says where the
budget went."""


def effective_ratio(trees: Sequence[RolloutTree]) -> float:
    """Share of prompts that got rollouts whose leaves are mixed (Knapsack-RL's effective prompt ratio)."""
    sampled = [t for t in trees if t.leaves().size]
    return float(np.mean([t.is_mixed() for t in sampled])) if sampled else 0.0


def anchor_mixed_ratio(trees: Sequence[RolloutTree]) -> float:
    """Share of anchors (nodes with ≥2 children, roots included) whose descendant leaves are mixed."""
    mixed, total = 0, 0
    for tree in trees:
        anchors = tree.anchors()
        if anchors.size:
            mixed += int(subtree_rewards(tree).mixed[anchors].sum())
            total += anchors.size
    return mixed / total if total else 0.0


def mixed_budget_share(trees: Sequence[RolloutTree]) -> float:
    """Share of all leaves (the budget) that belong to a prompt whose leaves are mixed.

    A mixed anchor lies inside a mixed prompt, so this is also the share of rollouts that sit in a
    mixed group or anchor: the part of the budget that can yield a non-zero GRPO-style gradient
    (Knapsack-RL's effective gradient ratio).
    """
    leaves = np.array([t.leaves().size for t in trees], dtype=np.int64)
    mixed = np.array([t.is_mixed() for t in trees], dtype=bool)
    total = int(leaves.sum())
    return float(leaves[mixed].sum() / total) if total else 0.0


def tree_metrics(trees: Sequence[RolloutTree]) -> dict[str, float]:
    """The `tree/*` metrics of one batch."""
    leaves = np.array([t.leaves().size for t in trees], dtype=np.float64)
    sampled = leaves > 0
    branch_depths = [t.nodes[a].depth for t in trees for a in t.anchors() if a != 0]
    mixed = np.array([t.is_mixed() for t in trees], dtype=bool)
    return {
        "tree/effective_ratio": effective_ratio(trees),
        "tree/effective_per_candidate": float(mixed.mean()) if len(trees) else 0.0,
        "tree/mixed_budget_share": mixed_budget_share(trees),
        "tree/anchor_mixed_ratio": anchor_mixed_ratio(trees),
        "tree/leaves_per_prompt": float(leaves[sampled].mean()) if sampled.any() else 0.0,
        "tree/prompts_sampled": float(sampled.sum()),
        "tree/leaves": float(leaves.sum()),
        "tree/branch_depth/mean": float(np.mean(branch_depths)) if branch_depths else 0.0,
        "tree/branch_points": float(len(branch_depths)),
    }


def rollout_metrics(trees: Sequence[RolloutTree]) -> dict[str, float]:
    """verl-style figures over every rollout (root-to-leaf path) of the batch."""
    rewards, lengths, turns = [], [], []
    for tree in trees:
        for leaf in tree.leaves():
            path = tree.path(int(leaf))
            rewards.append(tree.nodes[int(leaf)].reward)
            lengths.append(sum(sum(tree.nodes[i].mask) for i in path))
            turns.append(tree.nodes[int(leaf)].depth)
    if not rewards:
        return {}
    return {
        "critic/score/mean": float(np.mean(rewards)),
        "response_length/mean": float(np.mean(lengths)),
        "num_turns/mean": float(np.mean(turns)),
    }


def allocator_outcomes(trees: Sequence[RolloutTree]) -> tuple[np.ndarray, np.ndarray]:
    """(estimate, outcome) pairs: for every rollout, the estimate `predicted` of the node it started
    at (a root for a bare rollout, a prefix for a continuation) and its 0/1 outcome.

    Only these pairs are fair draws for judging the estimates the allocator acted on: the estimate
    was made before the rollout started, while the bare rollout through an expanded prefix is why
    that prefix was chosen. Rollouts from nodes without an estimate are left out.
    """
    predicted, outcomes = [], []
    for tree in trees:
        for leaf in tree.leaves():
            start = tree.nodes[tree.nodes[int(leaf)].rollout_start]
            if start.predicted is not None:
                predicted.append(start.predicted)
                outcomes.append(tree.nodes[int(leaf)].reward)
    return np.array(predicted, dtype=np.float64), np.array(outcomes, dtype=np.float64)


def predictor_metrics(trees: Sequence[RolloutTree]) -> dict[str, float]:
    """`predictor/brier` and `predictor/ece` of the allocator's estimates against the outcomes of the
    rollouts started where they were made (`allocator_outcomes`); {} when no rollout had an estimate.

    A constant 0.5 scores a Brier of 0.25: a predictor above that is worse than no predictor.
    """
    p, y = allocator_outcomes(trees)
    if not p.size:
        return {}
    return {
        "predictor/brier": brier_score(p, y),
        "predictor/ece": expected_calibration_error(p, y),
        "predictor/rollouts_scored": float(p.size),
    }
