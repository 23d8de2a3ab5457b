"""Distributed execution (extra `ray`): Ray actors that execute a batch's rollouts while the collector
plans in the main process (`rollout.backend: ray`, `rollout.workers: N`). Importing it needs Ray."""

from trace_rl.distributed.ray_rollout import (
    RayExecutor,
    RolloutWorker,
    WorkerBuild,
    partition,
)

__all__ = ["RayExecutor", "RolloutWorker", "WorkerBuild", "partition"]
