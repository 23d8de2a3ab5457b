"""Allocation under a token budget: the DP solvers against brute force, the rounding bound, the
spend-what-is-left rule, and the cost model on hand-built trees."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from trace_rl.core.contrast import prefix_value, root_value
from trace_rl.core.solvers import allocate_roots, expand_prefixes
from trace_rl.core.token_budget import (
    TokenCosts,
    _root_table,
    _solve,
    allocate_roots_by_cost,
    cost_units,
    expand_prefixes_by_cost,
)
from trace_rl.core.tree import RolloutTree


def root_objective(v, m):
    return float(root_value(np.asarray(v), np.asarray(m)).sum())


def prefix_objective(v, r, k):
    return float(prefix_value(np.asarray(v), np.asarray(r), np.asarray(k)).sum())


def brute_roots(v, costs, budget, low, high):
    """Best Σ root_value over every allocation within the budget (m = 0 or in [low, high])."""
    choices = []
    for c in costs:
        top = int(budget // c) if high is None else min(high, int(budget // c))
        choices.append([0] + list(range(low, top + 1)))
    best = 0.0
    for m in itertools.product(*choices):
        if np.dot(m, costs) <= budget + 1e-9:
            best = max(best, root_objective(v, m))
    return best


def brute_prefixes(v, r, costs, budget, cap):
    choices = [range(0, (int(budget // c) if cap is None else min(cap, int(budget // c))) + 1) for c in costs]
    best = 0.0
    for k in itertools.product(*choices):
        if np.dot(k, costs) <= budget + 1e-9:
            best = max(best, prefix_objective(v, r, k))
    return best


def leftover_fits_nothing(counts, costs, budget, low, cap):
    """No item can take its next allowed count within what the plan left."""
    left = budget - float(np.dot(counts, costs))
    for m, c in zip(counts, costs):
        step = low - m if m == 0 and low else 1
        if (cap is None or m + step <= cap) and step * c <= left + 1e-9:
            return False
    return True


@pytest.mark.parametrize("seed", range(60))
def test_stage1_by_cost_reaches_the_brute_force_optimum_with_integer_costs(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 5))
    v = rng.choice([0.0, 0.05, 0.3, 0.5, 0.8, 1.0], size=n) if seed % 3 == 0 else rng.random(n)
    costs = rng.integers(1, 6, size=n).astype(float)
    budget = int(rng.integers(0, 16))
    low = int(rng.integers(2, 4))
    high = None if seed % 2 else int(rng.integers(low, 7))
    counts = allocate_roots_by_cost(v, costs, budget, min_per_prompt=low, max_per_prompt=high)
    assert counts.dtype == np.int64 and counts.shape == (n,)
    if 0 < budget < low * costs.min():  # no group fits: one prompt gets a group anyway
        assert sorted(counts.tolist()) == [0] * (n - 1) + [low]
        return
    assert np.dot(counts, costs) <= budget
    assert all(m == 0 or (m >= low and (high is None or m <= high)) for m in counts)
    assert root_objective(v, counts) >= brute_roots(v, costs, budget, low, high) - 1e-12
    assert leftover_fits_nothing(counts, costs, budget, low, high)


@pytest.mark.parametrize("seed", range(60))
def test_stage2_by_cost_reaches_the_brute_force_optimum_with_integer_costs(seed):
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(1, 5))
    v = rng.choice([0.0, 0.02, 0.4, 0.5, 0.9, 1.0], size=n) if seed % 3 == 0 else rng.random(n)
    r = rng.integers(0, 2, size=n).astype(float)
    costs = rng.integers(1, 5, size=n).astype(float)
    budget = int(rng.integers(0, 12))
    cap = None if seed % 2 else int(rng.integers(0, 4))
    counts = expand_prefixes_by_cost(v, r, costs, budget, max_per_prefix=cap)
    assert np.dot(counts, costs) <= budget
    assert cap is None or counts.max(initial=0) <= cap
    assert prefix_objective(v, r, counts) >= brute_prefixes(v, r, costs, budget, cap) - 1e-12
    assert leftover_fits_nothing(counts, costs, budget, 0, cap)


@pytest.mark.parametrize("seed", range(20))
def test_rounded_costs_stay_within_the_true_budget_and_lose_at_most_n_units(seed):
    # budget 40 tokens cut into 8 units of 5: costs are rounded up to whole units
    rng = np.random.default_rng(200 + seed)
    n = 3
    v, r = rng.random(n), rng.integers(0, 2, size=n).astype(float)
    costs = rng.uniform(1.5, 9.0, size=n)
    budget, resolution = 40, 8
    _, _, unit = cost_units(costs, budget, resolution)
    most_rollouts = int(budget // costs.min())
    roots = allocate_roots_by_cost(v, costs, budget, resolution=resolution)
    assert np.dot(roots, costs) <= budget
    assert root_objective(v, roots) >= brute_roots(v, costs, budget - most_rollouts * unit, 2, None) - 1e-12
    prefixes = expand_prefixes_by_cost(v, r, costs, budget, resolution=resolution)
    assert np.dot(prefixes, costs) <= budget
    assert prefix_objective(v, r, prefixes) >= brute_prefixes(v, r, costs, budget - most_rollouts * unit, None) - 1e-12


def test_equal_costs_give_the_leaf_solvers_value():
    rng = np.random.default_rng(7)
    v, r = rng.random(32), rng.integers(0, 2, size=32).astype(float)
    by_cost = allocate_roots_by_cost(v, np.full(32, 10.0), 640)  # 64 leaves' worth
    assert by_cost.sum() == 64
    assert root_objective(v, by_cost) == pytest.approx(root_objective(v, allocate_roots(v, 64)), rel=1e-12)
    by_cost = expand_prefixes_by_cost(v, r, np.full(32, 10.0), 320)
    assert by_cost.sum() == 32
    assert prefix_objective(v, r, by_cost) == pytest.approx(prefix_objective(v, r, expand_prefixes(v, r, 32)), rel=1e-12)


def test_a_cheap_prefix_of_lower_gain_beats_a_dear_one():
    # prefix 0 flips its outcome with chance 0.5 but costs 60 tokens; prefix 1 with 0.4 and costs 10.
    # A leaf budget of 1 picks prefix 0; 60 tokens buy six continuations of prefix 1 instead.
    v, r = np.array([0.5, 0.6]), np.array([1.0, 1.0])
    assert expand_prefixes(v, r, 1).tolist() == [1, 0]
    assert expand_prefixes_by_cost(v, r, np.array([60.0, 10.0]), 60).tolist() == [0, 6]


def test_an_unaffordable_prompt_is_left_out_and_the_budget_spent_on_the_rest():
    counts = allocate_roots_by_cost([0.5, 0.5], [100.0, 10.0], 50)
    assert counts.tolist() == [0, 5]


def test_a_budget_that_affords_no_group_still_gives_one_to_the_best_value_per_token():
    # two rollouts of prompt 0 cost 200 and are worth 0.5; of prompt 1, 100 and 0.32: 0.0032 a token beats 0.0025
    assert allocate_roots_by_cost([0.5, 0.2], [100.0, 50.0], 60).tolist() == [0, 2]


def test_zero_gain_rollouts_still_spend_the_budget():
    # every prompt is certain (v = 0 or 1): nothing to gain, but a leaf solver spends its budget too
    counts = allocate_roots_by_cost([0.0, 1.0], [10.0, 10.0], 60)
    assert counts.sum() == 6 and all(m == 0 or m >= 2 for m in counts)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"costs": [1.0, 0.0]}, "costs must be finite and > 0"),
        ({"costs": [1.0, float("nan")]}, "costs must be finite and > 0"),
        ({"costs": [1.0]}, "costs has shape"),
        ({"budget": -1}, "budget must be >= 0"),
        ({"budget": 2.5}, "budget must be an integer"),
        ({"resolution": 0}, "resolution must be >= 1"),
    ],
)
def test_bad_input_is_refused_naming_the_argument(kwargs, match):
    args = {"v": [0.5, 0.5], "costs": [1.0, 2.0], "budget": 10, **kwargs}
    with pytest.raises(ValueError, match=match):
        allocate_roots_by_cost(args.pop("v"), args.pop("costs"), args.pop("budget"), **args)


def chain(tree: RolloutTree, parent: int, tokens: list[int], reward: float, *, starts: bool) -> list[int]:
    """Append one rollout of len(tokens) turns below `parent`; turn j writes tokens[j] policy tokens."""
    ids = []
    for j, count in enumerate(tokens):
        last = j == len(tokens) - 1
        parent = tree.add_turn(parent, token_ids=[1] * count + [2, 2], mask=[1] * count + [0, 0],
                               reward=reward if last else None, starts_rollout=starts if j == 0 else False)
        ids.append(parent)
    return ids


def test_cost_model_learns_per_depth_and_per_task_means_from_where_each_rollout_started():
    tree = RolloutTree.new("a", "q", [5, 5])
    bare = chain(tree, 0, [10, 20, 30], 1.0, starts=True)  # below depth 0: 60, depth 1: 50, depth 2: 30
    chain(tree, bare[0], [40, 10], 0.0, starts=True)  # a continuation from depth 1: 50 below it
    costs = TokenCosts(initial=64.0, prior=1.0, decay=1.0)
    assert costs.fresh(["a"]).tolist() == [64.0]
    costs.observe([tree])
    assert costs.depth_mean(0) == 60.0
    assert costs.depth_mean(1) == 50.0  # (50 + 50) / 2
    assert costs.depth_mean(2) == pytest.approx((30 + 10) / 2)
    other = RolloutTree.new("b", "q", [5])
    chain(other, 0, [20], 0.0, starts=True)
    costs.observe([other])
    # task a: its one fresh rollout (60) shrunk toward the depth-0 mean (40) at weight 1
    assert costs.fresh(["a", "new"]).tolist() == [pytest.approx((60 + 40) / 2), 40.0]
    # a prefix: its depth's mean (50), times its task's fresh cost over the mean fresh cost (50 / 40);
    # a depth never seen takes the nearest shallower one's
    assert costs.continuation([tree], [(0, bare[0])]).tolist() == [pytest.approx(50 * 50 / 40)]
    deep = RolloutTree.new("new", "q", [5])
    ids = chain(deep, 0, [1] * 6, 1.0, starts=True)
    assert costs.continuation([deep], [(0, ids[4])]).tolist() == [pytest.approx((30 + 10) / 2)]


def test_cost_model_state_round_trips():
    tree = RolloutTree.new("a", "q", [5])
    chain(tree, 0, [7, 9], 1.0, starts=True)
    costs = TokenCosts(initial=64.0)
    costs.observe([tree])
    again = TokenCosts(initial=64.0)
    again.load_state_dict(costs.state_dict())
    assert again.fresh(["a", "b"]).tolist() == costs.fresh(["a", "b"]).tolist()
    assert again.depth_mean(1) == costs.depth_mean(1)


@pytest.mark.parametrize("seed", range(40))
def test_lagrangian_plan_of_large_instances_is_within_its_stated_bound_of_brute_force(seed):
    # dp_work=0 forces the path large batches take; its bound must cover the true shortfall
    rng = np.random.default_rng(300 + seed)
    n = int(rng.integers(1, 5))
    v, r = rng.random(n), rng.integers(0, 2, size=n).astype(float)
    units = rng.integers(1, 5, size=n)
    capacity = int(rng.integers(1, 14))
    roots = [_root_table(x, int(capacity // w), 2) for x, w in zip(v, units)]
    counts, bound = _solve(roots, units, capacity, dp_work=0)
    assert counts @ units <= capacity and bound >= 0.0
    assert brute_roots(v, units.astype(float), capacity, 2, None) - root_objective(v, counts) <= bound + 1e-12
    prefixes = [prefix_value(x, y, np.arange(capacity // w + 1)) for x, y, w in zip(v, r, units)]
    counts, bound = _solve(prefixes, units, capacity, dp_work=0)
    assert counts @ units <= capacity
    assert brute_prefixes(v, r, units.astype(float), capacity, None) - prefix_objective(v, r, counts) <= bound + 1e-12


def test_lagrangian_bound_is_tight_at_a_large_batch():
    rng = np.random.default_rng(11)
    v, costs = rng.random(512), rng.uniform(30.0, 90.0, size=512)
    units, capacity, _ = cost_units(costs, int(1024 * costs.mean()), 1024)
    tables = [_root_table(x, int(capacity // w), 2) for x, w in zip(v, units)]
    counts, bound = _solve(tables, units, capacity)
    value = sum(t[m] for t, m in zip(tables, counts))
    assert bound <= 1e-3 * value


# ----------------------------------------------------------------------- the collector and the config


@pytest.fixture(scope="module")
def world():
    from scripted_engine import make_world

    return make_world()


@pytest.mark.parametrize("method", ["trace", "trace_stage1", "trace_stage2", "grpo", "random_tree"])
def test_a_token_budget_batch_plans_within_its_tokens_and_learns_the_costs_for_the_next(world, method):
    from scripted_engine import FixedValues, ScriptedEngine

    from trace_rl.rollout.collector import RolloutConfig, TreeRolloutCollector

    taskset, env, tokenizer, turns = world
    config = RolloutConfig(method=method, budget=600, budget_unit="tokens", max_new_tokens=32)
    collector = TreeRolloutCollector(ScriptedEngine(tokenizer, turns), tokenizer, env, FixedValues(), config, seed=1)
    first = collector.collect(taskset.tasks[:8])
    # before any rollout is seen a rollout is priced at its most, max_turns (4) full turns of 32 tokens
    most = 32 * env.max_turns
    assert first.stats["rollout/tokens_planned"] <= 600 and first.stats["rollout/leaves"] <= 600 // most
    assert collector.costs.depth_mean(0) is not None
    second = collector.collect(taskset.tasks[:8])
    assert second.stats["rollout/tokens_planned"] <= 600
    fresh = collector.costs.fresh([t.task_id for t in second.trees])
    assert np.all(fresh < most)  # the scripted rollouts write less than their most, so the second batch buys more
    assert second.stats["rollout/leaves"] > first.stats["rollout/leaves"]
    for tree in second.trees:
        tree.validate()
        assert sum(n.budget for n in tree.nodes) == tree.leaves().size  # every leaf was planned


def test_a_resumed_collector_plans_with_the_costs_it_had_learnt(world):
    from scripted_engine import FixedValues, ScriptedEngine

    from trace_rl.rollout.collector import RolloutConfig, TreeRolloutCollector

    taskset, env, tokenizer, turns = world
    config = RolloutConfig(method="trace", budget=600, budget_unit="tokens", max_new_tokens=32)

    def collector():
        return TreeRolloutCollector(ScriptedEngine(tokenizer, turns), tokenizer, env, FixedValues(), config, seed=4)

    unbroken = collector()
    unbroken.collect(taskset.tasks[:6])
    state = unbroken.state_dict()
    expected = unbroken.collect(taskset.tasks[:6])
    resumed = collector()
    resumed.load_state_dict(state)
    again = resumed.collect(taskset.tasks[:6])
    assert again.stats["rollout/tokens_planned"] == expected.stats["rollout/tokens_planned"]
    assert [n.budget for t in again.trees for n in t.nodes] == [n.budget for t in expected.trees for n in t.nodes]


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"method": "knapsack"}, "budget_unit must be leaves for method 'knapsack'"),
        ({"method": "dapo"}, "budget_unit must be leaves for method 'dapo'"),
        ({"stage2_objective": "prompt"}, "stage2_objective must be anchor with budget_unit tokens"),
        ({"budget": 2**28}, r"budget must be in \[1, 134217728\]"),
    ],
)
def test_a_token_budget_config_refuses_what_cannot_spend_tokens(fields, match):
    from trace_rl.rollout.collector import RolloutConfig

    with pytest.raises(ValueError, match=match):
        RolloutConfig(**{"budget_unit": "tokens", "budget": 4096, **fields})


def test_a_token_budget_of_more_leaves_than_max_budget_is_a_setting():
    from trace_rl.planning.methods import MAX_BUDGET
    from trace_rl.rollout.collector import RolloutConfig

    assert RolloutConfig(budget_unit="tokens", budget=100 * MAX_BUDGET).budget == 100 * MAX_BUDGET
