"""Per-prompt success estimates from each prompt's own past rollouts (Knapsack-RL / PCL style).

The `prompt_only` baseline allocates from what it has seen of each prompt before. Two estimates:

- `estimate="beta"` (default): a Beta(1, 1) posterior mean of all its past root outcomes, 0.5 for a
  prompt never sampled.
- `estimate="last_epoch"`: what Knapsack-RL feeds its allocator (`trace_rl.core.baselines.knapsack_roots`),
  as released in github.com/liziniu/KnapsackRL, `verl/utils/dataset/rl_dataset.py`
  (`update_sample_state` / `get_sample_state`, with the launch script's epoch_estimation =
  robust_epoch_estimation = true, reward_buffer_length = 16, min_buffer_length = 8): the success rate
  observed the last time the prompt was sampled (its last epoch); if that visit had fewer than
  `buffer_length` rollouts, the mean of its most recent `buffer_length` rollouts across visits. A
  prompt seen fewer than `min_count` times in all is not `known`: their allocator does not use its
  estimate but gives it the uniform rollout count, so pass `known(histories)` to `knapsack_roots`.

Either way it cannot generalise to new prompts or to intermediate prefixes (it answers a prefix with
its prompt's estimate), which is exactly the gap TRACE's shared text predictor closes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

from trace_rl.core.tree import History
from trace_rl.predictor.base import PromptEvidence, check_training_batch

Estimate = Literal["beta", "last_epoch"]


class PromptHistoryPredictor:
    """`SuccessPredictor` that remembers successes and trials per task id; only root examples teach it.

    One `update` call is one visit of each task id it holds root examples for (several examples of
    the same id in one call are one visit, as Knapsack-RL groups a batch's rollouts by prompt). A
    visit's rollouts are the examples' weights (leaf counts) and its successes weight × target.

    `estimate="last_epoch"` differs from the released code in two places, both forced by the
    interface: an older visit that only partly fits the `buffer_length` window counts its share of
    successes pro rata (theirs takes the rollouts last in that batch's order, an arbitrary subset);
    and a prompt never seen predicts 0.5 and is never `known` (theirs reads as success rate 0 with
    min_buffer_length = 0, a setting their script does not use), so the contract's "0.5 before any
    update" holds.
    """

    def __init__(
        self,
        *,
        prior_successes: float = 1.0,
        prior_failures: float = 1.0,
        estimate: Estimate = "beta",
        buffer_length: float = 16.0,
        min_count: float = 8.0,
    ) -> None:
        if prior_successes <= 0 or prior_failures <= 0:
            raise ValueError("prior_successes and prior_failures must be > 0")
        self.prior = (float(prior_successes), float(prior_failures))
        self.estimate, self.buffer_length, self.min_count = _options(estimate, buffer_length, min_count)
        self.successes: dict[str, float] = {}
        self.trials: dict[str, float] = {}
        self.recent: dict[str, list[list[float]]] = {}
        """Per task id, its latest visits as [successes, trials], oldest first: only as many as the
        `last_epoch` estimate reads (the last one, and older ones until `buffer_length` rollouts)."""

    def predict(self, histories: Sequence[History]) -> np.ndarray:
        out = np.empty(len(histories), dtype=np.float64)
        for index, history in enumerate(histories):
            out[index] = self._estimate(history.task_id)
        return out

    def evidence(self, histories: Sequence[History]) -> PromptEvidence:
        """`known` for Knapsack-RL's allocator."""
        return PromptEvidence(known=self.known(histories))

    def known(self, histories: Sequence[History]) -> np.ndarray:
        """True where the prompt has been sampled at least `min_count` times (and at all): Knapsack-RL's
        validity flag, below which its allocator ignores the estimate and gives the uniform count."""
        trials = [self.trials.get(history.task_id, 0.0) for history in histories]
        return np.array([0.0 < count and count >= self.min_count for count in trials], dtype=bool)

    def _estimate(self, key: str) -> float:
        trials = self.trials.get(key, 0.0)
        if self.estimate == "beta" or trials == 0.0:
            a, b = self.prior
            return (a + self.successes.get(key, 0.0)) / (a + b + trials)
        visits = self.recent.get(key)
        if not visits:  # a state saved before visits were kept: the all-time rate is all there is
            return self.successes.get(key, 0.0) / trials
        last_successes, last_trials = visits[-1]
        if last_trials >= self.buffer_length:
            return last_successes / last_trials
        # Robust epoch estimate: the latest `buffer_length` rollouts, newest visits first.
        wanted, got, hits = self.buffer_length, 0.0, 0.0
        for successes, count in reversed(visits):
            take = min(count, wanted - got)
            hits += successes * (take / count)
            got += take
            if got >= wanted:
                break
        return hits / got

    def update(self, histories: Sequence[History], targets: np.ndarray, weights: np.ndarray) -> dict[str, float]:
        """Adds each root example's weight (its leaf count) as trials and weight × target as successes."""
        y, w = check_training_batch(histories, targets, weights)
        used = 0
        visits: dict[str, list[float]] = {}
        for history, target, weight in zip(histories, y, w):
            if history.depth:
                continue
            key = history.task_id
            self.successes[key] = self.successes.get(key, 0.0) + weight * target
            self.trials[key] = self.trials.get(key, 0.0) + weight
            visit = visits.setdefault(key, [0.0, 0.0])
            visit[0] += weight * target
            visit[1] += weight
            used += 1
        for key, visit in visits.items():
            if visit[1] > 0.0:  # a visit without rollouts observed nothing
                self._remember(key, visit)
        return {"predictor/examples_used": float(used)}

    def _remember(self, key: str, visit: list[float]) -> None:
        """Append a visit and drop the ones older than the estimate's window."""
        kept = self.recent.setdefault(key, [])
        kept.append(visit)
        total, first = 0.0, len(kept)
        while first > 0 and (total < self.buffer_length or first == len(kept)):
            first -= 1
            total += kept[first][1]
        del kept[:first]

    def state_dict(self) -> dict:
        return {
            "prior": list(self.prior),
            "successes": dict(self.successes),
            "trials": dict(self.trials),
            "estimate": self.estimate,
            "buffer_length": self.buffer_length,
            "min_count": self.min_count,
            "recent": {key: [list(visit) for visit in visits] for key, visits in self.recent.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        """Restores a `state_dict`, the estimate options included; a state saved before those options
        existed keeps this predictor's options and has no visit history."""
        self.prior = (float(state["prior"][0]), float(state["prior"][1]))
        self.successes = {str(k): float(v) for k, v in state["successes"].items()}
        self.trials = {str(k): float(v) for k, v in state["trials"].items()}
        self.estimate, self.buffer_length, self.min_count = _options(
            state.get("estimate", self.estimate),
            state.get("buffer_length", self.buffer_length),
            state.get("min_count", self.min_count),
        )
        self.recent = {
            str(k): [[float(s), float(n)] for s, n in visits] for k, visits in state.get("recent", {}).items()
        }


def _options(estimate: object, buffer_length: object, min_count: object) -> tuple[Estimate, float, float]:
    """Checked (estimate, buffer_length, min_count)."""
    if estimate not in ("beta", "last_epoch"):
        raise ValueError(f"estimate must be 'beta' or 'last_epoch', got {estimate!r}")
    numbers = []
    for name, value in (("buffer_length", buffer_length), ("min_count", min_count)):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if not (np.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
        numbers.append(float(value))
    return estimate, numbers[0], numbers[1]  # type: ignore[return-value]
