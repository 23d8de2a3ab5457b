"""The success predictor's contract, its training targets (tree backups) and its calibration checks.

The predictor Ṽψ(H) estimates the chance that a rollout continued from history H succeeds. It serves
the allocator only (Stage 1 asks about roots, Stage 2 about intermediate prefixes) and never enters
the policy gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import numpy as np

from trace_rl.core.tree import Backup, History, RolloutTree

Weighting = Literal["count", "sqrt", "uniform"]
LeafSet = Literal["natural", "all"]


@runtime_checkable
class SuccessPredictor(Protocol):
    """Ṽψ: histories in, success probabilities out; learns online from tree backups.

    Contract: `predict` returns float64 values in [0, 1], one per history, and returns exactly 0.5
    for every history before the first `update` (so TRACE starts as uniform allocation). `update`
    runs one online training pass over (history, target, weight) triples with targets in [0, 1]
    (fractional backup values allowed) and weights >= 0, and returns loss metrics under
    `predictor/*` keys. `state_dict` / `load_state_dict` round-trip exactly.
    """

    def predict(self, histories: Sequence[History]) -> np.ndarray: ...

    def update(self, histories: Sequence[History], targets: np.ndarray, weights: np.ndarray) -> dict[str, float]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass(frozen=True)
class PromptEvidence:
    """What a per-prompt predictor knows beyond its point estimates, for the Stage-1 allocators that read
    it: Knapsack-RL's validity flags, BRACE's posterior counts and group correlation."""

    known: np.ndarray | None = None
    """Per prompt, whether the predictor vouches for its estimate (None: all); Knapsack-RL allocates the
    others uniformly."""
    successes: np.ndarray | None = None
    failures: np.ndarray | None = None
    """Per prompt, the counts behind the posterior Beta(1 + successes, 1 + failures) (BRACE)."""
    concentration: float = float("inf")
    """ν of the exchangeable group model (`trace_rl.core.mixing`); np.inf: a group's rollouts are independent."""


@runtime_checkable
class KnowsPrompts(Protocol):
    """A predictor with more to say about prompts than a point estimate; the collector passes its
    `evidence` to the Stage-1 allocator."""

    def evidence(self, histories: Sequence[History]) -> PromptEvidence: ...


