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


def agreeing_budget(trees: Sequence[RolloutTree]) -> tuple[float, float, int]:
    """Where the budget that cannot teach went: the share of all leaves in prompts whose leaves all
    failed (reward 0), the share in prompts whose leaves all got one positive reward (all succeeded;
    the two and `mixed_budget_share` sum to 1), and the most leaves any prompt got without mixing. An allocator that keeps betting on a prompt it
    cannot rescue shows here as a prompt that is 0 for 12; uniform sampling's largest is its group size.
    """
    failed = solved = most = total = 0
    for tree in trees:
        rewards = tree.leaf_rewards()
        total += rewards.size
        if rewards.size and rewards.max() == rewards.min():  # not mixed (`RolloutTree.is_mixed`)
            most = max(most, int(rewards.size))
            if rewards.max() > 0:
                solved += int(rewards.size)
            else:
                failed += int(rewards.size)
    return (failed / total, solved / total, most) if total else (0.0, 0.0, 0)


def generated_tokens(tree: RolloutTree) -> int:
    """Tokens the policy wrote in a tree (every turn's mask ones; the root holds the prompt)."""
    return sum(sum(node.mask) for node in tree.nodes[1:])


def tree_metrics(trees: Sequence[RolloutTree]) -> dict[str, float]:
    """The `tree/*` metrics of one batch. The `_per_ktoken` figures divide by the policy tokens the
    batch generated, what a step pays for on a GPU (`rollout.budget_unit: tokens` spends those)."""
    leaves = np.array([t.leaves().size for t in trees], dtype=np.float64)
    sampled = leaves > 0
    branch_depths = [t.nodes[a].depth for t in trees for a in t.anchors() if a != 0]
    mixed = np.array([t.is_mixed() for t in trees], dtype=bool)
    kilotokens = sum(generated_tokens(t) for t in trees) / 1000.0
    failed, solved, most_unmixed = agreeing_budget(trees)
    return {
        "tree/effective_ratio": effective_ratio(trees),
        "tree/effective_per_candidate": float(mixed.mean()) if len(trees) else 0.0,
        "tree/mixed_budget_share": mixed_budget_share(trees),
        "tree/failed_budget_share": failed,
        "tree/solved_budget_share": solved,
        "tree/most_leaves_unmixed": float(most_unmixed),
        "tree/anchor_mixed_ratio": anchor_mixed_ratio(trees),
        "tree/leaves_per_prompt": float(leaves[sampled].mean()) if sampled.any() else 0.0,
        "tree/prompts_sampled": float(sampled.sum()),
        "tree/leaves": float(leaves.sum()),
        "tree/branch_depth/mean": float(np.mean(branch_depths)) if branch_depths else 0.0,
        "tree/branch_points": float(len(branch_depths)),
        "tree/tokens_generated": 1000.0 * kilotokens,
        "tree/mixed_leaves_per_ktoken": float(leaves[mixed].sum() / kilotokens) if kilotokens else 0.0,
        "tree/mixed_prompts_per_ktoken": float(mixed.sum() / kilotokens) if kilotokens else 0.0,
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
        **tool_metrics(trees),
    }


UNAVAILABLE = ("unavailable", "timeout")
"""Tool error kinds on the tool's side (a server down, refusing or too slow), not the model's call."""


def tool_metrics(trees: Sequence[RolloutTree]) -> dict[str, float]:
    """Over every tool call the batch made (each turn whose call ran a tool, once however many rollouts
    share it): `tool/calls`, `tool/error_rate` (any failure, a model's bad arguments included) and
    `tool/unavailable_rate` (the tool's side: `UNAVAILABLE`). A server that dies mid-run shows as
    `tool/unavailable_rate` jumping to 1. Empty when no tool ran."""
    calls = errors = unavailable = 0
    for tree in trees:
        for node in tree.nodes:
            info = node.info or {}
            if info.get("call") is None or info.get("answer") is not None or info.get("truncated"):
                continue  # a malformed turn, an answer, or a last turn whose tool never ran
            kind = info.get("tool_error")
            calls += 1
            errors += kind is not None
            unavailable += kind in UNAVAILABLE
    if not calls:
        return {}
    return {"tool/calls": float(calls), "tool/error_rate": errors / calls, "tool/unavailable_rate": unavailable / calls}


