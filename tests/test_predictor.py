"""The success predictor: its contract, training targets and calibration measures."""

from __future__ import annotations

import time

import numpy as np
import pytest

from trace_rl.predictor import (
    HashedNgramPredictor,
    PredictorConfig,
    SuccessPredictor,
    backup_targets,
    brier_score,
    calibration_report,
    expected_calibration_error,
    natural_backup,
    rollout_starts,
)
from trace_rl.predictor.hashed import _fit_platt
from trace_rl.sim import LatentTreeSimulator
from trace_rl.tree import History, RolloutTree, Turn


def _toy(count: int, seed: int) -> tuple[list[History], np.ndarray]:
    """Prompts that say 'easy' succeed, 'hard' ones fail; the rest of the words are noise."""
    rng = np.random.default_rng(seed)
    filler = [f"w{i}" for i in range(50)]
    histories, targets = [], []
    for i in range(count):
        label = i % 2
        words = " ".join(rng.choice(filler, size=4))
        prompt = f"{'easy' if label else 'hard'} question {words}"
        turns = (Turn("think", "search[x]", "result"),) if i % 3 == 0 else ()
        histories.append(History(prompt, turns, f"t{i}"))
        targets.append(float(label))
    return histories, np.array(targets)


def test_predicts_exactly_half_before_any_update() -> None:
    histories, _ = _toy(20, seed=0)
    p = HashedNgramPredictor().predict(histories)
    assert p.dtype == np.float64
    assert np.all(p == 0.5)


def test_satisfies_the_success_predictor_protocol() -> None:
    assert isinstance(HashedNgramPredictor(), SuccessPredictor)


def test_learns_a_separable_toy_signal_and_generalises_to_new_prompts() -> None:
    train, y = _toy(400, seed=0)
    test, y_test = _toy(100, seed=1)
    predictor = HashedNgramPredictor(seed=0)
    first = predictor.update(train, y, np.ones_like(y))
    for _ in range(4):
        last = predictor.update(train, y, np.ones_like(y))
    assert last["predictor/loss"] < first["predictor/loss"]
    p = predictor.predict(test)
    assert p[y_test == 1.0].min() > 0.75 and p[y_test == 0.0].max() < 0.25
    assert np.mean(np.abs(p - y_test)) < 0.1


def test_training_is_deterministic_given_the_seed() -> None:
    histories, y = _toy(200, seed=0)
    a, b = HashedNgramPredictor(seed=3), HashedNgramPredictor(seed=3)
    a.update(histories, y, None)
    b.update(histories, y, None)
    np.testing.assert_array_equal(a.predict(histories), b.predict(histories))


def test_state_dict_round_trip_gives_identical_predictions_and_training() -> None:
    histories, y = _toy(200, seed=0)
    trained = HashedNgramPredictor(PredictorConfig(learning_rate=0.5), seed=1)
    trained.update(histories, y, None)
    restored = HashedNgramPredictor(PredictorConfig(num_features=64))  # another config: the state replaces it
    restored.load_state_dict(trained.state_dict())
    np.testing.assert_array_equal(restored.predict(histories), trained.predict(histories))
    trained.update(histories, y, None)  # same seeded minibatch order afterwards too
    restored.update(histories, y, None)
    np.testing.assert_array_equal(restored.predict(histories), trained.predict(histories))


def test_state_dict_is_a_copy() -> None:
    histories, y = _toy(50, seed=0)
    predictor = HashedNgramPredictor()
    state = predictor.state_dict()
    predictor.update(histories, y, None)
    for model in ("shared", "root"):
        assert not state[model]["weights"].any() and state[model]["bias"] == 0.0
    assert state["replay"] == [] and state["calibration"] == [1.0, 0.0]
    later = predictor.state_dict()
    later["replay"][0]["targets"][:] = -1.0  # editing a state leaves the predictor alone
    assert predictor.state_dict()["replay"][0]["targets"].min() >= 0.0


