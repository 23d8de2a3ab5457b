"""The parquet rows verl's dataset reads (`trace-rl verl-data`): no verl needed to write them."""

import json

import pytest

from trace_rl.agent.types import Task
from trace_rl.config import load_config
from trace_rl.integrations.verl.data import task_rows
from trace_rl.integrations.verl.manager import TASK_KEY
from trace_rl.run import RunConfig, load_tasks, task_splits


def test_verl_rows_name_each_task_of_the_rl_train_and_test_splits_once(tmp_path):
    config = load_config(RunConfig, None, ["task.name=multihop", "task.train_tasks=12", "task.test_tasks=4", "task.demo_tasks=5"])
    rows = task_rows(config)
    _, train = task_splits(config)
    test = load_tasks(config.task, "test", 4)
    assert [Task.from_dict(json.loads(r["extra_info"][TASK_KEY])) for r in rows["train"]] == train.tasks  # not the demonstration tasks
    assert [Task.from_dict(json.loads(r["extra_info"][TASK_KEY])) for r in rows["test"]] == test.tasks
    first = rows["train"][0]
    assert [m["role"] for m in first["prompt"]] == ["system", "user"] and train.tasks[0].question in first["prompt"][1]["content"]
    assert first["reward_model"]["ground_truth"] == train.tasks[0].answers[0]
    assert [r["extra_info"]["index"] for r in rows["test"]] == list(range(4))


@pytest.mark.parametrize("data", [[1], {"task_id": "a"}, {"task_id": "a", "question": "q", "answers": "x", "source": "s"},
                                  {"task_id": "a", "question": "q", "answers": ["x"], "source": "s", "code": "import os"}])
def test_a_task_from_a_file_is_data_and_a_malformed_one_is_refused(data):
    with pytest.raises(ValueError):
        Task.from_dict(data)


def test_the_verl_data_command_writes_both_files_or_says_in_one_line_what_it_needs(tmp_path, capsys):
    import importlib.util

    from trace_rl.cli import main

    code = main(["verl-data", "--config", "configs/smoke.yaml", "--out", str(tmp_path / "d"), "task.train_tasks=6", "task.test_tasks=2"])
    if importlib.util.find_spec("pyarrow") is None:
        assert code == 2
        assert capsys.readouterr().err.strip().splitlines() == ["trace-rl verl-data: writing parquet needs pyarrow: pip install -e '.[parquet]' (verl's environment has it)"]
    else:
        import pyarrow.parquet as pq

        assert code == 0
        assert pq.read_table(tmp_path / "d" / "train.parquet").num_rows == 6 and pq.read_table(tmp_path / "d" / "test.parquet").num_rows == 2
