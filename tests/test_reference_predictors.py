"""The reference predictors logged beside the allocator's: a running-mean constant and the per-prompt history."""

from __future__ import annotations

import pytest

from trace_rl.predictor.baselines import ReferencePredictors
from trace_rl.tree import RolloutTree


def _tree(task_id: str, rewards: list[float], predicted: float = 0.5) -> RolloutTree:
    tree = RolloutTree.new(task_id, f"question {task_id}")
    tree.root.predicted = predicted
    for reward in rewards:
        first = tree.add_turn(0, thought="look", starts_rollout=True)
        tree.add_turn(first, action="answer", reward=reward, starts_rollout=False)
    return tree


def test_references_start_at_a_half_then_learn_the_mean_and_each_prompt():
    refs = ReferencePredictors()
    first = [_tree("a", [1.0, 1.0]), _tree("b", [0.0, 0.0])]
    assert refs.score(first) == {"predictor/brier_constant": 0.25, "predictor/brier_history": 0.25}
    refs.update(first)
    again = [_tree("a", [1.0, 0.0]), _tree("c", [1.0, 1.0])]
    scores = refs.score(again)
    assert scores["predictor/brier_constant"] == pytest.approx(0.25)  # the mean so far is 0.5
    # history: a is Beta(1+2, 1+0) -> 0.75; c was never seen -> 0.5
    assert scores["predictor/brier_history"] == pytest.approx(((0.75 - 1) ** 2 + 0.75**2 + 2 * 0.25) / 4)


def test_only_rollouts_started_where_an_estimate_was_made_are_scored_and_state_round_trips():
    refs = ReferencePredictors()
    assert refs.score([_tree("a", [1.0], predicted=None)]) == {}
    refs.update([_tree("a", [1.0, 1.0, 0.0])])
    copy = ReferencePredictors()
    copy.load_state_dict(refs.state_dict())
    probe = [_tree("a", [0.0, 1.0])]
    assert copy.score(probe) == refs.score(probe)
