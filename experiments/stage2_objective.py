"""TRACE's Stage 2 with the paper's objective (`anchor`) against the one that counts prompts (`prompt`).

The paper's V_pref values a prefix by the chance that its anchor turns mixed, but the effective ratio
counts prompts: one flip in a prompt whose bare rollouts all agree makes that prompt useful, more
flips in a prompt that already mixed add no prompt. `rollout.stage2_objective: prompt`
(`trace_rl.core.solvers.expand_for_prompts`) maximises the expected number of prompts that end mixed;
it values nothing else, so what the agreeing prompts cannot use well still goes to them, down to long
shots (`most_leaves_unmixed`: the most rollouts one prompt got without mixing, a batch's mean).
This runs the allocation benchmark (`trace_rl.research.bench`, the latent-tree simulator, the planner that
trains) twice on the same worlds and prompts, once per objective, for `trace` with the learned
predictor and `trace@oracle` (true probabilities), and prints both objectives' figures side by side
with their ratio (prompt / anchor); `grpo` is the uniform reference (Stage 2 does not touch it).

    python experiments/stage2_objective.py [--prompts 64] [--budget 384] [--seeds 5] [--batches 20] [--workers 2] [--evidence]

`--evidence`: both objectives allocate with the evidence posterior (`rollout.stage2_evidence`,
`trace_rl.planning.evidence`); run it with and without to see what the posterior changes on the simulator.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from trace_rl.planning.metrics import FIGURES
from trace_rl.research.bench import run_benchmark

ROWS = ("grpo", "trace", "trace@oracle")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=64, help="candidate prompts per batch (default 64, the benchmark's)")
    parser.add_argument("--budget", type=int, default=384, help="leaves per batch (default 384)")
    parser.add_argument("--seeds", type=int, default=5, help="simulated worlds (default 5)")
    parser.add_argument("--batches", type=int, default=20, help="reported batches per world (default 20)")
    parser.add_argument("--workers", type=int, default=2, help="processes running worlds side by side")
    parser.add_argument("--evidence", action="store_true", help="Stage 2 allocates with the evidence posterior (trace_rl.planning.evidence)")
    args = parser.parse_args(argv)
    common = {"prompts_per_batch": args.prompts, "budget": args.budget, "seeds": args.seeds, "batches": args.batches,
              "warmup_batches": args.batches, "methods": ROWS, "workers": args.workers, "stage2_evidence": args.evidence}
    runs = {objective: run_benchmark(**common, stage2_objective=objective) for objective in ("anchor", "prompt")}
    rows: dict[str, Any] = {}
    for row in ROWS:
        figures = {}
        for name in (*FIGURES, "most_leaves_unmixed"):
            anchor, prompt = runs["anchor"]["methods"][row][name], runs["prompt"]["methods"][row][name]
            figures[name] = {"anchor": anchor, "prompt": prompt, "ratio": prompt / anchor if anchor else float("nan")}
        rows[row] = figures
    result = {"bench": "stage2_objective", **{k: v for k, v in common.items() if k != "methods"}, "rows": rows,
              "seconds": round(sum(run["seconds"] for run in runs.values()), 1)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
