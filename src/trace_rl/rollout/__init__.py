"""Executing plans: the collector, which runs the planner's requests with an engine and an env and
grows the trees (`collector.py`), and its Ray executor (`ray_workers.py`, extra `ray`) with the pure
helpers that split a batch over workers and merge it back (`split.py`)."""
