"""`trace-rl tasks`: list the registered tasksets, show rendered prompts and oracle rollouts.

For each taskset it loads a sample of tasks, runs the scripted oracle and the random agent through
the real env (parser, tools, scorer), and renders what the model would see; cli.py prints it, then
one JSON object with the headline figures: per taskset the oracle's and the random agent's success
rates on the sample (the oracle should be 1.0, the random agent near 0).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from trace_rl.agent.agents import Episode, OracleAgent, RandomAgent, run_episode
from trace_rl.agent.env import ToolEnv
from trace_rl.agent.protocol import FORMATS
from trace_rl.agent.types import TaskSet
from trace_rl.infra.config import SandboxConfig

DEFAULT_TASKSETS = ("multihop", "toolmath")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `trace-rl tasks` (cli.py adds them to its subcommand)."""
    parser.add_argument("names", nargs="*", help=f"tasksets to show (default: {', '.join(DEFAULT_TASKSETS)})")
    parser.add_argument("--split", default="train", choices=["train", "test"])
    parser.add_argument("--num-tasks", type=int, default=50, help="tasks per taskset to run the agents on")
    parser.add_argument("--seed", type=int, default=0, help="taskset seed; the random agent uses seeds from here")
    parser.add_argument("--format", default="tag", choices=sorted(FORMATS), help="ReAct turn format")
    parser.add_argument("--max-turns", type=int, default=8)
    parser.add_argument("--show", type=int, default=1, help="prompts and oracle rollouts to print per taskset")
    parser.add_argument("--random-seeds", type=int, default=2, help="random-agent episodes per task")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", dest="options",
                        help="a loader option for every named taskset, as task.options in a run config "
                             "(repeatable; the value is YAML), e.g. --option test_share=0.1")
    parser.add_argument("--sandbox-isolation", default="auto", choices=["auto", "bwrap", "rlimits"],
                        help="how the python tool isolates model code (task.sandbox.isolation in a run config)")
    parser.add_argument("--sandbox-python", type=_absolute_path, default=None, metavar="PATH",
                        help="interpreter for model code (task.sandbox.python); as root without bubblewrap, "
                             "one every user can run, e.g. /usr/bin/python3")


def task_options(items: Sequence[str]) -> dict[str, Any]:
    """`--option KEY=VALUE` items as a dict, each value read as YAML (`load_yaml`'s rules), as a run
    config's `task.options`; ConfigError for an item without `=`."""
    from trace_rl.infra.config import ConfigError, load_yaml

    options: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--option {item!r} must look like KEY=VALUE")
        options[key.strip()] = load_yaml(raw, f"--option {key.strip()}") if raw.strip() else ""
    return options


def _absolute_path(text: str) -> str:
    if not text.startswith("/"):
        raise argparse.ArgumentTypeError(f"must be an absolute path, got {text!r}")
    return text


def _parse(argv: argparse.Namespace | Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="trace-rl tasks", description=__doc__.split("\n")[0])
    add_arguments(parser)
    if isinstance(argv, argparse.Namespace):  # from cli.py: fill in whatever it did not define
        defaults = vars(parser.parse_args([]))
        return argparse.Namespace(**{**defaults, **{k: v for k, v in vars(argv).items() if k in defaults}})
    return parser.parse_args(list(argv) if argv is not None else None)


