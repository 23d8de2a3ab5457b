"""Allocation under a token budget (`rollout.budget_unit: tokens`): what a step pays for on a GPU.

A leaf budget prices every rollout the same, but a continuation from a deep prefix generates only
the turns after it, while a fresh rollout generates them all. Here each candidate (a prompt for
Stage 1, a prefix for Stage 2) has an expected cost c_i in generated tokens, and a stage maximises
the same objective as the leaf solvers under Σ c_i · m_i <= budget:

- `allocate_roots_by_cost`: Σ root_value(v_i, m_i), m_i ∈ {0} ∪ [min_per_prompt, max_per_prompt];
- `expand_prefixes_by_cost`: Σ prefix_value(v_c, r_c, k_c), 0 <= k_c <= max_per_prefix.

With costs the threshold rule of `trace_rl.core.solvers` is no longer optimal (a knapsack: a cheap
item of lower gain may beat a dear one of higher gain), so both are solved by dynamic programming
over the budget in whole cost units, exact for the stated objective (large batches: a plan within a
stated bound of it, see "Work" below):

- The budget is cut into at most `resolution` units of u = max(1, budget / resolution) tokens, and
  each cost is rounded *up* to whole units, w_i = ⌈c_i / u⌉. With integer costs and budget <=
  resolution, u = 1 and the rounding is the identity: the solve is exact for the true costs.
- The DP over items keeps, for every capacity b, the best value of the items so far within b units
  (best_i(b) = max_m best_{i-1}(b - m·w_i) + f_i(m)); backtracking from the whole capacity gives
  counts that reach the optimum of the rounded problem (exact, up to float rounding of the sums).
- Rounding up only adds cost, so a plan is never above the budget at the true costs; and a plan
  of N rollouts feasible at the true costs is feasible at the rounded ones with N·u more tokens, so
  the value found is at least the true-cost optimum of a budget N_max·u smaller (N_max: the most
  rollouts the budget affords at the cheapest cost). Both bounds are tested against brute force.
- Among plans of optimal value the budget is then spent, as the leaf solvers spend theirs: the
  units left go, one affordable increment at a time, to the largest gain per unit (every gain is
  >= 0, so this never lowers the value).

Work: Σ_i (options of item i) × capacity. Up to `DP_WORK` (a real batch of this repository's regimes:
32 prompts, ~100 prefixes, capacity 1024) the DP above runs, tens of milliseconds. Past it (512
prompts and 1,024 rollouts a batch, as the paper's) the solve is the Lagrangian plan instead: take
each item's steps in order of gain per unit until the next does not fit, then spend what is left.
That plan is optimal for what it spends, and weak duality bounds its shortfall from the optimum by
λ × the units it left, λ the rate of the first step not taken; `_solve` returns that bound (tested
against brute force, and under 0.1% of the value at that scale). `experiments/token_budget.py`
times both paths against the leaf solvers.

The costs come from `TokenCosts`, which learns from the trees so far: the mean generated tokens
below a node of each depth (every rollout observed from where it started), each task's own fresh
rollouts.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from trace_rl.core.contrast import prefix_value, root_value
from trace_rl.core.solvers import _outcomes, _per_prompt_bounds, _probabilities, _whole
from trace_rl.core.tree import RolloutTree

TOKEN_RESOLUTION = 1024
"""Cost units a stage's token budget is cut into: finer is closer to the true costs, and the DP's
work grows linearly with it."""


def _costs(costs: ArrayLike, like: np.ndarray) -> np.ndarray:
    try:
        array = np.asarray(costs, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"costs must be an array of positive token counts: {exc}") from exc
    if array.shape != like.shape:
        raise ValueError(f"costs has shape {array.shape} but v has {like.shape}")
    if array.size and not (np.all(np.isfinite(array)) and array.min() > 0.0):
        bad = np.flatnonzero(~(np.isfinite(array) & (array > 0.0)))[0]
        raise ValueError(f"costs must be finite and > 0 (expected tokens of a rollout), got costs[{bad}] = {array[bad]}")
    return array


def cost_units(costs: np.ndarray, budget: int, resolution: int) -> tuple[np.ndarray, int, float]:
    """(whole units per item, rounded up; capacity in units; tokens per unit) for a budget of tokens."""
    unit = max(1.0, budget / resolution)
    capacity = int(budget // unit)
    # round(·, 9) first, so 3 tokens at 1 token a unit stay 3 units despite float noise
    units = np.maximum(1, np.ceil(np.round(costs / unit, 9))).astype(np.int64)
    return units, capacity, unit


def _knapsack(tables: Sequence[np.ndarray], units: np.ndarray, capacity: int) -> np.ndarray:
    """Counts m_i maximising Σ tables[i][m_i] under Σ units[i]·m_i <= capacity (see the module doc).

    tables[i][m] is item i's value with m rollouts: tables[i][0] == 0, -inf where m is not allowed,
    and no entry past the most the item may take. Exact ties go to the smaller count, so the
    optimum is reached with as little spent as possible; `_spend` spends the rest.
    """
    best = np.zeros(capacity + 1)
    picks = np.zeros((len(tables), capacity + 1), dtype=np.int32)
    for i, (table, w) in enumerate(zip(tables, units)):
        w = int(w)
        new = best.copy()  # m = 0
        pick = picks[i]
        for m in range(1, min(len(table) - 1, capacity // w) + 1):
            if table[m] == -np.inf:
                continue
            shift = m * w
            candidate = best[: capacity + 1 - shift] + table[m]
            better = candidate > new[shift:]
            np.copyto(new[shift:], candidate, where=better)
            np.copyto(pick[shift:], m, where=better)
        best = new
    counts = np.zeros(len(tables), dtype=np.int64)
    left = capacity
    for i in range(len(tables) - 1, -1, -1):
        counts[i] = picks[i, left]
        left -= int(counts[i]) * int(units[i])
    return counts


def _lagrangian(tables: Sequence[np.ndarray], units: np.ndarray, capacity: int) -> tuple[np.ndarray, float]:
    """(counts, bound) for large instances. Each table's steps between allowed counts (a prompt's
    first min_per_prompt rollouts are one step) have non-increasing gain per unit: prefix_value is
    concave, and a prompt's first step's rate f(L)/L is at least every later gain, m·gain(m) <= f(m).
    So taking steps in order of rate until the next does not fit is the Lagrangian plan for λ = that
    next step's rate: optimal for what it spends, S, and by weak duality short of the optimum at the
    whole capacity by at most λ·(capacity - S), the returned bound."""
    items, rates, costs, sizes, allowed = [], [], [], [], []
    for i, (table, w) in enumerate(zip(tables, units)):
        at = np.flatnonzero(np.isfinite(table))
        allowed.append(at)
        gains, steps = np.diff(table[at]), np.diff(at) * int(w)
        items.append(np.full(gains.size, i))
        rates.append(np.minimum.accumulate(gains / steps))  # non-increasing in exact arithmetic; this fixes float noise
        costs.append(steps)
        sizes.append(np.arange(1, gains.size + 1))
    item, rate, cost, size = (np.concatenate(x) if x else np.zeros(0) for x in (items, rates, costs, sizes))
    order = np.lexsort((size, item, -rate))  # by rate, then item, then the item's own order
    spent = np.cumsum(cost[order])
    taken = int(np.searchsorted(spent, capacity, side="right"))
    steps = np.bincount(item[order[:taken]].astype(np.int64), minlength=len(tables))
    counts = np.array([at[k] for at, k in zip(allowed, steps)], dtype=np.int64)
    if taken == order.size:
        return counts, 0.0
    return counts, float(rate[order[taken]]) * (capacity - int(counts @ units))


DP_WORK = 20_000_000
"""Largest Σ_i options_i × capacity solved by the exact DP (about 0.1 s); larger instances take the
Lagrangian plan with its bound (`_lagrangian`), which at that scale is tight."""


def _solve(full: Sequence[np.ndarray], units: np.ndarray, capacity: int, *, dp_work: int = DP_WORK) -> tuple[np.ndarray, float]:
    """(counts, bound on the shortfall from the rounded problem's optimum: 0 when exact), with the
    budget then spent (`_spend`)."""
    tables = [_trimmed(t) for t in full]
    work = sum(len(t) for t in tables) * (capacity + 1)  # the tables end at what each item's cost affords
    if work <= dp_work:
        return _spend(_knapsack(tables, units, capacity), full, units, capacity), 0.0
    counts, bound = _lagrangian(tables, units, capacity)
    before = sum(float(t[m]) for t, m in zip(full, counts))
    counts = _spend(counts, full, units, capacity)
    after = sum(float(t[m]) for t, m in zip(full, counts))
    return counts, max(0.0, bound - (after - before))


def _spend(counts: np.ndarray, tables: Sequence[np.ndarray], units: np.ndarray, capacity: int) -> np.ndarray:
    """Spend the units an optimal plan left, one affordable increment at a time, on the largest
    gain per unit (ties: the lower index). An increment is the next allowed count of an item, so an
    unused prompt's first increment is its first min_per_prompt rollouts. Gains are >= 0 (the
    objectives grow with m), so the value never drops."""
    counts = counts.copy()
    left = capacity - int(counts @ units)
    while left > 0:
        best, choice = -1.0, None
        for i, table in enumerate(tables):
            m = int(counts[i])
            step = next((n for n in range(m + 1, len(table)) if np.isfinite(table[n])), None)
            if step is None or (step - m) * int(units[i]) > left:
                continue
            rate = (table[step] - table[m]) / ((step - m) * int(units[i]))
            if rate > best:
                best, choice = rate, (i, step)
        if choice is None:
            return counts
        i, step = choice
        left -= (step - int(counts[i])) * int(units[i])
        counts[i] = step
    return counts


def _trimmed(values: np.ndarray) -> np.ndarray:
    """A value table without its trailing entries that add nothing (saturated in float), which no
    optimum needs and which only cost work."""
    return values[: int(np.argmax(values)) + 1]  # the first maximum; -inf entries are never it (entry 0 is 0)


def _root_table(value: float, most: int, low: int) -> np.ndarray:
    """root_value(value, m) for m = 0..most, -inf for the forbidden 1..low-1; just [0] when not even
    `low` rollouts fit."""
    if most < low:
        return np.zeros(1)
    table = root_value(np.full(most + 1, value), np.arange(most + 1))
    table[1:low] = -np.inf
    return table


def _most(capacity: int, units: np.ndarray, cap: int | None) -> np.ndarray:
    """The most rollouts each item may take: what its cost affords, and the cap."""
    most = capacity // units
    return most if cap is None else np.minimum(most, cap)


def allocate_roots_by_cost(
    v: ArrayLike,
    costs: ArrayLike,
    budget: int,
    *,
    min_per_prompt: int = 2,
    max_per_prompt: int | None = None,
    resolution: int = TOKEN_RESOLUTION,
) -> np.ndarray:
    """Stage 1 under a token budget: rollouts per prompt maximising Σ root_value(v_i, m_i) with
    Σ costs_i · m_i <= budget, each m_i 0 or in [min_per_prompt, max_per_prompt] (None: no cap).
    When the budget affords no group at all, the prompt of most value per token gets min_per_prompt
    rollouts anyway: a batch always has something to learn its costs and policy from.
    `costs`: expected generated tokens of one fresh rollout of each prompt (> 0). Exact (large
    batches: within the bound the module docstring states); returns int64 counts, one per prompt."""
    v = _probabilities("v", v)
    costs = _costs(costs, v)
    budget = _whole("budget", budget, minimum=0)
    resolution = _whole("resolution", resolution, minimum=1)
    low, high = _per_prompt_bounds(min_per_prompt, max_per_prompt, minimum=2)
    if v.size == 0 or budget == 0:
        return np.zeros(v.size, dtype=np.int64)
    units, capacity, _ = cost_units(costs, budget, resolution)
    full = [_root_table(value, int(most), low) for value, most in zip(v, _most(capacity, units, high))]
    counts = _solve(full, units, capacity)[0]
    if not counts.any():  # not even one group fits: the best value per token gets one, over the budget
        counts[int(np.argmax(root_value(v, low) / costs))] = low
    return counts


def expand_prefixes_by_cost(
    v: ArrayLike,
    r: ArrayLike,
    costs: ArrayLike,
    budget: int,
    *,
    max_per_prefix: int | None = None,
    resolution: int = TOKEN_RESOLUTION,
) -> np.ndarray:
    """Stage 2 under a token budget: continuations per prefix maximising Σ prefix_value(v_c, r_c, k_c)
    with Σ costs_c · k_c <= budget and k_c <= max_per_prefix (None: no cap). `costs`: expected
    generated tokens of one continuation from each prefix (> 0). Exact (large batches:
    within the bound the module docstring states); returns int64 counts, one per prefix."""
    v = _probabilities("v", v)
    r = _outcomes("r", r, like=v)
    costs = _costs(costs, v)
    budget = _whole("budget", budget, minimum=0)
    resolution = _whole("resolution", resolution, minimum=1)
    cap = None if max_per_prefix is None else _whole("max_per_prefix", max_per_prefix, minimum=0)
    if v.size == 0 or budget == 0:
        return np.zeros(v.size, dtype=np.int64)
    units, capacity, _ = cost_units(costs, budget, resolution)
    full = [prefix_value(value, outcome, np.arange(int(most) + 1)) for value, outcome, most in zip(v, r, _most(capacity, units, cap))]
    return _solve(full, units, capacity)[0]


# ------------------------------------------------------------------------------------- the cost model


@dataclass
class TokenCosts:
    """Expected generated tokens of a rollout started at a node, learnt from the trees so far.

    - Per depth d: the mean tokens generated below a node of depth d, over every rollout observed
      from where it started (a bare rollout gives a sample at every depth it passes; a continuation
      from its branch point down). Depth 0 is a fresh rollout.
    - Per task: the mean of its own fresh rollouts, shrunk toward the depth-0 mean with `prior`
      pseudo-rollouts (tasks rarely repeat in a large pool, so most fall back to the mean).
    - A prefix: its depth's mean, scaled by its task's fresh cost relative to the mean. The rollout
      already through the prefix is not used: Stage 2 would pick the prefixes whose own rollout was
      short by chance (on the simulator that overspent the budget by 6-8%).

    Statistics decay by `decay` per `observe` call, so the estimates follow a policy whose rollouts
    grow or shrink. Before any rollout is seen every cost is `initial` (from the
    collector's `max_new_tokens` times the env's `max_turns`: the most a rollout can write, so a first
    batch cannot overspend). `state_dict` / `load_state_dict` make a resumed run exact.
    """

    initial: float
    prior: float = 1.0
    decay: float = 0.9
    depth_sum: list[float] = field(default_factory=list)
    depth_count: list[float] = field(default_factory=list)
    task_sum: dict[str, float] = field(default_factory=dict)
    task_count: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (np.isfinite(self.initial) and self.initial > 0):
            raise ValueError(f"initial must be a positive number of tokens, got {self.initial!r}")
        if not self.prior >= 0:
            raise ValueError(f"prior must be >= 0, got {self.prior!r}")
        if not 0 < self.decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {self.decay!r}")

    def depth_mean(self, depth: int) -> float | None:
        """Mean tokens below a node of this depth, or None before one is seen."""
        if depth < len(self.depth_count) and self.depth_count[depth] > 0:
            return self.depth_sum[depth] / self.depth_count[depth]
        return None

    def fresh(self, task_ids: Iterable[str]) -> np.ndarray:
        """Expected generated tokens of one fresh rollout of each task."""
        mean = self.depth_mean(0)
        base = self.initial if mean is None else mean
        out = []
        for task in task_ids:
            n = self.task_count.get(task, 0.0)
            out.append((self.task_sum.get(task, 0.0) + self.prior * base) / (n + self.prior) if n + self.prior > 0 else base)
        return np.maximum(np.array(out, dtype=np.float64), 1.0)

    def continuation(self, trees: Sequence[RolloutTree], candidates: Sequence[tuple[int, int]]) -> np.ndarray:
        """Expected generated tokens of one continuation from each (tree, node) prefix: the mean below
        a node of its depth (the nearest shallower depth's when none was seen at it; `initial` before any),
        scaled by its task's fresh cost over the mean fresh cost (1 for a task never seen)."""
        fresh_mean = self.depth_mean(0)
        tasks = sorted({trees[index].task_id for index, _ in candidates})
        ratio = dict(zip(tasks, self.fresh(tasks) / fresh_mean)) if fresh_mean is not None else dict.fromkeys(tasks, 1.0)
        out = []
        for index, node in candidates:
            tree = trees[index]
            mean = self._mean_at_or_above(tree.nodes[node].depth)
            out.append(self.initial if mean is None else mean * ratio[tree.task_id])
        return np.maximum(np.array(out, dtype=np.float64), 1.0)

    def _mean_at_or_above(self, depth: int) -> float | None:
        for d in range(min(depth, len(self.depth_count) - 1), -1, -1):
            mean = self.depth_mean(d)
            if mean is not None:
                return mean
        return None

    def observe(self, trees: Sequence[RolloutTree]) -> None:
        """Learn from a batch's finished trees (after the decay of what was known)."""
        self.depth_sum = [s * self.decay for s in self.depth_sum]
        self.depth_count = [c * self.decay for c in self.depth_count]
        for task in self.task_sum:
            self.task_sum[task] *= self.decay
            self.task_count[task] *= self.decay
        for tree in trees:
            for leaf in tree.leaves():
                path = tree.path(int(leaf))
                start = path.index(tree.nodes[int(leaf)].rollout_start)
                below = np.cumsum([sum(tree.nodes[n].mask) for n in path[::-1]])[::-1]  # below[j]: tokens of path[j:]
                for j in range(start, len(path) - 1):
                    depth = tree.nodes[path[j]].depth
                    while len(self.depth_sum) <= depth:
                        self.depth_sum.append(0.0)
                        self.depth_count.append(0.0)
                    self.depth_sum[depth] += float(below[j + 1])
                    self.depth_count[depth] += 1.0
                if start == 0:
                    self.task_sum[tree.task_id] = self.task_sum.get(tree.task_id, 0.0) + float(below[1])
                    self.task_count[tree.task_id] = self.task_count.get(tree.task_id, 0.0) + 1.0

    def state_dict(self) -> dict[str, Any]:
        return {"depth_sum": list(self.depth_sum), "depth_count": list(self.depth_count), "task_sum": dict(self.task_sum), "task_count": dict(self.task_count)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.depth_sum = [float(x) for x in state["depth_sum"]]
        self.depth_count = [float(x) for x in state["depth_count"]]
        self.task_sum = {str(k): float(x) for k, x in state["task_sum"].items()}
        self.task_count = {str(k): float(x) for k, x in state["task_count"].items()}

