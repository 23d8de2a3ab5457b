"""Prompt profiles per model and worked examples: what a pretrained model is prompted with by default."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

import trace_rl
from trace_rl import ToolCall
from trace_rl.agent.agents import worked_examples
from trace_rl.agent.env import ToolEnv
from trace_rl.agent.protocol import TagFormat
from trace_rl.agent.tasks import load_taskset
from trace_rl.infra.config import ConfigError, FieldError, from_dict, load_config, to_dict
from trace_rl.models.profiles import DEFAULT, PRESET_PROFILES, profile_for
from trace_rl.run import RunConfig, build_env, few_shot_examples, without_examples

from repo_files import load

SMOKE = "configs/smoke.yaml"


def test_presets_and_families_have_their_profiles(tmp_path):
    assert profile_for("smollm2-135m") == PRESET_PROFILES["smollm2-135m"]
    assert profile_for("tiny").format == "tag" and profile_for("tiny").few_shot == 0
    qwen = tmp_path / "qwen"
    qwen.mkdir()
    (qwen / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    assert profile_for(str(qwen)).format == "json"
    (qwen / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert profile_for(str(qwen)) == DEFAULT
    (qwen / "config.json").write_text("{not json")
    assert profile_for(str(qwen)) == DEFAULT
    assert profile_for("Qwen/Qwen3-8B").format == "json"
    assert profile_for("Qwen/Qwen2.5-7B-Instruct").format == "json"
    assert profile_for("meta-llama/Llama-3.2-1B") == DEFAULT


def test_the_run_config_fills_what_it_leaves_open_from_the_profile():
    cold = load_config(RunConfig, SMOKE, ["model.name=smollm2-135m", "model.warm_start=false"])
    assert (cold.task.format, cold.task.few_shot, cold.rollout.temperature) == ("tag", None, 0.7)
    tiny = load_config(RunConfig, SMOKE)
    assert (tiny.task.format, tiny.rollout.temperature) == ("tag", 1.0)
    chosen = load_config(RunConfig, SMOKE, ["model.name=smollm2-135m", "model.warm_start=false", "task.format=json",
                                            "task.few_shot=0", "rollout.temperature=1.0"])
    assert (chosen.task.format, chosen.task.few_shot, chosen.rollout.temperature) == ("json", 0, 1.0)


def test_the_profiles_examples_go_only_to_a_run_without_a_warm_start():
    train = load_taskset("multihop", split="train", num_tasks=40)
    cold = load_config(RunConfig, SMOKE, ["model.name=smollm2-135m", "model.warm_start=false"])
    assert len(build_env(cold, train).examples) == PRESET_PROFILES["smollm2-135m"].few_shot == 2
    warm = load_config(RunConfig, SMOKE, ["model.name=smollm2-135m"])
    assert build_env(warm, train).examples == ()  # the warm start teaches the format
    assert build_env(load_config(RunConfig, SMOKE), train).examples == ()
    asked = load_config(RunConfig, SMOKE, ["task.few_shot=1"])  # a warm-started tiny run that asks for one
    assert len(build_env(asked, train).examples) == 1


def test_the_resolved_config_is_a_fixed_point():
    """What a run folder saves loads back to itself: a resume compares the two."""
    config = load_config(RunConfig, SMOKE, ["model.name=smollm2-135m", "model.warm_start=false"])
    assert from_dict(RunConfig, to_dict(config)) == config


def test_worked_examples_are_refused_for_an_env_of_ones_own():
    with pytest.raises(FieldError, match="task.few_shot"):
        load_config(RunConfig, SMOKE, ["task.env=tests/own_env.py:make_env", "task.few_shot=1"])


def test_worked_examples_are_the_shortest_solved_episodes_in_task_order():
    train = load_taskset("multihop", split="train", num_tasks=40)
    env = ToolEnv.for_taskset(train, turn_format="tag", max_turns=5)
    examples = worked_examples(env, train.tasks, train.oracle, 2)
    assert len(examples) == 2
    lengths = {}
    for task in train.tasks[:32]:
        episode = worked_examples(env, [task], train.oracle, 1)[0]
        lengths[task.task_id] = len(episode.episode)
    shortest = sorted(lengths.values())[:2]
    assert sorted(len(e.episode) for e in examples) == shortest
    order = [t.task_id for t in train.tasks]
    assert order.index(examples[0].task.task_id) < order.index(examples[1].task.task_id)
    for example in examples:  # the whole episode as the model writes and reads it, ending with the answer
        assert example.episode.rstrip().endswith("</answer>") and "<information>" in example.episode


def test_the_prompt_shows_the_examples_as_earlier_turns_of_the_chat():
    train = load_taskset("multihop", split="train", num_tasks=40)
    env = ToolEnv.for_taskset(train, turn_format="tag")
    env.examples = tuple(worked_examples(env, train.tasks, train.oracle, 1))
    task = train.tasks[-1]
    messages = env.messages(task)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[1]["content"] == f"Question: {env.examples[0].task.question}"
    assert messages[2]["content"] == env.examples[0].episode
    assert messages[3]["content"] == f"Question: {task.question}"
    assert env.examples[0].episode in env.reset(task)  # the plain-text prompt too
    assert env.spawn().messages(task) == messages  # every spawned env shows the same


def test_recorded_demonstrations_serve_as_examples_without_an_oracle():
    rows = [{"id": f"r{i}", "question": f"What is {i} plus one?", "answer": str(i + 1)} for i in range(60)]
    demos = [{"id": "r50", "calls": [{"answer": "51"}]}]  # past the first 32 tasks
    train = trace_rl.task_set(rows, split="train", test_share=0.2, scorer="numeric", demonstrations=demos)
    env = ToolEnv.for_taskset(train, turn_format="tag")
    (example,) = worked_examples(env, train.tasks, train.oracle, 1)
    assert example.task.task_id == "r50" and example.episode == TagFormat().render_call(ToolCall("answer", {"answer": "51"}),
                                                                                        thought="I have what I need to answer.")
    with pytest.raises(ValueError, match="solved 1 of"):
        worked_examples(env, train.tasks, train.oracle, 2)


def test_a_task_set_without_oracle_or_demonstrations(tmp_path, monkeypatch):
    """The profile's examples are dropped with a warning that says how to give some; examples the
    config asks for are a one-line ConfigError."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plain.py").write_text(
        "import trace_rl\n"
        "def plain(split='train', num_tasks=None, seed=0):\n"
        "    rows = [{'question': f'q{i}?', 'answer': str(i)} for i in range(40)]\n"
        "    return trace_rl.task_set(rows, split=split, num_tasks=num_tasks, seed=seed, test_share=0.25)\n"
    )
    shutil.copytree(Path(__file__).parents[1] / "configs", tmp_path / "configs")
    train = load_taskset("plain.py:plain", split="train")
    cold = ["task.name=plain.py:plain", "model.name=smollm2-135m", "model.warm_start=false"]
    with pytest.warns(UserWarning, match="demonstrations="):
        assert build_env(load_config(RunConfig, SMOKE, cold), train).examples == ()
    with pytest.raises(ConfigError, match="demonstrations=") as caught:
        build_env(load_config(RunConfig, SMOKE, [*cold, "task.few_shot=1"]), train)
    assert "\n" not in str(caught.value) and "task.few_shot=1" in str(caught.value)


