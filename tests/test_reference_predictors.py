"""The reference predictors logged beside the allocator's: a running-mean constant and the per-prompt history."""

from __future__ import annotations

import pytest

from trace_rl.core.tree import RolloutTree
from trace_rl.predictor.baselines import ReferencePredictors


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
    expected = {f"predictor/brier_{r}{s}": 0.25 for r in ("constant", "history") for s in ("", "_census")}
    assert refs.score(first) == {**expected, "rollout/unsolved_share": 0.0}
    refs.update(first)
    again = [_tree("a", [1.0, 0.0]), _tree("c", [1.0, 1.0])]
    scores = refs.score(again)
    assert scores["predictor/brier_constant"] == pytest.approx(0.25)  # the mean so far is 0.5
    # history: a is Beta(1+2, 1+0) -> 0.75; c was never seen -> 0.5
    assert scores["predictor/brier_history"] == pytest.approx(((0.75 - 1) ** 2 + 0.75**2 + 2 * 0.25) / 4)


def test_only_rollouts_started_where_an_estimate_was_made_are_scored_and_state_round_trips():
    refs = ReferencePredictors()
    assert refs.score([_tree("a", [1.0], predicted=None)]) == {"rollout/unsolved_share": 0.0}
    refs.update([_tree("a", [1.0, 1.0, 0.0])])
    copy = ReferencePredictors()
    copy.load_state_dict(refs.state_dict())
    probe = [_tree("a", [0.0, 1.0])]
    assert copy.score(probe) == refs.score(probe)


def test_the_census_also_judges_every_prefix_estimate_against_the_rollouts_through_it():
    from trace_rl.planning.metrics import predictor_metrics, scored_estimates

    tree = RolloutTree.new("a", "question a")
    tree.root.predicted = 0.5
    first = tree.add_turn(0, thought="look", starts_rollout=True)
    tree.add_turn(first, action="answer", reward=0.0, starts_rollout=False)  # the bare rollout
    tree.nodes[first].predicted = 0.9  # an optimistic prefix estimate, expanded once
    tree.add_turn(first, action="answer", reward=1.0, starts_rollout=True)
    assert scored_estimates([tree]) == [(0, 0, 0.0), (0, 1, 1.0)]  # each rollout at its start
    assert scored_estimates([tree], census=True) == [(0, 0, 0.0), (0, 1, 0.0), (0, 1, 1.0)]
    figures = predictor_metrics([tree])
    assert figures["predictor/brier"] == pytest.approx((0.25 + 0.01) / 2)
    assert figures["predictor/brier_census"] == pytest.approx((0.25 + 0.81 + 0.01) / 3)
    refs = ReferencePredictors()
    assert refs.score([tree])["predictor/brier_constant_census"] == pytest.approx(0.25)


def test_the_step_brier_carries_a_standard_error_over_prompts_worked_by_hand():
    import numpy as np

    from trace_rl.planning.metrics import brier_standard_error, predictor_metrics

    # errors (p - y)^2: prompt a 0.25, 0.25; prompt b 0.04, 0.04, 0.64; Brier 1.22 / 5 = 0.244
    figures = predictor_metrics([_tree("a", [1.0, 1.0], predicted=0.5), _tree("b", [0.0, 0.0, 1.0], predicted=0.2)])
    assert figures["predictor/brier"] == pytest.approx(0.244)
    # each prompt's residual sum: 0.5 - 2 x 0.244 = 0.012 and 0.72 - 3 x 0.244 = -0.012;
    # variance 2 / (2 - 1) x (0.012^2 + 0.012^2) / 5^2
    assert figures["predictor/brier_se"] == pytest.approx(np.sqrt(2 * 2 * 0.012**2 / 25))
    # one pair a cluster: the textbook standard error of a mean, sample sd / sqrt(n)
    p, y = np.array([0.1, 0.7, 0.4, 0.9]), np.array([0.0, 1.0, 1.0, 0.0])
    errors = (p - y) ** 2
    assert brier_standard_error(p, y, np.arange(4)) == pytest.approx(errors.std(ddof=1) / 2)
    # one prompt: no spread across prompts to read, so no figure
    assert brier_standard_error(p, y, np.zeros(4)) is None
    assert "predictor/brier_se" not in predictor_metrics([_tree("a", [1.0, 0.0])])


def test_the_unsolved_share_counts_rollouts_on_prompts_failed_at_least_twelve_times_worked_by_hand():
    from trace_rl.planning.metrics import UnsolvedTally

    refs = ReferencePredictors()
    steps = [
        [_tree("a", [0.0] * 8), _tree("b", [0.0] * 12), _tree("c", [0.0] * 6 + [1.0] * 6)],
        [_tree("a", [0.0] * 4), _tree("b", [0.0] * 2), _tree("c", [0.0] * 2)],  # only b is 0 for 12 so far
        [_tree("a", [0.0] * 3, predicted=None), _tree("b", [1.0]), _tree("d", [0.0] * 2)],  # a 0 for 12 now; b too
        [_tree("a", [0.0]), _tree("b", [0.0] * 3)],  # b has a success now: solved
    ]
    logged = []
    for trees in steps:
        logged.append(refs.score(trees)["rollout/unsolved_share"])
        refs.update(trees)
    assert logged == pytest.approx([0.0, 2 / 8, (3 + 1) / 6, 1 / 4])
    stricter, shares = UnsolvedTally(after=8), []
    for trees in steps:
        shares.append(stricter.share(trees))
        stricter.add(trees)
    assert shares == pytest.approx([0.0, (4 + 2) / 8, 4 / 6, 1 / 4])
    # a resume continues the tally; a checkpoint from before it rebuilds the tally from the history
    state = refs.state_dict()
    for kept in (state, {k: v for k, v in state.items() if k != "unsolved"}):
        again = ReferencePredictors()
        again.load_state_dict(kept)
        probe = [_tree("a", [0.0]), _tree("c", [0.0])]
        assert again.score(probe) == refs.score(probe) and again.score(probe)["rollout/unsolved_share"] == 0.5
    assert UnsolvedTally().share([]) == 0.0
    # a penalty is no success, partial credit is one
    tally = UnsolvedTally()
    tally.add([_tree("p", [-0.5] * 12), _tree("q", [0.0] * 11 + [0.2])])
    assert tally.share([_tree("p", [0.0]), _tree("q", [0.0])]) == 0.5
