"""Deciding where a batch's rollouts go: the method registry (`methods.py`), the two-stage planner
that owns the sequence and its state (`planner.py`), Stage 2's evidence model (`evidence.py`) and the
batch figures that say how the budget was spent (`metrics.py`). The success predictors it plans with
are `trace_rl.predictor`."""
