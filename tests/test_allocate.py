"""The exact solvers against brute force and exact references; tie-breaking; input checks; baselines."""

from collections.abc import Iterator

import numpy as np
import pytest
from repo_files import load

from trace_rl.core.baselines import random_prefixes, uniform_roots
from trace_rl.core.solvers import allocate_roots, expand_for_prompts, expand_prefixes

bench = load("benchmarks/allocate_speed.py")
"""The benchmark holds the exact references (DP, heap greedy); they are tested here too, because its
`objectives_match` is only as good as they are."""


# ------------------------------------------------------------------------------- brute-force oracle


def root_objective(v, m) -> np.ndarray:
    """Σ V_root per row of allocations, from the definition (independent of trace_rl.core.contrast)."""
    v, m = np.asarray(v, dtype=np.float64), np.asarray(m)
    return np.where(m < 2, 0.0, 1.0 - v**m - (1.0 - v) ** m).sum(axis=-1)


def prefix_objective(v, r, k) -> np.ndarray:
    v, r, k = np.asarray(v, dtype=np.float64), np.asarray(r, dtype=np.float64), np.asarray(k)
    return (1.0 - (r * v + (1.0 - r) * (1.0 - v)) ** k).sum(axis=-1)


def allocations(parts: int, total: int, allowed: list[int]) -> Iterator[tuple[int, ...]]:
    """Every tuple of `parts` values from `allowed` that sums to `total`."""
    if parts == 0:
        if total == 0:
            yield ()
        return
    for first in allowed:
        if first <= total:
            for rest in allocations(parts - 1, total - first, allowed):
                yield (first, *rest)


def brute_force_roots(v, budget: int, low: int, high: int | None) -> float | None:
    """Best objective over every allocation, None when none spends the budget exactly."""
    allowed = [0, *range(low, (budget if high is None else high) + 1)]
    rows = list(allocations(len(v), budget, allowed))
    table = np.array(rows, dtype=np.int64).reshape(len(rows), len(v))
    return float(root_objective(v, table).max()) if len(table) else None


def brute_force_prefixes(v, r, budget: int, cap: int | None) -> float:
    cap = budget if cap is None else cap
    spend = min(budget, cap * len(v))
    rows = list(allocations(len(v), spend, list(range(cap + 1))))
    table = np.array(rows, dtype=np.int64).reshape(len(rows), len(v))
    return float(prefix_objective(v, r, table).max())


def probabilities(rng: np.random.Generator, size: int) -> np.ndarray:
    """Mixes what breaks solvers: ties, exact 0 / 1 / 1/2, coarse grids, and continuous values."""
    kind = rng.integers(4)
    if kind == 0:
        return rng.choice([0.0, 1.0, 0.5, 0.3, 0.7, 0.1, 0.9, 0.25], size)
    if kind == 1:
        return rng.choice(rng.uniform(size=2), size)
    if kind == 2:
        return np.round(rng.uniform(size=size), 1)
    return rng.uniform(size=size)


# --------------------------------------------------------------------------------------- Stage 1


def test_allocate_roots_matches_brute_force() -> None:
    rng = np.random.default_rng(0)
    infeasible = 0
    for _ in range(2000):
        prompts, low = int(rng.integers(0, 6)), int(rng.integers(2, 5))
        high = None if rng.uniform() < 0.3 else int(rng.integers(low, 9))
        budget = int(rng.integers(0, 13))
        if high is not None and rng.uniform() < 0.15:
            budget = prompts * high  # tight: every prompt full
        v = probabilities(rng, prompts)
        best = brute_force_roots(v, budget, low, high)
        if best is None:
            infeasible += 1
            with pytest.raises(ValueError, match="budget"):
                allocate_roots(v, budget, min_per_prompt=low, max_per_prompt=high)
            continue
        m = allocate_roots(v, budget, min_per_prompt=low, max_per_prompt=high)
        assert m.sum() == budget
        assert np.all((m == 0) | ((m >= low) & (m <= (budget if high is None else high))))
        assert root_objective(v, m) == pytest.approx(best, abs=1e-12)
    assert infeasible > 100  # the sample does exercise the error path


