"""Per-prompt success estimates from each prompt's own past rollouts (Knapsack-RL / PCL style).

The `prompt_only` baseline allocates from what it has seen of each prompt before: a Beta(1, 1)
posterior mean of its past root outcomes, 0.5 for a prompt never sampled. It cannot generalise to
new prompts or to intermediate prefixes (it answers a prefix with its prompt's estimate), which is
exactly the gap TRACE's shared text predictor closes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from trace_rl.predictor.base import check_training_batch
from trace_rl.tree import History


class PromptHistoryPredictor:
    """`SuccessPredictor` that remembers successes and trials per task id; only root examples teach it."""

    def __init__(self, *, prior_successes: float = 1.0, prior_failures: float = 1.0) -> None:
        if prior_successes <= 0 or prior_failures <= 0:
            raise ValueError("prior_successes and prior_failures must be > 0")
        self.prior = (float(prior_successes), float(prior_failures))
        self.successes: dict[str, float] = {}
        self.trials: dict[str, float] = {}

    def predict(self, histories: Sequence[History]) -> np.ndarray:
        a, b = self.prior
        out = np.empty(len(histories), dtype=np.float64)
        for index, history in enumerate(histories):
            key = history.task_id
            out[index] = (a + self.successes.get(key, 0.0)) / (a + b + self.trials.get(key, 0.0))
        return out

    def update(self, histories: Sequence[History], targets: np.ndarray, weights: np.ndarray) -> dict[str, float]:
        """Adds each root example's weight (its leaf count) as trials and weight × target as successes."""
        y, w = check_training_batch(histories, targets, weights)
        used = 0
        for history, target, weight in zip(histories, y, w):
            if history.depth:
                continue
            self.successes[history.task_id] = self.successes.get(history.task_id, 0.0) + weight * target
            self.trials[history.task_id] = self.trials.get(history.task_id, 0.0) + weight
            used += 1
        return {"predictor/examples_used": float(used)}

    def state_dict(self) -> dict:
        return {"prior": list(self.prior), "successes": dict(self.successes), "trials": dict(self.trials)}

    def load_state_dict(self, state: dict) -> None:
        self.prior = (float(state["prior"][0]), float(state["prior"][1]))
        self.successes = {str(k): float(v) for k, v in state["successes"].items()}
        self.trials = {str(k): float(v) for k, v in state["trials"].items()}