def scored_estimates(trees: Sequence[RolloutTree], *, census: bool = False) -> list[tuple[int, int, float]]:
    """(tree index, node id, outcome) triples: which estimate is judged against which 0/1 outcome.

    - `census=False`, the allocator's bets: every rollout against the node it started at (a root for
      a bare rollout, a prefix for a continuation). The estimate was made before the rollout started;
      but Stage 2 starts continuations where it rates failed rollouts' prefixes highest, so these
      pairs over-sample the prefixes the predictor is most optimistic about.
    - `census=True`, the outcomes the predictor is about to learn from (its natural backup targets,
      DESIGN.md): every node with an estimate against each rollout through it that started at it or
      above (the bare rollout through a prefix included: the estimate never saw its outcome). No
      choice of the allocator picks which estimates are judged.

    Nodes without an estimate (`predicted` None) are left out.
    """
    scored = []
    for index, tree in enumerate(trees):
        for leaf in tree.leaves():
            node = tree.nodes[int(leaf)]
            if census:
                path = tree.path(int(leaf))
                judged = path[path.index(node.rollout_start) : -1]
            else:
                judged = [node.rollout_start]
            scored += [(index, n, float(node.reward)) for n in judged if tree.nodes[n].predicted is not None]
    return scored


def allocator_outcomes(
    trees: Sequence[RolloutTree], *, census: bool = False, with_trees: bool = False
) -> tuple[np.ndarray, ...]:
    """(estimate, outcome) arrays of `scored_estimates`, and with `with_trees` the tree index of each."""
    scored = scored_estimates(trees, census=census)
    predicted = [trees[index].nodes[node].predicted for index, node, _ in scored]
    arrays = np.array(predicted, dtype=np.float64), np.array([y for *_, y in scored], dtype=np.float64)
    return (*arrays, np.array([index for index, *_ in scored], dtype=np.int64)) if with_trees else arrays


def brier_standard_error(p: np.ndarray, y: np.ndarray, clusters: np.ndarray) -> float | None:
    """Standard error of a Brier score (the mean of (p - y)²) over pairs that come in `clusters`
    (one per prompt: its rollouts share the prompt and their prefixes, so they are not independent);
    None with fewer than two clusters. The cluster-robust variance of a mean, with the G / (G - 1)
    small-sample factor: a step's Brier is a mean over ~64 rollouts of ~30 prompts, and whether one
    above 0.25 is a broken predictor or a noisy step is read against this."""
    groups, index = np.unique(clusters, return_inverse=True)
    if groups.size < 2:
        return None
    errors = (np.asarray(p, dtype=np.float64) - np.asarray(y, dtype=np.float64)) ** 2
    residual_sums = np.bincount(index, weights=errors - errors.mean(), minlength=groups.size)
    variance = groups.size / (groups.size - 1) * np.sum(residual_sums**2) / errors.size**2
    return float(np.sqrt(variance))


def predictor_metrics(trees: Sequence[RolloutTree]) -> dict[str, float]:
    """`predictor/brier` (with its standard error over prompts, `predictor/brier_se`) and
    `predictor/ece` of the allocator's estimates against the outcomes of the rollouts started where
    they were made, and `predictor/brier_census` over every estimate against
    the outcomes it is about to learn from (`scored_estimates`); {} when no rollout had an estimate.

    A constant 0.5 scores a Brier of 0.25: a predictor above that is worse than no predictor.
    """
    p, y, tree_of = allocator_outcomes(trees, with_trees=True)
    if not p.size:
        return {}
    census_p, census_y = allocator_outcomes(trees, census=True)
    se = brier_standard_error(p, y, tree_of)
    return {
        "predictor/brier": brier_score(p, y),
        **({"predictor/brier_se": se} if se is not None else {}),
        "predictor/ece": expected_calibration_error(p, y),
        "predictor/rollouts_scored": float(p.size),
        "predictor/brier_census": brier_score(census_p, census_y),
        "predictor/census_pairs": float(census_p.size),
    }
