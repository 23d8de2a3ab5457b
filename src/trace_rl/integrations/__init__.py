"""Adapters that let other RL trainers train on TRACE trees (each module needs its own extra: `trl`).

They sit above `trace_rl.run`: they assemble the same parts (collector, predictor, estimator) and hand
the trees to a foreign trainer; nothing in the core imports them.
"""
