"""A user's reward function: any real number in [0, 1] is a reward (numpy's scalars included); anything
else, a wrong signature or a reward that raises is one line naming the function, its file and line,
before any run folder where it can be (issue 63, rewards)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import trace_rl
from trace_rl.agent.env import ToolEnv
from trace_rl.agent.scoring import RewardError, call_reward, score
from trace_rl.infra.config import ConfigError, load_config
from trace_rl.run import RunConfig, check_trainable

REPO = Path(__file__).resolve().parents[1]
ROWS = [{"question": f"What is {i} plus {i}?", "answer": str(2 * i)} for i in range(12)]
RETURNED: dict[str, object] = {"value": 1.0}


def configurable(task: trace_rl.Task, answer: str) -> object:
    return RETURNED["value"]


def three_arguments(task, answer, extra):  # the wrong shape
    return 1.0


def fussy(task: trace_rl.Task, answer: str) -> float:
    return float(answer) / 10  # fails on text that is not a number: a model writes such text


def tasks_with(scorer) -> trace_rl.TaskSet:
    return trace_rl.task_set(ROWS, scorer=scorer, test_share=0.25)


@pytest.mark.parametrize("value", [np.float32(1.0), np.float64(0.25), np.int64(0), True, 1, 0.5, np.bool_(False)])
def test_any_real_number_in_0_1_is_a_reward(value) -> None:
    RETURNED["value"] = value
    task = tasks_with(configurable).tasks[0]
    got = score(task, "2")
    assert isinstance(got, float) and got == float(value)
    assert ToolEnv.for_taskset(tasks_with(configurable))._score(task, "2") == float(value)


@pytest.mark.parametrize("value", [float("nan"), None, "1", 2.0, -0.5, math.inf, [1.0], np.array([0.5, 0.5]), 1j])
def test_anything_else_is_one_line_naming_the_reward(value) -> None:
    RETURNED["value"] = value
    task = tasks_with(configurable).tasks[0]
    with pytest.raises(RewardError) as raised:
        score(task, "2")
    message = str(raised.value)
    assert "\n" not in message and "configurable" in message and f"{Path(__file__).name}:" in message
    assert "real number in [0, 1]" in message and task.task_id in message


def test_a_reward_of_the_wrong_shape_or_name_is_refused_when_the_task_set_is_made() -> None:
    with pytest.raises(RewardError, match=r"three_arguments .*\(task, answer, extra\).*takes \(task, answer\)"):
        tasks_with(three_arguments)
    with pytest.raises(ValueError, match="did you mean 'exact_match'"):
        tasks_with("exact_matc")


def test_a_reward_that_raises_is_one_line_naming_it_the_task_and_the_answer() -> None:
    task = tasks_with(fussy).tasks[0]
    assert score(task, "10") == 1.0
    with pytest.raises(RewardError, match=r"fussy \(.*test_user_rewards.py:\d+\) raised ValueError.*the answer 'ten'"):
        score(task, "ten")
    with pytest.raises(RewardError, match="raised ZeroDivisionError"):
        call_reward(lambda task, answer: 1 / 0, task, "x")


def test_a_bad_reward_stops_the_run_before_its_folder_with_one_line(tmp_path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    config = load_config(RunConfig, None, [f"task.name=file:{path}", f"task.options={{test_share: 0.25, scorer: '{__file__}:fussy'}}"])
    with pytest.raises(ConfigError, match="fussy .* raised ValueError"):
        check_trainable(config)
    out = tmp_path / "never"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    done = subprocess.run([sys.executable, "-m", "trace_rl", "train", "--config", str(REPO / "configs/smoke.yaml"), "--out", str(out),
                           f"task.name=file:{path}", f"task.options={{test_share: 0.25, scorer: '{__file__}:fussy'}}"],
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "fussy" in done.stderr and "a reward must take any text a model writes" in done.stderr
    assert not out.exists()