def test_state_round_trip_carries_the_replay_buffer_and_the_calibration() -> None:
    """Resuming mid-run must reproduce predictions and training exactly, so the state holds the
    replayed root examples and the calibration's data, not just the weights."""
    batches = [_toy(120, seed=s) for s in range(5)]
    trained = HashedNgramPredictor(PredictorConfig(replay_batches=2), seed=2)
    for histories, y in batches[:3]:
        trained.update(histories, y, None)
    state = trained.state_dict()
    assert len(state["replay"]) == 2  # the roots of the last two updates, oldest first
    assert state["replay"][-1]["prompts"] == [h.prompt for h in batches[2][0] if not h.turns]
    assert len(state["calibration_data"]) == 2 and state["calibration"] != [1.0, 0.0]  # fitted from update 2 on
    restored = HashedNgramPredictor(PredictorConfig(replay_batches=0, calibration_batches=0))  # the state's config wins
    restored.load_state_dict(state)
    for histories, y in batches[3:]:
        np.testing.assert_array_equal(restored.predict(histories), trained.predict(histories))
        assert restored.update(histories, y, None) == trained.update(histories, y, None)
    np.testing.assert_array_equal(restored.predict(batches[0][0]), trained.predict(batches[0][0]))


def test_load_state_dict_rejects_a_state_of_the_single_model_version() -> None:
    old = {k: v for k, v in HashedNgramPredictor().state_dict().items() if k != "version"}
    with pytest.raises(ValueError, match="version"):
        HashedNgramPredictor().load_state_dict(old)


def test_roots_are_answered_by_the_root_head_which_learns_from_roots_only() -> None:
    histories, y = _toy(300, seed=0)
    prefixes = [i for i, h in enumerate(histories) if h.turns]
    roots = [History(h.prompt) for h in histories]
    predictor = HashedNgramPredictor(seed=0)
    predictor.update([histories[i] for i in prefixes], y[prefixes], None)
    assert np.all(predictor.predict(roots) == 0.5)  # prefix examples never reach the root head
    assert not np.all(predictor.predict([histories[i] for i in prefixes]) == 0.5)
    predictor.update(roots, y, None)
    p = predictor.predict(roots)
    assert p[y == 1.0].min() > 0.5 > p[y == 0.0].max()


def test_replay_trains_again_on_earlier_roots_and_is_bounded() -> None:
    batches = [_toy(60, seed=s) for s in range(4)]
    predictor = HashedNgramPredictor(PredictorConfig(replay_batches=2))
    replayed = [predictor.update(h, y, None)["predictor/replayed"] for h, y in batches]
    roots = [sum(not h.turns for h in histories) for histories, _ in batches]
    assert replayed == [0.0, roots[0], roots[0] + roots[1], roots[1] + roots[2]]
    none = HashedNgramPredictor(PredictorConfig(replay_batches=0))
    assert [none.update(h, y, None)["predictor/replayed"] for h, y in batches] == [0.0] * 4
    assert none.state_dict()["replay"] == []


def test_platt_fit_recovers_a_known_slope_and_intercept() -> None:
    z = np.random.default_rng(0).normal(0.0, 2.0, size=4000)
    y = 1.0 / (1.0 + np.exp(-(0.7 * z - 0.3)))  # fractional targets: the exact probabilities
    slope, intercept = _fit_platt(z, y, np.ones_like(z))
    assert slope == pytest.approx(0.7, abs=0.02) and intercept == pytest.approx(-0.3, abs=0.02)
    # The prior keeps a batch whose logits barely vary close to the identity instead of blowing up.
    slope, intercept = _fit_platt(np.full(10, 0.5), np.ones(10), np.ones(10))
    assert np.isfinite(slope) and np.isfinite(intercept)


def test_calibration_can_be_switched_off() -> None:
    predictor = HashedNgramPredictor(PredictorConfig(calibration_batches=0))
    for s in range(3):
        predictor.update(*_toy(60, seed=s), None)
    assert predictor.calibration == (1.0, 0.0) and predictor.state_dict()["calibration_data"] == []


def test_load_state_dict_rejects_a_foreign_state() -> None:
    with pytest.raises(ValueError, match="kind"):
        HashedNgramPredictor().load_state_dict({"kind": "value_head"})


