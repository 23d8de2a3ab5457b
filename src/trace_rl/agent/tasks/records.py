"""A user's own task set from records: a list of dicts or a JSONL / JSON / parquet file, with the user's
reward function, tools and (for a policy that needs a warm start) a few-line oracle or recorded
demonstrations. Nothing is registered inside the package: a config names the function that returns
the task set (`task.name: my_tasks.py:shop`, `trace_rl.infra.references`).

    def shop(split="train", num_tasks=None, seed=0):
        return task_set(ROWS, split=split, num_tasks=num_tasks, seed=seed, test_share=0.25,
                        scorer=reward, tools=[price], oracle=oracle)

A row holds `question` (or `prompt`), optionally `answer` (a string, a number or a list of accepted
answers), `id` and `tools` (the names of the tools this row may call; default: all of them); every
other field goes to `task.meta`, where the reward reads what it needs. The reward is a function
`reward(task, answer) -> float in [0, 1]` (partial credit allowed) or the name of a bundled scorer;
a tool is a typed function whose docstring describes it to the model (`Tool.from_function`), or a `Tool`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from trace_rl.agent.protocol import ANSWER, ToolCall
from trace_rl.agent.scoring import check_reward_signature, get_scorer
from trace_rl.agent.tasks.loaders import (
    RowRef,
    TaskFileError,
    _read_rows,
    _rows_as_objects,
    _share_split,
    question_key,
    tasks_from_records,
    unique_ids,
)
from trace_rl.agent.tools import Tool
from trace_rl.agent.types import OraclePolicy, Task, TaskSet
from trace_rl.infra.references import reference_of

Records = Sequence[Mapping[str, Any]] | str | Path
"""Rows in memory, or a .jsonl / .json / .parquet file of them."""


def task_set(
    records: Records,
    *,
    name: str = "custom",
    split: str = "train",
    num_tasks: int | None = None,
    seed: int = 0,
    test_records: Records | None = None,
    test_share: float | None = None,
    test_on_train: bool = False,
    scorer: str | Callable[[Task, str], float] = "exact_match",
    tools: Sequence[Callable[..., str] | Tool] = (),
    oracle: OraclePolicy | None = None,
    demonstrations: Records | None = None,
) -> TaskSet:
    """The `split` of a task set made from `records` (see the module docstring); its first `num_tasks`.

    The test split is `test_records`, a seeded `test_share` of the distinct questions (the train split
    is then the rest), or, said explicitly, the training rows (`test_on_train`). `scorer` is a bundled
    scorer's name, a `module:function` reference, or a module-level function (kept as its reference,
    so every process finds it). `oracle(task, history) -> ToolCall` or `demonstrations` (rows of
    `{id or question, calls: [{tool, arguments} ..., {answer}]}`) let a policy warm-start.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    given = [test_records is not None, test_share is not None, bool(test_on_train)]
    if sum(given) > 1:
        raise ValueError("give one of test_records, test_share and test_on_train")
    if split == "test" and not any(given):
        raise ValueError(f"task set {name!r} has no test split: give test_records, test_share (a held-out share of the "
                         "questions) or test_on_train=True (evaluate on the training questions, said explicitly)")
    if num_tasks is not None and (isinstance(num_tasks, bool) or not isinstance(num_tasks, int) or num_tasks < 1):
        raise ValueError(f"num_tasks must be a whole number >= 1 (or None: every row), got {num_tasks!r}")
    if test_share is not None and (isinstance(test_share, bool) or not isinstance(test_share, (int, float))
                                   or not 0.0 < float(test_share) < 1.0):
        raise ValueError(f"test_share must be a number between 0 and 1 (the held-out share of the questions), got {test_share!r}")
    for tool in tools:
        if isinstance(tool, str):
            raise ValueError(f"tools=[{tool!r}, ...]: in Python give the tool functions themselves (or trace_rl.Tool "
                             "objects); names of bundled tools go in a config's task.options.tools")
        if not (isinstance(tool, Tool) or callable(tool)):
            raise ValueError(f"tools: {tool!r} is not a function or a trace_rl.Tool")
    built = {tool.name: tool for tool in (t if isinstance(t, Tool) else Tool.from_function(t) for t in tools)}
    if callable(scorer):
        check_reward_signature(scorer, getattr(scorer, "__name__", repr(scorer)))
    score_name = scorer if isinstance(scorer, str) else reference_of(scorer, "scorer")
    get_scorer(score_name)  # an unknown name or a reward of the wrong shape: one line now, not at the first rollout
    tasks = _tasks(records, name, score_name, tuple(built))
    if test_records is not None:  # both sides read, so that no test row is a training row
        test = _tasks(test_records, name, score_name, tuple(built))
        _check_held_out(tasks, test, name)
        tasks = test if split == "test" else tasks
    if test_share is not None:
        train, test = _share_split(tasks, float(test_share), seed, Path(name))
        tasks = test if split == "test" else train
    if oracle is None and demonstrations is not None:
        oracle = replay(demonstrations)
    return TaskSet(name=name, tasks=tasks[:num_tasks], oracle=oracle, tools=built, meta={"split": split, "source": "records"})


