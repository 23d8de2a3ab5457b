"""Success predictors Ṽψ(H): the contract, training targets, calibration, and implementations.

A method names the kind of predictor it allocates from (`MethodSpec.predictor`); `build_predictor`
makes it. Adding a predictor is one entry in `PREDICTORS`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from trace_rl.predictor.bank import BraceBank, bank_counts
from trace_rl.predictor.base import (
    KnowsPrompts,
    PromptEvidence,
    SuccessPredictor,
    backup_targets,
    brier_score,
    calibration_report,
    expected_calibration_error,
    natural_backup,
    rollout_starts,
)
from trace_rl.predictor.guard import GuardedPredictor
from trace_rl.predictor.hashed import (
    HashedNgramPredictor,
    PredictorAdvanced,
    PredictorConfig,
)
from trace_rl.predictor.history import PromptHistoryPredictor

PredictorKind = Literal["shared", "prompt_history", "knapsack_history", "brace_bank"]

PREDICTORS: dict[str, Callable[[PredictorConfig, int], SuccessPredictor]] = {
    "shared": lambda config, seed: _guarded(HashedNgramPredictor(config, seed=seed), config),
    "prompt_history": lambda config, seed: PromptHistoryPredictor(),
    "knapsack_history": lambda config, seed: PromptHistoryPredictor(estimate="last_epoch"),
    "brace_bank": lambda config, seed: BraceBank(),
}
"""`shared`: TRACE's text predictor over any history (reads `config`, with `config.guard` wrapped in a
`GuardedPredictor`); `prompt_history`: each prompt's own past outcomes, Beta posterior;
`knapsack_history`: each prompt's success rate the last time it was sampled, as Knapsack-RL estimates it;
`brace_bank`: BRACE's decayed per-prompt counts and fitted group correlation (a training run sets its
decay, warm bank and correlation from `rollout.brace`, `trace_rl.run.build_predictor`)."""


def _guarded(predictor: SuccessPredictor, config: PredictorConfig) -> SuccessPredictor:
    return GuardedPredictor(predictor, window=config.guard_window) if config.guard else predictor


def build_predictor(kind: PredictorKind, config: PredictorConfig, *, seed: int) -> SuccessPredictor:
    if kind not in PREDICTORS:
        raise ValueError(f"unknown predictor kind {kind!r} (known: {', '.join(PREDICTORS)})")
    return PREDICTORS[kind](config, seed)


__all__ = [
    "BraceBank",
    "GuardedPredictor",
    "HashedNgramPredictor",
    "KnowsPrompts",
    "PREDICTORS",
    "PredictorAdvanced",
    "PredictorConfig",
    "PredictorKind",
    "PromptEvidence",
    "PromptHistoryPredictor",
    "SuccessPredictor",
    "backup_targets",
    "bank_counts",
    "brier_score",
    "build_predictor",
    "calibration_report",
    "expected_calibration_error",
    "natural_backup",
    "rollout_starts",
]
