"""Values that used to be accepted and gave silently wrong runs are refused before any work (issue 12, class 2).

`train.grad_clip=-1` reversed every update and `0` zeroed them, `rollout.success_threshold=.nan` made
every Stage-2 outcome a failure, `rollout.max_context_tokens=0` ended every rollout after one turn,
`train.clip_low=.nan` logged NaN losses, `train.lr=.inf` left infinite weights behind before its error.
Each is now a one-line error naming the key, from the real CLI, before the warm start fills the cache;
and each limit is where the behaviour changes, so the nearest accepted value still trains.
"""

from __future__ import annotations

import math

import pytest
from test_hardening_config import SMOKE, trace_rl

from trace_rl.infra.config import ConfigError, load_config
from trace_rl.run import RunConfig


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("train.grad_clip=-1", "train.grad_clip must be > 0"),
        ("train.grad_clip=0", "train.grad_clip must be > 0"),
        ("rollout.success_threshold=.nan", "rollout.success_threshold must be a finite number, got nan"),
        ("rollout.max_context_tokens=0", "rollout.max_context_tokens must be > 48"),
        ("train.clip_low=.nan", "train.clip_low must be a finite number, got nan"),
        ("train.lr=.inf", "train.lr must be a finite number, got inf"),
    ],
)
def test_a_value_that_silently_spoiled_a_run_is_refused_before_any_work(tmp_path, override, named):
    code, err, seconds = trace_rl("train", "--config", str(SMOKE), "--out", str(tmp_path / "run"), override, cache=tmp_path / "cache")
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert named in err, err
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


@pytest.mark.parametrize(
    "override",
    ["train.grad_clip=1e-6", "rollout.success_threshold=0.0", "rollout.success_threshold=0.99", "rollout.max_context_tokens=49", "train.clip_low=0.0"],
)
def test_the_nearest_accepted_value_is_a_working_setting(override):
    config = load_config(RunConfig, SMOKE, [override])
    key, value = override.split("=")
    section, name = key.split(".")
    assert math.isclose(getattr(getattr(config, section), name), float(value))


def test_an_infinite_or_nan_learning_rate_never_reaches_the_optimizer():
    for value in (".inf", "-.inf", ".nan"):
        with pytest.raises(ConfigError, match="train.lr"):
            load_config(RunConfig, SMOKE, [f"train.lr={value}"])


def test_a_number_in_exponent_form_without_a_dot_is_a_number_not_a_string():
    """PyYAML (YAML 1.1) reads `1e-4` as a string; a learning rate typed that way must still be one."""
    config = load_config(RunConfig, SMOKE, ["train.lr=1e-4", "rollout.success_threshold=5E-1"])
    assert config.train.lr == 1e-4 and config.rollout.success_threshold == 0.5
    with pytest.raises(ConfigError, match="train.lr"):
        load_config(RunConfig, SMOKE, ["train.lr=1e999"])  # overflows to inf: still refused