def _check_held_out(train: list[Task], test: list[Task], name: str) -> None:
    """Refuse test rows that are training rows (the same question up to case, spacing and Unicode form,
    `question_key`): a held-out accuracy measured on them would be a training accuracy."""
    seen = {question_key(task.question) for task in train}
    shared = [task for task in test if question_key(task.question) in seen]
    if shared:
        raise ValueError(f"task set {name!r}: {len(shared)} of its {len(test)} test_records are training rows too "
                         f"(e.g. {shared[0].question[:80]!r}); held-out rows must not be trained on (test_on_train=True "
                         "says so explicitly if that is what you want)")


def _tasks(records: Records, name: str, scorer: str, tool_names: tuple[str, ...]) -> list[Task]:
    if isinstance(records, (str, Path)):
        rows, lines = _read_rows(Path(records))
        tasks = tasks_from_records(rows, name=name, scorer=scorer, tools=tool_names, file=str(records), lines=lines)
    else:
        tasks = tasks_from_records(list(records), name=name, scorer=scorer, tools=tool_names)
    if not tasks:
        raise TaskFileError(f"task set {name!r} has no rows")
    return unique_ids(tasks, name)


def _rows(records: Records, name: str) -> tuple[list[Mapping[str, Any]], list[RowRef]]:
    if isinstance(records, (str, Path)):
        rows, lines = _read_rows(Path(records))
        return rows, _rows_as_objects(rows, str(records), lines)
    rows = list(records)
    return rows, _rows_as_objects(rows, name, None)


def replay(demonstrations: Records) -> OraclePolicy:
    """An oracle that replays recorded demonstrations: rows of `{id or question, calls: [...]}`, each call
    `{"tool": name, "arguments": {...}}` or `{"answer": text}`, in order. A task without one raises."""
    rows, refs = _rows(demonstrations, "demonstrations")
    plans: dict[str, list[ToolCall]] = {}
    for row, ref in zip(rows, refs):
        key = str(row.get("id", row.get("question", "")))
        calls = row.get("calls")
        if not key or not isinstance(calls, list) or not calls:
            raise ref.error("calls", "a demonstration needs an id or question and a non-empty list of calls")
        plans[key] = [_call(call, ref) for call in calls]

    def oracle(task: Task, history: Sequence[tuple[ToolCall, str]]) -> ToolCall:
        plan = plans.get(task.task_id) or plans.get(task.question)
        if plan is None:
            raise ValueError(f"no demonstration for task {task.task_id!r}")
        return plan[min(len(history), len(plan) - 1)]

    return oracle


def _call(call: Any, ref: RowRef) -> ToolCall:
    if isinstance(call, Mapping) and "answer" in call:
        return ToolCall(ANSWER, {"answer": str(call["answer"])})
    if isinstance(call, Mapping) and isinstance(call.get("tool"), str) and isinstance(call.get("arguments", {}), Mapping):
        return ToolCall(call["tool"], dict(call.get("arguments", {})))
    raise ref.error("calls", f"each call is {{'tool': name, 'arguments': {{...}}}} or {{'answer': text}}, got {call!r}"[:200])
