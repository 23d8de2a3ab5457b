"""How the warm-started policy's success spreads over held-out questions: the regime TRACE needs.

Builds the run's parts exactly as a run does (`build_parts`, which warm-starts the policy or takes
it from the cache), then samples `--samples` bare rollouts of each of `--questions` held-out test
questions with the real collector (`grpo` = uniform allocation, so exactly `samples` rollouts per
question) at the RL temperature, 1. Allocation only matters when per-question success rates differ
and are neither all 0 nor all 1; this prints their histogram to stderr and one JSON object on stdout.

Greedy success is measured with the same collector at temperature 0 and 2 rollouts per question
(the collector's `min_per_prompt` is 2; both greedy rollouts are the same, so they count once).

    python experiments/warm_start_spread.py [--questions 64] [--samples 16] [key=value ...]

`key=value` overrides go to the run config (`sft.steps=200`, `task.topk=3`, `seed=1`, ...).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from dataclasses import asdict

import numpy as np

from trace_rl.infra.config import load_config
from trace_rl.rollout.collector import RolloutConfig, TreeRolloutCollector
from trace_rl.run import Parts, RunConfig, build_parts
from trace_rl.training.sft import sft_stats

BINS = 10


def per_question_success(parts: Parts, config: RunConfig, samples: int, temperature: float) -> np.ndarray:
    """Mean reward of `samples` rollouts of each test question, shape (questions,)."""
    rollout = RolloutConfig(method="grpo", budget=samples * len(parts.test.tasks), temperature=temperature)
    collector = TreeRolloutCollector(parts.engine, parts.policy.tokenizer, parts.env, parts.predictor, rollout, seed=config.seed)
    trees = collector.collect(parts.test.tasks).trees
    return np.array([tree.leaf_rewards().mean() for tree in trees])


def difficulty(tasks: list) -> tuple[str, list[int]]:
    """What the success is broken down by: `multihop`'s hop count, the number of calculator steps of a
    `toolmath` problem, or the terms of a reasoning-gym item that records them (`rg:chain_sum`)."""
    if all("hops" in task.meta for task in tasks):
        return "hops", [task.meta["hops"] for task in tasks]
    if all("steps" in task.meta for task in tasks):
        return "steps", [len(task.meta["steps"]) for task in tasks]
    if all("num_terms" in task.meta.get("rg_entry", {}).get("metadata", {}) for task in tasks):
        return "terms", [task.meta["rg_entry"]["metadata"]["num_terms"] for task in tasks]
    raise SystemExit("this benchmark breaks success down by multihop's hops, toolmath's steps or a reasoning-gym "
                     "item's num_terms; the task set has none of them")


def histogram(success: np.ndarray) -> list[int]:
    """Questions per tenth of [0, 1]; a success of exactly 1 falls in the last bin."""
    bins = np.minimum((success * BINS).astype(int), BINS - 1)
    return np.bincount(bins, minlength=BINS).tolist()


def draw(counts: list[int], samples: int) -> str:
    width = 50 / max(1, max(counts))
    lines = [f"per-question success at T=1 ({samples} samples each), {sum(counts)} questions:"]
    for i, count in enumerate(counts):
        lines.append(f"  [{i / BINS:.1f}, {(i + 1) / BINS:.1f}{']' if i == BINS - 1 else ')'} {'#' * round(count * width):<50} {count}")
    return "\n".join(lines)


def log_progress(step: int, loss: float) -> None:
    if step % 25 == 0:
        print(f"sft step {step}: loss {loss:.3f}", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--questions", type=int, default=64, help="held-out test questions")
    parser.add_argument("--samples", type=int, default=16, help="rollouts per question at temperature 1")
    parser.add_argument("--no-greedy", action="store_true", help="skip the greedy (temperature 0) pass")
    parser.add_argument("overrides", nargs="*", help="run config overrides, key=value")
    args = parser.parse_args()
    config = load_config(RunConfig, None, [f"task.test_tasks={args.questions}", *args.overrides])

    begin = time.perf_counter()
    parts = build_parts(config, progress=log_progress)
    build_seconds = time.perf_counter() - begin
    stats = sft_stats(parts.policy.path)

    begin = time.perf_counter()
    sampled = per_question_success(parts, config, args.samples, temperature=1.0)
    eval_seconds = time.perf_counter() - begin
    greedy = None if args.no_greedy else per_question_success(parts, config, 2, temperature=0.0)

    by, groups = difficulty(parts.test.tasks)
    by_group: dict[int, list[float]] = defaultdict(list)
    for g, s in zip(groups, sampled):
        by_group[g].append(float(s))
    counts = histogram(sampled)
    print(draw(counts, args.samples), file=sys.stderr)
    result = {
        "bench": "warm_start_spread",
        "model": config.model.name,
        "task": config.task.name,
        "questions": len(sampled),
        "samples": args.samples,
        "seed": config.seed,
        "success": round(float(sampled.mean()), 4),
        "greedy_success": None if greedy is None else round(float(greedy.mean()), 4),
        "histogram": counts,
        "share_at_0": round(float(np.mean(sampled == 0.0)), 4),
        "share_at_1": round(float(np.mean(sampled == 1.0)), 4),
        "success_std_across_questions": round(float(sampled.std()), 4),
        f"success_by_{by}": {str(g): round(float(np.mean(v)), 4) for g, v in sorted(by_group.items())},
        f"greedy_by_{by}": None
        if greedy is None
        else {str(g): round(float(np.mean([x for x, gg in zip(greedy, groups) if gg == g])), 4) for g in sorted(by_group)},
        "sft_seconds": round(stats["sft/total_seconds"], 1),
        "sft_train_seconds": round(stats["sft/seconds"], 1),
        "sft_final_loss": round(stats["sft/final_loss"], 4),
        "sft_precision": json.loads((parts.policy.path / "trace_rl_sft.json").read_text())["config"]["precision"],  # `auto` resolved
        "demo_success": round(stats["sft/demo_success"], 4),
        "build_seconds": round(build_seconds, 1),
        "eval_seconds": round(eval_seconds, 1),
        "config": {"task": asdict(config.task), "sft": asdict(config.sft)},
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
