"""How well Stage 2's success estimates of the prefixes it expanded foretold their continuations, on a run's saved trees.

Replays `trace_rl.planning.evidence.Stage2Evidence` online over a TRACE run's trees (`<run>/trees/step_*.jsonl`),
step by step as training would: each step's continuations are scored before the model refits on them.
Beside it, the predictor's own estimate (the paper's Stage-2 value, what `predicted` recorded) and a
constant that predicts the mean continuation outcome of the steps before. Also the share of
continuations that repeat the outcome of the bare rollout they branched from, by the prefix's turn,
and the continuations' success by what the prompt's bare rollouts showed.

    python experiments/stage2_evidence.py RUN [RUN ...] [--after 5]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from trace_rl.core.tree import read_jsonl
from trace_rl.planning.evidence import Stage2Evidence, continuations


def replay(run: Path, after: int, threshold: float = 0.5) -> dict[str, Any]:
    """The figures of one run (see the module docstring), over the steps after `after`."""
    files = sorted((run / "trees").glob("step_*.jsonl"))
    if not files:
        raise SystemExit(f"{run}: no trees/step_*.jsonl (a run saves its trees unless train.save_trees is false)")
    model = Stage2Evidence()
    squared: dict[str, float] = {"predictor": 0.0, "evidence": 0.0, "constant": 0.0}  # summed over continuations
    rows_after, past = [], []
    for path in files:
        step = int(path.stem.removeprefix("step_"))
        trees = read_jsonl(path)
        rows = continuations(trees, threshold)
        constant = float(np.mean(past)) if past else 0.5
        metrics = model.observe(trees, threshold)  # scores with the fit it had before this step, as training does
        if step > after and rows.size:
            y = rows[:, 5]
            squared["predictor"] += metrics["stage2/brier_predictor"] * y.size
            squared["evidence"] += metrics["stage2/brier_evidence"] * y.size
            squared["constant"] += float(np.sum((constant - y) ** 2))
            rows_after.append(rows)
        past += rows[:, 5].tolist()
    if not rows_after:
        raise SystemExit(f"{run}: no continuation after step {after}")
    rows = np.concatenate(rows_after)
    v, depth, r, s, n, y = rows.T
    repeats = {int(d): round(float(np.mean(y[depth == d] == r[depth == d])), 3) for d in np.unique(depth)}
    by_prompt = {
        name: {"continuations": int(mask.sum()), "success": round(float(y[mask].mean()), 3), "predicted": round(float(v[mask].mean()), 3)}
        for name, mask in (("bare all failed", s == 0), ("bare mixed", (s > 0) & (s < n)), ("bare all succeeded", s == n))
        if mask.any()
    }
    return {
        "run": str(run),
        "steps_scored": len(rows_after),
        "continuations": int(y.size),
        "brier": {name: round(total / y.size, 4) for name, total in squared.items()},
        "repeats_bare_outcome_by_turn": repeats,
        "by_bare_outcomes": by_prompt,
        "fit_at_end": {"prior_strength": model.prior_strength, "prompt_weight": model.prompt_weight},
    }


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders of a TRACE run (with trees/)")
    parser.add_argument("--after", type=int, default=5, help="score the steps after this one (default 5, the predictor's warm-up)")
    args = parser.parse_args(argv)
    results = [replay(run, args.after) for run in args.runs]
    print(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
