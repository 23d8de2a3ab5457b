"""PromptHistoryPredictor: the Beta-posterior default and Knapsack-RL's last-epoch estimate."""

from __future__ import annotations

import json

import numpy as np
import pytest

from trace_rl.core.baselines import knapsack_roots
from trace_rl.core.tree import History, Turn
from trace_rl.predictor import SuccessPredictor
from trace_rl.predictor.history import PromptHistoryPredictor


def root(task: str) -> History:
    return History(prompt=f"prompt {task}", task_id=task)


def visit(predictor: PromptHistoryPredictor, task: str, successes: int, rollouts: int) -> None:
    """One epoch's visit of `task`: its root example, as `backup_targets` gives it (mean, leaf count)."""
    predictor.update([root(task)], np.array([successes / rollouts]), np.array([float(rollouts)]))


def last_epoch(**options) -> PromptHistoryPredictor:
    return PromptHistoryPredictor(estimate="last_epoch", **options)


@pytest.mark.parametrize("estimate", ["beta", "last_epoch"])
def test_predicts_exactly_half_before_any_update(estimate) -> None:
    predictor = PromptHistoryPredictor(estimate=estimate)
    assert isinstance(predictor, SuccessPredictor)
    p = predictor.predict([root("a"), root("b")])
    assert p.dtype == np.float64 and p.tolist() == [0.5, 0.5]


def test_default_stays_the_beta_posterior_mean_of_every_visit() -> None:
    predictor = PromptHistoryPredictor()
    visit(predictor, "a", 16, 16)
    visit(predictor, "a", 4, 16)
    assert predictor.predict([root("a")])[0] == pytest.approx((1 + 20) / (2 + 32))


def test_last_epoch_reads_only_the_latest_visit_when_it_fills_the_buffer() -> None:
    predictor = last_epoch()
    visit(predictor, "a", 16, 16)
    visit(predictor, "a", 4, 16)
    assert predictor.predict([root("a")])[0] == 0.25


def test_last_epoch_tops_a_short_visit_up_with_the_latest_rollouts_before_it() -> None:
    predictor = last_epoch()
    visit(predictor, "a", 16, 16)
    visit(predictor, "a", 0, 8)  # 8 < 16: the latest 16 rollouts are these 8 and 8 of the last visit
    assert predictor.predict([root("a")])[0] == 0.5


def test_last_epoch_takes_a_partial_older_visit_pro_rata() -> None:
    predictor = last_epoch()
    visit(predictor, "a", 6, 8)
    visit(predictor, "a", 3, 12)  # needs 4 more rollouts: 4/8 of the older visit's 6 successes
    assert predictor.predict([root("a")])[0] == pytest.approx((3 + 3) / 16)


def test_last_epoch_uses_every_rollout_when_there_are_fewer_than_the_buffer() -> None:
    predictor = last_epoch()
    visit(predictor, "a", 4, 4)
    visit(predictor, "a", 0, 4)
    assert predictor.predict([root("a")])[0] == 0.5


def test_last_epoch_without_a_buffer_is_the_plain_latest_rate() -> None:
    predictor = last_epoch(buffer_length=0)
    visit(predictor, "a", 16, 16)
    visit(predictor, "a", 0, 2)
    assert predictor.predict([root("a")])[0] == 0.0


def test_one_update_is_one_visit_even_with_several_examples_of_a_prompt() -> None:
    predictor = last_epoch(buffer_length=0)
    histories = [root("a"), root("a")]
    predictor.update(histories, np.array([1.0, 0.0]), np.array([8.0, 8.0]))
    assert predictor.predict([root("a")])[0] == 0.5  # two visits would read only the second: 0.0


def test_prefix_histories_neither_teach_nor_get_their_own_estimate() -> None:
    predictor = last_epoch()
    prefix = History(prompt="prompt a", turns=(Turn("t", "search[x]", "obs"),), task_id="a")
    used = predictor.update([root("a"), prefix], np.array([0.25, 1.0]), np.array([16.0, 3.0]))
    assert used == {"predictor/examples_used": 1.0}
    assert predictor.predict([prefix, root("a")]).tolist() == [0.25, 0.25]


