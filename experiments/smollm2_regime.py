"""Which regime does RL move SmolLM2-135M in? The pilot of issue 60, by the rule its plan fixed first
(docs/results/smollm2_regime/plan.md).

Each regime is `configs/smollm2_regime.yaml` (TRACE, 32 rollouts a step, 12 steps, held-out 64 x 4
before and after) with its task and its start as overrides (`REGIMES`). `run` trains them one after
another with `trace-rl train`, each into `OUT/<regime>/`, resuming a folder that holds an unfinished
run and skipping a finished one, so a stopped pilot continues where it was. `summary` reads the run
folders and applies the plan's rule: eligible regimes start at 15-60% held-out sampled accuracy; the
chosen one is the eligible regime whose accuracy rose most over its 12 steps.

    python experiments/smollm2_regime.py run [--out runs/smollm2_regime] [--only NAME ...]
    python experiments/smollm2_regime.py summary [--out runs/smollm2_regime]
    python experiments/smollm2_regime.py save [--out runs/smollm2_regime] [--to docs/results/smollm2_regime]

`summary` prints one JSON object: every regime's start, end and rise with their standard errors,
its seconds a step and generated tokens a step, and the choice. `save` packs each finished run's
`config.yaml`, `code.json` and `metrics.jsonl` into `TO/runs.tar.xz` (its trees and checkpoints stay in
OUT) and writes the summary beside it as `pilot.json` (not `summary.json`: that name marks an exported
comparison, which the results pages and tests read).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

CONFIG = "configs/smollm2_regime.yaml"
WARM_START = ["task.demo_tasks=800", "sft.steps=40", "sft.lr=5.0e-5", "sft.demos=320", "sft.warmup_steps=4"]
"""configs/smollm2_demo.yaml's warm start: every weight, 40 steps of 8 of 320 oracle demonstrations."""
REGIMES: dict[str, list[str]] = {
    "multihop_1_2": ["task.name=multihop", "task.options={max_hops: 2, num_questions: 1600}", *WARM_START],
    "toolmath": ["task.name=toolmath", "task.max_turns=6", *WARM_START],
    "shop_cold": ["task.name=examples/custom_task.py:shop", "model.warm_start=false"],
}
"""The candidates, in the order they run. `shop_cold` is the own-task tutorial's task with no warm
start: the model's prompt profile (two worked examples) is all it gets."""
BAND = (0.15, 0.60)
"""Held-out sampled accuracy at step 0 that makes a regime eligible (the plan's rule)."""


def read_metrics(folder: Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def finished(folder: Path, steps: int) -> bool:
    return any(row.get("step") == steps and "val/accuracy_sampled" in row for row in read_metrics(folder))


def run(out: Path, only: list[str]) -> None:
    steps = 12
    for name, overrides in REGIMES.items():
        if only and name not in only:
            continue
        folder = out / name
        if finished(folder, steps):
            print(f"{name}: finished", file=sys.stderr)
            continue
        if (folder / "checkpoints").exists():
            command = ["trace-rl", "train", "--resume", str(folder)]
        else:
            command = ["trace-rl", "train", "--config", CONFIG, "--out", str(folder), *overrides]
        print(" ".join(command), file=sys.stderr, flush=True)
        subprocess.run([str(Path(sys.executable).parent / command[0]), *command[1:]], check=True)


def summary(out: Path) -> dict:
    rows = {}
    for name in REGIMES:
        metrics = read_metrics(out / name)
        evals = [row for row in metrics if "val/accuracy_sampled" in row]
        steps = [row for row in metrics if "timing_s/step" in row]
        if len(evals) < 2:
            rows[name] = {"finished": False, "evaluations": len(evals)}
            continue
        start, end = evals[0], evals[-1]
        rise = end["val/accuracy_sampled"] - start["val/accuracy_sampled"]
        rows[name] = {
            "finished": True,
            "start": start["val/accuracy_sampled"],
            "start_se": start["val/accuracy_sampled_se_tasks"],
            "start_greedy": start["val/accuracy_greedy"],
            "end": end["val/accuracy_sampled"],
            "end_se": end["val/accuracy_sampled_se_tasks"],
            "end_greedy": end["val/accuracy_greedy"],
            "end_step": end["step"],
            "rise": rise,
            "rise_se": float(np.hypot(start["val/accuracy_sampled_se_tasks"], end["val/accuracy_sampled_se_tasks"])),
            "train_reward_first_3": float(np.mean([row.get("critic/score/mean", np.nan) for row in steps[:3]])),
            "train_reward_last_3": float(np.mean([row.get("critic/score/mean", np.nan) for row in steps[-3:]])),
            "effective_ratio": float(np.mean([row.get("tree/effective_ratio", np.nan) for row in steps])),
            "seconds_per_step": float(np.mean([row["timing_s/step"] for row in steps])),
            "tokens_generated_per_step": float(np.mean([row.get("rollout/tokens_generated", np.nan) for row in steps])),
            "eval_seconds": float(np.mean([row.get("timing_s/eval", np.nan) for row in evals])),
            "eligible": BAND[0] <= start["val/accuracy_sampled"] <= BAND[1],
        }
    eligible = {name: row for name, row in rows.items() if row.get("eligible")}
    chosen = max(eligible, key=lambda name: eligible[name]["rise"]) if eligible else None
    done = all(row["finished"] for row in rows.values())
    return {"experiment": "smollm2_regime", "config": CONFIG, "band": BAND, "regimes": rows,
            "chosen": chosen if done else None, "complete": done}


def save(out: Path, to: Path) -> dict:
    """Pack the finished runs' small files into `to/runs.tar.xz` and write `to/pilot.json`."""
    import tarfile

    result = summary(out)
    to.mkdir(parents=True, exist_ok=True)
    with tarfile.open(to / "runs.tar.xz", "w:xz") as archive:
        for name, row in result["regimes"].items():
            for file in ("config.yaml", "code.json", "metrics.jsonl") if row["finished"] else ():
                archive.add(out / name / file, arcname=f"{name}/{file}")
    (to / "pilot.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("run", "summary", "save"))
    parser.add_argument("--out", type=Path, default=Path("runs/smollm2_regime"))
    parser.add_argument("--to", type=Path, default=Path("docs/results/smollm2_regime"))
    parser.add_argument("--only", nargs="*", default=[], choices=sorted(REGIMES))
    args = parser.parse_args()
    if args.command == "run":
        run(args.out, args.only)
    print(json.dumps(save(args.out, args.to) if args.command == "save" else summary(args.out)))


if __name__ == "__main__":
    main()
