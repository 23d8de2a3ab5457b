"""Knapsack-RL's released allocation rule and PCL's selection, against brute force and hand-worked cases."""

from __future__ import annotations

import itertools
import math
import time

import numpy as np
import pytest
from repo_files import load

from trace_rl.core.baselines import knapsack_roots, pcl_roots, uniform_roots

# ------------------------------------------------------------------ an independent reference


def value(p: float, rollouts: int) -> float:
    """Knapsack-RL's Value(N, p) = P(non-zero gradient) × InfoGain, InfoGain = p(1-p)²."""
    return p * (1.0 - p) ** 2 * (1.0 - p**rollouts - (1.0 - p) ** rollouts)


def dp_objective(p: list[float], extra: list[int], low: int) -> float:
    """The released DP's objective: a prompt with no extra rollout scores 0."""
    return sum(value(pi, low + k) if k else 0.0 for pi, k in zip(p, extra))


def evenly(amount: int, count: int) -> list[int]:
    base, remainder = divmod(amount, count)
    return [base + (i < remainder) for i in range(count)]


def released_steps_1_to_3(p, budget, *, low, high, zero, one, known, unknown, alpha, cost, fallback):
    """Steps 1-3 of the released rule written out plainly (see knapsack_roots' docstring), returning
    (allocation before step 4, the effective indices, the total step 4 spreads), or the final
    allocation and no step 4 when there is no effective prompt."""
    n = len(p)
    unknown = budget // n if unknown is None else unknown
    zero = low if zero is None else zero
    one = low if one is None else one
    known = [True] * n if known is None else list(known)
    alloc, effective, rate = [], [], []
    for i in range(n):
        if not known[i]:
            alloc.append(unknown)
            rate.append(0.0)
        elif p[i] == 0.0:
            alloc.append(zero)
            rate.append(0.0)
        elif p[i] == 1.0:
            alloc.append(one)
            rate.append(1.0)
        else:
            alloc.append(low)
            rate.append(p[i])
            effective.append(i)
    rest = budget - sum(alloc)
    assert rest >= 0
    zero_like = [i for i in range(n) if rate[i] == 0.0]
    if not effective:
        if rest > 0:
            if zero_like:
                for i, extra in zip(zero_like, evenly(rest, len(zero_like))):
                    alloc[i] += extra
            else:
                alloc = evenly(budget, n)
        return alloc, [], 0
    cap = budget if high is None else high
    estimated = 0
    for i in effective:
        q = p[i]
        c = math.log(1 - alpha) / math.log(max(q, 1 - q)) if cost == "probability" else 1 / (q * (1 - q)) - 1
        estimated += int(min(cap, float(np.float32(c))))
    if fallback and estimated < rest:
        takers = zero_like or [i for i in range(n) if i not in effective]
        if takers:
            for i, extra in zip(takers, evenly(rest - estimated, len(takers))):
                alloc[i] += extra
            rest = estimated
    return alloc, effective, rest


def compositions(total: int, parts: int, room: int):
    """Every tuple of `parts` integers in [0, room] summing to `total`."""
    if parts == 0:
        if total == 0:
            yield ()
        return
    for first in range(min(room, total) + 1):
        for rest in compositions(total - first, parts - 1, room):
            yield (first, *rest)


def brute_force_step4(p: list[float], total: int, low: int, room: int) -> float:
    """Best DP objective over every k with 0 <= k_i <= room and Σ k == total."""
    return max(dp_objective(p, list(extra), low) for extra in compositions(total, len(p), room))


def dp_table_step4(p: list[float], total: int, low: int, room: int) -> float:
    """Exact-budget knapsack table, one prompt at a time (their solver's recursion), vectorised over w."""
    best = np.full(total + 1, -np.inf)
    best[0] = 0.0
    for q in p:
        gains = np.array([0.0] + [value(q, low + k) for k in range(1, min(room, total) + 1)])
        new = best.copy()
        for k in range(1, gains.size):
            np.maximum(new[k:], best[:-k] + gains[k], out=new[k:])
        best = new
    return float(best[total])


