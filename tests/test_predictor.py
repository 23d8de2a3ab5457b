"""The success predictor: its contract, training targets and calibration measures."""

from __future__ import annotations

import time

import numpy as np
import pytest
from repo_files import load

from trace_rl.core.tree import History, RolloutTree, Turn
from trace_rl.predictor import (
    HashedNgramPredictor,
    PredictorAdvanced,
    PredictorConfig,
    SuccessPredictor,
    backup_targets,
    brier_score,
    calibration_report,
    expected_calibration_error,
    natural_backup,
    rollout_starts,
)
from trace_rl.predictor.hashed import (
    _calibration_helps,
    _cross_entropy,
    _fit_calibration,
    _fit_platt,
)
from trace_rl.research.sim import LatentTreeSimulator


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
    restored = HashedNgramPredictor(PredictorConfig(advanced=PredictorAdvanced(num_features=64)))  # another config: the state replaces it
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
    assert state["replay"] == [] and state["calibrated"] == {"root": False, "prefix": False}
    for head in ("root", "prefix"):  # the identity: slope 1, everything else 0
        assert state["calibration"][head][0] == 1.0 and not state["calibration"][head][1:].any()
        assert state["calibration_data"][head] == []
    later = predictor.state_dict()
    later["replay"][0]["targets"][:] = -1.0  # editing a state leaves the predictor alone
    assert predictor.state_dict()["replay"][0]["targets"].min() >= 0.0


def test_state_round_trip_carries_the_replay_buffer_and_the_calibration() -> None:
    """Resuming mid-run must reproduce predictions and training exactly, so the state holds the
    replayed root examples and the calibration's data, not just the weights."""
    batches = [_toy(120, seed=s) for s in range(5)]
    trained = HashedNgramPredictor(PredictorConfig(advanced=PredictorAdvanced(replay_batches=2)), seed=2)
    for histories, y in batches[:3]:
        trained.update(histories, y, None)
    state = trained.state_dict()
    assert len(state["replay"]) == 2  # the roots of the last two updates, oldest first
    assert state["replay"][-1]["prompts"] == [h.prompt for h in batches[2][0] if not h.turns]
    for head in ("root", "prefix"):  # fitted from update 1 on, one design block per update
        assert len(state["calibration_data"][head]) == 3
        assert not np.array_equal(state["calibration"][head], np.eye(state["calibration"][head].size)[0])
    assert state["calibration_data"]["prefix"][-1]["design"].shape == (sum(bool(h.turns) for h in batches[2][0]), 9)
    restored = HashedNgramPredictor(PredictorConfig(advanced=PredictorAdvanced(replay_batches=0, calibration_batches=0)))  # the state's config wins
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
    predictor = HashedNgramPredictor(PredictorConfig(advanced=PredictorAdvanced(replay_batches=2)))
    replayed = [predictor.update(h, y, None)["predictor/replayed"] for h, y in batches]
    roots = [sum(not h.turns for h in histories) for histories, _ in batches]
    assert replayed == [0.0, roots[0], roots[0] + roots[1], roots[1] + roots[2]]
    none = HashedNgramPredictor(PredictorConfig(advanced=PredictorAdvanced(replay_batches=0)))
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


def test_a_calibration_of_saturated_raw_logits_converges_to_the_optimum_instead_of_saturating() -> None:
    """Raw logits of ±30 that carry nothing (an over-confident model): plain Newton from the identity
    overshot and ended at the slope cap with an intercept in the tens (a real run's prefix calibration
    answered with saturated estimates, cross-entropy 17-32, for seven steps). The fit must reach the
    optimum: no descent direction left (KKT with the slope free) and the cross-entropy of about the
    best constant."""
    rng = np.random.default_rng(0)
    z = rng.choice([-30.0, 30.0], 400) + rng.normal(0.0, 1.0, 400)
    y = (rng.random(400) < 0.4).astype(float)
    design = np.column_stack([z, (rng.random(400) < 0.3).astype(float), np.ones(400)])
    w = np.ones(400)
    config = PredictorConfig()
    theta = _fit_calibration(design, y, w, config=config)
    assert 0.0 < theta[0] < config.advanced.calibration_max_slope  # the slope is interior: the gradient must vanish
    p = 1.0 / (1.0 + np.exp(-(design @ theta)))
    start = np.array([1.0, 0.0, 0.0])
    gradient = design.T @ ((p - y) / w.size) + config.advanced.calibration_prior * (theta - start)
    assert np.abs(gradient).max() < 1e-6
    best_constant = -(y.mean() * np.log(y.mean()) + (1 - y.mean()) * np.log(1 - y.mean()))
    assert _cross_entropy(design @ theta, y, w) < best_constant + 0.01


