"""The parquet files verl's `RLHFDataset` reads, one row per trace-rl task of a run config's splits.

`trace-rl verl-data --config configs/x.yaml --out data/x [key=value ...]` writes `train.parquet` (the RL train split, the tasks `TraceAgentLoopManager` trains on) and
`test.parquet` (the held-out split). Each row holds verl's columns: `prompt` (the env's chat
messages, which verl's dataset filters by length and shows in its logs; the manager renders the
prompt itself), `data_source` (the task's source), `reward_model` (rule style, the canonical answer,
for verl's logs: the env scores every leaf) and `extra_info` (`index`, and `trace_task`: the task as
JSON, which `TraceAgentLoopManager` rebuilds, so a validation file may come from another config).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

from trace_rl.agent.types import Task
from trace_rl.infra.config import ConfigError
from trace_rl.integrations.verl.manager import TASK_KEY
from trace_rl.run import RunConfig, build_env, load_tasks, task_splits, without_examples


def task_rows(config: RunConfig) -> dict[str, list[dict[str, Any]]]:
    """{split: rows} for the run's RL train split and its test split, which must share no question:
    verl validates on `test.parquet`, and a validation set of training prompts measures nothing held
    out (a `file:` task's test split is `task.options.test_file` or `test_share`; see `loaders`)."""
    _, train = task_splits(config)
    test = load_tasks(config.task, "test", config.task.test_tasks)
    check_disjoint(train.tasks, test.tasks)
    env = build_env(config, train)
    train = without_examples(train, env)
    splits = {}
    for name, taskset in (("train", train), ("test", test)):
        splits[name] = [
            {
                "data_source": task.source,
                "prompt": env.messages(task),
                "ability": config.task.name,
                "reward_model": {"style": "rule", "ground_truth": task.answers[0] if task.answers else ""},
                "extra_info": {"index": index, "split": name, TASK_KEY: json.dumps(task.to_dict())},
            }
            for index, task in enumerate(taskset.tasks)
        ]
    return splits


def check_disjoint(train: list[Task], test: list[Task]) -> None:
    """ConfigError unless no test question is a training question (compared with case and spacing
    folded), naming how many are and the first; `test_on_train` does not lift it here."""
    seen = {" ".join(task.question.casefold().split()) for task in train}
    shared = [task for task in test if " ".join(task.question.casefold().split()) in seen]
    if shared:
        raise ConfigError(
            f"{len(shared)} of {len(test)} test questions are training questions (the first: {shared[0].question[:80]!r}): "
            "verl would validate on prompts it trains on. Give the task a held-out split (task.options.test_file=PATH "
            "or task.options.test_share=0.1)"
        )


def require_pyarrow() -> None:
    """ImportError saying how to get pyarrow, unless it can be imported (checked before any work)."""
    if importlib.util.find_spec("pyarrow") is None:
        raise ImportError("writing parquet needs pyarrow: pip install -e '.[parquet]' (verl's environment has it)")


def write_parquet(config: RunConfig, out: str | Path) -> dict[str, Path]:
    """Write `train.parquet` and `test.parquet` into `out`; returns their paths (`require_pyarrow`)."""
    require_pyarrow()
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, rows in task_rows(config).items():
        paths[name] = folder / f"{name}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), paths[name])
    return paths