def check_against_reference(p, budget, step4, **options) -> None:
    """knapsack_roots agrees with the reference on steps 1-3 exactly and is optimal on step 4."""
    got = knapsack_roots(p, budget, **options)
    assert got.dtype == np.int64 and got.sum() == budget
    low = options.get("min_per_prompt", 2)
    high = options.get("max_per_prompt")
    before, effective, total = released_steps_1_to_3(
        list(p),
        budget,
        low=low,
        high=high,
        zero=options.get("zero_per_prompt"),
        one=options.get("one_per_prompt"),
        known=options.get("known"),
        unknown=options.get("unknown_per_prompt"),
        alpha=options.get("alpha", 0.9),
        cost=options.get("cost", "probability"),
        fallback=options.get("fallback", True),
    )
    others = [i for i in range(len(p)) if i not in effective]
    assert got[others].tolist() == [before[i] for i in others]
    if not effective:
        return
    extra = (got[effective] - low).tolist()
    room = (budget if high is None else high) - low
    assert sum(extra) == total
    if total >= len(effective) * room:  # every prompt full, the rest spread over them as released
        assert extra == [room + e for e in evenly(total - len(effective) * room, len(effective))]
        return
    assert min(extra) >= 0 and max(extra) <= room
    rates = [float(p[i]) for i in effective]
    best = step4(rates, total, low, room)
    achieved = dp_objective(rates, extra, low)
    assert achieved >= best - 1e-12 * max(1.0, best), (p, budget, options, extra, achieved, best)


# --------------------------------------------------------------------------------- Knapsack-RL


def test_knapsack_matches_brute_force_on_small_random_instances() -> None:
    rng = np.random.default_rng(0)
    grid = np.array([0.0, 1.0, 0.125, 0.25, 0.5, 0.75, 0.875])
    for _ in range(400):
        n = int(rng.integers(1, 6))
        p = np.where(rng.random(n) < 0.5, rng.choice(grid, n), rng.uniform(0.01, 0.99, n))
        low = int(rng.integers(1, 4))
        high = None if rng.random() < 0.3 else low + int(rng.integers(0, 9))
        known = None if rng.random() < 0.6 else rng.random(n) < 0.7
        base = sum(low if (known is None or known[i]) else 0 for i in range(n))
        budget = base + int(rng.integers(0, 17))
        check_against_reference(
            p,
            budget,
            brute_force_step4,
            min_per_prompt=low,
            max_per_prompt=high,
            known=known,
            unknown_per_prompt=0,
            cost=str(rng.choice(["probability", "expectation"])),
            alpha=float(rng.choice([0.5, 0.9, 0.99])),
            fallback=bool(rng.random() < 0.5),
        )


def test_knapsack_matches_the_dynamic_program_on_larger_instances() -> None:
    rng = np.random.default_rng(1)
    for _ in range(25):
        n = int(rng.integers(10, 40))
        p = np.round(rng.uniform(0.0, 1.0, n), 2)  # some exact 0s and 1s
        high = int(rng.integers(3, 30))
        budget = 2 * n + int(rng.integers(0, 8 * n))
        check_against_reference(p, budget, dp_table_step4, max_per_prompt=high, fallback=bool(rng.random() < 0.5))


def test_knapsack_matches_the_dynamic_program_at_batch_scale() -> None:
    rng = np.random.default_rng(5)
    p = rng.uniform(0.01, 0.99, 512)
    # No fallback, so the knapsack spreads everything past the floors: 3000 extra rollouts, 30 at most each.
    check_against_reference(p, 512 * 2 + 3000, dp_table_step4, max_per_prompt=32, fallback=False)


@pytest.mark.filterwarnings("error")
def test_knapsack_handles_rates_at_the_edge_of_the_float_range() -> None:
    for p in ([5e-324, 0.3], [1e-300, 0.5, 1 - 2**-53], [1e-12, 1e-9, 0.999999]):
        for high in (None, 128):
            got = knapsack_roots(p, 400, max_per_prompt=high, fallback=False)
            assert got.sum() == 400 and got.min() >= 2
    # A rate of 0.3 is worth more than a subnormal one at every count: it takes every extra rollout.
    assert knapsack_roots([5e-324, 0.3], 400, fallback=False).tolist() == [2, 398]