def test_allocate_roots_matches_dynamic_program_on_larger_inputs() -> None:
    rng = np.random.default_rng(1)
    for _ in range(60):
        prompts, low = int(rng.integers(1, 40)), int(rng.integers(2, 6))
        high = None if rng.uniform() < 0.4 else int(rng.integers(low, 20))
        budget = int(rng.integers(low, prompts * (high or 10) + 1))
        v = probabilities(rng, prompts)
        best = bench.dp_roots_value(v, budget, low, high)
        if best == -np.inf:
            with pytest.raises(ValueError):
                allocate_roots(v, budget, min_per_prompt=low, max_per_prompt=high)
            continue
        m = allocate_roots(v, budget, min_per_prompt=low, max_per_prompt=high)
        assert m.sum() == budget
        assert root_objective(v, m) == pytest.approx(best, rel=1e-12, abs=1e-12)


def test_allocate_roots_is_uniform_when_every_prediction_is_one_half() -> None:
    # Before the predictor has data it says 0.5 everywhere; TRACE must then match GRPO's split.
    assert allocate_roots(np.full(4096, 0.5), 65_536).tolist() == [16] * 4096
    assert allocate_roots(np.full(5, 0.5), 17).tolist() == [4, 4, 3, 3, 3]


def test_allocate_roots_breaks_ties_towards_the_lower_index() -> None:
    v = np.array([0.25, 0.75, 0.25, 0.75, 0.25])  # identical prompts: min(v, 1 - v) = 0.25 exactly
    m = allocate_roots(v, 11)
    assert np.all(np.diff(m) <= 0)  # nothing goes to a later prompt before an earlier one
    assert np.array_equal(m, allocate_roots(v, 11))


def test_allocate_roots_filters_out_prompts_without_contrast() -> None:
    m = allocate_roots([0.0, 1.0, 0.5, 0.2], 4)
    assert m.tolist() == [0, 0, 4, 0]  # 1 - 2/16 beats 1/2 + 0.32 for two pairs
    assert allocate_roots([0.0, 1.0, 0.5], 6).tolist() == [0, 0, 6]


def test_allocate_roots_spends_a_large_budget_exactly_within_bounds() -> None:
    v = np.random.default_rng(2).uniform(size=4096)
    for high in (None, 32):
        m = allocate_roots(v, 65_536, max_per_prompt=high)
        assert m.dtype == np.int64 and m.shape == (4096,) and m.sum() == 65_536
        assert np.all((m == 0) | ((m >= 2) & (m <= (high or 65_536))))


@pytest.mark.parametrize(
    ("v", "budget", "low", "high", "reason"),
    [
        ([0.5, 0.5], 1, 2, None, "budget=1 cannot be placed: a prompt gets 0 or at least min_per_prompt=2"),
        ([0.5, 0.5], 9, 2, 4, "budget=9 exceeds the capacity of 2 prompts x max_per_prompt=4"),
        ([0.5, 0.5, 0.5], 7, 4, 5, "no number of prompts"),
        ([], 4, 2, None, "v is empty"),
    ],
)
def test_allocate_roots_raises_when_the_budget_cannot_be_placed_exactly(v, budget, low, high, reason) -> None:
    with pytest.raises(ValueError, match=reason):
        allocate_roots(v, budget, min_per_prompt=low, max_per_prompt=high)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"v": [0.5, np.nan]}, "v"),
        ({"v": [0.5, 1.5]}, "v"),
        ({"v": [-0.1]}, "v"),
        ({"v": [[0.5, 0.5]]}, "v must be 1-D"),
        ({"v": ["high"]}, "v must be"),
        ({"budget": -1}, "budget must be >= 0"),
        ({"budget": 2.5}, "budget must be an integer"),
        ({"budget": 4.0}, "budget must be an integer"),
        ({"budget": True}, "budget must be an integer"),
        ({"min_per_prompt": 1}, "min_per_prompt must be >= 2"),
        ({"max_per_prompt": 3, "min_per_prompt": 4}, "max_per_prompt=3 must be >= min_per_prompt=4"),
        ({"max_per_prompt": 2.0}, "max_per_prompt must be an integer"),
    ],
)
def test_allocate_roots_names_the_bad_argument(kwargs, name) -> None:
    arguments = {"v": [0.5, 0.5], "budget": 4} | kwargs
    with pytest.raises(ValueError, match=name):
        allocate_roots(arguments.pop("v"), arguments.pop("budget"), **arguments)