def test_calibration_can_be_switched_off() -> None:
    predictor = HashedNgramPredictor(PredictorConfig(advanced=PredictorAdvanced(calibration_batches=0)))
    for s in range(3):
        predictor.update(*_toy(60, seed=s), None)
    assert predictor.calibrated == {"root": False, "prefix": False}
    state = predictor.state_dict()
    for head in ("root", "prefix"):
        assert state["calibration_data"][head] == []
        np.testing.assert_array_equal(state["calibration"][head], np.eye(state["calibration"][head].size)[0])


# ---------------------------------------------------------------- real trees: long texts, weak signal


def _long_histories(count: int, seed: int, words: int = 300) -> tuple[list[History], np.ndarray]:
    """Real-tree-like prefixes: a question, then a search whose long observation (`words` random words,
    hundreds of active features) names the next entity. Half the second turns search for that entity
    (a grounded query: success 0.7), half for a name seen nowhere (a guess: success 0.1); 0/1 targets."""
    rng = np.random.default_rng(seed)
    vocabulary = [f"v{i}" for i in range(5000)]
    histories, targets = [], []
    for i in range(count):
        start, found, guess = (f"e{rng.integers(10**6)}" for _ in range(3))
        prompt = f"Who founded the company {start} works for?"
        text = " ".join(rng.choice(vocabulary, size=words))
        first = Turn("Step 1 of 2.", f"<search> {start} </search>", f"{start} works for {found}. {text}")
        grounded = i % 2 == 0
        second = Turn("Step 2 of 2.", f"<search> {found if grounded else guess} </search>", " ".join(rng.choice(vocabulary, size=words)))
        histories.append(History(prompt, (first, second), f"t{seed}-{i}"))
        targets.append(float(rng.random() < (0.7 if grounded else 0.1)))
    return histories, np.array(targets)


def test_one_update_on_long_texts_does_not_overshoot() -> None:
    """The demo run's failure: one AdaGrad step moved a long history's logit by lr x (active features),
    taking the first batch's loss from 0.693 to 8.46. Capped, the step leaves the batch's loss below
    where it started; uncapped (the old update) it still overshoots. (With the turns' n-grams read,
    as then: without them a history lights up few features.)"""
    histories, y = _long_histories(120, seed=0)
    capped = HashedNgramPredictor(PredictorConfig(turn_features=True), seed=0).update(histories, y, None)
    assert capped["predictor/loss"] == pytest.approx(np.log(2.0))
    assert capped["predictor/loss_after"] < capped["predictor/loss"]
    assert capped["predictor/step_capped"] > 0.0  # the cap was what held it
    uncapped = HashedNgramPredictor(PredictorConfig(turn_features=True, advanced=PredictorAdvanced(max_logit_step=0.0)), seed=0).update(histories, y, None)
    assert uncapped["predictor/loss_after"] > 2.0 and uncapped["predictor/step_capped"] == 0.0


def test_a_capped_step_moves_no_logit_further_than_the_cap() -> None:
    histories, y = _long_histories(60, seed=1)
    config = PredictorConfig(turn_features=True, advanced=PredictorAdvanced(max_logit_step=0.25, epochs=1, root_epochs=1, calibration_batches=0))
    predictor = HashedNgramPredictor(config)
    predictor.update(histories, y, None)  # one minibatch: one step from all-zero weights
    p = predictor.predict(histories)
    assert np.all(np.abs(np.log(p / (1.0 - p))) <= 0.25 + 1e-9)


def test_beats_the_running_mean_on_long_texts_after_a_few_updates() -> None:
    """What the real-tree replay checks, in small: learning online from batches with long texts, the
    predictor's Brier on the next, unseen batch beats a constant at the mean of every outcome so far."""
    predictor = HashedNgramPredictor(seed=0)
    seen: list[float] = []
    scores, constant = [], []
    for step in range(8):
        histories, y = _long_histories(80, seed=10 + step)
        if step >= 4:
            scores.append(brier_score(predictor.predict(histories), y))
            constant.append(brier_score(np.full(y.size, np.mean(seen)), y))
        predictor.update(histories, y, None)
        seen.extend(y)
    assert np.mean(scores) < np.mean(constant) - 0.02
    assert predictor.calibrated["prefix"]  # it got there through the calibration's summary features
    assert max(scores) < 0.25


