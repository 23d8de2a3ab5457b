"""Distributed execution: the collector plans in the main process, workers execute a batch's rollouts.

`split` (no Ray needed) says which trees each worker takes and merges its result back;
`ray_rollout` (extra `ray`) runs the workers as Ray actors (`rollout.backend: ray`, `rollout.workers: N`).
"""