def check_training_batch(
    histories: Sequence[History], targets: np.ndarray, weights: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """Validate one `update` batch; return (targets, weights) as float64 arrays.

    Raises ValueError naming the argument for mismatched lengths, NaN or out-of-range targets and
    negative or non-finite weights. `weights=None` means all ones.
    """
    y = np.asarray(targets, dtype=np.float64).reshape(-1)
    if y.size != len(histories):
        raise ValueError(f"targets has {y.size} entries but histories has {len(histories)}")
    if not np.all(np.isfinite(y)):
        raise ValueError("targets must be finite (got NaN or inf)")
    if y.size and (y.min() < 0.0 or y.max() > 1.0):
        raise ValueError(f"targets must lie in [0, 1], got range [{y.min()}, {y.max()}]")
    w = np.ones_like(y) if weights is None else np.asarray(weights, dtype=np.float64).reshape(-1)
    if w.size != y.size:
        raise ValueError(f"weights has {w.size} entries but targets has {y.size}")
    if not np.all(np.isfinite(w)) or (w.size and w.min() < 0.0):
        raise ValueError("weights must be finite and >= 0")
    return y, w


# ---------------------------------------------------------------- training targets


def backup_targets(
    trees: Sequence[RolloutTree], *, weighting: Weighting = "count", leaves: LeafSet = "natural"
) -> tuple[list[History], np.ndarray, np.ndarray]:
    """Tree backup targets for the predictor: (histories, targets, weights).

    One example per node that the allocator could ask about and that has at least one counted leaf
    below it: the root and every non-terminal node. The target is the mean reward of the counted
    leaves. Leaves themselves are left out: the allocator never queries a finished rollout, and a
    leaf's "value" is its reward, which the predictor would learn from the answer text (a grader's
    job, not a value estimate's).

    Which leaves count for node y:

    - `"natural"` (default): the leaves of rollouts that reached y on their own, i.e. that started at
      y or above it. Continuations started *below* y are left out of y's target: Stage 2 chose where
      to start them by looking at outcomes (it expands failed rollouts' most promising prefixes, and
      successful rollouts' least promising ones), so they over-sample the subtrees most likely to
      flip, and the plain mean drags every ancestor's target towards 0.5. What counts is fair: the
      rollout through an expanded prefix is an unselected draw (every prefix of every bare rollout
      is an example, expanded or not) and its continuations are fresh draws, so the count-weighted
      cross-entropy's expected gradient vanishes at the true value. On the simulator's TRACE trees
      the plain mean puts roots of true success 0.11 at 0.17 and of 0.89 at 0.82; this one at 0.09
      and 0.90 (`trace_rl.research.sim` knows the truth).
    - `"all"`: every leaf below y, the backup value V̂ of `RolloutTree.backup` (the mean reward of
      y's leaves). Fair only when no branching decision looked at outcomes.

    Where each rollout started is what the collector recorded on each node (`Node.rollout_start`).

    `weighting="count"` (default) weights a node by its counted leaves n. Cross-entropy is linear in
    the target, so n·CE(p, mean r) equals the sum of CE(p, r) over those leaves: the count weight
    trains on every (prefix, final outcome) pair, the usual Monte-Carlo value target. `"sqrt"` damps
    the root's dominance (its leaves share prefixes); `"uniform"` weights every node alike.
    """
    if weighting not in ("count", "sqrt", "uniform"):
        raise ValueError(f"weighting must be 'count', 'sqrt' or 'uniform', got {weighting!r}")
    if leaves not in ("natural", "all"):
        raise ValueError(f"leaves must be 'natural' or 'all', got {leaves!r}")
    histories: list[History] = []
    targets: list[float] = []
    counts: list[float] = []
    for tree in trees:
        backup = natural_backup(tree) if leaves == "natural" else tree.backup()
        for node_id, history in enumerate(node_histories(tree)):
            if tree.nodes[node_id].is_terminal or backup.counts[node_id] == 0:
                continue
            histories.append(history)
            targets.append(float(backup.values[node_id]))
            counts.append(float(backup.counts[node_id]))
    y = np.array(targets, dtype=np.float64)
    n = np.array(counts, dtype=np.float64)
    if y.size and not (y.min() >= 0.0 and y.max() <= 1.0):
        raise ValueError(f"backup targets must lie in [0, 1] (rewards in {{0, 1}}), got range [{y.min()}, {y.max()}]")
    weights = {"count": n, "sqrt": np.sqrt(n), "uniform": np.ones_like(n)}[weighting]
    return histories, y, weights


def rollout_starts(tree: RolloutTree) -> np.ndarray:
    """Per node, the id of the node where the rollout that made it began (the root: 0), as recorded
    on the tree when each turn was added (`Node.rollout_start`)."""
    return np.array([node.rollout_start for node in tree.nodes], dtype=np.int64)


def natural_backup(tree: RolloutTree) -> Backup:
    """Like `RolloutTree.backup`, counting for each node only the leaves of rollouts that started at
    it or above (see `backup_targets`). Leaves keep their reward and count 1; NaN where no leaf counts."""
    nodes = tree.nodes
    start = rollout_starts(tree)
    sums = np.zeros(len(nodes), dtype=np.float64)
    counts = np.zeros(len(nodes), dtype=np.int64)
    for node in nodes:
        if not node.is_terminal:
            continue
        sums[node.id] = node.reward
        counts[node.id] = 1
        top = nodes[start[node.id]].depth
        current = node.parent
        while current is not None and nodes[current].depth >= top:
            sums[current] += node.reward
            counts[current] += 1
            current = nodes[current].parent
    with np.errstate(invalid="ignore", divide="ignore"):
        values = np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)
    return Backup(values=values, counts=counts)


