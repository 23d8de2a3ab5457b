"""Planning: where a batch's rollouts start, decided from values and budgets alone.

The planner is pure: it reads trees, the success estimates of the nodes it may spend on and the
method's allocators, writes each node's `predicted` and `budget`, and returns `Request`s (start
`count` rollouts at node `node` of tree `tree`). It never generates, steps an env or looks at
tokens, so the training collector (`trace_rl.rollout`), the allocation benchmark on the simulator
(`trace_rl.bench`) and a distributed collector all run this same code:

    requests = plan_roots(method, settings, trees, v_root)            # Stage 1
    ... execute: sample the bare rollouts ...
    candidates = prefix_candidates(trees, can_expand)                 # intermediate prefixes
    requests = plan_prefixes(method, settings, trees, candidates, v_prefix, rng)   # Stage 2
    ... execute: sample the continuations ...

Stage 2's observed outcome r of a prefix is the outcome of the one bare rollout through it (its
backup value against `success_threshold`). Stage-2 budget that no prefix can take (no intermediate
prefix, or every one at `max_per_prefix`) goes round-robin to the prompts already sampled, so a
batch always holds exactly `budget` leaves.

Under a token budget (`settings.budget_unit == "tokens"`) both stages also take each candidate's
expected cost in generated tokens (`costs`, from `trace_rl.token_budget.TokenCosts`) and spend
expected tokens instead of leaves; Stage-2 tokens no prefix takes buy bare rollouts at the sampled
prompts' mean fresh cost (`fresh_costs`), so the number of leaves is whatever the tokens buy.

With `per_tree=True`, `settings.budget` is each tree's own: every tree is planned alone (Stage 1
gives its one prompt the Stage-1 budget, Stage 2 spends the rest over that tree's own prefixes), so
every tree holds exactly `budget` leaves. This is the shape of GRPO trainers with a fixed group size
(TRL's `num_generations`, `trace_rl.integrations.trl`), where no budget moves between prompts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from trace_rl.methods import (
    AllocationSettings,
    MethodSpec,
    expand_stage2,
    uniform_stage1,
)
from trace_rl.mixing import PrefixPosterior
from trace_rl.predictor.base import PromptEvidence
from trace_rl.tree import RolloutTree


@dataclass(frozen=True)
class Request:
    """Start `count` rollouts at node `node` of tree number `tree` of the batch."""

    tree: int
    node: int
    count: int


Candidate = tuple[int, int]
"""(tree index in the batch, node id): an intermediate prefix Stage 2 may expand."""


def plan_roots(
    method: MethodSpec,
    settings: AllocationSettings,
    trees: Sequence[RolloutTree],
    values: np.ndarray | None,
    evidence: PromptEvidence | None = None,
    *,
    per_tree: bool = False,
    costs: np.ndarray | None = None,
    rng: np.random.Generator | None = None,
) -> list[Request]:
    """Stage 1: rollouts per prompt. Sets every root's `budget`, and `predicted` when `values` are given
    (they may be None for a method that does not read them: a uniform split). `evidence`: what the
    predictor knows beyond the values, for allocators that read it (Knapsack-RL's `known`, BRACE's
    counts). `per_tree`: each tree is planned alone on its own budget (see the module docstring).
    `costs`: each prompt's expected tokens per fresh rollout, required under a token budget. `rng`: for
    allocators that draw (BRACE)."""
    if values is None and method.stage1 is not uniform_stage1:
        raise ValueError(f"method {method.name!r} allocates Stage 1 from values; got none")
    costs = _costs_for(settings, costs, len(trees), "tree")
    if per_tree:
        checked = None if values is None else _checked(values, len(trees), "tree")[0]
        return [
            replace(request, tree=index)
            for index in range(len(trees))
            for request in plan_roots(
                method, settings, trees[index : index + 1],
                None if checked is None else checked[index : index + 1],
                _one(evidence, index),
                costs=None if costs is None else costs[index : index + 1],
                rng=rng,
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


def plan_prefixes(
    method: MethodSpec,
    settings: AllocationSettings,
    trees: Sequence[RolloutTree],
    candidates: Sequence[Candidate],
    values: np.ndarray | None,
    rng: np.random.Generator,
    *,
    per_tree: bool = False,
    costs: np.ndarray | None = None,
    fresh_costs: np.ndarray | None = None,
    allocate_with: np.ndarray | PrefixPosterior | None = None,
) -> list[Request]:
    """Stage 2: continuations per candidate prefix, then the leftover to sampled roots (see module doc).

    Sets `predicted` on every candidate (when `values` are given) and `budget` on the expanded ones.
    `allocate_with`: per candidate, the values Stage 2 allocates with instead of `values` (which stay
    the recorded predictions; these go to `stage2_value`): `trace_rl.evidence`'s posterior mean, or its
    whole posterior (`PrefixPosterior`) to value prefixes by the posterior expectation.
    Returns [] for a method without Stage 2. `per_tree`: each tree spends its own Stage-2 budget
    over its own candidates, trees in order (see the module docstring). Under a token budget,
    `costs` (per candidate, tokens per continuation) and `fresh_costs` (per tree, tokens per fresh
    rollout) are required.
    """
    budget = method.stage2_budget(settings)
    if method.stage2 is None or budget <= 0:
        return []
    if values is None and method.stage2 is expand_stage2:
        raise ValueError(f"method {method.name!r} allocates Stage 2 from values; got none")
    costs = _costs_for(settings, costs, len(candidates), "candidate")
    fresh_costs = _costs_for(settings, fresh_costs, len(trees), "tree")
    if per_tree:
        checked = None if values is None else _checked(values, len(candidates), "candidate")[0]
        requests: list[Request] = []
        for index in range(len(trees)):
            mine = [k for k, (tree, _) in enumerate(candidates) if tree == index]
            own = plan_prefixes(
                method, settings, trees[index : index + 1], [(0, candidates[k][1]) for k in mine],
                None if checked is None else checked[mine], rng,
                costs=None if costs is None else costs[mine], fresh_costs=None if fresh_costs is None else fresh_costs[index : index + 1],
                allocate_with=_pick(allocate_with, mine),
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
