"""Run folders as the trainer writes them, for the tests of a study read across folders
(`trace_rl.research.study`, `experiments/evidence_study.py`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

T0 = 1_800_000_000.0  # a POSIX time on a whole minute: 2027-01-15T08:00Z


def write_run(run: Path, finals: dict[int, float], *, steps: int = 4, step_s: float = 10.0, eval_s: float = 100.0, tokens: int = 50) -> Path:
    """A run folder as the trainer writes it: a line per step (an evaluation at each step in `finals`)
    and a tree file per step whose mtime is the step's end (every step_s + eval_s after T0)."""
    (run / "trees").mkdir(parents=True)
    lines, end = [], T0
    for step in range(1, steps + 1):
        end += step_s
        line = {"step": step, "timing_s/step": step_s, "rollout/rollouts_total": 8.0 * step, "rollout/tokens_total": float(tokens * step),
                "tree/effective_ratio": 0.5, "tree/effective_per_candidate": 0.25, "tree/failed_budget_share": 0.3, "tree/solved_budget_share": 0.1}
        tree = run / "trees" / f"step_{step:04d}.jsonl"
        tree.write_text("")
        os.utime(tree, (end, end))
        if step in finals:
            line |= {"timing_s/eval": eval_s, "val/accuracy_sampled": finals[step]}
            end += eval_s
        lines.append(line)
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return run


def write_study(root: Path) -> tuple[Path, Path]:
    """Two phases: the first with a start, grpo, pcl and trace on seeds 0-1 (trace's seed 1 unfinished), the second grpo's and trace's seed 2."""
    one, two = root / "one", root / "two"
    for seed, start in ((0, 0.10), (1, 0.20)):
        react = one / "react" / f"seed_{seed}"
        react.mkdir(parents=True)
        (react / "metrics.jsonl").write_text(json.dumps({"step": 0, "val/accuracy_sampled": start}) + "\n")
    write_run(one / "grpo" / "seed_0", {2: 0.10, 4: 0.20})
    write_run(one / "grpo" / "seed_1", {4: 0.30})
    write_run(one / "pcl" / "seed_0", {4: 0.25})
    write_run(one / "pcl" / "seed_1", {4: 0.25})
    write_run(one / "trace" / "seed_0", {4: 0.35})
    write_run(one / "trace" / "seed_1", {2: 0.5}, steps=2)
    write_run(two / "trace" / "seed_2", {4: 0.40})
    write_run(two / "grpo" / "seed_2", {4: 0.30})
    return one, two
