"""A predictor that knows when it is wrong: its estimates scaled about 0.5 by how much they have helped.

`GuardedPredictor` wraps any `SuccessPredictor`. Before each update it scores the inner predictor on
the batch it is about to learn from; those estimates were made before the predictor saw these
outcomes, so they are out of sample. Over the last `window` such batches it fits the one number
that decides how far to trust the inner predictor: the λ in [−1, 1] for which

    p' = 0.5 + λ (p − 0.5)

has the lowest weighted Brier score against the targets y, in closed form

    λ = Σ w (p − ½)(y − ½) / Σ w (p − ½)², clipped to [−1, 1].

λ = 1 trusts the estimates as they are; λ near 0 means they did no better than a coin (their
ranking was noise), and every answer is about 0.5, which makes TRACE allocate as it would with no
information (its exact Stage 1 splits a budget evenly over prompts of equal value); λ < 0 means
they were upside down, and they are turned over. Shrinking alone (λ ≥ 0) made an inverted
predictor worse than leaving it be: Stage 1's value is symmetric in p and 1 − p, so an upside-down
predictor still ranks prompts by their chance to mix, and only Stage 2 is misled
(`experiments/predictor_guard.py`). Until the window holds an estimate away from 0.5 there is no
evidence and λ = 1 (the inner predictor answers 0.5 before its first update anyway).

Each update logs `predictor/guard_shrink` (λ after it), `predictor/guard_brier` (the inner
estimates' Brier on this batch), `predictor/guard_brier_half` (a constant 0.5's on the same
pairs) and `predictor/guard_gain` (how much lower the scaled estimates' Brier is than 0.5's over the
window: what the ranking bought; 0 when λ = 0).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from trace_rl.core.tree import History
from trace_rl.predictor.base import SuccessPredictor, check_training_batch


class GuardedPredictor:
    """`inner`, scaled about 0.5 by the Brier-optimal λ over its last `window` out-of-sample batches."""

    def __init__(self, inner: SuccessPredictor, *, window: int = 10) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.inner = inner
        self.window = window
        self.shrink = 1.0
        self._scored: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (estimate, target, weight) per batch

    def predict(self, histories: Sequence[History]) -> np.ndarray:
        p = np.asarray(self.inner.predict(histories), dtype=np.float64)
        return 0.5 + self.shrink * (p - 0.5)

    def update(self, histories: Sequence[History], targets: np.ndarray, weights: np.ndarray | None) -> dict[str, float]:
        y, w = check_training_batch(histories, targets, weights)
        p = np.asarray(self.inner.predict(histories), dtype=np.float64)  # before it learns from them: out of sample
        self._scored = [*self._scored, (p, y, w)][-self.window :]
        p_all, y_all, w_all = (np.concatenate(column) for column in zip(*self._scored))
        self.shrink = brier_shrinkage(p_all, y_all, w_all)
        metrics = dict(self.inner.update(histories, y, w))
        total = max(float(w.sum()), 1e-12)
        shrunk = 0.5 + self.shrink * (p_all - 0.5)
        total_all = max(float(w_all.sum()), 1e-12)
        metrics.update(
            {
                "predictor/guard_shrink": self.shrink,
                "predictor/guard_brier": float(np.sum(w * (p - y) ** 2) / total),
                "predictor/guard_brier_half": float(np.sum(w * (0.5 - y) ** 2) / total),
                "predictor/guard_gain": float(np.sum(w_all * ((0.5 - y_all) ** 2 - (shrunk - y_all) ** 2)) / total_all),
            }
        )
        return metrics

    def state_dict(self) -> dict:
        return {
            "kind": "guarded",
            "inner": self.inner.state_dict(),
            "window": self.window,
            "shrink": self.shrink,
            "scored": [{"estimates": p.copy(), "targets": y.copy(), "weights": w.copy()} for p, y, w in self._scored],
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "guarded":
            raise ValueError(f"not a guarded predictor's state (kind {state.get('kind')!r})")
        self.inner.load_state_dict(state["inner"])
        self.window = int(state["window"])
        self.shrink = float(state["shrink"])
        self._scored = [
            (np.asarray(b["estimates"], dtype=np.float64), np.asarray(b["targets"], dtype=np.float64), np.asarray(b["weights"], dtype=np.float64))
            for b in state["scored"]
        ]


def brier_shrinkage(p: np.ndarray, y: np.ndarray, w: np.ndarray) -> float:
    """The λ in [−1, 1] minimising Σ w (0.5 + λ (p − 0.5) − y)²; 1 when every p is 0.5 (no evidence)."""
    d = p - 0.5
    spread = float(np.sum(w * d * d))
    if spread <= 1e-12:
        return 1.0
    return float(np.clip(np.sum(w * d * (y - 0.5)) / spread, -1.0, 1.0))
