"""Tree-aware advantage estimators: a batch of rollout trees in, per-node (so per-token) advantages out.

Every estimator in `ESTIMATORS` has the signature

    estimator(trees: Sequence[RolloutTree], *, <keyword-only options with defaults>) -> list[NodeAdvantages]

and returns one `NodeAdvantages` per tree, in order. The trainer trains node by node, each node's tokens
conditioned on its path: every token of node i with mask 1 gets the coefficient `advantage[i]` and
counts `weight[i]` times in the loss. Mask-0 tokens (prompt, observations) never enter the loss;
`token_advantages` and `token_weights` zero them. An unknown option is a `TypeError` from Python's
own keyword check; a bad option value or a non-finite reward is a `ValueError` naming it.

Notation, per tree (one prompt). For a node s: L(s) the rewards of the finished leaves below s
(s included), n(s) = |L(s)|, V(s) = mean L(s) (`RolloutTree.backup`, the design's tree backup),
σ(s) = std L(s) with ddof=1; p(s) the parent of s; top(s) the root's child above s (s itself at
depth 1). A node is *mixed* when L(s) holds two different rewards, which needs n(s) ≥ 2.
Contrasting a value difference d at node a means

    C_a(d) = d / (σ(a) + eps)    if a is mixed and scale_rewards
           = d                   if a is mixed and not scale_rewards
           = 0                   if a is not mixed (all its leaves agree, or it has fewer than two)

Choices shared by all estimators:
- std uses ddof=1 (unbiased), as TRL's and verl's GRPO do (`torch.std`), so `grpo` here reproduces
  the numbers of the trainers our users already run. `eps` defaults to verl's 1e-6.
- A group with one leaf or all-equal leaves contributes exactly 0: it holds no contrast. (verl scores a
  lone sample r - 0 / 1; we do not, and we never divide a zero spread by eps.)
- `scale_rewards=False` drops the division by σ (Dr. GRPO); the name and meaning follow TRL.
- The root (prompt tokens only) and nodes with no finished leaf below (n = 0: a truncated or failed
  rollout, NaN in the backup) always get advantage 0 and weight 0, never NaN.
- Weights depend only on the tree's shape, never on rewards: an all-equal tree keeps its weights
  (its tokens still count in a token-mean loss's denominator) with zero advantages.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from trace_rl.core.tree import RolloutTree, subtree_rewards

_NONZERO_ATOL = 1e-12  # advantages are O(1); anything this small is round-off, not signal


@dataclass(frozen=True)
class NodeAdvantages:
    """One tree's advantages. Index i is node i.

    Every mask-1 token of node i is trained with coefficient `advantage[i]` and counted `weight[i]`
    times in the loss; under sum aggregation node i's tokens contribute `weight[i] * advantage[i]`.
    """

    advantage: np.ndarray  # (num_nodes,) float64
    weight: np.ndarray  # (num_nodes,) float64, >= 0

    def __post_init__(self) -> None:
        advantage = np.asarray(self.advantage, dtype=np.float64)
        weight = np.asarray(self.weight, dtype=np.float64)
        if advantage.ndim != 1 or advantage.shape != weight.shape:
            raise ValueError(
                f"advantage and weight must be 1-D arrays of one length, got shapes {advantage.shape} and {weight.shape}"
            )
        if not (np.isfinite(advantage).all() and np.isfinite(weight).all()):
            raise ValueError("advantage and weight must be finite")
        if (weight < 0).any():
            raise ValueError(f"weight must be >= 0, got minimum {weight.min()!r}")
        object.__setattr__(self, "advantage", advantage)
        object.__setattr__(self, "weight", weight)


# An estimator takes the batch's trees plus keyword-only options; `Callable[...]` because each
# estimator has its own options (a Protocol with **options would reject them under a type checker).
AdvantageFn = Callable[..., list[NodeAdvantages]]


# ---------------------------------------------------------------- per-tree statistics


@dataclass(frozen=True)
class _TreeStats:
    values: np.ndarray  # (N,) V(s); 0.0 (not NaN) where n(s) = 0
    counts: np.ndarray  # (N,) n(s), int64
    spread: np.ndarray  # (N,) σ(s) with ddof=1; 0.0 where n(s) < 2
    mixed: np.ndarray  # (N,) bool: L(s) holds two different rewards
    parents: np.ndarray  # (N,) p(s); -1 for the root


def _tree_stats(tree: RolloutTree) -> _TreeStats:
    for node in tree.nodes:
        if node.is_terminal and not np.isfinite(node.reward):
            raise ValueError(f"tree {tree.task_id!r}: node {node.id} has reward {node.reward!r}; rewards must be finite")
    leaves = subtree_rewards(tree)  # L(s) of every node, one reverse sweep
    n = leaves.counts.astype(np.float64)
    mixed = leaves.mixed & (leaves.counts >= 2)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(n > 0, leaves.sums / np.maximum(n, 1.0), 0.0)
        variance = (leaves.squares - n * mean * mean) / np.maximum(n - 1.0, 1.0)  # ddof=1
    spread = np.where(mixed, np.sqrt(np.maximum(variance, 0.0)), 0.0)
    return _TreeStats(values=mean, counts=leaves.counts, spread=spread, mixed=mixed, parents=tree.parents())


def _contrast(diff: np.ndarray, at: np.ndarray, stats: _TreeStats, *, eps: float, scale_rewards: bool) -> np.ndarray:
    """C_at(diff), elementwise: 0 where node `at` is not mixed."""
    scale = stats.spread[at] + eps if scale_rewards else np.ones_like(diff)
    return np.where(stats.mixed[at], diff / np.where(stats.mixed[at], scale, 1.0), 0.0)


def _per_sequence(stats: _TreeStats, leaf_advantage: np.ndarray) -> NodeAdvantages:
    """Spread per-leaf (per root-to-leaf sequence) advantages onto the nodes those sequences share.

    Node s gets weight n(s) and advantage mean of its leaves' advantages, so weight * advantage is the
    sum of the coefficients that training each sequence separately would give s's tokens.
    """
    sums = leaf_advantage.astype(np.float64)  # nonzero on leaves only
    for node in range(len(sums) - 1, 0, -1):
        sums[stats.parents[node]] += sums[node]
    counts = stats.counts.astype(np.float64)
    advantage = np.where(counts > 0, sums / np.maximum(counts, 1.0), 0.0)
    advantage[0], counts[0] = 0.0, 0.0  # the root holds the prompt only
    return NodeAdvantages(advantage=advantage, weight=counts)


def _per_node(stats: _TreeStats, advantage: np.ndarray, weight: np.ndarray) -> NodeAdvantages:
    """Zero the root and the nodes with no finished leaf below."""
    keep = stats.counts > 0
    keep[0] = False
    return NodeAdvantages(advantage=np.where(keep, advantage, 0.0), weight=np.where(keep, weight, 0.0))


def _check_eps(eps: float) -> None:
    if not (np.isfinite(eps) and eps >= 0):
        raise ValueError(f"advantage option eps must be finite and >= 0, got {eps!r}")


def _check_coef(name: str, value: float) -> None:
    if not np.isfinite(value):
        raise ValueError(f"advantage option {name} must be finite, got {value!r}")


# ---------------------------------------------------------------- estimators


def grpo_leaves(trees: Sequence[RolloutTree], *, eps: float = 1e-6, scale_rewards: bool = True) -> list[NodeAdvantages]:
    """Flat GRPO over each prompt's leaves, every root-to-leaf path trained as its own sequence.

    Leaf l: A(l) = C_root(r_l − V(root)) = (r_l − mean) / (std + eps), the prompt's leaves as the group.
    Node s: advantage = mean of A over L(s) = C_root(V(s) − V(root)) (C is linear), weight = n(s).

    Equivalence: weight(s) · advantage(s) = Σ_{l below s} A(l), which is exactly the coefficient that
    training every root-to-leaf sequence separately gives s's tokens under sum aggregation (s's tokens
    occur once in each of those n(s) sequences). So this is per-sequence GRPO without materialising
    the sequences. On a tree of bare rollouts only (no branching below the root) it is textbook GRPO.
    """
    _check_eps(eps)
    results = []
    for tree in trees:
        stats = _tree_stats(tree)
        leaves = tree.leaves()
        leaf_advantage = np.zeros(len(tree.nodes))
        leaf_advantage[leaves] = _contrast(
            stats.values[leaves] - stats.values[0], np.zeros_like(leaves), stats, eps=eps, scale_rewards=scale_rewards
        )
        results.append(_per_sequence(stats, leaf_advantage))
    return results


def trace_contrast(
    trees: Sequence[RolloutTree],
    *,
    root_coef: float = 1.0,
    prefix_coef: float = 1.0,
    eps: float = 1e-6,
    scale_rewards: bool = True,
) -> list[NodeAdvantages]:
    """TRACE (default): root-level plus prefix-level contrast, every node's tokens trained once.

    For a node s ≠ root with n(s) > 0 and parent p:

        A(s) = root_coef · C_root(V(s) − V(root)) + prefix_coef · [p ≠ root] · C_p(V(s) − V(p))
        weight(s) = 1

    Root-level term: s against the prompt's whole group. It equals `grpo`'s node advantage (the mean
    of the per-sequence GRPO advantages of s's leaves), but a shared prefix is counted once instead
    of n(s) times, so heavily expanded prefixes do not dominate the gradient.

    Prefix-level term: the turn taken at a branching anchor p against its siblings, normalised by the
    spread of p's own leaves. It vanishes by itself where there is nothing to contrast: when s is the
    only child of p with finished leaves, L(s) = L(p) and V(s) = V(p); when p is not mixed, C_p is 0.
    So in effect p is an anchor (two or more children with leaves) with mixed descendants, and only
    the turn right after it gets the term; deeper nodes of that branch carry their root-level term,
    plus their own prefix term where they branch again.

    Why not at the root: for p = root the prefix term would repeat the root-level term, doubling the
    credit of first turns only (for bare chains, first turn 2·A, later turns A). Leaving it out makes
    TRACE equal GRPO exactly on trees without Stage-2 expansions, and makes the prefix term the part
    that Stage 2 adds.
    """
    _check_eps(eps)
    _check_coef("root_coef", root_coef)
    _check_coef("prefix_coef", prefix_coef)
    results = []
    for tree in trees:
        stats = _tree_stats(tree)
        size = len(tree.nodes)
        values, parents = stats.values, stats.parents
        root_term = _contrast(values - values[0], np.zeros(size, dtype=np.int64), stats, eps=eps, scale_rewards=scale_rewards)
        prefix_term = np.zeros(size)
        below = np.arange(1, size)
        anchors = parents[below]
        prefix_term[below] = np.where(
            anchors > 0,
            _contrast(values[below] - values[anchors], anchors, stats, eps=eps, scale_rewards=scale_rewards),
            0.0,
        )
        advantage = root_coef * root_term + prefix_coef * prefix_term
        results.append(_per_node(stats, advantage, np.ones(size)))
    return results


def treerl(trees: Sequence[RolloutTree], *, normalize_by_sqrt_leaves: bool = True) -> list[NodeAdvantages]:
    """TreeRL (Hou et al. 2025): global plus local advantage on raw values, every path its own sequence.

    For a node s ≠ root with n(s) > 0 and parent p:

        A(s) = [(V(s) − V(root)) + (V(s) − V(p))] / sqrt(n(s))    (divisor 1 without the option)
        weight(s) = n(s)

    As in TreeRL, each root-to-leaf path is one training sequence, so s counts n(s) times; the
    sqrt(n(s)) divisor is TreeRL's guard against early shared steps dominating (their total
    coefficient grows as sqrt(n(s)) instead of n(s)). Values are not divided by a std. Unlike
    `trace`, the local term also applies below the root, so first turns get both terms.
    """
    results = []
    for tree in trees:
        stats = _tree_stats(tree)
        size = len(tree.nodes)
        values, parents = stats.values, stats.parents
        global_term = np.where(stats.mixed[0], values - values[0], 0.0)
        local_term = np.zeros(size)
        below = np.arange(1, size)
        local_term[below] = np.where(stats.mixed[parents[below]], values[below] - values[parents[below]], 0.0)
        counts = stats.counts.astype(np.float64)
        advantage = global_term + local_term
        if normalize_by_sqrt_leaves:
            advantage = advantage / np.sqrt(np.maximum(counts, 1.0))
        results.append(_per_node(stats, advantage, counts))
    return results


def tree_grpo(trees: Sequence[RolloutTree], *, eps: float = 1e-6, scale_rewards: bool = True) -> list[NodeAdvantages]:
    """Tree-GRPO (Ji et al. 2025): intra-tree plus inter-tree GRPO advantages of each leaf.

    Tree-GRPO grows several trees per prompt; here the subtree under each child of the root (one bare
    rollout and the continuations branched from it) plays the part of one tree. For a leaf l:

        A(l) = C_top(l)(r_l − V(top(l))) + C_root(r_l − V(root))     (intra-tree + inter-tree)

    A subtree with a single leaf has intra-tree term 0. Paths are trained per sequence as in `grpo`:
    node s gets weight n(s) and the mean of its leaves' A, which is
    C_top(s)(V(s) − V(top(s))) + C_root(V(s) − V(root)).
    """
    _check_eps(eps)
    results = []
    for tree in trees:
        stats = _tree_stats(tree)
        top = np.zeros(len(tree.nodes), dtype=np.int64)
        for node in tree.nodes[1:]:  # parents come first, so top[parent] is already set
            top[node.id] = node.id if node.parent == 0 else top[node.parent]
        leaves = tree.leaves()
        rewards = stats.values[leaves]
        leaf_advantage = np.zeros(len(tree.nodes))
        leaf_advantage[leaves] = _contrast(
            rewards - stats.values[top[leaves]], top[leaves], stats, eps=eps, scale_rewards=scale_rewards
        ) + _contrast(rewards - stats.values[0], np.zeros_like(leaves), stats, eps=eps, scale_rewards=scale_rewards)
        results.append(_per_sequence(stats, leaf_advantage))
    return results


ESTIMATORS: dict[str, AdvantageFn] = {
    "grpo": grpo_leaves,
    "trace": trace_contrast,
    "treerl": treerl,
    "tree_grpo": tree_grpo,
}
DEFAULT_ESTIMATOR = "trace"


def get_estimator(name: str) -> AdvantageFn:
    if name not in ESTIMATORS:
        close = difflib.get_close_matches(name, ESTIMATORS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown advantage.name {name!r}{hint} (known: {sorted(ESTIMATORS)})")
    return ESTIMATORS[name]


# ---------------------------------------------------------------- per-token views and metrics


def _check_aligned(tree: RolloutTree, node_adv: NodeAdvantages) -> None:
    if node_adv.advantage.shape != (len(tree.nodes),):
        raise ValueError(
            f"tree {tree.task_id!r} has {len(tree.nodes)} nodes but its advantages have shape {node_adv.advantage.shape}"
        )


def token_advantages(tree: RolloutTree, node_adv: NodeAdvantages) -> list[np.ndarray]:
    """One float64 array per node, aligned with `node.token_ids`: advantage[i] where mask is 1, else 0.

    Example: a node with token_ids [7, 8, 9], mask [1, 1, 0] and advantage 0.5 gives [0.5, 0.5, 0.0].
    """
    _check_aligned(tree, node_adv)
    return [node_adv.advantage[node.id] * np.asarray(node.mask, dtype=np.float64) for node in tree.nodes]


def token_weights(tree: RolloutTree, node_adv: NodeAdvantages) -> list[np.ndarray]:
    """One float64 array per node, aligned with `node.token_ids`: weight[i] where mask is 1, else 0."""
    _check_aligned(tree, node_adv)
    return [node_adv.weight[node.id] * np.asarray(node.mask, dtype=np.float64) for node in tree.nodes]


def advantage_metrics(trees: Sequence[RolloutTree], advantages: Sequence[NodeAdvantages]) -> dict[str, float]:
    """`tree/nonzero_adv_token_share`: share of trained policy tokens whose advantage is not zero.

    A token is counted as often as it enters the loss (its node's weight), so for `grpo` this is the
    usual share over the batch's sequences, and for `trace` the share over distinct tokens. 0.0 when
    nothing is trained.
    """
    if len(trees) != len(advantages):
        raise ValueError(f"got {len(trees)} trees but {len(advantages)} advantage sets")
    trained, nonzero = 0.0, 0.0
    for tree, node_adv in zip(trees, advantages):
        _check_aligned(tree, node_adv)
        policy_tokens = np.array([sum(node.mask) for node in tree.nodes], dtype=np.float64)
        counted = node_adv.weight * policy_tokens
        trained += float(counted.sum())
        nonzero += float(counted[np.abs(node_adv.advantage) > _NONZERO_ATOL].sum())
    return {"tree/nonzero_adv_token_share": nonzero / trained if trained else 0.0}