def test_summary_features_count_query_words_seen_nowhere_before() -> None:
    predictor = HashedNgramPredictor()
    prompt = "Who founded the company Acme Corp?"
    first = Turn("look it up", "<search> Acme Corp </search>", "Acme Corp was founded by Jane Roe.")
    follow = Turn("next", "<search> Jane Roe </search>", "Jane Roe is a chemist.")
    guess = Turn("next", "<search> John Smith </search>", "John Smith is a painter.")
    again = Turn("again", "<search> Acme Corp </search>", "Acme Corp was founded by Jane Roe.")
    short = [0.0, 0.0, 0.0]  # six words: below every prompt-length bin
    assert predictor._summary(History(prompt)) == short
    assert predictor._summary(History(prompt, (first,))) == [0.0, 0.0, 0.0, 0.0, *short]
    assert predictor._summary(History(prompt, (first, follow))) == [0.0, 0.0, 0.0, 0.0, *short]  # seen in the observation
    assert predictor._summary(History(prompt, (first, guess))) == [0.0, 1.0, 0.0, 0.0, *short]  # two novel words
    assert predictor._summary(History(prompt, (first, again))) == [0.0, 0.0, 0.0, 1.0, *short]  # a repeated action
    assert predictor._summary(History(prompt, (Turn("hm", "", ""),))) == [0.0, 0.0, 1.0, 0.0, *short]  # no action words
    long_prompt = "In which country is the city where the founder of the company Acme Corp was born?"
    assert predictor._summary(History(long_prompt)) == [0.0, 1.0, 0.0]  # 16 words


def test_calibration_slope_is_bounded_and_a_calibration_is_used_only_where_it_helps() -> None:
    rng = np.random.default_rng(0)
    z = rng.normal(0.0, 0.2, size=2000)
    y = (rng.random(z.size) < 1.0 / (1.0 + np.exp(-20.0 * z))).astype(float)  # the best slope is 20
    slope, intercept = _fit_platt(z, y, np.ones_like(z))
    assert slope == 2.0 and np.isfinite(intercept)  # calibration_max_slope
    slope, _ = _fit_platt(z, 1.0 - y, np.ones_like(z))
    assert slope == 0.0  # a calibration may ignore the raw logit, never reverse it

    def window(scale: float) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        batches = []
        for _ in range(4):
            logits = rng.normal(0.0, 2.0, size=300)
            design = np.column_stack([logits, np.zeros((300, 3)), np.ones(300)])
            batches.append((design, 1.0 / (1.0 + np.exp(-logits / scale)), np.ones(300)))
        return batches

    config = PredictorConfig()
    assert _calibration_helps(window(4.0), config)  # over-confident raw logits: shrinking helps
    assert not _calibration_helps(window(1.0), config)  # calibrated raw logits: leave them alone
    assert not _calibration_helps(window(4.0)[:1], config)  # one update: nothing to test it on


def test_the_replay_benchmark_scores_each_step_before_learning_from_it(tmp_path) -> None:
    """experiments/predictor_replay.py on a small recorded run: every row is scored on a step's rollouts
    before it learns from them, so at the first step the learned rows answer 0.5 everywhere."""

    from trace_rl.core.tree import write_jsonl
    from trace_rl.planning.metrics import allocator_outcomes

    replay = load("experiments/predictor_replay.py")
    sim, rng = LatentTreeSimulator(seed=0), np.random.default_rng(0)
    (tmp_path / "trees").mkdir()
    steps = []
    for step in range(3):
        trees = [sim.new_tree(p) for p in sim.sample_prompts(8, rng)]
        for tree in trees:
            for _ in range(3):
                sim.rollout(tree, 0, rng)
            sim.rollout(tree, 1, rng)  # a continuation from a prefix
            for node in tree.nodes:
                node.predicted = 0.5
        write_jsonl(trees, tmp_path / "trees" / f"step_{step + 1:04d}.jsonl")
        steps.append(trees)
    result = replay.main([str(tmp_path), "--warmup", "1", "--sim-seeds", "0", "--previous", "none", "--steps"])
    run = result["runs"][str(tmp_path)]
    assert run["steps"] == 3 and run["scored_steps"] == 2 and len(run["per_step"]) == 3
    assert set(run["summary"]) == {"shared", "running_mean", "last_step_mean", "prompt_history", "half"}
    assert set(run["acceptance"]) >= {"brier_below_quarter_every_step", "beats_running_mean"}
    first, second = run["per_step"][0], run["per_step"][1]
    _, outcomes = allocator_outcomes(steps[0])
    assert first["rollouts"] == outcomes.size == 8 * 4 and first["from_prefixes"] == 8
    assert first["rows"]["shared"]["brier"] == first["rows"]["half"]["brier"] == brier_score(np.full(outcomes.size, 0.5), outcomes)
    _, later = allocator_outcomes(steps[1])
    assert second["rows"]["running_mean"]["brier"] == pytest.approx(brier_score(np.full(later.size, outcomes.mean()), later))
    assert {"loss", "loss_after", "brier_roots", "brier_prefixes", "brier_nodes", "ece"} <= set(second["rows"]["shared"])


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
        HashedNgramPredictor(PredictorConfig(advanced=PredictorAdvanced(replay_batches=-1)))
    with pytest.raises(ValueError, match="root_epochs"):
        HashedNgramPredictor(PredictorConfig(advanced=PredictorAdvanced(root_epochs=0)))
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