def test_knapsack_counts_the_floor_value_only_for_prompts_given_an_extra_rollout() -> None:
    # Their DP scores k = 0 as 0, so the first extra rollout is worth the whole Value(3): one each.
    # Marginal values from the floor, Value(N) - Value(2), would give both to p = 0.5: [4, 2].
    assert knapsack_roots([0.5, 0.125], 6, fallback=False).tolist() == [3, 3]


def test_knapsack_gives_the_uniform_split_when_every_rate_is_one_half() -> None:
    assert knapsack_roots(np.full(8, 0.5), 64, max_per_prompt=128).tolist() == [8] * 8


def test_knapsack_spreads_an_indivisible_budget_lowest_index_first() -> None:
    got = knapsack_roots(np.full(8, 0.5), 60, max_per_prompt=128)
    assert got.tolist() == [8, 8, 8, 8, 7, 7, 7, 7]


def test_knapsack_sends_the_budget_to_unsolved_prompts_when_none_is_uncertain() -> None:
    # Floors of 2 each, the other 8 split over the p = 0 prompts.
    assert knapsack_roots([0.0, 1.0, 0.0, 1.0], 16).tolist() == [6, 2, 6, 2]


def test_knapsack_falls_back_to_the_uniform_share_when_every_prompt_is_solved() -> None:
    assert knapsack_roots([1.0, 1.0, 1.0], 12).tolist() == [4, 4, 4]
    assert knapsack_roots([1.0, 1.0, 1.0], 13).tolist() == [5, 4, 4]


def test_knapsack_gives_the_surplus_over_the_costs_to_unsolved_prompts() -> None:
    # Floors 6; the p = 0.5 prompt costs floor(log 0.1 / log 0.5) = 3, so 24 - 3 = 21 go to the p = 0
    # prompts (11 + 10) and the knapsack spreads the 3.
    assert knapsack_roots([0.5, 0.0, 0.0], 30, max_per_prompt=128).tolist() == [5, 13, 12]
    # Without the fallback the knapsack takes all 24.
    assert knapsack_roots([0.5, 0.0, 0.0], 30, max_per_prompt=128, fallback=False).tolist() == [26, 2, 2]


def test_knapsack_gives_the_surplus_to_solved_prompts_when_no_prompt_is_unsolved() -> None:
    assert knapsack_roots([0.5, 1.0], 20).tolist() == [5, 15]


def test_knapsack_counts_unknown_prompts_as_unsolved_in_the_fallback_as_released() -> None:
    # The unknown prompt takes 8 (budget // 3) first, then the surplus 12 - 6 as if its rate were 0.
    got = knapsack_roots([0.5, 0.5, 0.5], 24, known=[True, True, False])
    assert got.tolist() == [5, 5, 14]


def test_knapsack_keeps_the_surplus_in_the_knapsack_when_the_fallback_has_nowhere_to_go() -> None:
    # Every prompt uncertain: the released code divides by zero here; the knapsack takes it all.
    got = knapsack_roots([0.5, 0.25], 30, max_per_prompt=128)
    assert got.sum() == 30 and got.min() >= 2


def test_knapsack_never_exceeds_max_per_prompt_while_the_caps_hold_the_budget() -> None:
    p = [0.5, 0.1, 0.3]
    for budget in range(6, 16):
        got = knapsack_roots(p, budget, max_per_prompt=5, fallback=False)
        assert got.sum() == budget and got.max() <= 5 and got.min() >= 2
    # Past the caps the released solver spreads the rest evenly over the uncertain prompts.
    assert knapsack_roots(p, 20, max_per_prompt=5, fallback=False).tolist() == [7, 7, 6]


