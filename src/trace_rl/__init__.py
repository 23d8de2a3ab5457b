"""trace-rl: agentic RL with tree-structured rollouts and exact rollout-budget allocation (TRACE).

The public API, importable from `trace_rl` itself (each name loads its module on first use, so
`import trace_rl` stays light):

    import trace_rl

    tasks = trace_rl.task_set(rows, scorer=reward, tools=[price], test_share=0.25)   # your own task
    trace_rl.train("configs/smoke.yaml", out="runs/mine", overrides=["task.name=shop.py:tasks"])

- your own work: `task_set` (rows in memory or a file, your reward and tools), `Task`, `TaskSet`, `Tool`,
  `ToolCall`, `Env` (the protocol an environment of your own implements, named by `task.env`; its
  `StepResult` / `StepInfo`, and `check_env` to test one), `ToolEnv`, `load_taskset`, `SCORERS`, `score`;
- running: `RunConfig`, `load_config`, `train`, `evaluate`;
- the method: `METHODS`, `get_method`, `allocate_roots` (Stage 1), `expand_prefixes` (Stage 2),
  `root_value`, `prefix_value`, `ESTIMATORS` (advantages over trees), `RolloutTree`.

A config names your code as `module:function` or `path/to/file.py:function` (`trace_rl.infra.references`).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "task_set": "trace_rl.agent.tasks.records",
    "Task": "trace_rl.agent.types",
    "TaskSet": "trace_rl.agent.types",
    "ToolCall": "trace_rl.agent.types",
    "Tool": "trace_rl.agent.tools",
    "Env": "trace_rl.agent.env",
    "ToolEnv": "trace_rl.agent.env",
    "StepResult": "trace_rl.agent.env",
    "StepInfo": "trace_rl.agent.env",
    "check_env": "trace_rl.agent.env",
    "load_taskset": "trace_rl.agent.tasks",
    "SCORERS": "trace_rl.agent.scoring",
    "score": "trace_rl.agent.scoring",
    "RunConfig": "trace_rl.run",
    "load_config": "trace_rl.infra.config",
    "train": "trace_rl.run",
    "evaluate": "trace_rl.run",
    "METHODS": "trace_rl.planning.methods",
    "get_method": "trace_rl.planning.methods",
    "allocate_roots": "trace_rl.core.solvers",
    "expand_prefixes": "trace_rl.core.solvers",
    "root_value": "trace_rl.core.contrast",
    "prefix_value": "trace_rl.core.contrast",
    "ESTIMATORS": "trace_rl.core.advantage",
    "RolloutTree": "trace_rl.core.tree",
}

__all__ = [
    "ESTIMATORS",
    "METHODS",
    "SCORERS",
    "Env",
    "RolloutTree",
    "RunConfig",
    "StepInfo",
    "StepResult",
    "Task",
    "TaskSet",
    "Tool",
    "ToolCall",
    "ToolEnv",
    "allocate_roots",
    "check_env",
    "evaluate",
    "expand_prefixes",
    "get_method",
    "load_config",
    "load_taskset",
    "prefix_value",
    "root_value",
    "score",
    "task_set",
    "train",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'trace_rl' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
