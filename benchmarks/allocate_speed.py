"""Speed of the exact allocators against straightforward exact references; prints one JSON object.

References (exact, independent of the solvers' proofs; tests/test_allocate.py checks them too):
- Stage 1, `dp_roots_value`: a Knapsack-RL-style dynamic program over the budget, numpy over budget
  levels and Python over prompts and sizes: O(prompts x budget x max_per_prompt). It computes the
  optimal objective only (no allocation), so its times are a lower bound for a full DP solver.
  Uncapped, max_per_prompt is the budget and the DP at full size would run for hours, so that case is
  also timed at a smaller size (same rollouts per prompt), and the JSON says so.
- Stage 2, `heap_prefixes`: the priority-queue greedy in pure Python (heapq), exact because each
  prefix's gains q^k (1 - q) never increase.

    python benchmarks/allocate_speed.py [--repeat N] [--seed S] [--scale F] [--quick]

`--quick` (`make bench`): every size an eighth, 3 repeats, a few seconds.
"""

from __future__ import annotations

import argparse
import heapq
import time
from collections.abc import Callable
from typing import TypeVar

import numpy as np
from common import arguments, emit, parse_args

from trace_rl.core.contrast import prefix_value, root_value
from trace_rl.core.solvers import allocate_roots, expand_prefixes

T = TypeVar("T")


def dp_roots_value(v: np.ndarray, budget: int, min_per_prompt: int = 2, max_per_prompt: int | None = None) -> float:
    """Best Σ root_value(v_i, m_i) with m_i ∈ {0} ∪ [min, max] and Σ m_i == budget; -inf if infeasible."""
    high = budget if max_per_prompt is None else min(max_per_prompt, budget)
    best = np.full(budget + 1, -np.inf)  # best[b]: best value of the prompts so far using exactly b
    best[0] = 0.0
    for value in v:
        after = best.copy()
        for m in range(min_per_prompt, high + 1):
            np.maximum(after[m:], best[: budget + 1 - m] + float(root_value(value, m)), out=after[m:])
        best = after
    return float(best[budget])


def heap_prefixes(v: np.ndarray, r: np.ndarray, budget: int, max_per_prefix: int | None = None) -> np.ndarray:
    """Stage 2 by a max-heap of next gains: pop the best, give it a continuation, push its next gain."""
    flip = [float(x) for x in np.abs(r - v)]  # p = 1 - q; the next gain is p q^k
    cap = budget if max_per_prefix is None else max_per_prefix
    counts = [0] * len(flip)
    heap = [(-p, i) for i, p in enumerate(flip)] if cap > 0 else []
    heapq.heapify(heap)
    for _ in range(min(budget, cap * len(flip))):
        gain, i = heapq.heappop(heap)
        counts[i] += 1
        if counts[i] < cap:
            heapq.heappush(heap, (gain * (1.0 - flip[i]), i))
    return np.array(counts, dtype=np.int64)


def best_time(run: Callable[[], T], repeat: int) -> tuple[float, T]:
    """Fastest of `repeat` runs (seconds) and the last result."""
    fastest = np.inf
    for _ in range(repeat):
        start = time.perf_counter()
        result = run()
        fastest = min(fastest, time.perf_counter() - start)
    return fastest, result


def roots_case(v: np.ndarray, budget: int, max_per_prompt: int | None, repeat: int) -> dict[str, float | bool]:
    """Time allocate_roots and the DP (once: it takes seconds) on one input; compare objectives."""
    ours_s, allocation = best_time(lambda: allocate_roots(v, budget, max_per_prompt=max_per_prompt), repeat)
    reference_s, reference = best_time(lambda: dp_roots_value(v, budget, 2, max_per_prompt), 1)
    objective = float(root_value(v, allocation).sum())
    return {
        "ours_s": ours_s,
        "reference_s": reference_s,
        "speedup": reference_s / ours_s,
        "objective": objective,
        "reference_objective": reference,
        "objectives_match": bool(abs(objective - reference) <= 1e-9 * max(1.0, reference)),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20, help="runs of our solvers; the best counts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scale", type=float, default=1.0, help="every size times this (1: 4,096 prompts, 200,000 candidates)")
    args = parse_args(parser, argv, repeat=3, scale=0.125)
    rng = np.random.default_rng(args.seed)
    prompts, budget = round(4096 * args.scale), round(65_536 * args.scale)
    v = rng.uniform(size=prompts)

    capped = {"prompts": prompts, "budget": budget, "min_per_prompt": 2, "max_per_prompt": 32}
    capped |= roots_case(v, budget, 32, args.repeat)

    uncapped_s, _ = best_time(lambda: allocate_roots(v, budget), args.repeat)
    # the DP is O(P B^2) uncapped: timed on the first prompts, with the same 16 rollouts per prompt
    small_prompts = max(16, round(128 * args.scale))
    small_budget = small_prompts * budget // prompts
    small = roots_case(v[:small_prompts], small_budget, None, args.repeat)
    uncapped = {
        "prompts": prompts,
        "budget": budget,
        "min_per_prompt": 2,
        "max_per_prompt": None,
        "ours_s": uncapped_s,
        "reference_note": "the DP is O(prompts x budget^2) uncapped, so it runs on the first prompts only",
        "at_reference_size": {"prompts": small_prompts, "budget": small_budget} | small,
        # An estimate, not a measurement: the DP's work grows with prompts x budget^2.
        "reference_s_full_size_extrapolated": (
            small["reference_s"] * (prompts / small_prompts) * (budget / small_budget) ** 2
        ),
    }

    candidates, prefix_budget, per_prefix = round(200_000 * args.scale), round(65_536 * args.scale), 8
    pv, pr = rng.uniform(size=candidates), (rng.uniform(size=candidates) < 0.5).astype(np.float64)
    ours_s, counts = best_time(lambda: expand_prefixes(pv, pr, prefix_budget, max_per_prefix=per_prefix), args.repeat)
    heap_s, heap_counts = best_time(lambda: heap_prefixes(pv, pr, prefix_budget, per_prefix), 3)
    objective = float(prefix_value(pv, pr, counts).sum())
    reference = float(prefix_value(pv, pr, heap_counts).sum())
    prefixes = {
        "candidates": candidates,
        "budget": prefix_budget,
        "max_per_prefix": per_prefix,
        "ours_s": ours_s,
        "reference": "heapq greedy, best of 3",
        "reference_s": heap_s,
        "speedup": heap_s / ours_s,
        "objective": objective,
        "reference_objective": reference,
        "objectives_match": bool(abs(objective - reference) <= 1e-9 * max(1.0, reference)),
    }

    emit(
        "allocate_speed",
        config=arguments(args),
        results={"allocate_roots": {"max_per_prompt_32": capped, "uncapped": uncapped}, "expand_prefixes": prefixes},
        baseline="Stage 1: the knapsack DP (dp_roots_value, objective only); Stage 2: the heapq greedy (heap_prefixes)",
        speedup={
            "allocate_roots_max_per_prompt_32": capped["speedup"],
            "allocate_roots_uncapped_at_reference_size": small["speedup"],
            "expand_prefixes": prefixes["speedup"],
        },
    )


if __name__ == "__main__":
    main()