def test_knapsack_floors_use_their_own_counts() -> None:
    got = knapsack_roots([0.0, 1.0, 0.5, 0.5], 20, zero_per_prompt=0, one_per_prompt=1, known=[1, 1, 1, 0],
                         unknown_per_prompt=8, fallback=False)
    assert got.tolist() == [0, 1, 11, 8]


def test_knapsack_spends_a_real_batch_exactly_and_fast() -> None:
    rng = np.random.default_rng(2)
    p = rng.integers(0, 17, 512) / 16  # last-epoch rates of 16 rollouts each: many 0s and 1s
    for high in (128, None):
        for fallback in (True, False):
            knapsack_roots(p, 4096, max_per_prompt=high, fallback=fallback)  # warm up
            start = time.perf_counter()
            got = knapsack_roots(p, 4096, max_per_prompt=high, fallback=fallback)
            elapsed = time.perf_counter() - start
            assert got.sum() == 4096 and got.min() >= 2
            assert elapsed < 0.25, f"{elapsed:.3f} s at 512 prompts / budget 4096"


def test_knapsack_scales_to_many_prompts() -> None:
    rng = np.random.default_rng(3)
    p = rng.uniform(0.0, 1.0, 50_000)
    got = knapsack_roots(p, 400_000, max_per_prompt=64, fallback=False)
    assert got.sum() == 400_000 and got.max() <= 64


@pytest.mark.parametrize(
    ("args", "kwargs", "name"),
    [
        (([0.5, np.nan], 8), {}, "p"),
        (([0.5, 1.5], 8), {}, "p"),
        (([[0.5]], 8), {}, "p"),
        (([0.5], -1), {}, "budget"),
        (([0.5], 8.0), {}, "budget"),
        (([0.5], 8), {"min_per_prompt": 0}, "min_per_prompt"),
        (([0.5], 8), {"max_per_prompt": 1}, "max_per_prompt"),
        (([0.5], 8), {"zero_per_prompt": -1}, "zero_per_prompt"),
        (([0.5], 8), {"one_per_prompt": 1.5}, "one_per_prompt"),
        (([0.5], 8), {"unknown_per_prompt": -2}, "unknown_per_prompt"),
        (([0.5, 0.5], 8), {"known": [True]}, "known"),
        (([0.5, 0.5], 8), {"known": [1, 2]}, "known"),
        (([0.5], 8), {"alpha": 1.0}, "alpha"),
        (([0.5], 8), {"alpha": "0.9"}, "alpha"),
        (([0.5], 8), {"cost": "variance"}, "cost"),
        (([0.5], 8), {"fallback": "yes"}, "fallback"),
        (([0.5, 0.5, 0.5], 5), {}, "budget"),  # below the floors
        (([], 4), {}, "budget"),
    ],
)
def test_knapsack_names_the_bad_argument(args, kwargs, name) -> None:
    with pytest.raises(ValueError, match=name):
        knapsack_roots(*args, **kwargs)


def test_knapsack_accepts_an_empty_batch_with_no_budget() -> None:
    assert knapsack_roots([], 0).tolist() == []


# ------------------------------------------------------------------------------------------- PCL


def test_pcl_keeps_the_candidates_nearest_one_half_and_splits_the_budget_uniformly() -> None:
    got = pcl_roots([0.1, 0.5, 0.9, 0.45, 0.7, 0.0], 12, keep=3)
    assert got.tolist() == [0, 4, 0, 4, 4, 0]


def test_pcl_keeps_exactly_keep_prompts_however_far_from_one_half() -> None:
    # A nearest-m selection, not a band: all four are far from 0.5, the two nearest are kept.
    assert pcl_roots([0.0, 1.0, 0.95, 0.02], 8, keep=2).tolist() == [0, 0, 4, 4]


def test_pcl_breaks_ties_towards_the_lower_index() -> None:
    v = [0.25, 0.75, 0.75, 0.25]  # all 0.25 from 0.5, exactly
    assert pcl_roots(v, 4, keep=2).tolist() == [2, 2, 0, 0]
    assert pcl_roots(v, 6, keep=3).tolist() == [2, 2, 2, 0]