def evaluate_taskset(
    taskset: TaskSet,
    *,
    turn_format: str = "tag",
    max_turns: int = 8,
    random_seeds: int = 2,
    seed: int = 0,
    sandbox: SandboxConfig | None = None,
) -> tuple[dict[str, Any], list[Episode]]:
    """Oracle and random-agent success on every task of `taskset`; returns the figures and the oracle episodes."""
    env = ToolEnv.for_taskset(taskset, turn_format=turn_format, max_turns=max_turns, sandbox=sandbox)
    start = time.perf_counter()
    oracle_episodes: list[Episode] = []
    if taskset.oracle is not None:
        oracle = OracleAgent(taskset.oracle, env.format)
        oracle_episodes = [run_episode(env, task, oracle, seed=seed) for task in taskset.tasks]
    agent = RandomAgent.for_corpus(env.format, taskset.corpus, specs={name: tool.spec for name, tool in env.tools.items()})
    random_rewards = [
        run_episode(env, task, agent, seed=seed + i * random_seeds + j).reward
        for i, task in enumerate(taskset.tasks)
        for j in range(random_seeds)
    ]
    figures = {
        "sampled": len(taskset.tasks),
        "passages": len(taskset.corpus),
        "tools": sorted({name for task in taskset.tasks for name in task.tools}),
        "oracle_success": _mean([e.reward for e in oracle_episodes]) if oracle_episodes else None,
        "oracle_turns": _mean([e.num_turns for e in oracle_episodes]) if oracle_episodes else None,
        "random_success": _mean(random_rewards),
        "seconds": round(time.perf_counter() - start, 3),
    }
    return figures, oracle_episodes


def _mean(values: Sequence[float]) -> float:
    return round(float(np.mean(values)), 4) if len(values) else 0.0


def tasks_report(argv: argparse.Namespace | Sequence[str] | None = None) -> tuple[str, dict[str, Any]]:
    """Body of `trace-rl tasks` (cli.py's Namespace or a list of arguments): the text to show (rendered
    prompts, oracle rollouts and a table; empty with `--json`) and the JSON summary."""
    import io

    from rich.console import Console
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    from trace_rl.agent.tasks import available_tasksets, load_taskset

    args = _parse(argv)
    out = io.StringIO()
    console = Console(file=out, quiet=args.json, soft_wrap=False, width=120)
    names = args.names or list(DEFAULT_TASKSETS)
    sandbox = SandboxConfig(isolation=args.sandbox_isolation, python=args.sandbox_python)
    console.print(Text(f"registered tasksets: {', '.join(available_tasksets())}"))
    summary: dict[str, Any] = {}
    table = Table(
        title=f"tasksets: {args.split} split, format {args.format!r}",
        caption=(
            f"oracle / random: success rate of the scripted oracle / the random agent on the first {args.num_tasks} "
            "tasks; turns: the oracle's mean"
        ),
    )
    for column in ("taskset", "tasks", "passages", "tools", "oracle", "turns", "random"):
        table.add_column(column)
    options = task_options(args.options)
    for name in names:
        full = load_taskset(name, split=args.split, seed=args.seed, **options)
        sample = dataclasses.replace(full, tasks=full.tasks[: args.num_tasks])
        figures, episodes = evaluate_taskset(
            sample, turn_format=args.format, max_turns=args.max_turns, random_seeds=args.random_seeds, seed=args.seed,
            sandbox=sandbox,
        )
        summary[name] = {"tasks": len(full.tasks), **figures}
        table.add_row(
            name,
            str(len(full.tasks)),
            str(figures["passages"]),
            ", ".join(figures["tools"]) or "-",
            "-" if figures["oracle_success"] is None else f"{figures['oracle_success']:.1%}",
            "-" if figures["oracle_turns"] is None else f"{figures['oracle_turns']:.2f}",
            f"{figures['random_success']:.1%}",
        )
        for episode in episodes[: args.show]:
            title = f"{name} / {episode.task.task_id}: reward {episode.reward:g} in {episode.num_turns} turns"
            console.print(Panel(Text(episode.context), title=title, subtitle=f"gold: {episode.task.answers[0]!r}"))
    console.print(table)
    return out.getvalue(), {
        "command": "tasks",
        "registered": available_tasksets(),
        "split": args.split,
        "num_tasks": args.num_tasks,
        "seed": args.seed,
        "format": args.format,
        "max_turns": args.max_turns,
        "tasksets": summary,
    }
