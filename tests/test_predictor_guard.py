"""The predictor guard: estimates scaled about 0.5 by the Brier-optimal amount on what they were scored on."""

from __future__ import annotations

import numpy as np
import pytest
from repo_files import load

from trace_rl.core.tree import History
from trace_rl.predictor import GuardedPredictor, PredictorConfig, build_predictor
from trace_rl.predictor.guard import brier_shrinkage


class Fixed:
    """A predictor that answers `values[question]` and records what it learns from."""

    def __init__(self, values: dict[str, float]) -> None:
        self.values, self.updates = values, 0

    def predict(self, histories):
        return np.array([self.values[h.prompt] for h in histories], dtype=np.float64)

    def update(self, histories, targets, weights):
        self.updates += 1
        return {"predictor/loss": 0.0}

    def state_dict(self):
        return {"values": dict(self.values), "updates": self.updates}

    def load_state_dict(self, state):
        self.values, self.updates = dict(state["values"]), state["updates"]


def histories(*prompts: str) -> list[History]:
    return [History(p) for p in prompts]


def test_brier_shrinkage_is_the_least_squares_lambda_clipped_to_plus_minus_1():
    p, y, w = np.array([0.9, 0.2, 0.6]), np.array([1.0, 0.0, 0.0]), np.array([1.0, 2.0, 1.0])
    # p - 0.5 = 0.4, -0.3, 0.1
    expected = (1 * 0.4 * 0.5 + 2 * -0.3 * -0.5 + 1 * 0.1 * -0.5) / (1 * 0.16 + 2 * 0.09 + 1 * 0.01)
    assert expected == pytest.approx(0.45 / 0.35)  # > 1: clipped
    assert brier_shrinkage(p, y, w) == 1.0
    assert brier_shrinkage(1.0 - p, y, w) == -1.0  # upside down: turned over
    assert brier_shrinkage(np.full(3, 0.5), y, w) == 1.0  # no spread, no evidence
    grid = np.linspace(-1, 1, 2001)
    noisy = np.array([0.7, 0.4, 0.8])
    brier = [np.sum(w * (0.5 + g * (noisy - 0.5) - y) ** 2) for g in grid]
    assert brier_shrinkage(noisy, y, w) == pytest.approx(grid[int(np.argmin(brier))], abs=1e-3)


def test_a_guarded_predictor_turns_an_upside_down_one_over_ignores_a_coin_and_keeps_a_right_one():
    truth = {"easy": 1.0, "hard": 0.0}
    wrong = GuardedPredictor(Fixed({"easy": 0.1, "hard": 0.9}), window=3)
    coin = GuardedPredictor(Fixed({"easy": 0.8, "hard": 0.8, "mid": 0.2}), window=3)
    right = GuardedPredictor(Fixed({"easy": 0.8, "hard": 0.3}), window=3)
    batch = histories("easy", "hard", "easy")
    targets = np.array([truth[h.prompt] for h in batch])
    for guarded in (wrong, right):
        metrics = guarded.update(batch, targets, None)
        assert guarded.inner.updates == 1 and "predictor/loss" in metrics  # the inner predictor still learns
    assert wrong.shrink == -1.0 and np.allclose(wrong.predict(batch), [0.9, 0.1, 0.9])
    assert right.shrink == 1.0 and np.allclose(right.predict(batch), [0.8, 0.3, 0.8])
    # an estimate that says nothing about the outcome (0.8 for an easy and a hard question alike)
    noise = histories("easy", "hard", "mid", "mid")
    coin.update(noise, np.array([1.0, 0.0, 1.0, 0.0]), None)
    assert coin.shrink == 0.0 and np.all(coin.predict(noise) == 0.5)
    assert coin.update(noise, np.array([1.0, 0.0, 1.0, 0.0]), None)["predictor/guard_gain"] == 0.0
    gain = right.update(batch, targets, None)
    assert gain["predictor/guard_gain"] > 0 and gain["predictor/guard_brier"] < gain["predictor/guard_brier_half"] == 0.25


def test_the_guard_forgets_batches_older_than_its_window():
    inner = Fixed({"q": 0.9})
    guarded = GuardedPredictor(inner, window=2)
    for _ in range(2):
        guarded.update(histories("q"), np.array([0.0]), None)  # wrong twice
    assert guarded.shrink == -1.0
    for _ in range(2):
        guarded.update(histories("q"), np.array([1.0]), None)  # right twice: the wrong ones have left the window
    assert guarded.shrink == 1.0


def test_a_guarded_predictor_starts_at_a_half_and_its_state_round_trips():
    config = PredictorConfig(guard=True, guard_window=4)
    predictor = build_predictor("shared", config, seed=0)
    assert isinstance(predictor, GuardedPredictor) and predictor.window == 4
    batch = histories("Which river flows through Paris?", "Who wrote Hamlet?")
    assert np.all(predictor.predict(batch) == 0.5)
    for _ in range(3):
        predictor.update(batch, np.array([1.0, 0.0]), None)
    again = build_predictor("shared", config, seed=0)
    again.load_state_dict(predictor.state_dict())
    assert again.shrink == predictor.shrink and np.array_equal(again.predict(batch), predictor.predict(batch))
    assert not isinstance(build_predictor("shared", PredictorConfig(), seed=0), GuardedPredictor)


def test_the_guard_benchmark_distrusts_a_spoiled_predictor_and_trusts_a_clean_one(capsys):
    """experiments/predictor_guard.py on one small world: the guard's λ stays near 1 on the clean
    predictor and turns negative on the inverted one."""
    import json

    bench = load("experiments/predictor_guard.py")
    result = bench.main(["--seeds", "1", "--batches", "8", "--warmup", "3"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    rows = result["rows"]
    assert rows["trace+guard (inverted)"]["guard_shrink"] < 0.0 < rows["trace+guard"]["guard_shrink"]
    assert rows["grpo"]["vs_grpo"] == 1.0 and "guard_shrink" not in rows["trace"]
