"""Where a warm-started `toolmath` policy leaves the oracle's path: the first wrong move of each rollout.

`warm_start_spread.py` says how often the policy solves held-out problems; this says why it does not.
It builds the run's parts as a run does (the warm start comes from the cache or is trained), samples
`--samples` bare rollouts of each of `--questions` held-out problems at temperature 1, and walks each
rollout beside `toolmath_oracle`: at every turn the oracle says what it would do from the same history,
and the first turn that differs is classed by what went wrong:

- `wrong_question_number`: the right operation, an operand that the question states copied wrong;
- `wrong_earlier_result`: the right operation, an earlier calculator result copied wrong;
- `wrong_unstated_number`: the right operation, a constant the question does not state (`/ 100`) wrong;
- `structure`: another operation or operand count; `other_action`: no calculator call (malformed turn,
  another tool, an early answer); `wrong_answer`: every step right, the answer not.

    python experiments/toolmath_errors.py [--questions 64] [--samples 4] [key=value ...]

Prints one JSON object: the count of each kind, the kinds by (step, the problem's number of steps), and
a few examples of each.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter, defaultdict

from trace_rl.agent.env import ToolEnv
from trace_rl.agent.protocol import ANSWER
from trace_rl.agent.tasks.toolmath import _question_numbers, toolmath_oracle
from trace_rl.agent.types import Task, ToolCall
from trace_rl.core.tree import RolloutTree
from trace_rl.infra.config import load_config
from trace_rl.rollout.collector import RolloutConfig, TreeRolloutCollector
from trace_rl.run import RunConfig, build_parts

_NUMBER = re.compile(r"\d+(?:\.\d+)?")
EXAMPLES = 3


def first_error(task: Task, tree: RolloutTree, leaf: int, env: ToolEnv) -> tuple[str, int, dict[str, str]]:
    """(kind, 1-based turn, example) of the first turn of the path to `leaf` that leaves the oracle."""
    specs = env.tool_specs(task)
    history: list[tuple[ToolCall, str]] = []
    for turn, node_id in enumerate(tree.path(leaf)[1:], start=1):
        node = tree.nodes[node_id]
        want = toolmath_oracle(task, history)
        got = env.format.parse_turn(f"<think>{node.thought}</think>{node.action}", specs).call
        example = {"question": task.question, "thought": node.thought.strip(), "action": node.action.strip(), "oracle": str(want.arguments)}
        if want.name == ANSWER:
            right = got is not None and got.name == ANSWER and str(got.arguments.get("answer", "")).strip() == want.arguments["answer"]
            return ("solved" if right else "wrong_answer"), turn, example
        if got is None or got.name != "calculator":
            return "other_action", turn, example
        wrote, expected = (re.sub(r"\s+", "", c.arguments["expression"]) for c in (got, want))
        if wrote != expected:
            if _NUMBER.sub("#", wrote) != _NUMBER.sub("#", expected):
                return "structure", turn, example
            wrong = [e for w, e in zip(_NUMBER.findall(wrote), _NUMBER.findall(expected)) if w != e]
            results = {observation.strip() for _, observation in history}
            stated = {text for _, text in _question_numbers(task.question).values()}
            kind = ("wrong_earlier_result" if any(e in results for e in wrong)
                    else "wrong_question_number" if any(e in stated for e in wrong) else "wrong_unstated_number")
            return kind, turn, example
        history.append((want, node.observation))  # the oracle's own spelling, so it counts the step as done
    return "unfinished", len(tree.path(leaf)) - 1, {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--questions", type=int, default=64, help="held-out test problems")
    parser.add_argument("--samples", type=int, default=4, help="rollouts per problem at temperature 1")
    parser.add_argument("overrides", nargs="*", help="run config overrides, key=value")
    args = parser.parse_args()
    config = load_config(RunConfig, None, ["task.name=toolmath", f"task.test_tasks={args.questions}", *args.overrides])
    if config.task.name != "toolmath":
        raise SystemExit("this benchmark follows toolmath's oracle; task.name must be toolmath")
    parts = build_parts(config)
    rollout = RolloutConfig(method="grpo", budget=args.samples * len(parts.test.tasks), temperature=1.0)
    collector = TreeRolloutCollector(parts.engine, parts.policy.tokenizer, parts.env, parts.predictor, rollout, seed=config.seed)
    trees = collector.collect(parts.test.tasks).trees
    tasks = {task.task_id: task for task in parts.test.tasks}

    kinds: Counter[str] = Counter()
    by_step: Counter[str] = Counter()
    examples: dict[str, list[dict[str, str]]] = defaultdict(list)
    for tree in trees:
        task = tasks[tree.task_id]
        for leaf in tree.leaves():
            kind, turn, example = first_error(task, tree, int(leaf), parts.env)
            kinds[kind] += 1
            by_step[f"{kind} at step {turn} of {task.meta['num_steps']}"] += 1
            if example and kind != "solved" and len(examples[kind]) < EXAMPLES:
                examples[kind].append(example)
    print(json.dumps({
        "bench": "toolmath_errors",
        "questions": len(trees),
        "samples": args.samples,
        "model": config.model.name,
        "split_digits": config.model.split_digits,
        "sft_steps": config.sft.steps,
        "kinds": dict(kinds.most_common()),
        "by_step": dict(sorted(by_step.items())),
        "examples": examples,
    }))


if __name__ == "__main__":
    main()
