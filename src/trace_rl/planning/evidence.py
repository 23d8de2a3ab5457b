"""Stage 2's success estimate of a prefix, updated on what the batch's bare rollouts already show.

DESIGN.md's Stage-2 value reads the predictor's ṽ of a prefix as its true success rate. But when
Stage 2 decides, the batch has already sampled from that prefix once (the bare rollout through it,
outcome r) and from its prompt n times (s successes). On real trees this is most of what is known:
on the two (32, 6) TRACE runs of docs/results/paper_budget_32x6 (9,120 continuations each after step 5)
the predictor's ṽ scored a Brier of 0.252 / 0.257 on the continuations Stage 2 started (a constant
predicting the past mean, 0.254 / 0.251), while a continuation repeated r 67-70% of the time from a
first-turn prefix and 86-87% from a fourth-turn one, and succeeded 7% of the time where every bare
rollout of its prompt had failed (ṽ said 0.41-0.43). The posterior below, fitted online step by
step, scored 0.172 / 0.164 (`experiments/stage2_evidence.py`,
docs/results/stage2_evidence/replay_paper_budget_32x6.json).

The estimate is a Beta posterior with ṽ as the prior mean:

    ṽ' = (κ_t ṽ + r + w (s − r)) / (κ_t + 1 + w (n − 1)),   κ_t = κ / t

for a prefix after turn t. κ is how many outcomes the prediction is worth at the first turn (fewer
deeper down, where the rest of the rollout is shorter and its one sampled continuation tells more);
w is what each of the prompt's other bare rollouts is worth against the prefix's own. κ = ∞ is the
paper's value (ṽ' = ṽ). Both are fitted by maximum likelihood on the run's own past continuations
(`Stage2Evidence`), so a predictor that already knows (the simulator's oracle) keeps κ large and a
predictor that knows little hands Stage 2 to the evidence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from trace_rl.core.mixing import PrefixPosterior, fit_repeat_concentration
from trace_rl.core.tree import RolloutTree

PRIOR_STRENGTHS = (0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, np.inf)
"""The grid of κ the fit chooses from (∞: the paper's value)."""
PROMPT_WEIGHTS = (0.0, 0.125, 0.25, 0.5, 1.0)
"""The grid of w the fit chooses from."""
_CLIP = 1e-6


@dataclass(frozen=True)
class Evidence:
    """Per prefix: its depth t, the outcome r of the bare rollout through it, and its prompt's bare
    rollouts' successes s and count n (r among them)."""

    depth: np.ndarray
    outcome: np.ndarray
    successes: np.ndarray
    count: np.ndarray


def bare_evidence(trees: Sequence[RolloutTree], prefixes: Sequence[tuple[int, int]], threshold: float) -> Evidence:
    """The evidence of each (tree index, node id) prefix, from the finished bare rollouts (those that
    started at the root) of its tree; a success is a reward above `threshold`. Continuations already
    in the tree are not counted, so the same numbers come out before and after Stage 2 ran. A prefix
    whose bare rollout did not finish has r = 0, as `trace_rl.planning.planner` reads its NaN backup."""
    per_tree: dict[int, tuple[dict[int, float], float, int]] = {}
    depth, outcome, successes, count = [], [], [], []
    for index, node_id in prefixes:
        if index not in per_tree:
            per_tree[index] = bare_outcomes(trees[index], threshold)
        through, wins, total = per_tree[index]
        depth.append(trees[index].nodes[node_id].depth)
        outcome.append(through.get(node_id, 0.0))  # no finished bare rollout below: a failure, as the planner reads it
        successes.append(wins)
        count.append(total)
    return Evidence(*(np.asarray(a, dtype=np.float64) for a in (depth, outcome, successes, count)))


def bare_outcomes(tree: RolloutTree, threshold: float) -> tuple[dict[int, float], float, int]:
    """(outcome of the first bare rollout through each node, bare successes, bare count)."""
    through: dict[int, float] = {}
    wins, total = 0.0, 0
    for leaf in tree.leaves():
        node = tree.nodes[int(leaf)]
        if node.rollout_start != 0 or node.reward is None:
            continue
        r = float(node.reward > threshold)
        wins, total = wins + r, total + 1
        for n in tree.path(int(leaf)):
            through.setdefault(n, r)
    return through, wins, total


def posterior(values: np.ndarray, evidence: Evidence, prior_strength: float, prompt_weight: float) -> np.ndarray:
    """ṽ' of the module docstring for every prefix (prior_strength = κ, prompt_weight = w)."""
    values = np.asarray(values, dtype=np.float64)
    if np.isinf(prior_strength):
        return values.copy()
    kappa = prior_strength / np.maximum(evidence.depth, 1.0)
    others = prompt_weight * (evidence.successes - evidence.outcome)
    return (kappa * values + evidence.outcome + others) / (kappa + 1.0 + prompt_weight * (evidence.count - 1.0))


def posterior_strength(evidence: Evidence, prior_strength: float, prompt_weight: float) -> np.ndarray:
    """a + b of the posterior `posterior` takes the mean of: κ_t + 1 + w (n − 1) (np.inf at κ = ∞)."""
    if np.isinf(prior_strength):
        return np.full(evidence.depth.shape, np.inf)
    return prior_strength / np.maximum(evidence.depth, 1.0) + 1.0 + prompt_weight * (evidence.count - 1.0)


class Stage2Evidence:
    """κ and w fitted on the run's past continuations: each continuation's outcome against the
    posterior of the prefix it started at. Until `min_examples` continuations are seen, κ = ∞ (the
    paper's value). The last `capacity` continuations are kept, so the fit follows the policy."""

    def __init__(self, *, min_examples: int = 200, capacity: int = 4096, min_groups: int = 50) -> None:
        self.min_examples, self.capacity, self.min_groups = min_examples, capacity, min_groups
        self.prior_strength, self.prompt_weight = float(np.inf), 0.0
        self.concentration = float(np.inf)
        """ν of a prefix's continuations (`trace_rl.core.mixing`), fitted on the run's groups of them once
        `min_groups` are seen (np.inf before: independent draws, the paper's model)."""
        self._seen = np.zeros((0, 6))  # columns: ṽ, depth, r, s, n, continuation outcome
        self._groups = np.zeros((0, 5))  # per prefix with >= 2 continuations: posterior mean, strength, r, k, all repeated r

    def adjust(self, trees: Sequence[RolloutTree], prefixes: Sequence[tuple[int, int]], values: np.ndarray, threshold: float) -> np.ndarray:
        """The values Stage 2 should allocate with: the posterior at the current fit."""
        if not len(prefixes):
            return np.asarray(values, dtype=np.float64)
        return posterior(values, bare_evidence(trees, prefixes, threshold), self.prior_strength, self.prompt_weight)

    def expected(self, trees: Sequence[RolloutTree], prefixes: Sequence[tuple[int, int]], values: np.ndarray, threshold: float) -> PrefixPosterior:
        """What Stage 2 allocates with when it values prefixes by the posterior expectation of mixing:
        the posterior at the current fit, its strength, and the fitted ν."""
        values = np.asarray(values, dtype=np.float64)
        if not len(prefixes):
            return PrefixPosterior(values, np.zeros(0), self.concentration)
        evidence = bare_evidence(trees, prefixes, threshold)
        return PrefixPosterior(posterior(values, evidence, self.prior_strength, self.prompt_weight),
                               posterior_strength(evidence, self.prior_strength, self.prompt_weight), self.concentration)

    def observe(self, trees: Sequence[RolloutTree], threshold: float) -> dict[str, float]:
        """Scores this batch's continuations (the predictor's ṽ and the posterior Stage 2 would have
        used, before refitting on them), then refits. {} when the batch has no scored continuation.
        `stage2/own_weight` is the share of a first-turn prefix's posterior that its bare outcome
        carries after the refit, 1 / (κ + 1) (0: the paper's value); `stage2/prompt_weight` is w."""
        rows, ids = _continuations(trees, threshold)
        if not rows.size:
            return {}
        y = rows[:, 5]
        used = posterior(rows[:, 0], _evidence(rows), self.prior_strength, self.prompt_weight)
        metrics = {
            "stage2/brier_predictor": float(np.mean((rows[:, 0] - y) ** 2)),
            "stage2/brier_evidence": float(np.mean((used - y) ** 2)),
            "stage2/continuations": float(y.size),
        }
        groups = _groups(rows, ids, self.prior_strength, self.prompt_weight)
        self._seen = np.concatenate([self._seen, rows])[-self.capacity :]
        self._groups = np.concatenate([self._groups, groups])[-self.capacity :]
        if len(self._seen) >= self.min_examples:
            self.prior_strength, self.prompt_weight = fit(self._seen)
        if len(self._groups) >= self.min_groups:
            g = self._groups
            self.concentration = fit_repeat_concentration(g[:, 0], g[:, 1], g[:, 2], np.rint(g[:, 3]).astype(np.int64), g[:, 4])
        metrics["stage2/correlation"] = 1.0 / (1.0 + self.concentration)  # ν = ∞ (independent draws) logs 0, strict JSON
        metrics["stage2/own_weight"] = 0.0 if np.isinf(self.prior_strength) else 1.0 / (self.prior_strength + 1.0)
        metrics["stage2/prompt_weight"] = self.prompt_weight
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return {"prior_strength": self.prior_strength, "prompt_weight": self.prompt_weight, "seen": self._seen.tolist(),
                "concentration": self.concentration, "groups": self._groups.tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores a `state_dict`; one saved before ν was fitted has ν = ∞ and no groups."""
        self.prior_strength, self.prompt_weight = float(state["prior_strength"]), float(state["prompt_weight"])
        self._seen = np.asarray(state["seen"], dtype=np.float64).reshape(-1, 6)
        self.concentration = float(state.get("concentration", np.inf))
        self._groups = np.asarray(state.get("groups", []), dtype=np.float64).reshape(-1, 5)


def fit(rows: np.ndarray) -> tuple[float, float]:
    """(κ, w) on the grids with the smallest log loss of the posterior on `rows` (columns as
    `Stage2Evidence` keeps them); ties go to the larger κ, then the smaller w (closer to the paper)."""
    evidence, y = _evidence(rows), rows[:, 5]
    best = (np.inf, np.inf, 0.0)
    for kappa in reversed(PRIOR_STRENGTHS):
        for weight in PROMPT_WEIGHTS:
            p = np.clip(posterior(rows[:, 0], evidence, kappa, weight), _CLIP, 1 - _CLIP)
            loss = float(-np.mean(y * np.log(p) + (1 - y) * np.log1p(-p)))
            if loss < best[0] - 1e-12:
                best = (loss, kappa, weight)
    return float(best[1]), float(best[2])


def _groups(rows: np.ndarray, ids: np.ndarray, prior_strength: float, prompt_weight: float) -> np.ndarray:
    """One row per prefix with at least 2 continuations (`_continuations`' ids): the posterior mean and
    strength it was planned with, r, the count k and whether all k repeated r."""
    if not rows.size:
        return np.zeros((0, 5))
    starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
    ends = np.r_[starts[1:], len(rows)]
    out = []
    for start, end in zip(starts, ends):
        if end - start < 2:
            continue
        head = rows[start : start + 1]
        evidence = _evidence(head)
        mean = posterior(head[:, 0], evidence, prior_strength, prompt_weight)[0]
        strength = posterior_strength(evidence, prior_strength, prompt_weight)[0]
        r = head[0, 2]
        out.append((mean, strength, r, float(end - start), float(np.all(rows[start:end, 5] == r))))
    return np.array(out, dtype=np.float64).reshape(-1, 5)


def _evidence(rows: np.ndarray) -> Evidence:
    return Evidence(rows[:, 1], rows[:, 2], rows[:, 3], rows[:, 4])


def continuations(trees: Sequence[RolloutTree], threshold: float) -> np.ndarray:
    """One row per finished continuation whose prefix has a prediction: ṽ, depth t, r, s, n (its
    prefix's `bare_evidence`) and the continuation's outcome."""
    return _continuations(trees, threshold)[0]


def _continuations(trees: Sequence[RolloutTree], threshold: float) -> tuple[np.ndarray, np.ndarray]:
    """`continuations`' rows and, per row, the index of its prefix (a prefix's rows are adjacent)."""
    prefixes, predicted, outcomes, ids = [], [], [], []
    for index, tree in enumerate(trees):
        starts: dict[int, list[float]] = {}  # a prefix's continuations together, prefixes in the order first met
        for leaf in tree.leaves():
            node = tree.nodes[int(leaf)]
            start = node.rollout_start
            if start != 0 and node.reward is not None and tree.nodes[start].predicted is not None:
                starts.setdefault(start, []).append(float(node.reward > threshold))
        for start, ys in starts.items():
            prefixes += [(index, start)] * len(ys)
            predicted += [tree.nodes[start].predicted] * len(ys)
            outcomes += ys
            ids += [ids[-1] + 1 if ids else 0] * len(ys)
    if not prefixes:
        return np.zeros((0, 6)), np.zeros(0, dtype=np.int64)
    ev = bare_evidence(trees, prefixes, threshold)
    rows = np.column_stack([predicted, ev.depth, ev.outcome, ev.successes, ev.count, outcomes]).astype(np.float64)
    return rows, np.asarray(ids, dtype=np.int64)