def test_known_needs_min_count_rollouts_in_all() -> None:
    predictor = last_epoch()
    visit(predictor, "a", 2, 4)
    visit(predictor, "b", 2, 4)
    visit(predictor, "b", 2, 4)
    assert predictor.known([root("a"), root("b"), root("never")]).tolist() == [False, True, False]
    assert last_epoch(min_count=0).known([root("never")]).tolist() == [False]  # never seen: never known


def test_keeps_only_the_visits_the_estimate_reads() -> None:
    predictor = last_epoch()
    for successes in range(20):
        visit(predictor, "a", successes % 9, 8)
    assert len(predictor.recent["a"]) == 2  # 8 + 8 rollouts fill the buffer of 16
    visit(predictor, "a", 16, 16)
    assert predictor.recent["a"] == [[16.0, 16.0]]
    assert predictor.trials["a"] == 20 * 8 + 16


def test_state_dict_round_trips_the_option_and_the_visits() -> None:
    predictor = last_epoch(buffer_length=12, min_count=6)
    visit(predictor, "a", 9, 12)
    visit(predictor, "a", 1, 4)
    visit(predictor, "b", 0, 4)
    state = json.loads(json.dumps(predictor.state_dict()))  # plain JSON types: checkpoints can hold it
    restored = PromptHistoryPredictor()  # default options: the state must bring its own
    restored.load_state_dict(state)
    assert (restored.estimate, restored.buffer_length, restored.min_count) == ("last_epoch", 12.0, 6.0)
    histories = [root("a"), root("b"), root("c")]
    assert restored.predict(histories).tolist() == predictor.predict(histories).tolist()
    assert restored.known(histories).tolist() == predictor.known(histories).tolist()
    for p in (predictor, restored):
        visit(p, "a", 0, 4)
    assert restored.predict(histories).tolist() == predictor.predict(histories).tolist()
    assert restored.state_dict() == predictor.state_dict()


def test_a_state_from_before_the_option_keeps_the_beta_default() -> None:
    restored = PromptHistoryPredictor()
    restored.load_state_dict({"prior": [1.0, 1.0], "successes": {"a": 3.0}, "trials": {"a": 4.0}})
    assert restored.estimate == "beta"
    assert restored.predict([root("a")])[0] == pytest.approx(4 / 6)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"estimate": "ema"}, "estimate"),
        ({"buffer_length": -1}, "buffer_length"),
        ({"buffer_length": float("nan")}, "buffer_length"),
        ({"min_count": "8"}, "min_count"),
        ({"prior_successes": 0.0}, "prior_successes"),
    ],
)
def test_names_the_bad_option(kwargs, name) -> None:
    with pytest.raises(ValueError, match=name):
        PromptHistoryPredictor(**kwargs)


def test_feeds_knapsack_roots_as_knapsack_rl_does() -> None:
    predictor = last_epoch()
    visit(predictor, "solved", 16, 16)
    visit(predictor, "unsolved", 0, 16)
    visit(predictor, "mixed", 8, 16)
    histories = [root("solved"), root("unsolved"), root("mixed"), root("new")]
    p, known = predictor.predict(histories), predictor.known(histories)
    assert p.tolist() == [1.0, 0.0, 0.5, 0.5] and known.tolist() == [True, True, True, False]
    got = knapsack_roots(p, 32, known=known, max_per_prompt=128)
    # Floors: 2 (solved), 2 (unsolved), 2 (mixed), 8 = 32 // 4 (new, unknown). The mixed prompt costs
    # 3, so the surplus 18 - 3 = 15 goes to the prompts read as unsolved (8 to "unsolved", 7 to "new").
    assert got.tolist() == [2, 10, 5, 15]
