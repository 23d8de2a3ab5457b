"""TRACE under a token budget (`rollout.budget_unit: tokens`) against TRACE under the paper's leaf
budget, at an equal number of generated tokens; and the token solvers' speed beside the leaf ones'.

Allocation: the allocation benchmark (`trace_rl.research.bench`: the latent-tree simulator, the planner that
trains) first runs `grpo`, `trace` (learned predictor) and `trace@oracle` with `--budget` leaves a
batch. Each row's mean generated tokens per batch then becomes that row's token budget in a second
run with `budget_unit: tokens`, on the same worlds and prompts, so each pair spends the same tokens
(the token rows learn their costs from their own trees; what they spent is printed). Figures per
row: effective ratio, mixed-budget share, leaves, generated tokens, and per 1,000 generated tokens
the leaves in mixed prompts and the mixed prompts (what a GPU step buys), with ratios token / leaf.

Speed: `allocate_roots_by_cost` / `expand_prefixes_by_cost` against `allocate_roots` /
`expand_prefixes` on the same values, at the paper-regime scale (32 prompts, 64 leaves; ~100
prefixes) and at a large batch (512 prompts, 1,024 leaves; 1,500 prefixes), costs drawn so each
solve spends about the same rollouts; median of `--repeats` calls, and the ratio.

    python experiments/token_budget.py [--prompts 64] [--budget 384] [--seeds 5] [--batches 20] [--workers 2] [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from trace_rl.core.solvers import allocate_roots, expand_prefixes
from trace_rl.core.token_budget import allocate_roots_by_cost, expand_prefixes_by_cost
from trace_rl.research.bench import TOKEN_FIGURES, run_benchmark

ROWS = ("grpo", "trace", "trace@oracle")
SHOWN = ("effective_ratio", "mixed_budget_share", *TOKEN_FIGURES)


def allocation(args: argparse.Namespace) -> dict[str, Any]:
    common = {"prompts_per_batch": args.prompts, "seeds": args.seeds, "batches": args.batches, "warmup_batches": args.batches, "workers": args.workers}
    leaves = run_benchmark(**common, budget=args.budget, methods=ROWS)
    rows: dict[str, Any] = {}
    seconds = leaves["seconds"]
    for row in ROWS:
        tokens = int(round(leaves["methods"][row]["tokens_generated"]))
        spent = run_benchmark(**common, budget=tokens, budget_unit="tokens", methods=(row,))
        seconds += spent["seconds"]
        leaf, token = leaves["methods"][row], spent["methods"][row]
        rows[row] = {"token_budget": tokens, **{
            name: {"leaves": leaf[name], "tokens": token[name], "leaves_std": leaf[f"{name}_std"], "tokens_std": token[f"{name}_std"],
                   "ratio": token[name] / leaf[name] if leaf[name] else float("nan")}
            for name in SHOWN
        }}
    return {"rows": rows, "seconds": round(seconds, 1)}


def median_seconds(solve: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        solve()
        times.append(time.perf_counter() - begin)
    return float(np.median(times))


def speed(repeats: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    out = {}
    for prompts, leaves, prefixes in ((32, 64, 100), (512, 1024, 1500)):
        v = rng.random(prompts)
        costs = rng.uniform(30.0, 90.0, size=prompts)  # fresh rollouts of 30-90 tokens
        budget = int(leaves * costs.mean())
        leaf = median_seconds(lambda: allocate_roots(v, leaves), repeats)
        token = median_seconds(lambda: allocate_roots_by_cost(v, costs, budget), repeats)
        out[f"stage1_{prompts}_prompts"] = {"leaf_s": leaf, "token_s": token, "ratio": token / leaf}
        pv, r = rng.random(prefixes), rng.integers(0, 2, size=prefixes).astype(float)
        pcosts = rng.uniform(10.0, 60.0, size=prefixes)  # continuations: the turns after the prefix
        pbudget = int(leaves / 2 * pcosts.mean())
        leaf = median_seconds(lambda: expand_prefixes(pv, r, leaves // 2), repeats)
        token = median_seconds(lambda: expand_prefixes_by_cost(pv, r, pcosts, pbudget), repeats)
        out[f"stage2_{prefixes}_prefixes"] = {"leaf_s": leaf, "token_s": token, "ratio": token / leaf}
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=64, help="candidate prompts per batch (default 64, the benchmark's)")
    parser.add_argument("--budget", type=int, default=384, help="leaves per batch of the leaf rows (default 384)")
    parser.add_argument("--seeds", type=int, default=5, help="simulated worlds (default 5)")
    parser.add_argument("--batches", type=int, default=20, help="reported batches per world (default 20)")
    parser.add_argument("--workers", type=int, default=2, help="processes running worlds side by side")
    parser.add_argument("--repeats", type=int, default=20, help="solver calls timed per case (median)")
    args = parser.parse_args(argv)
    result = {"bench": "token_budget", "prompts": args.prompts, "budget": args.budget, "seeds": args.seeds, "batches": args.batches,
              "allocation": allocation(args), "speed": speed(args.repeats)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
