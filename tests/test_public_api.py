"""The public API: a user's own task, reward and tool, with no file under src/ edited."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import trace_rl
from trace_rl.agent.agents import RandomAgent
from trace_rl.agent.env import ToolEnv
from trace_rl.agent.protocol import get_format
from trace_rl.agent.tasks import load_taskset
from trace_rl.agent.tasks.loaders import TaskFileError
from trace_rl.agent.tasks.records import replay
from trace_rl.infra.config import ConfigError, FieldError, load_config
from trace_rl.infra.references import BadReference, is_reference, reference_of, resolve
from trace_rl.run import RunConfig, check_trainable

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "custom_task.py"
FAST = ["sft.demos=40", "sft.steps=20", "train.steps=2", "train.eval_every=2", "task.test_tasks=8", "rollout.budget=8", "prompts_per_step=2"]
ROWS = [{"question": f"What is {i} plus {i}?", "answer": 2 * i, "difficulty": i % 3} for i in range(40)]


def shout(text: str) -> str:
    """Say the text louder."""
    return text.upper()


def half_credit(task: trace_rl.Task, answer: str) -> float:
    return 1.0 if answer.strip() == task.answers[0] else 0.5 if task.answers[0] in answer else 0.0


def test_trace_rl_train_stays_the_function_after_every_submodule_is_imported():
    # A subpackage named like an exported function would replace it as an attribute of trace_rl once
    # imported (`trace_rl.train` was both: "module is not callable"). In a fresh process, so nothing
    # this test session imported first hides it.
    code = (
        "import importlib, pkgutil, trace_rl\n"
        "for m in pkgutil.walk_packages(trace_rl.__path__, 'trace_rl.'):\n"
        "    if m.name.endswith('__main__'):\n"
        "        continue\n"
        "    try:\n"
        "        importlib.import_module(m.name)\n"
        "    except ModuleNotFoundError as exc:  # an optional extra (ray, verl) not installed here\n"
        "        if (exc.name or '').startswith('trace_rl'):\n"
        "            raise\n"
        "import trace_rl.training.loss\n"
        "clash = sorted(n for n in trace_rl.__all__ if not callable(getattr(trace_rl, n)) and type(getattr(trace_rl, n)).__name__ == 'module')\n"
        "assert not clash, clash\n"
        "assert callable(trace_rl.train) and trace_rl.train.__module__ == 'trace_rl.run', trace_rl.train\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def test_the_names_users_and_peers_rely_on_are_importable_from_trace_rl():
    from trace_rl import agent
    from trace_rl.core import advantage
    from trace_rl.core import solvers as allocate
    from trace_rl.planning import methods

    assert trace_rl.allocate_roots is allocate.allocate_roots and trace_rl.expand_prefixes is allocate.expand_prefixes
    assert trace_rl.ESTIMATORS is advantage.ESTIMATORS and trace_rl.METHODS is methods.METHODS
    assert trace_rl.load_taskset is agent.tasks.load_taskset and "exact_match" in trace_rl.SCORERS
    assert set(trace_rl.__all__) <= set(dir(trace_rl))
    with pytest.raises(AttributeError, match="no attribute 'alocate_roots'"):
        trace_rl.alocate_roots  # noqa: B018


def test_a_task_set_from_rows_keeps_what_the_reward_needs_and_splits_without_overlap():
    train = trace_rl.task_set(ROWS, name="sums", test_share=0.25, scorer=half_credit, tools=[shout], seed=3)
    test = trace_rl.task_set(ROWS, name="sums", split="test", test_share=0.25, scorer=half_credit, tools=[shout], seed=3)
    assert len(train.tasks) == 30 and len(test.tasks) == 10
    assert not {t.question for t in train.tasks} & {t.question for t in test.tasks}
    task = train.tasks[0]
    assert task.answers == (str(2 * int(task.question.split()[2])),) and "difficulty" in task.meta and task.tools == ("shout",)
    assert is_reference(task.scorer) and resolve(task.scorer, "scorer").__name__ == "half_credit"
    assert trace_rl.score(task, task.answers[0] + " euros") == 0.5  # partial credit through the reference
    assert set(train.tools) == {"shout"} and train.tools["shout"].fn("hi") == "HI"
    with pytest.raises(ValueError, match="no test split: give test_records, test_share"):
        trace_rl.task_set(ROWS, split="test")
    with pytest.raises(BadReference, match="a lambda or nested function"):
        trace_rl.task_set(ROWS, scorer=lambda task, answer: 1.0)
    with pytest.raises(TaskFileError, match="row 1.*question"):
        trace_rl.task_set([{"question": "ok?"}, {"prompt": ""}])


def test_rows_from_a_file_and_a_replayed_demonstration(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:4]))
    tasks = trace_rl.task_set(path, test_on_train=True, split="test")
    assert [t.question for t in tasks.tasks] == [r["question"] for r in ROWS[:4]]
    oracle = replay([{"question": ROWS[0]["question"], "calls": [{"tool": "shout", "arguments": {"text": "x"}}, {"answer": "0"}]}])
    first = oracle(tasks.tasks[0], [])
    assert first.name == "shout" and oracle(tasks.tasks[0], [(first, "X")]).arguments == {"answer": "0"}
    with pytest.raises(ValueError, match="no demonstration"):
        oracle(tasks.tasks[1], [])


def test_references_name_modules_and_files_and_fail_in_one_line(tmp_path):
    assert resolve("trace_rl.core.solvers:allocate_roots", "x") is trace_rl.allocate_roots
    assert resolve(f"{EXAMPLE}:price", "tool")("pear") == "5"
    assert reference_of(half_credit, "scorer") == "test_public_api:half_credit"
    with pytest.raises(BadReference, match="has no attribute 'shpo'; did you mean 'shop'"):
        resolve(f"{EXAMPLE}:shpo", "task set")
    with pytest.raises(BadReference, match="no file"):
        resolve("nowhere/mine.py:tasks", "task set")
    with pytest.raises(BadReference, match="cannot import"):
        resolve("no_such_module_here:tasks", "task set")
    assert not is_reference("file:data.jsonl") and not is_reference("rg:chain_sum") and is_reference("pkg.mod:fn")


def test_the_random_agent_calls_a_users_tool_with_arguments_of_its_types():
    tasks = trace_rl.task_set(ROWS, tools=[shout])
    env = ToolEnv.for_taskset(tasks)
    agent = RandomAgent(get_format("tag"), corpus_words=["alpha", "beta"], answer_prob=0.0, malformed_prob=0.0,
                        specs={n: t.spec for n, t in env.tools.items()})
    rng = np.random.default_rng(0)
    env.reset(tasks.tasks[0])
    result = env.step(agent.act(tasks.tasks[0], [], rng))
    assert result.info.call.name == "shout" and result.info.observation.isupper()


def test_a_file_task_takes_a_users_tool_and_reward_by_reference(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"question": r["question"], "answer": str(r["answer"])}) + "\n" for r in ROWS))
    tasks = load_taskset(f"file:{path}", tools=[f"{EXAMPLE}:price"], scorer=f"{Path(__file__)}:half_credit")
    assert tasks.tasks[0].tools == ("price",) and set(tasks.tools) == {"price"}
    assert ToolEnv.for_taskset(tasks).tools["price"].fn("melon") == "12"
    with pytest.raises(FieldError, match=r"task.options.tools\[0\]"):
        load_config(RunConfig, None, [f"task.name=file:{path}", "task.options={tools: [prize]}"])


def test_a_users_mistakes_are_one_line_errors_before_any_folder(tmp_path):
    with pytest.raises(FieldError, match="has no attribute 'shpo'"):
        load_config(RunConfig, None, [f"task.name={EXAMPLE}:shpo"])
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"question": r["question"], "answer": str(r["answer"])}) + "\n" for r in ROWS))
    config = load_config(RunConfig, None, [f"task.name=file:{path}", "task.options={test_share: 0.2}"])
    with pytest.raises(ConfigError, match="no oracle or demonstrations"):
        check_trainable(config)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    out = tmp_path / "never"
    done = subprocess.run([sys.executable, "-m", "trace_rl", "train", "--config", str(REPO / "configs/smoke.yaml"), "--out", str(out),
                           f"task.name=file:{path}", "task.options={test_share: 0.2}"], env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 2 and "no oracle or demonstrations" in done.stderr and "Traceback" not in done.stderr
    assert not out.exists()


def test_the_custom_task_example_trains_for_two_steps(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "TRACE_RL_CACHE": str(tmp_path / "cache")}
    out = tmp_path / "shop"
    subprocess.run([sys.executable, str(EXAMPLE), str(out), *FAST], cwd=REPO, env=env, check=True, capture_output=True, timeout=600)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2] and "val/accuracy_sampled" in lines[-1]
    user_lines = [line for line in EXAMPLE.read_text().splitlines() if line.strip() and not line.strip().startswith("#")]
    assert len(user_lines) <= 70  # code and docstrings; the code alone is under 50 lines


def test_a_config_naming_the_users_task_trains_through_the_cli_and_compare_with_two_workers(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "TRACE_RL_CACHE": str(tmp_path / "cache")}
    config = tmp_path / "compare.yaml"
    config.write_text(
        "methods: [grpo, trace]\nseeds: [0]\nworkers: 2\nevaluate_start: false\n"
        f"run:\n  task:\n    name: {EXAMPLE}:shop\n    test_tasks: 8\n  sft: {{demos: 40, steps: 20}}\n"
        "  prompts_per_step: 2\n  rollout: {budget: 8, max_new_tokens: 32}\n  train: {steps: 1, eval_every: 1, eval_samples: 1}\n"
    )
    done = subprocess.run([sys.executable, "-m", "trace_rl", "compare", "--config", str(config), "--out", str(tmp_path / "cmp")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((tmp_path / "cmp" / "summary.json").read_text())
    assert set(summary["methods"]) == {"grpo", "trace"}


def test_the_warm_start_is_its_own_cached_step(tmp_path, monkeypatch, capsys):
    from trace_rl.cli import main

    monkeypatch.setenv("TRACE_RL_CACHE", str(tmp_path / "cache"))
    argv = ["warm-start", "--config", str(REPO / "configs/smoke.yaml"), "sft.steps=4", "sft.demos=8"]
    assert main(argv) == 0
    made = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert Path(made["policy"]).is_dir() and made["trained_steps"] == 4
    assert main(argv) == 0
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert again == {**made, "trained_steps": 0}  # cached: train and compare find it so
    assert main(["warm-start", "--config", str(REPO / "configs/smoke.yaml"), "model.warm_start=false", "model.name=smollm2-135m"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["policy"] == "smollm2-135m"


OWN_ENV = REPO / "tests" / "own_env.py"


def test_an_env_of_your_own_is_checked_and_its_mistakes_are_one_line(tmp_path):
    from own_env import make_env  # tests/ is on the path, as for scripted_engine

    from trace_rl.run import build_env
    tasks = load_taskset("multihop", split="train", num_tasks=4)
    steps = trace_rl.check_env(make_env(tasks), tasks.tasks[0], ["<search>who</search>", f"<answer>{tasks.tasks[0].answers[0]}</answer>"])
    assert steps[0].observation.startswith("hint:") and steps[-1].reward == 1.0
    with pytest.raises(FieldError, match=r"task\.env.*has no attribute 'make_evn'"):
        load_config(RunConfig, None, [f"task.env={OWN_ENV}:make_evn"])
    with pytest.raises(FieldError, match=r"task\.env.*module:function"):
        load_config(RunConfig, None, ["task.env=HintEnv"])
    config = load_config(RunConfig, None, [f"task.env={OWN_ENV}:not_an_env", "model.warm_start=false", "model.name=smollm2-135m"])
    with pytest.raises(ConfigError, match=r"returned a object without messages\(\), stop_strings\(\).*max_turns"):
        build_env(config, tasks)
    config = load_config(RunConfig, None, [f"task.env={OWN_ENV}:make_env"])  # tiny needs a warm start, which writes ToolEnv turns
    with pytest.raises(ConfigError, match="makes a HintEnv, and model.warm_start writes its demonstrations"):
        check_trainable(config)


def test_a_config_naming_an_env_of_your_own_trains_through_the_cli(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "TRACE_RL_CACHE": str(tmp_path / "cache")}
    smoke = str(REPO / "configs/smoke.yaml")
    made = subprocess.run([sys.executable, "-m", "trace_rl", "warm-start", "--config", smoke, "sft.steps=10", "sft.demos=20"],
                          env=env, capture_output=True, text=True, timeout=600, check=True)
    policy = json.loads(made.stdout.strip().splitlines()[-1])["policy"]  # a tiny policy made ahead: needs no warm start now
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "trace_rl", "train", "--config", smoke, "--out", str(out), f"task.env={OWN_ENV}:make_env",
                           f"model.name={policy}", "model.warm_start=false", *FAST[2:]], env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2] and "val/accuracy_sampled" in lines[-1]
    trees = [json.loads(line) for line in (out / "trees" / "step_0001.jsonl").read_text().splitlines()]
    observations = [node["info"].get("observation", "") for tree in trees for node in tree["nodes"] if node.get("info")]
    assert any(o.startswith("hint:") for o in observations) and all(o == "" or o.startswith("hint:") for o in observations)  # HintEnv's steps


def test_brace_excludes_the_certified_useless_and_stops_before_any_folder_when_none_is_left():
    config = load_config(RunConfig, None, [f"task.name={OWN_ENV}:presolved", "model.warm_start=false", "model.name=smollm2-135m",
                                           "rollout.method=brace", "rollout.brace.exclude_certified=true"])
    with pytest.raises(ConfigError, match="all 15 train tasks are certified useless"):
        check_trainable(config)
    from own_env import free_or_exact

    from trace_rl.run import brace_pool

    rows = [{"question": f"Say x ({i}).", "answer": "x", "free": i < 2} for i in range(6)]
    tasks = trace_rl.task_set(rows, name="mixed", scorer=free_or_exact)
    pool = brace_pool(config, tasks)
    assert [t.meta["free"] for t in pool.tasks] == [False] * 4
    assert pool.meta["brace_excluded"] == {t.task_id: "pre-solved" for t in tasks.tasks if t.meta["free"]}
    assert brace_pool(load_config(RunConfig, None, ["model.warm_start=false", "model.name=smollm2-135m"]), tasks) is tasks