def test_a_runs_examples_come_from_its_train_split_and_leave_rls_pool():
    config = load_config(RunConfig, SMOKE, ["model.name=smollm2-135m", "model.warm_start=false", "task.few_shot=2"])
    train = load_taskset("multihop", split="train", num_tasks=config.task.train_tasks)
    env = build_env(config, train)
    shown = {e.task.task_id for e in env.examples}
    assert len(shown) == 2 and shown <= {t.task_id for t in train.tasks}
    assert env.examples == tuple(few_shot_examples(config, env))  # the same in every process
    kept = without_examples(train, env)
    assert {t.task_id for t in kept.tasks} == {t.task_id for t in train.tasks} - shown
    assert without_examples(train, ToolEnv.for_taskset(train)) is train


def test_protocol_share_counts_valid_turns_overall_and_first():
    from trace_rl.core.tree import RolloutTree

    shares = load("experiments/protocol_share.py").turn_shares
    tree = RolloutTree.new("t", "q?", [1, 2, 3])
    tree.add_turn(0, action="<answer>a</answer>", token_ids=[4], reward=1.0, info={"call": {"name": "answer"}})
    tree.add_turn(0, token_ids=[5], reward=0.0, info={"call": None})
    figures = shares([tree])
    assert figures["turns"] == 2 and figures["valid_share"] == 0.5 and figures["first_turn_valid_share"] == 0.5