def node_histories(tree: RolloutTree) -> list[History]:
    """`tree.history(i)` for every node i, built in one pass (parents have smaller ids), sharing Turn objects."""
    histories = [History(prompt=tree.prompt, turns=(), task_id=tree.task_id)]
    for node in tree.nodes[1:]:
        parent = histories[node.parent]
        histories.append(History(prompt=tree.prompt, turns=parent.turns + (node.turn(),), task_id=tree.task_id))
    return histories


# ---------------------------------------------------------------- calibration


def _check_pair(p: np.ndarray, y: np.ndarray, weights: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    p = np.asarray(p, dtype=np.float64).reshape(-1)
    y = np.asarray(y, dtype=np.float64).reshape(-1)
    if p.size != y.size:
        raise ValueError(f"p has {p.size} entries but y has {y.size}")
    if p.size == 0:
        raise ValueError("p and y are empty")
    for name, a in (("p", p), ("y", y)):
        if not np.all(np.isfinite(a)) or a.min() < 0.0 or a.max() > 1.0:
            raise ValueError(f"{name} must be finite and lie in [0, 1]")
    w = np.ones_like(p) if weights is None else np.asarray(weights, dtype=np.float64).reshape(-1)
    if w.size != p.size:
        raise ValueError(f"weights has {w.size} entries but p has {p.size}")
    if not np.all(np.isfinite(w)) or w.min() < 0.0 or w.sum() <= 0.0:
        raise ValueError("weights must be finite, >= 0 and not all zero")
    return p, y, w


def brier_score(p: np.ndarray, y: np.ndarray, weights: np.ndarray | None = None) -> float:
    """(Weighted) mean of (p - y)²; lower is better.

    `y` may be 0/1 outcomes (the classic Brier score) or fractional backup targets (then it is the
    squared error against the empirical success rate, which also counts the targets' own noise).
    """
    p, y, w = _check_pair(p, y, weights)
    return float(np.sum(w * (p - y) ** 2) / np.sum(w))


def expected_calibration_error(
    p: np.ndarray, y: np.ndarray, n_bins: int = 10, weights: np.ndarray | None = None
) -> float:
    """ECE with `n_bins` equal-width bins on [0, 1], each bin weighted by its (weighted) size.

    ECE = Σ_b (W_b / W) · |mean_b(p) − mean_b(y)|. `y` may be 0/1 outcomes or fractional targets:
    only bin means of y enter, so a fractional target counts as that share of a success. p = 1.0
    falls in the last bin.
    """
    if not isinstance(n_bins, (int, np.integer)) or n_bins < 1:
        raise ValueError(f"n_bins must be a positive integer, got {n_bins!r}")
    p, y, w = _check_pair(p, y, weights)
    bins = np.minimum((p * n_bins).astype(np.int64), n_bins - 1)
    size = np.bincount(bins, weights=w, minlength=n_bins)
    sum_p = np.bincount(bins, weights=w * p, minlength=n_bins)
    sum_y = np.bincount(bins, weights=w * y, minlength=n_bins)
    used = size > 0
    gaps = np.abs(sum_p[used] - sum_y[used]) / size[used]
    return float(np.sum(size[used] * gaps) / np.sum(size))


def calibration_report(
    predictor: SuccessPredictor, trees: Sequence[RolloutTree], *, n_bins: int = 10
) -> dict[str, float]:
    """Brier score and ECE of `predictor` on the backup targets of `trees`, weighted by leaf count.

    Call it on trees the predictor has not trained on yet (e.g. before `update` on a new batch), or
    the figures measure fit rather than prediction. Returns `predictor/brier`, `predictor/ece` and
    `predictor/examples`.
    """
    histories, y, w = backup_targets(trees, weighting="count")
    if not histories:
        raise ValueError("trees hold no finished rollout: nothing to calibrate against")
    p = predictor.predict(histories)
    return {
        "predictor/brier": brier_score(p, y, w),
        "predictor/ece": expected_calibration_error(p, y, n_bins, w),
        "predictor/examples": float(len(histories)),
    }