def test_allocate_roots_accepts_lists_and_numpy_integers() -> None:
    assert allocate_roots([0.5, 0.4], np.int32(4), min_per_prompt=np.int64(2)).tolist() == [2, 2]
    assert allocate_roots([0.5], 0).tolist() == [0] and allocate_roots([], 0).shape == (0,)


# --------------------------------------------------------------------------------------- Stage 2


def test_expand_prefixes_matches_brute_force() -> None:
    rng = np.random.default_rng(3)
    for _ in range(2000):
        candidates, budget = int(rng.integers(0, 7)), int(rng.integers(0, 11))
        cap = None if rng.uniform() < 0.3 else int(rng.integers(0, 4))
        v, r = probabilities(rng, candidates), rng.integers(0, 2, candidates).astype(np.float64)
        k = expand_prefixes(v, r, budget, max_per_prefix=cap)
        capacity = budget if cap is None else cap * candidates
        assert k.sum() == (min(budget, capacity) if candidates else 0)
        assert np.all((k >= 0) & (k <= (budget if cap is None else cap)))
        assert prefix_objective(v, r, k) == pytest.approx(brute_force_prefixes(v, r, budget, cap), abs=1e-12)


def prompt_objective(v, r, prompts, mixed, k) -> np.ndarray:
    """Expected prompts that end mixed, per row of allocations, from the definition: a mixed prompt
    counts 1; an agreeing one 1 - P(every continuation repeats its outcome)."""
    v, r, k = np.asarray(v, dtype=np.float64), np.asarray(r, dtype=np.float64), np.atleast_2d(k)
    repeat = (r * v + (1.0 - r) * (1.0 - v)) ** k  # per candidate: all its continuations repeat r
    total = np.zeros(k.shape[0])
    for group in np.unique(prompts):
        members = np.flatnonzero(np.asarray(prompts) == group)
        total += 1.0 if mixed[members[0]] else 1.0 - repeat[:, members].prod(axis=1)
    return total