def test_pcl_gives_the_remainder_to_the_closest_kept_prompts_first() -> None:
    assert pcl_roots([0.1, 0.5, 0.375], 9, keep=2).tolist() == [0, 5, 4]
    assert pcl_roots([0.1, 0.375, 0.5], 9, keep=2).tolist() == [0, 4, 5]


def test_pcl_follows_the_target() -> None:
    assert pcl_roots([0.5, 0.8, 0.2, 0.75], 4, keep=2, target=0.8).tolist() == [0, 2, 0, 2]


def test_pcl_kept_set_minimises_the_total_distance_to_the_target() -> None:
    rng = np.random.default_rng(4)
    for _ in range(200):
        n = int(rng.integers(1, 9))
        v = rng.choice([0.0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 1.0], n) if rng.random() < 0.5 else rng.random(n)
        keep = int(rng.integers(1, n + 1))
        low = int(rng.integers(2, 4))
        budget = keep * low + int(rng.integers(0, 10))
        got = pcl_roots(v, budget, keep=keep, min_per_prompt=low)
        kept = np.flatnonzero(got)
        assert got.sum() == budget and kept.size == keep and got[kept].min() >= low
        assert got[kept].max() - got[kept].min() <= 1
        distance = np.abs(v - 0.5)
        best = min(distance[list(s)].sum() for s in itertools.combinations(range(n), keep))
        assert distance[kept].sum() <= best + 1e-12
        # Among equally near subsets the lower indices win: the kept set is the first in stable order.
        assert kept.tolist() == sorted(np.argsort(distance, kind="stable")[:keep].tolist())


def test_pcl_equals_uniform_roots_over_the_kept_prompts() -> None:
    v = np.linspace(0.0, 1.0, 11)
    got = pcl_roots(v, 16, keep=4)
    kept = [5, 4, 6, 3]  # by distance to 0.5, ties to the lower index
    assert got[kept].tolist() == uniform_roots(4, 16).tolist()
    assert got.sum() == 16


@pytest.mark.parametrize(
    ("args", "kwargs", "name"),
    [
        (([0.5, 0.5], 4), {"keep": 0}, "keep"),
        (([0.5, 0.5], 8), {"keep": 3}, "keep"),
        (([0.5, 0.5], 8), {"keep": 1.0}, "keep"),
        (([0.5, 0.5], 3), {"keep": 2}, "budget"),
        (([0.5, 0.5], -1), {"keep": 1}, "budget"),
        (([0.5, 0.5], 4), {"keep": 1, "min_per_prompt": 1}, "min_per_prompt"),
        (([0.5, np.nan], 4), {"keep": 1}, "v"),
        (([0.5, 2.0], 4), {"keep": 1}, "v"),
        (([0.5, 0.5], 4), {"keep": 1, "target": 1.5}, "target"),
        (([0.5, 0.5], 4), {"keep": 1, "target": None}, "target"),
    ],
)
def test_pcl_names_the_bad_argument(args, kwargs, name) -> None:
    with pytest.raises(ValueError, match=name):
        pcl_roots(*args, **kwargs)


def test_the_stage2_objective_benchmark_runs_both_objectives_on_the_same_worlds(capsys):
    """experiments/stage2_objective.py: GRPO (no Stage 2) is the same under both objectives; TRACE's
    rows carry both objectives' figures and their ratio."""
    import json

    module = load("experiments/stage2_objective.py")
    result = module.main(["--prompts", "16", "--budget", "64", "--seeds", "1", "--batches", "2", "--workers", "1"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    assert all(f["ratio"] == 1.0 for f in result["rows"]["grpo"].values())
    assert result["rows"]["grpo"]["most_leaves_unmixed"]["anchor"] <= 64 / 16  # uniform: a group of 4 at most
    oracle = result["rows"]["trace@oracle"]["effective_ratio"]
    assert oracle["ratio"] == oracle["prompt"] / oracle["anchor"]