def test_update_rejects_bad_input() -> None:
    histories, y = _toy(4, seed=0)
    predictor = HashedNgramPredictor()
    with pytest.raises(ValueError, match="finite"):
        predictor.update(histories, np.array([0.0, np.nan, 1.0, 0.0]), None)
    with pytest.raises(ValueError, match="entries"):
        predictor.update(histories, y[:3], None)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        predictor.update(histories, np.array([0.0, 2.0, 1.0, 0.0]), None)
    with pytest.raises(ValueError, match="weights"):
        predictor.update(histories, y, np.ones(3))
    with pytest.raises(ValueError, match="weights"):
        predictor.update(histories, y, np.array([1.0, -1.0, 1.0, 1.0]))
    with pytest.raises(ValueError, match="learning_rate"):
        HashedNgramPredictor(PredictorConfig(learning_rate=0.0))
    with pytest.raises(ValueError, match="replay_batches"):
        HashedNgramPredictor(PredictorConfig(replay_batches=-1))
    with pytest.raises(ValueError, match="root_epochs"):
        HashedNgramPredictor(PredictorConfig(root_epochs=0))
    assert np.all(predictor.predict(histories) == 0.5)  # nothing was learned from bad batches


def test_predicting_ten_thousand_fresh_histories_takes_well_under_a_second() -> None:
    words = [f"word{i}" for i in np.random.default_rng(0).integers(500, size=10_000 * 40)]
    histories = []
    for i in range(10_000):  # distinct prompts and turns: 15,000 turns, 55,000 texts in all
        w = words[40 * i : 40 * (i + 1)]
        turns = tuple(Turn(" ".join(w[j : j + 6]), f"search[{w[j + 6]}]", " ".join(w[j + 7 : j + 15])) for j in range(i % 4))
        histories.append(History(f"question {i} " + " ".join(w[25:37]), turns))
    predictor = HashedNgramPredictor()
    start = time.process_time()  # CPU time: a busy test machine must not fail this
    p = predictor.predict(histories)  # cold: every text is featurised for the first time
    assert time.process_time() - start < 1.0
    assert p.shape == (10_000,)


def test_an_update_with_a_full_replay_buffer_takes_well_under_a_second() -> None:
    """The benchmark's scale: 64 prompts and 384 leaves a batch, and 64 earlier batches of roots to replay."""
    sim = LatentTreeSimulator(seed=0)
    rng = np.random.default_rng(0)
    trees = [sim.new_tree(p) for p in sim.sample_prompts(64, rng)]
    for tree in trees:
        for _ in range(6):
            sim.rollout(tree, 0, rng)
    batch = backup_targets(trees)
    predictor = HashedNgramPredictor(PredictorConfig(max_ngram=1))
    predictor.update(*batch)
    state = predictor.state_dict()
    state["replay"] = state["replay"] * 64  # a full buffer, without running 64 updates first
    predictor.load_state_dict(state)
    start = time.process_time()
    metrics = predictor.update(*batch)
    assert time.process_time() - start < 0.5
    assert metrics["predictor/replayed"] == 64 * 64


# ---------------------------------------------------------------- backup targets


def _hand_tree() -> RolloutTree:
    """Two bare rollouts from the root, then Stage-2 continuations from nodes 1 and 2.

        0 ─ 1 ─ 2 ─ 3 (r=0)       bare rollout 1
        │   │   └── 7 (r=1)       continuation started at 2
        │   └── 6 (r=1)           continuation started at 1
        └── 4 ─ 5 (r=1)           bare rollout 2
    """
    tree = RolloutTree.new("t", "a prompt")
    one = tree.add_turn(0, thought="a")
    two = tree.add_turn(one, thought="b")
    tree.add_turn(two, action="answer", reward=0.0)
    four = tree.add_turn(0, thought="c")
    tree.add_turn(four, action="answer", reward=1.0)
    tree.add_turn(one, action="answer", reward=1.0)
    tree.add_turn(two, action="answer", reward=1.0)
    return tree


def test_rollout_starts_reads_where_each_rollout_began() -> None:
    np.testing.assert_array_equal(rollout_starts(_hand_tree()), [0, 0, 0, 0, 0, 0, 1, 2])


def test_backup_targets_natural_leave_out_continuations_started_below() -> None:
    tree = _hand_tree()
    histories, targets, weights = backup_targets([tree])
    # Non-terminal nodes 0, 1, 2, 4. Root: bare rollouts 3 and 5 only. Node 1: leaf 3 and its own
    # continuation 6 (not 7, started below it). Node 2: leaves 3 and 7. Node 4: leaf 5.
    assert [h.depth for h in histories] == [0, 1, 2, 1]
    assert histories[2] == tree.history(2)
    np.testing.assert_array_equal(targets, [0.5, 0.5, 0.5, 1.0])
    np.testing.assert_array_equal(weights, [2, 2, 2, 1])
    backup = natural_backup(tree)
    np.testing.assert_array_equal(backup.counts, [2, 2, 2, 1, 1, 1, 1, 1])


