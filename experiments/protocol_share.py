"""Does a pretrained model speak the turn protocol from step 1, without a warm start?

For each setting (turn format, worked examples, temperature) this builds a run's parts exactly as
`trace-rl train` does with `model.warm_start=false` (`build_parts`), samples `--samples` bare rollouts
of each of `--tasks` train tasks with the real collector, and counts the turns whose text parsed to
a valid action (a tool call with valid arguments, or an answer), over every turn and over first turns,
beside the mean reward. Train tasks, because step 1 samples those; the worked examples' own tasks are
left out of them as a run leaves them out.

The settings: `profile` (what the model's prompt profile picks, `trace_rl.models.profiles`: what a
user gets by default) and the variants that explain it: the old defaults (tag format, no examples,
temperature 1), each change alone, and the json format.

    python experiments/protocol_share.py [--tasks 16] [--samples 4] [--settings A,B] [key=value ...]

`key=value` overrides go to every setting's run config after the script's own (SmolLM2-135M, no warm
start, turns of up to 128 tokens): `task.name=examples/custom_task.py:shop`, ...
Prints one JSON object (a row per setting) on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from trace_rl.infra.config import load_config
from trace_rl.run import RunConfig, build_parts

SETTINGS: dict[str, list[str]] = {
    "profile": [],
    "closed_thought": ["task.open_thought=false"],
    "before_profiles": ["task.format=tag", "task.few_shot=0", "task.open_thought=false", "rollout.temperature=1.0"],
    "no_examples_t0.7": ["task.format=tag", "task.few_shot=0", "task.open_thought=false", "rollout.temperature=0.7"],
    "examples_t1": ["task.format=tag", "task.few_shot=2", "task.open_thought=false", "rollout.temperature=1.0"],
    "json_examples_t0.7": ["task.format=json", "task.few_shot=2", "task.open_thought=false", "rollout.temperature=0.7"],
}
"""Each setting's overrides: `profile` is what a user gets by default; `closed_thought` the profile
without opening each turn with `<think>`; `before_profiles` the defaults before
`trace_rl.models.profiles` (tag format, no examples, temperature 1); the rest change one thing each
from the closed profile, and `json_examples_t0.7` tries the other format."""


def turn_shares(trees: list) -> dict[str, float]:
    """Valid actions among all turns and among first turns, mean leaf reward, turns and tokens."""
    valid, first_valid, turns, firsts = 0, 0, 0, 0
    for tree in trees:
        for node in tree.nodes[1:]:
            ok = node.info.get("call") is not None
            valid += ok
            turns += 1
            if node.depth == 1:
                first_valid += ok
                firsts += 1
    rewards = np.concatenate([tree.leaf_rewards() for tree in trees])
    return {
        "valid_share": valid / max(turns, 1),
        "first_turn_valid_share": first_valid / max(firsts, 1),
        "reward_mean": float(rewards.mean()),
        "turns": turns,
        "first_turns": firsts,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/smoke.yaml")
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated settings to run (default: all)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    base = ["model.name=smollm2-135m", "model.warm_start=false", "model.cpu_threads=2", "rollout.max_new_tokens=128", *args.overrides]
    rows = []
    for name in args.settings.split(","):
        config = load_config(RunConfig, args.config, [*base, *SETTINGS[name]])
        parts = build_parts(config)
        tasks = parts.train.tasks[: args.tasks]
        begin = time.perf_counter()
        trees = parts.collector.sample(tasks, args.samples)
        prompt_tokens = int(np.mean([len(tree.nodes[0].token_ids) for tree in trees]))
        rows.append({
            "setting": name,
            "format": config.task.format,
            "few_shot": len(getattr(parts.env, "examples", ())),
            "open_thought": config.task.open_thought,
            "temperature": config.rollout.temperature,
            **turn_shares(trees),
            "prompt_tokens": prompt_tokens,
            "seconds": round(time.perf_counter() - begin, 1),
        })
        print(json.dumps(rows[-1]), flush=True, file=sys.stderr)
    print(json.dumps({"experiment": "protocol_share", "model": "smollm2-135m", "config": args.config, "overrides": args.overrides,
                      "tasks": args.tasks, "samples": args.samples, "rows": rows}))


if __name__ == "__main__":
    main()
