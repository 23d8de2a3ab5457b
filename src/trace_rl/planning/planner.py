"""Planning: where a batch's rollouts start, decided from values and budgets alone.

The `Planner` owns the two-stage sequence and its optional state (the token costs learnt so far,
Stage 2's evidence model): it reads trees, the success estimates of the nodes it may spend on and the
method's allocators, writes each node's `predicted` and `budget`, and yields `Request`s (start
`count` rollouts at node `node` of tree `tree`). It never generates, steps an env or looks at
tokens, so the training collector (`trace_rl.rollout.collector`, whose Ray executor only executes), and the
allocation benchmark on the simulator (`trace_rl.research.bench`) run this same code:

    planner = Planner(method, settings, costs=..., evidence=...)
    for requests in planner.plan(trees, values, rng):    # Stage 1, then (two-stage methods) Stage 2
        ... execute: sample the rollouts requested ...
    stats = planner.observe(trees)                        # the evidence model and the costs learn

`values(trees, queries)` gives the success estimates of (tree index, node id) queries: a predictor's,
or the simulator's truth. `Planner.roots` and `Planner.prefixes` are the two stages alone (what a
replay of a batch calls); what each reads is in `Estimates`.

Stage 2's observed outcome r of a prefix is the outcome of the one bare rollout through it (its
backup value against `success_threshold`). Stage-2 budget that no prefix can take (no intermediate
prefix, or every one at `max_per_prefix`) goes round-robin to the prompts already sampled, so a
batch always holds exactly `budget` leaves.

Under a token budget (`settings.budget_unit == "tokens"`) both stages also take each candidate's
expected cost in generated tokens (`costs`, from `trace_rl.core.token_budget.TokenCosts`) and spend
expected tokens instead of leaves; Stage-2 tokens no prefix takes buy bare rollouts at the sampled
prompts' mean fresh cost (`fresh_costs`), so the number of leaves is whatever the tokens buy.

With `per_tree=True`, `settings.budget` is each tree's own: every tree is planned alone (Stage 1
gives its one prompt the Stage-1 budget, Stage 2 spends the rest over that tree's own prefixes), so
every tree holds exactly `budget` leaves. This is the shape of GRPO trainers with a fixed group size
(TRL's `num_generations`, `trace_rl.integrations.trl`), where no budget moves between prompts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np

from trace_rl.core.mixing import PrefixPosterior
from trace_rl.core.token_budget import TokenCosts
from trace_rl.core.tree import RolloutTree
from trace_rl.planning.evidence import Stage2Evidence
from trace_rl.planning.methods import (
    AllocationSettings,
    MethodSpec,
    expand_stage2,
    uniform_stage1,
)
from trace_rl.predictor.base import PromptEvidence


@dataclass(frozen=True)
class Request:
    """Start `count` rollouts at node `node` of tree number `tree` of the batch."""

    tree: int
    node: int
    count: int


Candidate = tuple[int, int]
"""(tree index in the batch, node id): an intermediate prefix Stage 2 may expand."""


ValueFn = Callable[[Sequence[RolloutTree], Sequence[tuple[int, int]]], np.ndarray]
"""Success estimates of (tree index, node id) queries, one float per query."""


@dataclass(frozen=True)
class Estimates:
    """What a stage knows of each candidate it may spend on (a prompt, or a prefix)."""

    values: np.ndarray | None = None
    """Success estimates, recorded as each node's `predicted`; None for a method that reads none."""
    evidence: PromptEvidence | None = None
    """Stage 1: what the predictor knows beyond `values` (Knapsack-RL's `known`, BRACE's counts)."""
    allocate_with: np.ndarray | PrefixPosterior | None = None
    """Stage 2: what it allocates with instead of `values` (recorded as `stage2_value`): the evidence
    posterior's mean, or the whole posterior to value prefixes by the expectation."""
    costs: np.ndarray | None = None
    """Under a token budget: each candidate's expected tokens per rollout started there."""
    fresh_costs: np.ndarray | None = None
    """Stage 2 under a token budget: per tree, the expected tokens of a fresh rollout."""


