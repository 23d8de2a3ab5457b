"""Shared test setup."""

import torch

# One thread: the tiny models' ops are too small to split, and busy-waiting worker threads make
# every op many times slower when other jobs share the machine's two cores.
torch.set_num_threads(1)

import os

import pytest


def skip_without_sandbox(isolation: str | None = None) -> None:
    """Skip (or, with TRACE_RL_SANDBOX_TESTS=require as in CI, fail) when model code cannot run here:
    no bubblewrap and no usable fallback. `make test` installs bubblewrap where it can."""
    from trace_rl.agent.sandbox import ISOLATIONS, isolation_problem

    levels = (isolation,) if isolation else ISOLATIONS
    problems = {level: isolation_problem(level) for level in levels}
    if all(problems.values()):
        reason = "; ".join(f"{level}: {problem}" for level, problem in problems.items())
        if os.environ.get("TRACE_RL_SANDBOX_TESTS") == "require":
            pytest.fail(f"the sandbox is required here (TRACE_RL_SANDBOX_TESTS=require) but cannot run: {reason}")
        pytest.skip(f"no sandbox can run model code on this machine ({reason}); install bubblewrap")


def skip_without_sandbox_for(taskset) -> None:
    """`skip_without_sandbox` where the task set has a `python` tool: its environment checks at build
    time that model code can run sandboxed, and its oracle's calls run there."""
    if "python" in {name for task in taskset.tasks for name in task.tools}:
        skip_without_sandbox()


def write_reward_trees(run, steps: dict[int, list[list[float]]]) -> None:
    """A run folder's saved trees (`trees/step_<k>.jsonl`): at each step one tree per prompt, each
    with one bare rollout per reward listed (prompt ids p0, p1, ... in order)."""
    from trace_rl.core.tree import RolloutTree, write_jsonl

    for step, prompts in steps.items():
        batch = []
        for number, rewards in enumerate(prompts):
            tree = RolloutTree.new(f"p{number}", f"prompt {number}")
            for reward in rewards:
                tree.add_turn(0, reward=reward)
            batch.append(tree)
        write_jsonl(batch, run / "trees" / f"step_{step:04d}.jsonl")
