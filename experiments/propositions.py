"""The TRACE paper's three propositions, measured on real training trees.

1. **Prefix information improves the prediction of a group's outcome.** Two shared predictors
   (`HashedNgramPredictor`) learn online from the same backup targets of a run's steps, one from the
   full histories, one from the prompt alone (every history cut to its root). Each is scored on a
   step's intermediate-prefix targets *before* it learns from that step (held out), by weighted
   log-loss; a running-mean constant is scored beside them.
2. **Contrast potential tracks V(1 − V).** At every node the allocator valued (a root in Stage 1, a
   prefix in Stage 2) with the estimate V it used (`Node.predicted`, made before the outcomes), the
   rollouts that *started* there are n fresh draws from it (a root's bare rollouts, a prefix's
   continuations). Binned by V(1 − V): how often those n draws mixed, against the chance the
   estimate implies, 1 − V^n − (1 − V)^n, and the correlation of V(1 − V) with mixing over nodes.
3. **Active allocation beats uniform.** Each run's mean `tree/effective_ratio` and
   `tree/mixed_budget_share` over its steps, by method (from `metrics.jsonl`).

    python experiments/propositions.py RUN_DIR [RUN_DIR ...] [--warmup 5]

RUN_DIR is a `trace-rl train` run folder with `trees/step_XXXX.jsonl` (a comparison's
`DIR/<method>/seed_<k>`). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from trace_rl.core.tree import History, RolloutTree, read_jsonl
from trace_rl.predictor import HashedNgramPredictor, PredictorConfig, backup_targets
from trace_rl.storage.rundir import read_metrics

BINS = (0.0, 0.05, 0.10, 0.15, 0.20, 0.2501)
"""Bins of V(1 − V), which lies in [0, 0.25]."""


def run_steps(run_dir: Path) -> list[list[RolloutTree]]:
    files = sorted((run_dir / "trees").glob("step_*.jsonl"))
    if not files:
        raise SystemExit(f"{run_dir}: no trees/step_*.jsonl")
    return [read_jsonl(f) for f in files]


def log_loss(p: np.ndarray, y: np.ndarray, w: np.ndarray) -> float:
    p = np.clip(p, 1e-6, 1.0 - 1e-6)
    return float(np.sum(w * -(y * np.log(p) + (1.0 - y) * np.log(1.0 - p))) / np.sum(w))


def prefix_information(steps: Sequence[Sequence[RolloutTree]], warmup: int) -> dict[str, float]:
    """Proposition 1: held-out log-loss on prefix targets, with and without the prefix's turns."""
    full, prompt_only = HashedNgramPredictor(PredictorConfig(), seed=0), HashedNgramPredictor(PredictorConfig(), seed=0)
    seen_sum = seen_weight = 0.0
    scores: dict[str, list[float]] = defaultdict(list)
    for index, trees in enumerate(steps):
        histories, y, w = backup_targets(trees)
        if not histories:
            continue
        cut = [History(h.prompt, (), h.task_id) for h in histories]
        prefix = np.array([bool(h.turns) for h in histories])
        if index >= warmup and prefix.any():
            scores["with_prefix"].append(log_loss(full.predict(histories)[prefix], y[prefix], w[prefix]))
            scores["prompt_only"].append(log_loss(prompt_only.predict(cut)[prefix], y[prefix], w[prefix]))
            constant = seen_sum / seen_weight if seen_weight else 0.5
            scores["running_mean"].append(log_loss(np.full(int(prefix.sum()), constant), y[prefix], w[prefix]))
        full.update(histories, y, w)
        prompt_only.update(cut, y, w)
        seen_sum, seen_weight = seen_sum + float(np.sum(w * y)), seen_weight + float(np.sum(w))
    out = {f"logloss_{k}": float(np.mean(v)) for k, v in scores.items()}
    out["steps_scored"] = len(scores["with_prefix"])
    if out["steps_scored"]:
        out["steps_prefix_helps"] = int(np.sum(np.array(scores["with_prefix"]) < np.array(scores["prompt_only"])))
    return out


def contrast_potential(steps: Sequence[Sequence[RolloutTree]], threshold: float) -> list[tuple[float, float, int]]:
    """Proposition 2's data: (V, mixed 0/1, n) per valued node with n >= 2 rollouts started there."""
    rows = []
    for trees in steps:
        for tree in trees:
            started: dict[int, list[bool]] = defaultdict(list)
            for leaf in tree.leaves().tolist():
                node = tree.nodes[leaf]
                started[node.rollout_start].append(node.reward > threshold)
            for start, outcomes in started.items():
                v = tree.nodes[start].predicted
                if v is None or len(outcomes) < 2:
                    continue
                rows.append((float(v), float(any(outcomes) and not all(outcomes)), len(outcomes)))
    return rows


def binned(rows: list[tuple[float, float, int]]) -> dict[str, Any]:
    if not rows:
        return {"nodes": 0}
    v, mixed, n = (np.array(column, dtype=np.float64) for column in zip(*rows))
    potential = v * (1.0 - v)
    implied = 1.0 - v**n - (1.0 - v) ** n
    table = []
    for low, high in zip(BINS[:-1], BINS[1:]):
        inside = (potential >= low) & (potential < high)
        if inside.any():
            table.append({"v_one_minus_v": [low, min(high, 0.25)], "nodes": int(inside.sum()),
                          "mixed": float(mixed[inside].mean()), "implied": float(implied[inside].mean())})
    correlation = float(np.corrcoef(potential, mixed)[0, 1]) if potential.std() > 0 and mixed.std() > 0 else float("nan")
    return {"nodes": int(v.size), "correlation": correlation, "bins": table}


def allocation(run_dirs: Sequence[Path]) -> dict[str, dict[str, float]]:
    """Proposition 3: mean effective ratio and budget share in mixed groups per method over its runs."""
    by_method: dict[str, list[dict[str, float]]] = defaultdict(list)
    for run_dir in run_dirs:
        method = yaml.safe_load((run_dir / "config.yaml").read_text())["rollout"]["method"]
        records = read_metrics(run_dir / "metrics.jsonl")
        steps = [r for r in records if r.get("step", 0) > 0 and "tree/effective_ratio" in r]
        by_method[method].append({k: float(np.mean([r[f"tree/{k}"] for r in steps])) for k in ("effective_ratio", "mixed_budget_share")})
    return {m: {k: float(np.mean([run[k] for run in runs])) for k in runs[0]} | {"runs": len(runs)} for m, runs in by_method.items()}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="trace-rl run folders with trees")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of proposition 1's scores (default 5)")
    args = parser.parse_args(argv)
    runs: dict[str, Any] = {}
    rows: list[tuple[float, float, int]] = []
    for run_dir in args.runs:
        steps = run_steps(run_dir)
        threshold = float(yaml.safe_load((run_dir / "config.yaml").read_text())["rollout"].get("success_threshold", 0.5))
        mine = contrast_potential(steps, threshold)
        rows += mine
        runs[str(run_dir)] = {"prefix_information": prefix_information(steps, args.warmup), "contrast_potential": binned(mine)}
    result = {"bench": "propositions", "runs": runs, "contrast_potential": binned(rows), "allocation": allocation(args.runs)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