class Planner:
    """One method's two-stage sequence (see the module docstring). `costs`: the token costs learnt so
    far (required under a token budget); `evidence`: Stage 2's evidence model, observed every batch
    and allocated with when `stage2_value` is `evidence` (its mean) or `expected` (its whole posterior).
    `stats` holds the last batch's planning figures (`rollout/stage2_to_roots`, `timing_s/alloc`, and
    `rollout/tokens_planned` under a token budget)."""

    def __init__(
        self,
        method: MethodSpec,
        settings: AllocationSettings,
        *,
        costs: TokenCosts | None = None,
        evidence: Stage2Evidence | None = None,
        stage2_value: Literal["paper", "evidence", "expected"] = "paper",
    ) -> None:
        if settings.budget_unit == "tokens" and costs is None:
            raise ValueError("a token budget needs the token costs learnt so far (TokenCosts)")
        if stage2_value != "paper" and evidence is None:
            raise ValueError(f"stage2_value={stage2_value!r} needs Stage 2's evidence model")
        self.method, self.settings = method, settings
        self.costs, self.evidence, self.stage2_value = costs, evidence, stage2_value
        self.stats: dict[str, float] = {}

    @property
    def has_stage2(self) -> bool:
        return self.method.stage2 is not None and self.method.stage2_budget(self.settings) > 0

    def plan(
        self,
        trees: Sequence[RolloutTree],
        values: ValueFn | None,
        rng: np.random.Generator,
        *,
        prompt_evidence: PromptEvidence | None = None,
        per_tree: bool = False,
        can_expand: Callable[[int, int], bool] | None = None,
    ) -> Iterator[list[Request]]:
        """Yields Stage 1's requests, then (after the caller has executed them, so the bare rollouts are
        in `trees`) Stage 2's. `values` may be None for a method that reads none; `can_expand` may veto
        prefixes (no room left in the context)."""
        start = time.perf_counter()
        fresh = None if self.costs is None else self.costs.fresh([tree.task_id for tree in trees])
        roots = [(index, 0) for index in range(len(trees))]
        requests = self.roots(trees, Estimates(values(trees, roots) if values else None, prompt_evidence, costs=fresh), rng, per_tree=per_tree)
        planned = 0.0 if fresh is None else sum(r.count * fresh[r.tree] for r in requests)
        self.stats = {"rollout/stage2_to_roots": 0.0, "timing_s/alloc": time.perf_counter() - start}
        yield requests
        if self.has_stage2:
            start = time.perf_counter()
            candidates = prefix_candidates(trees, can_expand)
            v = values(trees, candidates) if values else None
            branch = None if self.costs is None else self.costs.continuation(trees, candidates)
            posterior = self._posterior(trees, candidates, v)
            requests = self.prefixes(trees, candidates, Estimates(v, allocate_with=posterior, costs=branch, fresh_costs=fresh), rng, per_tree=per_tree)
            self.stats["rollout/stage2_to_roots"] = float(sum(r.count for r in requests if r.node == 0))
            if fresh is not None:
                cost_of = {c: k for k, c in enumerate(candidates)}
                planned += sum(r.count * (fresh[r.tree] if r.node == 0 else branch[cost_of[(r.tree, r.node)]]) for r in requests)
            self.stats["timing_s/alloc"] += time.perf_counter() - start
            yield requests
        if fresh is not None:
            self.stats["rollout/tokens_planned"] = float(planned)

    def _posterior(self, trees: Sequence[RolloutTree], candidates: list[Candidate], values: np.ndarray | None) -> np.ndarray | PrefixPosterior | None:
        if self.stage2_value == "paper" or self.evidence is None or values is None:
            return None
        threshold = self.settings.success_threshold
        if self.stage2_value == "expected":
            return self.evidence.expected(trees, candidates, values, threshold)
        return self.evidence.adjust(trees, candidates, values, threshold)

    def roots(self, trees: Sequence[RolloutTree], estimates: Estimates, rng: np.random.Generator | None = None, *, per_tree: bool = False) -> list[Request]:
        """Stage 1: rollouts per prompt. Sets every root's `budget`, and `predicted` when values are given
        (None for a method that does not read them: a uniform split). `per_tree`: each tree is planned
        alone on its own budget (see the module docstring). Under a token budget `estimates.costs` (each
        prompt's expected tokens per fresh rollout) are required. `rng` serves allocators that draw (BRACE)."""
        method, settings, values, evidence = self.method, self.settings, estimates.values, estimates.evidence
        if values is None and method.stage1 is not uniform_stage1:
            raise ValueError(f"method {method.name!r} allocates Stage 1 from values; got none")
        costs = _costs_for(settings, estimates.costs, len(trees), "tree")
        if per_tree:
            checked = None if values is None else _checked(values, len(trees), "tree")[0]
            return [
                replace(request, tree=index)
                for index in range(len(trees))
                for request in self.roots(
                    trees[index : index + 1],
                    Estimates(None if checked is None else checked[index : index + 1], _one(evidence, index),
                              costs=None if costs is None else costs[index : index + 1]),
                    rng,
                )
            ]
        values, record = _checked(values, len(trees), "tree")
        per_prompt = method.stage1(values, method.stage1_budget(settings), settings, evidence, rng, costs=costs)
        requests = []
        for index, (tree, v, m) in enumerate(zip(trees, values, per_prompt)):
            tree.root.budget = int(m)
            if record:
                tree.root.predicted = float(v)
            if m > 0:
                requests.append(Request(index, 0, int(m)))
        return requests

    def prefixes(
        self, trees: Sequence[RolloutTree], candidates: Sequence[Candidate], estimates: Estimates, rng: np.random.Generator, *, per_tree: bool = False
    ) -> list[Request]:
        """Stage 2: continuations per candidate prefix, then the leftover to sampled roots (see module doc).

        Sets `predicted` on every candidate (when values are given), `stage2_value` when it allocates
        with `estimates.allocate_with`, and `budget` on the expanded ones. Returns [] for a method
        without Stage 2. `per_tree`: each tree spends its own Stage-2 budget over its own candidates,
        trees in order. Under a token budget, `estimates.costs` (per candidate, tokens per
        continuation) and `estimates.fresh_costs` (per tree, tokens per fresh rollout) are required.
        """
        method, settings, values, allocate_with = self.method, self.settings, estimates.values, estimates.allocate_with
        budget = method.stage2_budget(settings)
        if method.stage2 is None or budget <= 0:
            return []
        if values is None and method.stage2 is expand_stage2:
            raise ValueError(f"method {method.name!r} allocates Stage 2 from values; got none")
        costs = _costs_for(settings, estimates.costs, len(candidates), "candidate")
        fresh_costs = _costs_for(settings, estimates.fresh_costs, len(trees), "tree")
        if per_tree:
            checked = None if values is None else _checked(values, len(candidates), "candidate")[0]
            requests: list[Request] = []
            for index in range(len(trees)):
                mine = [k for k, (tree, _) in enumerate(candidates) if tree == index]
                own = self.prefixes(
                    trees[index : index + 1], [(0, candidates[k][1]) for k in mine],
                    Estimates(None if checked is None else checked[mine], allocate_with=_pick(allocate_with, mine),
                              costs=None if costs is None else costs[mine], fresh_costs=None if fresh_costs is None else fresh_costs[index : index + 1]),
                    rng,
                )
                requests += [replace(request, tree=index) for request in own]
            return requests
        values, record = _checked(values, len(candidates), "candidate")
        allocated = values if allocate_with is None else _allocated(allocate_with, len(candidates))
        backups = {}
        for index, _ in candidates:
            if index not in backups:
                backups[index] = trees[index].backup().values
        outcomes = np.array([backups[i][n] > settings.success_threshold for i, n in candidates], dtype=np.float64)
        prompts = np.array([index for index, _ in candidates], dtype=np.int64)
        mixed_trees = {index: _mixed(trees[index], settings.success_threshold) for index in backups}
        mixed = np.array([mixed_trees[index] for index, _ in candidates], dtype=bool)
        per_prefix = method.stage2(allocated, outcomes, budget, settings, rng, prompts=prompts, mixed=mixed, costs=costs) if candidates else np.zeros(0, dtype=np.int64)
        requests = []
        means = allocated.mean if isinstance(allocated, PrefixPosterior) else allocated
        for (index, node_id), v, a, k in zip(candidates, values, means, per_prefix):
            node = trees[index].nodes[node_id]
            if record:
                node.predicted = float(v)
            if allocate_with is not None:
                node.stage2_value = float(a)
            if k > 0:
                node.budget = int(k)
                requests.append(Request(index, node_id, int(k)))
        if costs is None:
            return requests + leftover_requests(trees, budget - int(per_prefix.sum()))
        left = budget - float(per_prefix @ costs) if candidates else float(budget)
        sampled = [index for index, tree in enumerate(trees) if tree.root.budget > 0]
        fresh = float(np.mean(fresh_costs[sampled])) if sampled else np.inf
        return requests + leftover_requests(trees, int(left // fresh))

    def observe(self, trees: Sequence[RolloutTree]) -> dict[str, float]:
        """After a batch ran: the evidence model scores its continuations and refits (its `stage2/*`
        figures are returned), and the token costs learn from the trees."""
        stats = {} if self.evidence is None else self.evidence.observe(trees, self.settings.success_threshold)
        if self.costs is not None:
            self.costs.observe(trees)
        return stats

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        if self.costs is not None:
            state["costs"] = self.costs.state_dict()
        if self.evidence is not None:
            state["evidence"] = self.evidence.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores `state_dict`; a part missing from an older checkpoint keeps its fresh state."""
        if self.costs is not None and "costs" in state:
            self.costs.load_state_dict(state["costs"])
        if self.evidence is not None and "evidence" in state:
            self.evidence.load_state_dict(state["evidence"])


def prefix_candidates(
    trees: Sequence[RolloutTree], can_expand: Callable[[int, int], bool] | None = None
) -> list[Candidate]:
    """Every intermediate prefix of the bare rollouts: non-terminal nodes below the root with a child,
    in tree then id order; `can_expand(tree, node)` may veto some (e.g. no room left in the context)."""
    return [
        (index, node.id)
        for index, tree in enumerate(trees)
        for node in tree.nodes[1:]
        if not node.is_terminal and node.children and (can_expand is None or can_expand(index, node.id))
    ]


def _allocated(allocate_with: np.ndarray | PrefixPosterior, count: int) -> np.ndarray | PrefixPosterior:
    if isinstance(allocate_with, PrefixPosterior):
        if len(allocate_with) != count or np.shape(allocate_with.strength) != (count,):
            raise ValueError(f"allocate_with has {len(allocate_with)} entries, expected one per candidate ({count})")
        return allocate_with
    return _checked(allocate_with, count, "candidate")[0]


def _pick(allocate_with: np.ndarray | PrefixPosterior | None, rows: list[int]) -> np.ndarray | PrefixPosterior | None:
    if allocate_with is None:
        return None
    if isinstance(allocate_with, PrefixPosterior):
        return PrefixPosterior(np.asarray(allocate_with.mean)[rows], np.asarray(allocate_with.strength)[rows], allocate_with.concentration)
    return np.asarray(allocate_with)[rows]


def _one(evidence: PromptEvidence | None, index: int) -> PromptEvidence | None:
    """The evidence of prompt `index` alone."""
    if evidence is None:
        return None
    pick = lambda a: None if a is None else np.asarray(a)[index : index + 1]
    return PromptEvidence(pick(evidence.known), pick(evidence.successes), pick(evidence.failures), evidence.concentration)


def _costs_for(settings: AllocationSettings, costs: np.ndarray | None, count: int, what: str) -> np.ndarray | None:
    """The costs as float64 under a token budget (required there), None under a leaf budget."""
    if settings.budget_unit != "tokens":
        return None
    if costs is None:
        raise ValueError(f"a token budget needs each {what}'s expected cost in tokens; got none")
    array = np.asarray(costs, dtype=np.float64)
    if array.shape != (count,):
        raise ValueError(f"costs has shape {array.shape}, expected one per {what} ({count})")
    return array


def _mixed(tree: RolloutTree, threshold: float) -> bool:
    """Whether a tree's leaves so far hold both a success and a failure."""
    successes = tree.leaf_rewards() > threshold
    return bool(successes.any() and not successes.all())


def _checked(values: np.ndarray | None, count: int, what: str) -> tuple[np.ndarray, bool]:
    """(values as float64, whether to record them on the nodes); None stands for "no information", ½."""
    if values is None:
        return np.full(count, 0.5), False
    array = np.asarray(values, dtype=np.float64)
    if array.shape != (count,):
        raise ValueError(f"values has shape {array.shape}, expected one per {what} ({count})")
    return array, True


def leftover_requests(trees: Sequence[RolloutTree], leftover: int) -> list[Request]:
    """`leftover` more bare rollouts, round-robin over the prompts Stage 1 sampled (adds to their budget)."""
    if leftover <= 0:
        return []
    sampled = [index for index, tree in enumerate(trees) if tree.root.budget > 0]
    if not sampled:
        raise ValueError("Stage 1 sampled no prompt, so Stage 2 has nowhere to spend its budget")
    extra = np.bincount(np.arange(leftover) % len(sampled), minlength=len(sampled))
    requests = []
    for index, k in zip(sampled, extra):
        if k:
            trees[index].root.budget += int(k)
            requests.append(Request(index, 0, int(k)))
    return requests
