"""The parquet rows verl's dataset reads (`trace-rl verl-data`): no verl needed to write them."""

from trace_rl.config import load_config
from trace_rl.integrations.verl.data import task_rows
from trace_rl.integrations.verl.manager import TASK_KEY
from trace_rl.run import RunConfig, load_tasks, task_splits


def test_verl_rows_name_each_task_of_the_rl_train_and_test_splits_once(tmp_path):
    config = load_config(RunConfig, None, ["task.name=multihop", "task.train_tasks=12", "task.test_tasks=4", "task.demo_tasks=5"])
    rows = task_rows(config)
    _, train = task_splits(config)
    test = load_tasks(config.task, "test", 4)
    assert [r["extra_info"][TASK_KEY] for r in rows["train"]] == [t.task_id for t in train.tasks]  # not the demonstration tasks
    assert [r["extra_info"][TASK_KEY] for r in rows["test"]] == [t.task_id for t in test.tasks]
    first = rows["train"][0]
    assert [m["role"] for m in first["prompt"]] == ["system", "user"] and train.tasks[0].question in first["prompt"][1]["content"]
    assert first["reward_model"]["ground_truth"] == train.tasks[0].answers[0]
    assert [r["extra_info"]["index"] for r in rows["test"]] == list(range(4))
