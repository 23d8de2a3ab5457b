"""ToolEnv: episodes, malformed turns, the turn limit, branching by replay and snapshot, agents."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

import numpy as np
import pytest
from conftest import skip_without_sandbox, skip_without_sandbox_for

from trace_rl.agent.agents import OracleAgent, RandomAgent, run_episode
from trace_rl.agent.env import EnvSnapshot, StepResult, ToolEnv, check_env
from trace_rl.agent.protocol import FORMATS, get_format
from trace_rl.agent.tools import Tool, ToolInputError, build_tools
from trace_rl.agent.tools.retrieval_server import RetrievalServer
from trace_rl.agent.types import Passage, Task, TaskSet, ToolCall

# A tiny two-hop world: "In which country was the director of <film> born?", then a calculator step.
FILMS = {"Blue Harbor": "Ann Lindqvist", "Night Orchard": "Tomas Reyes", "Paper Moons": "Ilse Varga"}
BIRTH = {"Ann Lindqvist": ("Norway", 1961), "Tomas Reyes": ("Chile", 1970), "Ilse Varga": ("Hungary", 1955)}
CORPUS = [
    *(Passage(f"f{i}", film, f"{film} is a drama film directed by {who}.") for i, (film, who) in enumerate(FILMS.items())),
    *(
        Passage(f"p{i}", who, f"{who} is a film director born in {country} in {year}.")
        for i, (who, (country, year)) in enumerate(BIRTH.items())
    ),
]
TASKS = [
    Task(f"film-{i}", f"In which country was the director of {film} born?", (BIRTH[who][0],), "toy", tools=("search", "calculator"))
    for i, (film, who) in enumerate(FILMS.items())
]


def toy_oracle(task: Task, history: Sequence[tuple[ToolCall, str]]) -> ToolCall:
    """Reads each hop out of the search results; never looks at the gold answer."""
    film = re.search(r"director of (.+) born\?", task.question).group(1)
    if not history:
        return ToolCall("search", {"query": film})
    if len(history) == 1:
        director = re.search(rf"{re.escape(film)} is a drama film directed by ([^.]+)\.", history[0][1]).group(1)
        return ToolCall("search", {"query": director})
    if len(history) == 2:
        year = re.search(r"born in \w+ in (\d{4})", history[1][1]).group(1)
        return ToolCall("calculator", {"expression": f"2024 - {year}"})
    country = re.search(r"born in (\w+) in", history[1][1]).group(1)
    return ToolCall("answer", {"answer": country})


TASKSET = TaskSet("toy", TASKS, CORPUS, toy_oracle)
SEARCH_ONLY = Task("s", "Who directed Blue Harbor?", ("Ann Lindqvist",), "toy", tools=("search",))


def exact(task: Task, answer: str) -> float:
    return float(answer.strip().lower() in {a.lower() for a in task.answers})


def make_env(fmt: str = "tag", **kwargs) -> ToolEnv:
    return ToolEnv(build_tools(["search", "calculator"], corpus=CORPUS), turn_format=fmt, scorer=exact, **kwargs)


def oracle_actions(env: ToolEnv, task: Task) -> list[str]:
    return run_episode(env, task, OracleAgent(toy_oracle, env.format)).actions


FORMAT_NAMES = list(FORMATS)


# ---------------------------------------------------------------- episodes


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_oracle_episode_goes_through_real_tools_and_is_rewarded(fmt):
    env = make_env(fmt)
    episode = run_episode(env, TASKS[0], OracleAgent(toy_oracle, env.format), seed=0)
    assert episode.reward == 1.0 and episode.terminated and not episode.truncated
    assert episode.num_turns == 4
    assert episode.answer == "Norway"
    calls = [info.call.name for info in episode.infos]
    assert calls == ["search", "search", "calculator", "answer"]
    assert episode.infos[2].observation == "63"
    assert episode.steps[-1].observation == ""
    assert episode.context == episode.prompt + "".join(a + s.observation for a, s in zip(episode.actions, episode.steps))
    assert env.context == episode.context


def test_wrong_answer_ends_the_episode_with_the_scorers_reward():
    env = make_env()
    env.reset(TASKS[0])
    result = env.step("<answer>Sweden</answer>")
    assert result.terminated and not result.truncated and result.done
    assert result.reward == 0.0 and result.info.answer == "Sweden"


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_malformed_turn_becomes_an_error_observation_and_counts_as_a_turn(fmt):
    env = make_env(fmt, max_turns=3)
    env.reset(TASKS[0])
    first = env.step("I think the answer is Norway.")
    assert not first.done and first.reward == 0.0
    assert first.info.parse_error.startswith("no action found")
    assert first.info.text == "I think the answer is Norway."
    assert first.info.call is None
    assert first.observation == env.format.render_observation(f"error: {first.info.parse_error}")
    second = env.step("<answer>Norway")  # unclosed
    assert second.info.parse_error.startswith("unclosed <answer>")
    third = env.step("still no action")
    assert third.truncated and not third.terminated and third.reward == 0.0
    assert third.info.parse_error.startswith("no action found")
    assert [s.info.turn for s in env.steps] == [1, 2, 3]


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_turn_limit_truncates_with_reward_zero_without_running_the_tool(fmt):
    calls = []

    def search(query: str) -> str:
        """Search."""
        calls.append(query)
        return "nothing"

    env = ToolEnv({"search": Tool.from_function(search)}, turn_format=fmt, scorer=exact, max_turns=2)
    env.reset(SEARCH_ONLY)
    call = env.format.render_call(ToolCall("search", {"query": "Blue Harbor"}))
    assert not env.step(call).done
    last = env.step(call)
    assert last.truncated and not last.terminated and last.reward == 0.0
    assert last.observation == "" and last.info.call == ToolCall("search", {"query": "Blue Harbor"})
    assert calls == ["Blue Harbor"]


def test_answer_on_the_last_turn_still_counts():
    env = make_env(max_turns=1)
    env.reset(TASKS[0])
    result = env.step("<answer>Norway</answer>")
    assert result.terminated and not result.truncated and result.reward == 1.0


def test_tool_input_error_is_an_observation_and_recorded():
    env = make_env()
    env.reset(TASKS[0])
    result = env.step("<calculator>__import__('os')</calculator>")
    assert not result.done
    assert result.info.tool_error == "input"
    assert result.info.observation.startswith("error: calculator: cannot call '__import__'")
    assert result.info.parse_error is None


def test_tool_outside_the_tasks_tools_is_refused_by_the_parser():
    env = make_env()
    prompt = env.reset(SEARCH_ONLY)
    assert "<calculator>" not in prompt
    result = env.step("<calculator>1 + 1</calculator>")
    assert result.info.parse_error.startswith("<calculator> is not an action")


def test_task_needing_a_tool_the_env_lacks_is_a_clear_error():
    env = ToolEnv(build_tools(["calculator"]), scorer=exact)
    with pytest.raises(ValueError, match=r"needs tools \['search'\] that this env lacks"):
        env.reset(TASKS[0])


def test_tool_crashes_are_recorded_and_scorer_bugs_raise():
    def broken(query: str) -> str:
        """Search."""
        raise RuntimeError("index corrupted")

    env = ToolEnv({"search": Tool.from_function(broken, name="search")}, scorer=exact)
    env.reset(SEARCH_ONLY)
    info = env.step("<search>x</search>").info
    assert info.tool_error == "crash" and info.observation == "error: search: the tool crashed (RuntimeError: index corrupted)"

    for bad in (lambda t, a: 2.0, lambda t, a: float("nan"), lambda t, a: "1"):
        env = make_env()
        env.scorer = bad
        env.reset(TASKS[0])
        with pytest.raises(ValueError, match=r"returns a real number in \[0, 1\]"):
            env.step("<answer>Norway</answer>")


def test_step_outside_an_episode_raises():
    env = make_env()
    with pytest.raises(RuntimeError, match="call reset"):
        env.step("<answer>x</answer>")
    env.reset(TASKS[0])
    env.step("<answer>x</answer>")
    with pytest.raises(RuntimeError, match="episode is over"):
        env.step("<answer>x</answer>")


def test_long_observations_are_cut_with_a_marker():
    def flood(query: str) -> str:
        """Search."""
        return "x" * 100

    env = ToolEnv({"search": Tool.from_function(flood, name="search")}, scorer=exact, max_observation_chars=30)
    env.reset(SEARCH_ONLY)
    result = env.step("<search>anything</search>")
    assert result.info.observation_truncated
    assert result.info.observation == "x" * 30 + "\n[... 70 more characters truncated]"
    assert result.observation == env.format.render_observation(result.info.observation)


def test_step_info_is_json_ready_and_keeps_malformed_text():
    env = make_env("json")
    env.reset(TASKS[0])
    bad = env.step('<tool_call>{"name": "search", "arguments": {"query": 3}}</tool_call> trailing')
    good = env.step(env.format.render_call(ToolCall("search", {"query": "Blue Harbor"})))
    for result in (bad, good):
        data = json.loads(json.dumps(result.info.to_dict()))
        assert data["text"] == result.info.text and data["turn"] == result.info.turn
    assert bad.info.to_dict()["parse_error"] == "search: argument 'query' must be a string, got integer."
    assert bad.info.trailing == " trailing"
    assert good.info.to_dict()["call"] == {"name": "search", "arguments": {"query": "Blue Harbor"}}


def test_env_constructor_validates_its_settings():
    with pytest.raises(ValueError, match="max_turns must be >= 1"):
        make_env(max_turns=0)
    with pytest.raises(ValueError, match="unknown turn format 'xml'"):
        make_env("xml")


def test_prompt_messages_and_stop_strings_come_from_the_format():
    env = make_env("tag")
    assert env.messages(TASKS[0])[1]["content"] == f"Question: {TASKS[0].question}"
    assert env.stop_strings(TASKS[0]) == ("</search>", "</calculator>", "</answer>")
    assert env.reset(TASKS[0]) == env.prompt(TASKS[0]) == env.context


# ---------------------------------------------------------------- branching


def _mixed_actions(fmt: str) -> list[str]:
    """A recorded episode with every kind of turn: tool calls, a malformed turn, a tool error, an answer."""
    format_ = get_format(fmt)
    return [
        format_.render_call(ToolCall("search", {"query": "Night Orchard"}), thought="first hop"),
        "no action here",
        format_.render_call(ToolCall("calculator", {"expression": "1 / 0"})),
        format_.render_call(ToolCall("search", {"query": "Tomas Reyes"})),
        format_.render_call(ToolCall("calculator", {"expression": "2024 - 1970"})),
        format_.render_call(ToolCall("answer", {"answer": "Chile"})),
    ]


def assert_branching_is_exact(env: ToolEnv, task: Task, actions: Sequence[str]) -> list[StepResult]:
    """For every intermediate prefix, replay() then continuing equals the unbroken run."""
    unbroken = check_env(env, task, actions)
    full_context = env.context
    for t in range(len(actions)):
        env.replay(task, actions[:t], seed=0)
        assert list(env.steps) == unbroken[:t]
        [env.step(a) for a in actions[t:]]
        assert env.context == full_context
    return unbroken


def test_check_env_catches_a_spawned_env_that_forgets_a_setting():
    class Forgetful(ToolEnv):
        def spawn(self) -> ToolEnv:
            return ToolEnv(self.tools, turn_format="json", scorer=self.scorer)  # the turn format is lost

    env = Forgetful(build_tools(["search", "calculator"], corpus=CORPUS), scorer=exact)
    with pytest.raises(AssertionError, match="after 0 actions in a spawned env differs"):
        check_env(env, TASKS[0], oracle_actions(make_env(), TASKS[0]))


def test_spawned_envs_run_their_own_episodes():
    env = make_env()
    env.reset(TASKS[0])
    first = env.step(oracle_actions(make_env(), TASKS[0])[0])
    other = env.spawn()
    assert other.task is None and other.done
    other.reset(TASKS[1])
    assert env.task == TASKS[0] and env.steps == (first,)


def test_check_env_catches_an_env_whose_replay_differs():
    class Flaky(ToolEnv):
        calls = 0

        def step(self, action: str) -> StepResult:
            result = super().step(action)
            Flaky.calls += 1
            if Flaky.calls > 4 and not result.done:
                return StepResult(result.observation + "!", result.reward, result.terminated, result.truncated, result.info)
            return result

    env = Flaky(build_tools(["search", "calculator"], corpus=CORPUS), scorer=exact)
    with pytest.raises(AssertionError, match="replaying the same actions gave different steps"):
        check_env(env, TASKS[0], oracle_actions(make_env(), TASKS[0]))


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_replay_then_continue_matches_the_unbroken_run_for_every_prefix(fmt):
    env = make_env(fmt)
    for task in TASKS:
        assert_branching_is_exact(env, task, oracle_actions(env, task))
    unbroken = assert_branching_is_exact(env, TASKS[1], _mixed_actions(fmt))
    assert [s.info.parse_error is not None for s in unbroken] == [False, True, False, False, False, False]
    assert unbroken[2].info.tool_error == "input"
    assert unbroken[-1].reward == 1.0


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_replay_on_a_fresh_env_matches_the_original(fmt):
    actions = _mixed_actions(fmt)
    env = make_env(fmt)
    env.reset(TASKS[1])
    original = [env.step(a) for a in actions]
    other = make_env(fmt)
    other.replay(TASKS[1], actions[:3])
    assert [other.step(a) for a in actions[3:]] == original[3:]


def test_replay_refuses_a_prefix_that_ends_the_episode():
    env = make_env(max_turns=3)
    with pytest.raises(ValueError, match="action 1 of 2 ended the episode \\(answer\\)"):
        env.replay(TASKS[0], ["<answer>x</answer>", "<answer>y</answer>"])
    with pytest.raises(ValueError, match="action 3 of 3 ended the episode \\(turn limit\\)"):
        env.replay(TASKS[0], ["a", "b", "c"])


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_snapshot_continues_exactly_like_replay(fmt):
    actions = _mixed_actions(fmt)
    env = make_env(fmt)
    env.reset(TASKS[1])
    snapshots: list[EnvSnapshot] = []
    unbroken = []
    for action in actions:
        snapshots.append(env.snapshot())
        unbroken.append(env.step(action))
    for t, snapshot in enumerate(snapshots):
        env.restore(snapshot)
        assert [env.step(a) for a in actions[t:]] == unbroken[t:]
    env.restore(env.snapshot())
    assert env.done


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_local_search_and_retrieval_server_give_identical_episodes(fmt):
    local = make_env(fmt)
    with RetrievalServer(CORPUS) as server:
        remote = ToolEnv(build_tools(["search", "calculator"], search_url=server.url), turn_format=fmt, scorer=exact)
        for task in TASKS:
            actions = oracle_actions(local, task)
            local.reset(task)
            remote_prompt = remote.reset(task)
            assert remote_prompt == local.prompt(task)
            assert [remote.step(a) for a in actions] == [local.step(a) for a in actions]
            for seed in range(3):
                agent = RandomAgent.for_corpus(local.format, CORPUS)
                a = run_episode(local, task, agent, seed=seed)
                b = run_episode(remote, task, agent, seed=seed)
                assert a.actions == b.actions and a.steps == b.steps


# ---------------------------------------------------------------- agents


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_oracle_solves_every_toy_task_and_random_agent_rarely_does(fmt):
    env = ToolEnv.for_taskset(TASKSET, turn_format=fmt, scorer=exact)
    oracle = OracleAgent(TASKSET.oracle, env.format)
    assert all(run_episode(env, task, oracle).reward == 1.0 for task in TASKSET.tasks)
    agent = RandomAgent.for_corpus(env.format, TASKSET.corpus)
    rewards = [run_episode(env, task, agent, seed=seed).reward for task in TASKSET.tasks for seed in range(20)]
    assert np.mean(rewards) < 0.1


def test_random_agent_is_reproducible_and_exercises_every_branch():
    env = make_env("tag")
    agent = RandomAgent.for_corpus(env.format, CORPUS, malformed_prob=0.2)
    first = [run_episode(env, TASKS[0], agent, seed=s).actions for s in range(30)]
    assert first == [run_episode(env, TASKS[0], agent, seed=s).actions for s in range(30)]
    infos = [info for s in range(30) for info in run_episode(env, TASKS[0], agent, seed=s).infos]
    names = {info.call.name for info in infos if info.call}
    assert names == {"search", "calculator", "answer"}
    assert any(info.parse_error for info in infos)


def test_oracle_agent_refuses_to_continue_from_a_turn_it_did_not_write():
    env = make_env("tag")
    env.reset(TASKS[0])
    bad = env.step("garbage")
    with pytest.raises(ValueError, match="did not parse"):
        OracleAgent(toy_oracle, env.format).act(TASKS[0], [bad], np.random.default_rng(0))


def test_task_without_tools_is_answer_only():
    env = make_env()
    task = Task("n", "What is 2 + 2?", ("4",), "toy")
    prompt = env.reset(task)
    assert "<search>" not in prompt and "<answer>" in prompt
    episode = run_episode(env, task, RandomAgent(env.format, malformed_prob=0.0), seed=1)
    assert episode.num_turns == 1 and episode.infos[0].call.name == "answer"


def test_calculator_tool_errors_do_not_stop_the_oracle_loop():
    def picky(expression: str) -> str:
        """Only accepts sums."""
        if "+" not in expression:
            raise ToolInputError("only sums")
        return "ok"

    env = ToolEnv({"calculator": Tool.from_function(picky, name="calculator")}, scorer=exact)
    task = Task("c", "Sum?", ("ok",), "toy", tools=("calculator",))
    env.reset(task)
    assert env.step("<calculator>2 * 3</calculator>").info.observation == "error: calculator: only sums"
    assert env.step("<calculator>2 + 3</calculator>").info.observation == "ok"


# ---------------------------------------------------------------- bundled tasksets (acceptance)

BUNDLED = ("multihop", "toolmath")


@pytest.fixture(scope="module", params=BUNDLED)
def bundled(request):
    from trace_rl.agent.tasks import load_taskset

    return {split: load_taskset(request.param, split=split, seed=0) for split in ("train", "test")}


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_oracle_solves_every_bundled_task_through_the_real_tools(bundled, fmt):
    skip_without_sandbox_for(bundled["train"])
    for taskset in bundled.values():
        env = ToolEnv.for_taskset(taskset, turn_format=fmt)
        oracle = OracleAgent(taskset.oracle, env.format)
        # Every task in the tag format; the json format parses the same calls, so a sample suffices there.
        tasks = taskset.tasks if fmt == "tag" else taskset.tasks[:200]
        failures = [e.task.task_id for e in (run_episode(env, t, oracle) for t in tasks) if e.reward != 1.0]
        assert len(taskset.tasks) > 100
        assert failures == [], f"{taskset.name}: the oracle failed {len(failures)} tasks, e.g. {failures[:5]}"


def test_random_agent_almost_never_solves_a_bundled_task(bundled):
    taskset = bundled["train"]
    skip_without_sandbox_for(taskset)
    env = ToolEnv.for_taskset(taskset)
    agent = RandomAgent.for_corpus(env.format, taskset.corpus)
    # toolmath's random agent runs sandboxed python (~0.1 s a call): a smaller sample keeps this quick
    sample = taskset.tasks[: 400 if taskset.name == "multihop" else 40]
    rewards = [run_episode(env, task, agent, seed=i).reward for i, task in enumerate(sample)]
    assert np.mean(rewards) < 0.05


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_branching_is_exact_on_bundled_tasks(bundled, fmt):
    taskset = bundled["test"]
    skip_without_sandbox_for(taskset)
    env = ToolEnv.for_taskset(taskset, turn_format=fmt)
    oracle = OracleAgent(taskset.oracle, env.format)
    for task in taskset.tasks[:4]:
        check_env(env, task, run_episode(env, task, oracle).actions)
    random_agent = RandomAgent.for_corpus(env.format, taskset.corpus)
    episode = run_episode(env, taskset.tasks[0], random_agent, seed=3)
    check_env(env, taskset.tasks[0], episode.actions)


def test_tasks_command_prints_oracle_and_random_success_as_json(capsys):
    from trace_rl.cli import main

    skip_without_sandbox()  # toolmath's python tool
    assert main(["tasks", "multihop", "toolmath", "--num-tasks", "4", "--random-seeds", "1", "--format", "json"]) == 0
    out = capsys.readouterr().out
    assert "Question:" in out and "<tool_call>" in out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["format"] == "json"
    for name in ("multihop", "toolmath"):
        figures = summary["tasksets"][name]
        assert figures["sampled"] == 4 and figures["tasks"] > 1000
        assert figures["oracle_success"] == 1.0 and figures["random_success"] <= 0.25
    assert "multihop" in summary["registered"]


def test_tasks_command_json_flag_prints_only_the_json_line(capsys):
    from trace_rl.cli import main

    assert main(["tasks", "multihop", "--num-tasks", "2", "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["tasksets"]["multihop"]["oracle_success"] == 1.0
