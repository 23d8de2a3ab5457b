"""BRACE's per-prompt evidence: decayed success and failure counts, a warm bank, a fitted correlation.

BRACE (github.com/fatebreaker/brace, `brace/triage.py`, its README's rule) keeps, per task, counts of
solved and failed rollouts; each task's success rate has the posterior Beta(1 + s, 1 + f). Before a
cycle's rollouts are added, every count is multiplied by γ = 0.9, so a task written off under an old
policy is probed again as the policy moves. The counts may start from a *warm bank*: rollouts of other,
earlier runs on the same tasks, capped per task at 20 successes and 40 failures (so the run's own
rollouts soon outweigh them) and decayed like the rest. The run's own groups also fit the within-group
concentration ν (`trace_rl.core.mixing.fit_concentration`), which starts at BRACE's published 0.285.

What trace-rl had to choose, where BRACE's setting differs from a training step here:

- BRACE rebuilds its allocation once a *cycle* (many steps). Here Stage 1 allocates every step over
  that step's candidate prompts, so γ applies once per pass over the training pool: each update
  multiplies the counts by γ^(1 / cycle_steps), cycle_steps = pool size / prompts per step.
- A success is a rollout whose reward exceeds the run's success threshold (BRACE's reward > 0 on its
  0/1 rewards); an example's successes are its weight (leaves) times its target, as for
  `PromptHistoryPredictor`.
- ν is refitted every update on the run's last `capacity` groups once it holds `min_groups`; a group is
  one prompt's rollouts in one step, scored against its prompt's posterior before that step.

Prefixes are answered with their prompt's estimate (BRACE has no Stage 2).
"""

from __future__ import annotations

import glob
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from trace_rl.core.mixing import PUBLISHED_CONCENTRATION, fit_concentration
from trace_rl.core.tree import History, read_jsonl
from trace_rl.planning.evidence import bare_outcomes
from trace_rl.predictor.base import PromptEvidence, check_training_batch


class BraceBank:
    """`SuccessPredictor` with BRACE's per-prompt counts (see the module docstring); `evidence` gives the
    counts and ν to the `brace` allocator."""

    def __init__(
        self,
        *,
        decay: float = 0.9,
        cycle_steps: float = 1.0,
        min_groups: int = 32,
        capacity: int = 4096,
        concentration: float | None = None,
    ) -> None:
        if not 0 < decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {decay!r}")
        if not cycle_steps >= 1:
            raise ValueError(f"cycle_steps must be >= 1, got {cycle_steps!r}")
        self.per_update = float(decay) ** (1.0 / float(cycle_steps))
        self.min_groups, self.capacity = int(min_groups), int(capacity)
        self.fixed = concentration
        """A concentration to use throughout instead of fitting one (None: fit on the run's groups)."""
        self.concentration = float(PUBLISHED_CONCENTRATION if concentration is None else concentration)
        self.counts: dict[str, list[float]] = {}
        """Per task id, [successes, failures], decayed."""
        self._groups = np.zeros((0, 4))  # columns: a, b, k, agreed

    # ------------------------------------------------------------------ the warm bank

    def add_bank(self, counts: dict[str, tuple[float, float]], *, cap_successes: float = 20.0, cap_failures: float = 40.0) -> int:
        """Adds other runs' (successes, failures) per task id, each capped; returns the tasks it touched."""
        for key, (wins, losses) in counts.items():
            entry = self.counts.setdefault(str(key), [0.0, 0.0])
            entry[0] += min(float(wins), cap_successes)
            entry[1] += min(float(losses), cap_failures)
        return len(counts)

    # ------------------------------------------------------------------ the predictor contract

    def predict(self, histories: Sequence[History]) -> np.ndarray:
        """Posterior means (1 + s) / (2 + s + f) of each history's prompt."""
        out = np.empty(len(histories), dtype=np.float64)
        for index, history in enumerate(histories):
            wins, losses = self.counts.get(history.task_id, (0.0, 0.0))
            out[index] = (1.0 + wins) / (2.0 + wins + losses)
        return out

    def evidence(self, histories: Sequence[History]) -> PromptEvidence:
        counts = np.array([self.counts.get(h.task_id, (0.0, 0.0)) for h in histories], dtype=np.float64).reshape(-1, 2)
        return PromptEvidence(successes=counts[:, 0], failures=counts[:, 1], concentration=self.concentration)

    def update(self, histories: Sequence[History], targets: np.ndarray, weights: np.ndarray) -> dict[str, float]:
        """Decays every count, then adds each root example's rollouts (weight leaves, weight × target of
        them successes) and scores its group against the posterior before it; refits ν."""
        y, w = check_training_batch(histories, targets, weights)
        for entry in self.counts.values():
            entry[0] *= self.per_update
            entry[1] *= self.per_update
        groups, used = [], 0
        for history, target, weight in zip(histories, y, w):
            if history.depth:
                continue
            entry = self.counts.setdefault(history.task_id, [0.0, 0.0])
            if weight >= 2:
                groups.append((1.0 + entry[0], 1.0 + entry[1], float(weight), float(target in (0.0, 1.0))))
            entry[0] += weight * target
            entry[1] += weight * (1.0 - target)
            used += 1
        if groups:
            self._groups = np.concatenate([self._groups, np.array(groups)])[-self.capacity :]
        if self.fixed is None and len(self._groups) >= self.min_groups:
            g = self._groups
            sizes = np.rint(g[:, 2]).astype(np.int64)
            self.concentration = fit_concentration(g[:, 0], g[:, 1], sizes, g[:, 3])
        return {
            "predictor/examples_used": float(used),
            "brace/correlation": 1.0 / (1.0 + self.concentration),
            "brace/groups_seen": float(len(self._groups)),
        }

    def state_dict(self) -> dict[str, Any]:
        return {"counts": {k: list(v) for k, v in self.counts.items()}, "concentration": self.concentration,
                "groups": self._groups.tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counts = {str(k): [float(v[0]), float(v[1])] for k, v in state["counts"].items()}
        self.concentration = float(state["concentration"])
        self._groups = np.asarray(state["groups"], dtype=np.float64).reshape(-1, 4)


def bank_counts(
    paths: Iterable[str | Path], threshold: float, *, tasks: set[str] | None = None, exclude: Path | None = None
) -> dict[str, tuple[float, float]]:
    """(successes, failures) per task id over the bare rollouts saved by earlier runs: every
    `trees/step_*.jsonl` under each run folder (glob patterns allowed; `exclude`, the run's own folder,
    never read), restricted to `tasks` if given. Continuations are left out: they started from prefixes
    a method chose, not from the prompt (`evidence.bare_outcomes`)."""
    counts: dict[str, list[float]] = {}
    folders = sorted({Path(p) for pattern in paths for p in (glob.glob(str(pattern)) or [pattern])})
    for folder in folders:
        if exclude is not None and folder.resolve() == exclude.resolve():
            continue
        files = sorted((folder / "trees").glob("step_*.jsonl"))
        if not files:
            raise ValueError(f"warm bank {folder}: no trees/step_*.jsonl (a run folder of trace-rl train with train.save_trees)")
        for path in files:
            for tree in read_jsonl(path):
                if tasks is not None and tree.task_id not in tasks:
                    continue
                _, wins, total = bare_outcomes(tree, threshold)
                if total:
                    entry = counts.setdefault(tree.task_id, [0.0, 0.0])
                    entry[0] += wins
                    entry[1] += total - wins
    return {k: (v[0], v[1]) for k, v in counts.items()}