def test_the_regime_pilot_applies_its_plans_rule(tmp_path):
    pilot = load("experiments/smollm2_regime.py")

    def write(name, start, end):
        folder = tmp_path / name
        folder.mkdir()
        rows = [{"step": 0, "val/accuracy_sampled": start, "val/accuracy_sampled_se_tasks": 0.03, "val/accuracy_greedy": start}]
        rows += [{"step": s, "timing_s/step": 60.0, "critic/score/mean": 0.3} for s in range(1, 13)]
        rows[-1].update({"val/accuracy_sampled": end, "val/accuracy_sampled_se_tasks": 0.04, "val/accuracy_greedy": end})
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    write("multihop_1_2", 0.20, 0.30)
    write("toolmath", 0.10, 0.40)  # the largest rise, but it starts below the band
    summary = pilot.summary(tmp_path)
    assert summary["complete"] is False and summary["chosen"] is None  # shop_cold has not run
    write("shop_cold", 0.30, 0.35)
    summary = pilot.summary(tmp_path)
    assert summary["complete"] and summary["chosen"] == "multihop_1_2"
    assert not summary["regimes"]["toolmath"]["eligible"]
    assert abs(summary["regimes"]["multihop_1_2"]["rise"] - 0.10) < 1e-9
    assert pilot.finished(tmp_path / "toolmath", 12) and not pilot.finished(tmp_path / "toolmath", 13)
    for name in pilot.REGIMES:
        (tmp_path / name / "config.yaml").write_text("seed: 0\n")
        (tmp_path / name / "code.json").write_text("{}")
    saved = pilot.save(tmp_path, tmp_path / "saved")
    assert json.loads(json.dumps(saved)) == json.loads((tmp_path / "saved" / "pilot.json").read_text())
    import tarfile

    with tarfile.open(tmp_path / "saved" / "runs.tar.xz") as archive:
        assert sorted(archive.getnames()) == sorted(f"{n}/{f}" for n in pilot.REGIMES for f in ("config.yaml", "code.json", "metrics.jsonl"))


def test_an_opened_thought_round_trips_through_the_env_and_the_examples():
    """With `open_thought` every turn of the model starts inside a <think> the env wrote: the prompt and
    each observation end with it, the oracle's turns (and so the examples and the warm start's
    demonstrations) leave it out, and they still parse and solve the task."""
    from trace_rl.agent.agents import OracleAgent, run_episode
    from trace_rl.models import load_policy
    from trace_rl.rollout.collector import encode_prompt

    train = load_taskset("multihop", split="train", num_tasks=40)
    env = ToolEnv.for_taskset(train, turn_format="tag", open_thought=True, max_turns=5)
    assert env.prompt_suffix == "<think>" and env.reset(train.tasks[0]).endswith("<think>")
    solved = 0
    for task in train.tasks[:8]:
        episode = run_episode(env, task, OracleAgent(train.oracle, env.format))
        solved += episode.reward == 1.0
        assert not any(action.startswith("<think>") for action in episode.actions)
        assert all(step.observation.endswith("<think>") for step in episode.steps[:-1])
        assert all(step.info.call is not None for step in episode.steps)
    assert solved == 8
    (example,) = worked_examples(env, train.tasks, train.oracle, 1)
    assert example.episode.startswith("<think>I should use") and "<think><think>" not in example.episode
    tokenizer = load_policy("tiny", tokenizer_texts=["a b c"]).tokenizer
    ids = encode_prompt(tokenizer, env, train.tasks[0])
    assert tokenizer.decode(ids).endswith("<think>")
    closed = ToolEnv.for_taskset(train, turn_format="tag")
    assert closed.prompt_suffix == "" and not tokenizer.decode(encode_prompt(tokenizer, closed, train.tasks[0])).endswith("<think>")


def test_the_profile_opens_smollm2s_turns():
    assert load_config(RunConfig, SMOKE, ["model.name=smollm2-135m"]).task.open_thought is True
    assert load_config(RunConfig, SMOKE).task.open_thought is False
    assert load_config(RunConfig, SMOKE, ["model.name=smollm2-135m", "task.open_thought=false"]).task.open_thought is False


def test_a_run_folder_written_before_the_profiles_resumes_as_it_ran(tmp_path):
    """A run folder's config.yaml lists every key its trace-rl knew: one without `task.open_thought` or
    `task.few_shot` ran with closed turns and no examples, and must resume so, not as the profile says."""
    from trace_rl.run import load_run_config

    old = load_config(RunConfig, SMOKE, ["model.name=smollm2-135m"])
    data = to_dict(old)
    del data["task"]["open_thought"], data["task"]["few_shot"]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(data))
    resumed = load_run_config(tmp_path / "config.yaml", ["train.steps=3"])
    assert (resumed.task.open_thought, resumed.task.few_shot, resumed.train.steps) == (False, 0, 3)
    assert load_config(RunConfig, tmp_path / "config.yaml").task.open_thought is True  # a config of one's own: the profile
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(to_dict(old)))
    assert load_run_config(tmp_path / "config.yaml") == old