def test_the_brier_floor_benchmark_scores_the_truth_below_a_constant_and_counts_bad_batches(capsys) -> None:
    """experiments/brier_floor.py: the true probabilities, scored on TRACE's own bets, beat a constant
    0.5 on average, and each row's share of batches above 0.25 is a share of the scored batches."""
    import json

    floor = load("experiments/brier_floor.py")
    result = floor.main(["--batches", "6", "--seeds", "1", "--warmup", "1", "--prompts", "16", "--budget", "32"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    for figures in result["rows"].values():
        assert figures["scored_batches"] == 5 and figures["share_above_quarter"] * 5 == round(figures["share_above_quarter"] * 5)
        assert figures["max_brier"] >= figures["mean_brier"]
    assert result["rows"]["trace@oracle"]["mean_brier"] < 0.25


def test_the_propositions_benchmark_counts_fresh_draws_per_valued_node_and_scores_held_out(tmp_path, capsys) -> None:
    """experiments/propositions.py on a small recorded run: proposition 2 takes each valued node's
    rollouts that started there (a root's 3 bare rollouts, a prefix's 2 continuations) and bins them
    by V(1 - V); proposition 1 scores every step after the warm-up; proposition 3 reads the metrics."""
    import json

    import yaml

    from trace_rl.core.tree import write_jsonl

    bench = load("experiments/propositions.py")
    sim, rng = LatentTreeSimulator(seed=0), np.random.default_rng(0)
    (tmp_path / "trees").mkdir()
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"rollout": {"method": "trace", "success_threshold": 0.5}}))
    records, expanded = [], 0
    for step in range(4):
        trees = [sim.new_tree(p) for p in sim.sample_prompts(6, rng)]
        for tree in trees:
            tree.root.predicted = 0.3
            for _ in range(3):
                sim.rollout(tree, 0, rng)
            parents = {n.parent for n in tree.nodes}
            prefix = next((n.id for n in tree.nodes[1:] if n.id in parents), None)  # an intermediate prefix
            if prefix is not None:
                tree.nodes[prefix].predicted = 0.1
                for _ in range(2):
                    sim.rollout(tree, prefix, rng)  # two continuations from it
                expanded += 1
        write_jsonl(trees, tmp_path / "trees" / f"step_{step + 1:04d}.jsonl")
        records.append({"step": step + 1, "tree/effective_ratio": 0.5, "tree/mixed_budget_share": 0.25 * step})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    result = bench.main([str(tmp_path), "--warmup", "1"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    potential = result["contrast_potential"]
    assert expanded and potential["nodes"] == 4 * 6 + expanded and sum(b["nodes"] for b in potential["bins"]) == potential["nodes"]
    roots = next(b for b in potential["bins"] if b["v_one_minus_v"][0] == 0.2)  # V = 0.3: V(1 - V) = 0.21
    assert roots["implied"] == pytest.approx(1 - 0.3**3 - 0.7**3) and roots["nodes"] == 24
    prefixes = next(b for b in potential["bins"] if b["v_one_minus_v"][0] == 0.05)  # V = 0.1: 0.09
    assert prefixes["implied"] == pytest.approx(1 - 0.1**2 - 0.9**2) and prefixes["nodes"] == expanded
    information = result["runs"][str(tmp_path)]["prefix_information"]
    assert information["steps_scored"] == 3 and {"logloss_with_prefix", "logloss_prompt_only", "logloss_running_mean"} <= set(information)
    assert result["allocation"] == {"trace": {"effective_ratio": 0.5, "mixed_budget_share": 0.375, "runs": 1}}


def test_by_default_the_shared_model_reads_a_prefix_s_prompt_and_depth_not_its_turns_text() -> None:
    """`turn_features` off (the default, chosen on real trees): two prefixes of one prompt at one
    depth have the same features whatever their turns say; with it on, the turns' n-grams are added."""
    prompt = "In which city was the founder of Acme born?"
    a = History(prompt, (Turn("look", "<search>Acme</search>", "Acme was founded by Ana Berg."),))
    b = History(prompt, (Turn("guess", "<search>river</search>", "No documents."),))
    root = History(prompt)
    default = HashedNgramPredictor(seed=0)
    rows, indices = default.features([a, b, root])
    assert sorted(indices[rows == 0]) == sorted(indices[rows == 1])
    assert set(indices[rows == 0]) != set(indices[rows == 2])  # a root reads its own `r:` n-grams and depth 0
    reading = HashedNgramPredictor(PredictorConfig(turn_features=True), seed=0)
    rows, indices = reading.features([a, b])
    assert sorted(indices[rows == 0]) != sorted(indices[rows == 1])