def agreeing_prompts(rng: np.random.Generator, candidates: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Candidates of up to three prompts: an agreeing prompt's candidates share one outcome r."""
    prompts = rng.integers(0, 3, candidates)
    mixed_prompt = rng.uniform(size=3) < 0.3
    outcome = rng.integers(0, 2, 3).astype(np.float64)
    r = np.where(mixed_prompt[prompts], rng.integers(0, 2, candidates), outcome[prompts]).astype(np.float64)
    return probabilities(rng, candidates), r, prompts, mixed_prompt[prompts]


def test_expand_for_prompts_maximises_the_expected_mixed_prompts_as_brute_force_does() -> None:
    rng = np.random.default_rng(5)
    for _ in range(1500):
        candidates, budget = int(rng.integers(0, 6)), int(rng.integers(0, 8))
        cap = None if rng.uniform() < 0.3 else int(rng.integers(0, 4))
        v, r, prompts, mixed = agreeing_prompts(rng, candidates)
        k = expand_for_prompts(v, r, prompts, mixed, budget, max_per_prefix=cap)
        limit = budget if cap is None else cap
        spend = min(budget, limit * candidates)
        assert k.sum() == spend and np.all((k >= 0) & (k <= limit))
        if candidates:
            table = np.array(list(allocations(candidates, spend, list(range(limit + 1)))), dtype=np.int64)
            best = prompt_objective(v, r, prompts, mixed, table).max()
            assert prompt_objective(v, r, prompts, mixed, k)[0] == pytest.approx(best, abs=1e-12)


def test_expand_for_prompts_spends_on_mixed_prompts_only_what_agreeing_ones_cannot_use() -> None:
    # prompt 0 agrees on failure (r = 0) and can flip; prompt 1 is already mixed
    v, r, prompts, mixed = [0.4, 0.6, 0.5], [0.0, 1.0, 0.0], [0, 1, 1], [False, True, True]
    assert expand_for_prompts(v, r, prompts, mixed, 2, max_per_prefix=None).tolist() == [2, 0, 0]
    # capped at one continuation, prompt 0 takes one; the rest follows the paper's gains (candidate 2's
    # chance to flip, 0.5, beats candidate 1's 0.4)
    assert expand_for_prompts(v, r, prompts, mixed, 2, max_per_prefix=1).tolist() == [1, 0, 1]
    # with every prompt mixed it is the paper's Stage 2
    rng = np.random.default_rng(6)
    for _ in range(300):
        n, budget = int(rng.integers(1, 8)), int(rng.integers(0, 12))
        cap = None if rng.uniform() < 0.3 else int(rng.integers(1, 4))
        v, r = probabilities(rng, n), rng.integers(0, 2, n).astype(np.float64)
        ours = expand_for_prompts(v, r, np.zeros(n, dtype=int), np.ones(n, dtype=bool), budget, max_per_prefix=cap)
        assert prefix_objective(v, r, ours) == pytest.approx(prefix_objective(v, r, expand_prefixes(v, r, budget, max_per_prefix=cap)), abs=1e-12)


def test_expand_prefixes_matches_heap_greedy_on_larger_inputs() -> None:
    rng = np.random.default_rng(4)
    for _ in range(40):
        candidates, budget = int(rng.integers(1, 400)), int(rng.integers(0, 3000))
        cap = None if rng.uniform() < 0.3 else int(rng.integers(1, 10))
        v, r = probabilities(rng, candidates), rng.integers(0, 2, candidates).astype(np.float64)
        k = expand_prefixes(v, r, budget, max_per_prefix=cap)
        reference = bench.heap_prefixes(v, r, budget, cap)
        assert k.sum() == reference.sum()
        assert prefix_objective(v, r, k) == pytest.approx(prefix_objective(v, r, reference), rel=1e-12, abs=1e-12)


def test_expand_prefixes_is_exact_on_large_inputs_with_ties() -> None:
    # 40,000 candidates take the strided-sample path; heavy ties take the equal-keys path.
    rng = np.random.default_rng(5)
    for v in (rng.uniform(size=40_000), np.full(40_000, 0.5), rng.choice([0.1, 0.5, 0.8], 40_000)):
        r = rng.integers(0, 2, v.size).astype(np.float64)
        k = expand_prefixes(v, r, 15_000, max_per_prefix=4)
        reference = bench.heap_prefixes(v, r, 15_000, 4)
        assert k.sum() == 15_000
        assert prefix_objective(v, r, k) == pytest.approx(prefix_objective(v, r, reference), rel=1e-12)


def test_expand_prefixes_spends_on_hopeless_prefixes_only_when_the_rest_is_full() -> None:
    v, r = np.array([1.0, 0.3, 0.0]), np.array([1.0, 1.0, 0.0])  # q = 1, 0.3, 1
    assert expand_prefixes(v, r, 2, max_per_prefix=2).tolist() == [0, 2, 0]
    assert expand_prefixes(v, r, 4, max_per_prefix=2).tolist() == [2, 2, 0]  # gainless: lower index first
    assert expand_prefixes(v, r, 9, max_per_prefix=2).tolist() == [2, 2, 2]  # capacity caps the spend


def test_expand_prefixes_gives_a_sure_flip_a_single_continuation() -> None:
    # q = 0: the first continuation flips the outcome for sure, a second one adds nothing.
    assert expand_prefixes([0.0, 0.5], [1.0, 1.0], 3).tolist() == [1, 2]


def test_expand_prefixes_breaks_ties_towards_the_lower_index() -> None:
    k = expand_prefixes(np.full(7, 0.5), np.ones(7), 10, max_per_prefix=3)
    assert k.tolist() == [2, 2, 2, 1, 1, 1, 1]


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"v": [np.nan, 0.5]}, "v"),
        ({"v": [0.5, 2.0]}, "v"),
        ({"r": [1.0, 0.5]}, "r must be 0 or 1"),
        ({"r": [1.0]}, "r has 1 entries but v has 2"),
        ({"r": [[1.0, 0.0]]}, "r must be 1-D"),
        ({"budget": -3}, "budget must be >= 0"),
        ({"budget": 1.5}, "budget must be an integer"),
        ({"max_per_prefix": -1}, "max_per_prefix must be >= 0"),
        ({"max_per_prefix": 2.0}, "max_per_prefix must be an integer"),
    ],
)
def test_expand_prefixes_names_the_bad_argument(kwargs, name) -> None:
    arguments = {"v": [0.5, 0.5], "r": [1.0, 0.0], "budget": 4} | kwargs
    with pytest.raises(ValueError, match=name):
        expand_prefixes(arguments.pop("v"), arguments.pop("r"), arguments.pop("budget"), **arguments)


