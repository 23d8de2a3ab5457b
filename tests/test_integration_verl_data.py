"""The parquet rows verl's dataset reads (`trace-rl verl-data`): no verl needed to write them."""

import json

import pytest
from conftest import skip_without_sandbox

from trace_rl.agent.types import Task
from trace_rl.infra.config import ConfigError, load_config
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


def gsm8k_file(path, questions):
    path.write_text("".join(json.dumps({"question": q, "answer": f"so\n#### {i}"}) + "\n" for i, q in enumerate(questions)))
    return path


def test_verl_train_and_test_rows_of_a_file_task_share_no_question(tmp_path):
    """A file was one split, so the Qwen3 recipe's test.parquet was the first rows of its training file (issue 44)."""
    skip_without_sandbox()  # a GSM8K-style file task has the python tool, checked when its environment is built
    train_file = gsm8k_file(tmp_path / "train.jsonl", [f"What is {i} plus {i}?" for i in range(40)])
    base = ["task.name=file:" + str(train_file), "task.test_tasks=null", "model.warm_start=false", "model.name=smollm2-135m"]
    share = task_rows(load_config(RunConfig, None, [*base, "task.options={test_share: 0.25}"]))
    questions = {name: [json.loads(r["extra_info"][TASK_KEY])["question"] for r in rows] for name, rows in share.items()}
    assert len(questions["test"]) == 10 and len(questions["train"]) == 30
    assert not set(questions["test"]) & set(questions["train"])

    test_file = gsm8k_file(tmp_path / "test.jsonl", ["What is 100 plus 1?", "WHAT is  3 plus 3?"])  # one is a training question
    with pytest.raises(ConfigError, match=r"1 of 2 test questions are training questions .*'WHAT is  3 plus 3\?'"):
        task_rows(load_config(RunConfig, None, [*base, f"task.options={{test_file: {test_file}}}"]))
    with pytest.raises(ConfigError, match="training questions"):
        task_rows(load_config(RunConfig, None, [*base, "task.options={test_on_train: true}"]))
    with pytest.raises(ConfigError, match="test_share"):
        task_rows(load_config(RunConfig, None, base))


def test_the_qwen3_search_recipe_validates_on_its_own_test_file():
    from trace_rl.infra.config import load_yaml_file

    options = load_yaml_file("configs/gpu/qwen3_8b_search.yaml")["task"]["options"]
    assert options["test_file"] != load_yaml_file("configs/gpu/qwen3_8b_search.yaml")["task"]["name"].removeprefix("file:")


SGLANG_SAMPLING_FIELDS = {
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
    "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "beam_width", "json_schema", "regex", "ebnf", "structural_tag",
    "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias",
    "sampling_seed", "custom_params",
}
"""The fields of SGLang's `SamplingParams` (sglang 0.5.23, srt/sampling/sampling_params.py), which refuses any other key."""
VERL_SGLANG_MAPS = {"max_tokens", "logprobs"}
"""Keys verl's SGLang server (`async_sglang_server.generate`) takes out and maps before SGLang sees them."""


def test_sglang_requests_use_sglangs_names_and_vllm_requests_keep_vllms():
    """The verl engine sent vLLM-only keys to SGLang replicas, whose SamplingParams refuses them (issue 44)."""
    from trace_rl.engine.base import SamplingParams
    from trace_rl.integrations.verl.engine import LLMServerEngine, sampling_request

    params = SamplingParams(temperature=0.7, max_new_tokens=32, stop=("</action>",))
    sglang = sampling_request(params, 11, "sglang")
    assert set(sglang) - VERL_SGLANG_MAPS <= SGLANG_SAMPLING_FIELDS
    assert sglang["no_stop_trim"] is True and sglang["sampling_seed"] == 11 and sglang["stop"] == ["</action>"]
    vllm = sampling_request(params, 11)
    assert vllm["include_stop_str_in_output"] is True and vllm["seed"] == 11 and "no_stop_trim" not in vllm
    assert "seed" not in sampling_request(params, None, "sglang") and "sampling_seed" not in sampling_request(params, None, "sglang")
    with pytest.raises(ValueError, match="'trtllm' is not supported"):
        LLMServerEngine(None, None, backend="trtllm")  # refused before the client or tokenizer is used
