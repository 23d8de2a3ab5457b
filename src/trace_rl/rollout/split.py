"""Splitting a batch's execution among workers, Ray-free: which trees each worker takes, the part it
is sent, and how its result goes back into the batch (`ray_workers.RayExecutor` uses these; so does
the default suite's test that a split batch grows the same trees as a whole one)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from trace_rl.planning.planner import Request
from trace_rl.rollout.collector import Batch


def partition(batch: Batch, requests: Sequence[Request], workers: int) -> list[list[int]]:
    """Tree indices per worker, each list ascending; only trees with requests. Trees with the same
    prompt stay together; groups go largest first (by requested rollouts) to the least loaded worker,
    ties to the lower index, so the split is a function of the requests alone."""
    counts: dict[int, int] = defaultdict(int)
    for request in requests:
        counts[request.tree] += request.count
    groups: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for tree in sorted(counts):
        groups[tuple(batch.trees[tree].root.token_ids)].append(tree)
    loads, parts = [0] * workers, [[] for _ in range(workers)]
    for group in sorted(groups.values(), key=lambda g: (-sum(counts[t] for t in g), g[0])):
        worker = min(range(workers), key=lambda w: (loads[w], w))
        parts[worker] += group
        loads[worker] += sum(counts[t] for t in group)
    return [sorted(part) for part in parts]


def part_of(batch: Batch, requests: Sequence[Request], trees: Sequence[int]) -> tuple[Batch, list[Request]]:
    """The sub-batch of `trees` (renumbered from 0, with the env states its requests start from) and
    its requests."""
    local = {tree: index for index, tree in enumerate(trees)}
    mine = [Request(local[r.tree], r.node, r.count) for r in requests if r.tree in local]
    part = Batch(
        trees=[batch.trees[t] for t in trees],
        tasks=[batch.tasks[t] for t in trees],
        states={(r.tree, r.node): batch.states[(trees[r.tree], r.node)] for r in mine},
    )
    return part, mine


def merge(batch: Batch, trees: Sequence[int], part: Batch, slowest: dict[str, float]) -> None:
    """`part` (grown from `part_of(batch, ..., trees)`) back into `batch`: its trees in place, the env
    states of the nodes it made, its token counts added; its timings into `slowest` (the workers run
    at once, so a timing is the slowest worker's)."""
    for index, tree in enumerate(part.trees):
        batch.trees[trees[index]] = tree
    batch.states.update({(trees[index], node): state for (index, node), state in part.states.items()})
    for key, count in part.tokens.items():
        batch.tokens[key] += count
    for key, seconds in part.timings.items():
        slowest[key] = max(slowest[key], seconds)