# --------------------------------------------------------------------------------------- references


def test_benchmark_references_match_brute_force() -> None:
    rng = np.random.default_rng(6)
    for _ in range(300):
        size, budget = int(rng.integers(1, 5)), int(rng.integers(0, 10))
        v = probabilities(rng, size)
        best = brute_force_roots(v, budget, 2, 5)
        assert bench.dp_roots_value(v, budget, 2, 5) == pytest.approx(-np.inf if best is None else best, abs=1e-12)
        r = rng.integers(0, 2, size).astype(np.float64)
        heap = bench.heap_prefixes(v, r, budget, 3)
        assert prefix_objective(v, r, heap) == pytest.approx(brute_force_prefixes(v, r, budget, 3), abs=1e-12)


# ---------------------------------------------------------------------------------------- baselines


def test_uniform_roots_splits_equally_with_the_remainder_first() -> None:
    assert uniform_roots(4, 32).tolist() == [8, 8, 8, 8]
    assert uniform_roots(5, 13).tolist() == [3, 3, 3, 2, 2]
    assert uniform_roots(3, 0).tolist() == [0, 0, 0]


def test_uniform_roots_keeps_min_per_prompt_when_the_budget_is_short() -> None:
    m = uniform_roots(10, 7, min_per_prompt=2)
    assert m.tolist() == [3, 2, 2, 0, 0, 0, 0, 0, 0, 0]
    assert uniform_roots(10, 9, min_per_prompt=4).tolist() == [5, 4] + [0] * 8


def test_uniform_roots_raises_when_no_prompt_can_get_min_per_prompt() -> None:
    with pytest.raises(ValueError, match="min_per_prompt=2"):
        uniform_roots(3, 1)
    with pytest.raises(ValueError, match="no prompts"):
        uniform_roots(0, 4)
    with pytest.raises(ValueError, match="num_prompts"):
        uniform_roots(-1, 4)


def test_random_prefixes_spends_exactly_and_respects_the_cap() -> None:
    rng = np.random.default_rng(7)
    for candidates, budget, cap in [(50, 120, 3), (50, 150, 3), (50, 400, 3), (7, 1000, None), (0, 5, 2), (5, 5, 0)]:
        k = random_prefixes(candidates, budget, rng=rng, max_per_prefix=cap)
        assert k.dtype == np.int64 and k.shape == (candidates,)
        assert k.sum() == (min(budget, candidates * cap) if cap is not None else (budget if candidates else 0))
        assert cap is None or k.max(initial=0) <= cap


def test_random_prefixes_is_reproducible_with_a_seeded_rng() -> None:
    draw = lambda seed: random_prefixes(100, 250, rng=np.random.default_rng(seed), max_per_prefix=4)  # noqa: E731
    assert np.array_equal(draw(3), draw(3))
    assert not np.array_equal(draw(3), draw(4))


def test_random_prefixes_needs_a_generator() -> None:
    with pytest.raises(ValueError, match="rng must be a numpy.random.Generator"):
        random_prefixes(10, 5, rng=0)


@pytest.mark.parametrize(("prompts", "budget"), [(4, 8), (8, 16), (5, 13), (64, 128), (4096, 8192)])
def test_allocate_roots_with_no_information_falls_back_to_the_uniform_split(prompts, budget):
    # v = 1/2 everywhere (an untrained predictor): several allocations tie, and ties go to coverage
    allocation = allocate_roots(np.full(prompts, 0.5), budget)
    assert np.array_equal(np.sort(allocation)[::-1], np.sort(uniform_roots(prompts, budget))[::-1])