def test_backup_targets_all_are_the_tree_backup_values() -> None:
    tree = _hand_tree()
    _, targets, weights = backup_targets([tree], leaves="all")
    np.testing.assert_allclose(targets, [0.75, 2 / 3, 0.5, 1.0])
    np.testing.assert_array_equal(weights, [4, 3, 2, 1])
    _, _, sqrt_weights = backup_targets([tree], leaves="all", weighting="sqrt")
    np.testing.assert_allclose(sqrt_weights, np.sqrt([4, 3, 2, 1]))
    _, _, flat = backup_targets([tree], weighting="uniform")
    np.testing.assert_array_equal(flat, [1, 1, 1, 1])


def test_backup_targets_skip_nodes_without_finished_leaves_and_reject_bad_options() -> None:
    tree = RolloutTree.new("t", "p")
    tree.add_turn(0, thought="unfinished")
    histories, targets, weights = backup_targets([tree])
    assert histories == [] and targets.size == 0 and weights.size == 0
    with pytest.raises(ValueError, match="weighting"):
        backup_targets([tree], weighting="log")
    with pytest.raises(ValueError, match="leaves"):
        backup_targets([tree], leaves="some")


# ---------------------------------------------------------------- calibration


def test_brier_score_matches_hand_computation() -> None:
    p, y = np.array([0.1, 0.4, 0.8, 0.9]), np.array([0.0, 1.0, 1.0, 0.0])
    assert brier_score(p, y) == pytest.approx((0.01 + 0.36 + 0.04 + 0.81) / 4)
    assert brier_score(p, y, np.array([1.0, 0.0, 0.0, 1.0])) == pytest.approx((0.01 + 0.81) / 2)
    assert brier_score(np.array([0.3]), np.array([0.5])) == pytest.approx(0.04)  # fractional target


def test_expected_calibration_error_matches_hand_computation() -> None:
    p, y = np.array([0.1, 0.4, 0.8, 0.9]), np.array([0.0, 1.0, 1.0, 0.0])
    # Ten bins: each prediction alone in its bin.
    assert expected_calibration_error(p, y) == pytest.approx((0.1 + 0.6 + 0.2 + 0.9) / 4)
    # Two bins: [0.1, 0.4] has mean p 0.25 and mean y 0.5; [0.8, 0.9] has 0.85 and 0.5.
    assert expected_calibration_error(p, y, n_bins=2) == pytest.approx(0.5 * 0.25 + 0.5 * 0.35)
    # Weighted bins, fractional targets, and p = 1 falls in the last bin.
    p2, y2, w2 = np.array([0.2, 0.3, 1.0]), np.array([0.5, 0.0, 0.75]), np.array([1.0, 3.0, 4.0])
    low_gap = abs((0.2 + 0.9) / 4 - (0.5 + 0.0) / 4)
    assert expected_calibration_error(p2, y2, n_bins=2, weights=w2) == pytest.approx((4 * low_gap + 4 * 0.25) / 8)
    assert expected_calibration_error(np.array([0.7, 0.7]), np.array([1.0, 0.4])) == pytest.approx(0.0)


def test_calibration_measures_reject_bad_input() -> None:
    with pytest.raises(ValueError, match="entries"):
        brier_score(np.array([0.1, 0.2]), np.array([1.0]))
    with pytest.raises(ValueError, match="p must"):
        brier_score(np.array([np.nan]), np.array([1.0]))
    with pytest.raises(ValueError, match="y must"):
        expected_calibration_error(np.array([0.5]), np.array([1.5]))
    with pytest.raises(ValueError, match="n_bins"):
        expected_calibration_error(np.array([0.5]), np.array([1.0]), n_bins=0)
    with pytest.raises(ValueError, match="empty"):
        brier_score(np.array([]), np.array([]))


def test_calibration_report_of_an_untrained_predictor() -> None:
    report = calibration_report(HashedNgramPredictor(), [_hand_tree()])
    # p = 0.5 everywhere: the Brier score is the mean of (0.5 - target)^2 weighted by leaf count.
    assert report["predictor/brier"] == pytest.approx((2 * 0 + 2 * 0 + 2 * 0 + 1 * 0.25) / 7)
    assert report["predictor/ece"] == pytest.approx(abs(0.5 - (0.5 * 6 + 1.0) / 7))
    assert report["predictor/examples"] == 4.0
