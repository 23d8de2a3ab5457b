"""An environment of a user's own, not a ToolEnv: the questions of any task set, answered with hints.

A turn that answers (`<answer>…</answer>`) ends the episode, scored by exact match; any other turn
costs a turn and gets a hint (the answer's length and first letter). Named from a config as
`task.env: tests/own_env.py:make_env`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import trace_rl
from trace_rl import StepInfo, StepResult, Task, TaskSet


@dataclass(frozen=True)
class State:
    task: Task
    turns: int


class HintEnv:
    max_turns = 3

    def __init__(self) -> None:
        self.state: State | None = None
        self.done = True

    def messages(self, task: Task) -> list[dict[str, str]]:
        return [{"role": "system", "content": "Answer as <answer>…</answer>; anything else buys a hint."},
                {"role": "user", "content": task.question}]

    def stop_strings(self) -> tuple[str, ...]:
        return ("</answer>", "</search>")

    def reset(self, task: Task, *, seed: int | None = None) -> str:
        self.state, self.done = State(task, 0), False
        return task.question

    def step(self, action: str) -> StepResult:
        if self.state is None or self.done:
            raise RuntimeError("no episode in progress")
        task, turn = self.state.task, self.state.turns + 1
        self.state = State(task, turn)
        found = re.search(r"<answer>(.*?)</answer>", action, re.DOTALL)
        info = StepInfo(turn=turn, text=action, thought="", action=action, call=None, answer=found.group(1).strip() if found else None)
        if found:
            self.done = True
            return StepResult("", float(found.group(1).strip() == task.answers[0]), True, False, info)
        self.done = turn >= self.max_turns
        gold = task.answers[0]
        hint = "" if self.done else f"hint: {len(gold)} letters, starts with {gold[:1]!r}"
        return StepResult(hint, 0.0, False, self.done, replace(info, observation=hint))

    def snapshot(self) -> tuple[State | None, bool]:
        return self.state, self.done

    def restore(self, snapshot: tuple[State | None, bool]) -> None:
        self.state, self.done = snapshot

    def spawn(self) -> HintEnv:
        return HintEnv()


def make_env(taskset: TaskSet) -> HintEnv:
    return HintEnv()


def not_an_env(taskset: TaskSet) -> object:
    return object()


assert trace_rl.Env  # the protocol HintEnv implements


def always_paid(task: Task, answer: str) -> float:
    return 1.0


def presolved(split: str = "train", num_tasks: int | None = None, seed: int = 0) -> TaskSet:
    """Questions whose reward pays any answer: BRACE's certified exclusion leaves none to train on."""
    rows = [{"question": f"Say anything ({i}).", "answer": "x"} for i in range(20)]
    return trace_rl.task_set(rows, name="presolved", split=split, num_tasks=num_tasks, seed=seed, test_share=0.25, scorer=always_paid)


def free_or_exact(task: Task, answer: str) -> float:
    """Pays any answer to a task marked free (certified pre-solved), else the exact answer only."""
    return 1.0 if task.meta.get("free") else float(answer.strip() == task.answers[0])
