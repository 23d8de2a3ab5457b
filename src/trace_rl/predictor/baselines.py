"""Reference predictors scored beside the allocator's on every training step, so a broken predictor
shows at once: a constant at the running mean of every outcome so far, and each prompt's own history.

Each step, before anything learns from the step's rollouts, `score` judges them all on the same
pairs as `predictor/brier` and `predictor/brier_census` (`trace_rl.planning.metrics.scored_estimates`); then
`update` feeds them the step's trees. A shared predictor
whose Brier is above `predictor/brier_constant` is worse than knowing only the overall success rate.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from trace_rl.core.tree import RolloutTree
from trace_rl.planning.metrics import UnsolvedTally, scored_estimates
from trace_rl.predictor.base import backup_targets, brier_score
from trace_rl.predictor.history import PromptHistoryPredictor


class ReferencePredictors:
    """The running-mean constant and the per-prompt history, with their state for exact resumes; and
    the run's per-prompt tally behind `rollout/unsolved_share`."""

    def __init__(self) -> None:
        self.history = PromptHistoryPredictor()
        self.unsolved = UnsolvedTally()
        self.successes = 0.0
        self.rollouts = 0.0

    def score(self, trees: Sequence[RolloutTree]) -> dict[str, float]:
        """`predictor/brier_constant` and `predictor/brier_history` on the pairs `predictor/brier` uses,
        and `_census` on those of `predictor/brier_census` (`trace_rl.planning.metrics.scored_estimates`),
        none of them if no rollout was started at a node with an estimate; and `rollout/unsolved_share`."""
        figures = {"rollout/unsolved_share": self.unsolved.share(trees)}
        mean = self.successes / self.rollouts if self.rollouts else 0.5
        for census, suffix in ((False, ""), (True, "_census")):
            scored = scored_estimates(trees, census=census)
            if not scored:
                return figures
            y = np.array([outcome for *_, outcome in scored], dtype=np.float64)
            histories = [trees[index].history(node) for index, node, _ in scored]
            figures[f"predictor/brier_constant{suffix}"] = brier_score(np.full(y.size, mean), y)
            figures[f"predictor/brier_history{suffix}"] = brier_score(self.history.predict(histories), y)
        return figures

    def update(self, trees: Sequence[RolloutTree]) -> None:
        rewards = np.concatenate([t.leaf_rewards() for t in trees]) if trees else np.zeros(0)
        self.successes += float(rewards.sum())
        self.rollouts += float(rewards.size)
        self.unsolved.add(trees)
        histories, targets, weights = backup_targets(trees)
        if histories:
            self.history.update(histories, targets, weights)

    def state_dict(self) -> dict:
        return {"history": self.history.state_dict(), "unsolved": self.unsolved.state_dict(), "successes": self.successes, "rollouts": self.rollouts}

    def load_state_dict(self, state: dict) -> None:
        self.history.load_state_dict(state["history"])
        if "unsolved" in state:
            self.unsolved.load_state_dict(state["unsolved"])
        else:  # a checkpoint from before the tally: the history's counts (its summed rewards are > 0 where one was)
            self.unsolved = UnsolvedTally()
            self.unsolved.trials, self.unsolved.successes = dict(self.history.trials), dict(self.history.successes)
        self.successes, self.rollouts = float(state["successes"]), float(state["rollouts"])
