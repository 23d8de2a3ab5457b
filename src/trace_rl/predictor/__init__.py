"""Success predictors Ṽψ(H): the contract, training targets, calibration, and implementations."""

from trace_rl.predictor.base import (
    SuccessPredictor,
    backup_targets,
    brier_score,
    calibration_report,
    expected_calibration_error,
    natural_backup,
    rollout_starts,
)
from trace_rl.predictor.hashed import HashedNgramPredictor

__all__ = [
    "HashedNgramPredictor",
    "SuccessPredictor",
    "backup_targets",
    "brier_score",
    "calibration_report",
    "expected_calibration_error",
    "natural_backup",
    "rollout_starts",
]
