"""Text environments for tool-using agents: the `Env` protocol and `ToolEnv`, its ReAct implementation.

An episode is one task. `reset(task)` returns the prompt; each `step(action_text)` takes one
generated turn (thought + action, as text) and returns what to append to the context next. The
episode ends when the agent answers (`terminated`, reward from the task's scorer) or when it has
used `max_turns` turns without answering (`truncated`, reward 0). A malformed turn is not a crash:
the observation tells the model what was wrong, the turn counts toward the limit, and the raw text
is kept in `StepInfo`.

Branching (TRACE Stage 2 continues rollouts from intermediate prefixes): `snapshot()` captures an
episode's state after any turn and `restore(snapshot)` returns to it without re-running tools, in
this env or in another made by `spawn()`, which is how the collector continues many rollouts from
one prefix at once. `ToolEnv.replay(task, actions)` rebuilds the same state by replaying the turns:
our tools are deterministic and stateless, so replay reproduces the observations exactly.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from trace_rl.agent.protocol import ANSWER, TurnFormat, WorkedExample, get_format
from trace_rl.agent.tools import Tool, ToolErrorKind, ToolSpec, build_tools, run_tool
from trace_rl.agent.types import Task, TaskSet, ToolCall
from trace_rl.infra.config import SandboxConfig

Scorer = Callable[[Task, str], float]
"""`scorer(task, answer) -> reward in [0, 1]`; exceptions propagate (a crashed scorer is not a failed rollout)."""

TRUNCATION_MARKER = "\n[... {n} more characters truncated]"


@dataclass(frozen=True)
class StepInfo:
    """Everything known about one turn. Fields, not a free-form dict (STYLE §4)."""

    turn: int
    """1-based index of this turn in the episode."""
    text: str
    """The turn exactly as the policy wrote it (malformed turns included)."""
    thought: str
    action: str
    """The action as written ("" when none was found)."""
    call: ToolCall | None
    """The parsed action; None when the turn was malformed."""
    parse_error: str | None = None
    tool_error: ToolErrorKind | None = None
    """Why the tool call failed, if it did (the model sees the message as its observation)."""
    observation: str = ""
    """The bare observation (tool output or error message, after truncation), without format tags."""
    observation_truncated: bool = False
    """Whether the observation was cut to `max_observation_chars` (a marker says how much went)."""
    tool_seconds: float = field(default=0.0, compare=False)
    """Wall time of the tool call; not compared, so replayed steps equal the originals."""
    trailing: str = ""
    """Text after the action, ignored."""
    answer: str | None = None
    """The final answer, on the turn that gave one."""

    @property
    def timed_out(self) -> bool:
        return self.tool_error == "timeout"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (for `Node.info` in rollout trees)."""
        data = asdict(self)
        data["call"] = None if self.call is None else {"name": self.call.name, "arguments": dict(self.call.arguments)}
        return data


@dataclass(frozen=True)
class StepResult:
    """What one `step` returns.

    `terminated` (the agent answered) and `truncated` (the turn limit; says nothing about the answer)
    are kept apart, as in Gymnasium; `done` is either.
    """

    observation: str
    """Text to append to the context after the turn (rendered in the format's observation tags);
    "" when the episode is over."""
    reward: float
    """The task's score on the terminal turn; 0.0 otherwise."""
    terminated: bool
    truncated: bool
    info: StepInfo

    @property
    def done(self) -> bool:
        return self.terminated or self.truncated


class Env(Protocol):
    """One task episode at a time; the agent's turns (text) are the actions.

    This is all the rollout collector calls; `check_env` checks an implementation against it.
    """

    max_turns: int

    def messages(self, task: Task) -> list[dict[str, str]]:
        """The task's prompt as chat messages (system + user), for the policy's chat template."""
        ...

    def stop_strings(self) -> tuple[str, ...]:
        """Strings that end a turn for any task of this env (each stays in the turn's text)."""
        ...

    def reset(self, task: Task, *, seed: int | None = None) -> str:
        """Start an episode; returns the prompt (the first observation)."""
        ...

    def step(self, action: str) -> StepResult:
        """Apply one generated turn. Raises RuntimeError outside an episode (before reset, after the end)."""
        ...

    def snapshot(self) -> Any:
        """The episode's whole state, immutable: `restore` returns to it, here or in a `spawn`ed env."""
        ...

    def restore(self, snapshot: Any) -> None:
        """Continue from a state `snapshot` returned (the episode goes on from there)."""
        ...

    def spawn(self) -> Env:
        """A new env with the same tools and settings and no episode, to run a rollout of its own
        (the collector steps many rollouts at once, one env each)."""
        ...


@dataclass(frozen=True)
class EnvSnapshot:
    """The whole state of a `ToolEnv` episode (tools are stateless, so this is enough)."""

    task: Task
    prompt: str
    steps: tuple[StepResult, ...]
    context: str


class ToolEnv:
    """ReAct tool use: a turn format, a tool registry, a scorer, a turn limit.

    Each task's `tools` selects which tools of the registry it may call (empty: it can only answer).
    Observations longer than `max_observation_chars` are cut, with a marker saying how much was cut.
    """

    def __init__(
        self,
        tools: Mapping[str, Tool],
        *,
        turn_format: TurnFormat | str = "tag",
        scorer: Scorer | None = None,
        max_turns: int = 8,
        max_observation_chars: int = 4000,
        examples: Sequence[WorkedExample] = (),
        open_thought: bool = False,
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if max_observation_chars < 1:
            raise ValueError(f"max_observation_chars must be >= 1, got {max_observation_chars}")
        self.tools = dict(tools)
        self.format = (get_format(turn_format) if isinstance(turn_format, str) else turn_format).with_open_thought(open_thought)
        self.scorer = scorer if scorer is not None else default_scorer
        self.max_turns = max_turns
        self.max_observation_chars = max_observation_chars
        self.examples = tuple(examples)
        """Worked examples shown before every question (`task.few_shot`; `agents.worked_examples` makes them)."""
        self._state: EnvSnapshot | None = None
        self._specs: list[ToolSpec] = []
        self._done = True

    @classmethod
    def for_taskset(
        cls,
        taskset: TaskSet,
        *,
        turn_format: TurnFormat | str = "tag",
        scorer: Scorer | None = None,
        max_turns: int = 8,
        max_observation_chars: int = 4000,
        search_url: str | None = None,
        topk: int = 3,
        sandbox: SandboxConfig | None = None,
        open_thought: bool = False,
    ) -> ToolEnv:
        """An env with the tools the taskset's tasks use (its own, `TaskSet.tools`, and the bundled ones);
        search runs over its corpus (or `search_url`), python in `sandbox` (checked now:
        SandboxUnavailable when this machine cannot run it)."""
        names = sorted({name for task in taskset.tasks for name in task.tools} - set(taskset.tools))
        corpus = taskset.corpus if "search" in names and search_url is None else None
        tools = {**build_tools(names, corpus=corpus, search_url=search_url, topk=topk, sandbox=sandbox), **taskset.tools}
        return cls(tools, turn_format=turn_format, scorer=scorer, max_turns=max_turns, max_observation_chars=max_observation_chars,
                   open_thought=open_thought)

    # ---------------------------------------------------------------- what the policy sees

    def tool_specs(self, task: Task) -> list[ToolSpec]:
        """Specs of the tools `task` may call, in the task's order. Raises ValueError if one is missing."""
        missing = [name for name in task.tools if name not in self.tools]
        if missing:
            raise ValueError(f"task {task.task_id!r} needs tools {missing} that this env lacks (has: {sorted(self.tools)})")
        return [self.tools[name].spec for name in task.tools]

    def prompt(self, task: Task) -> str:
        return self.format.render_prompt(task, self.tool_specs(task), self.examples)

    @property
    def prompt_suffix(self) -> str:
        """Text that follows the chat template's generation prompt: the format's turn opener (`<think>`
        when `open_thought`), which `rollout.collector.encode_prompt` appends."""
        return self.format.opener

    def messages(self, task: Task) -> list[dict[str, str]]:
        """The prompt as chat messages (system, the worked examples' exchanges, user), for chat templates."""
        return self.format.messages(task, self.tool_specs(task), self.examples)

    def stop_strings(self, task: Task | None = None) -> tuple[str, ...]:
        """Stop strings of `task`'s tools, or (None) of every tool of this env."""
        specs = self.tool_specs(task) if task is not None else [self.tools[name].spec for name in sorted(self.tools)]
        return self.format.stop_strings(specs)

    def spawn(self) -> ToolEnv:
        """Shares the (stateless) tools; the episode state is per env."""
        env = copy.copy(self)
        env._state, env._specs, env._done = None, [], True
        return env

    # ---------------------------------------------------------------- episode

    def reset(self, task: Task, *, seed: int | None = None) -> str:
        """Start `task`. `seed` is accepted for the `Env` protocol; this env has no randomness of its own."""
        self._specs = self.tool_specs(task)
        prompt = self.format.render_prompt(task, self._specs, self.examples) + self.format.opener
        self._state = EnvSnapshot(task=task, prompt=prompt, steps=(), context=prompt)
        self._done = False
        return prompt

    def step(self, action: str) -> StepResult:
        """Apply one turn. Never raises on what the model wrote, and takes bounded time: parsing is
        total and linear, and every tool bounds its time and output and turns failures, crashes
        included, into the observation (`run_tool`). Only misuse (no episode) and a crashed scorer raise."""
        state = self._state
        if state is None or self._done:
            raise RuntimeError("no episode in progress: call reset() first" if state is None else "the episode is over: call reset()")
        turn = len(state.steps) + 1
        last_turn = turn >= self.max_turns
        parsed = self.format.parse_turn(action, self._specs)
        base = dict(turn=turn, text=action, thought=parsed.thought, action=parsed.action, call=parsed.call, trailing=parsed.trailing)
        if parsed.call is not None and parsed.call.name == ANSWER:
            answer = parsed.call.arguments["answer"]
            reward = self._score(state.task, answer)
            result = StepResult("", reward, True, False, StepInfo(**base, answer=answer))
        elif last_turn:  # out of turns: the tool would run for an observation nobody reads
            result = StepResult("", 0.0, False, True, StepInfo(**base, parse_error=parsed.error))
        elif parsed.call is None:
            text, cut = self._cut(f"error: {parsed.error}")
            info = StepInfo(**base, parse_error=parsed.error, observation=text, observation_truncated=cut)
            result = StepResult(self.format.render_observation(text) + self.format.opener, 0.0, False, False, info)
        else:
            outcome = run_tool(self.tools, parsed.call)
            text, cut = self._cut(outcome.output)
            info = StepInfo(
                **base, tool_error=outcome.error_kind, observation=text, observation_truncated=cut, tool_seconds=outcome.seconds
            )
            result = StepResult(self.format.render_observation(text) + self.format.opener, 0.0, False, False, info)
        self._state = EnvSnapshot(state.task, state.prompt, (*state.steps, result), state.context + action + result.observation)
        self._done = result.done
        return result

    def replay(self, task: Task, actions: Sequence[str], *, seed: int | None = None) -> str:
        """Replay `actions` from a fresh reset; returns the observation after the last one.

        Raises ValueError if one of the actions ends the episode."""
        observation = self.reset(task, seed=seed)
        for index, action in enumerate(actions):
            result = self.step(action)
            if result.done:
                raise ValueError(
                    f"action {index + 1} of {len(actions)} ended the episode ({'answer' if result.terminated else 'turn limit'}); "
                    "a prefix to restore must end before the episode does"
                )
            observation = result.observation
        return observation

    def snapshot(self) -> EnvSnapshot:
        """The current episode state; `restore` returns to it without re-running tools."""
        if self._state is None:
            raise RuntimeError("no episode to snapshot: call reset() first")
        return self._state

    def restore(self, snapshot: EnvSnapshot) -> None:
        self._specs = self.tool_specs(snapshot.task)
        self._state = snapshot
        self._done = bool(snapshot.steps) and snapshot.steps[-1].done

    # ---------------------------------------------------------------- state

    @property
    def task(self) -> Task | None:
        return None if self._state is None else self._state.task

    @property
    def steps(self) -> tuple[StepResult, ...]:
        return () if self._state is None else self._state.steps

    @property
    def context(self) -> str:
        """Prompt + every turn + every observation so far: the text the policy continues."""
        return "" if self._state is None else self._state.context

    @property
    def done(self) -> bool:
        return self._done

    def _score(self, task: Task, answer: str) -> float:
        from trace_rl.agent.scoring import call_reward

        return call_reward(self.scorer, task, answer)

    def _cut(self, text: str) -> tuple[str, bool]:
        if len(text) <= self.max_observation_chars:
            return text, False
        kept = text[: self.max_observation_chars]
        return kept + TRUNCATION_MARKER.format(n=len(text) - len(kept)), True


ENV_METHODS = ("messages", "stop_strings", "reset", "step", "snapshot", "restore", "spawn")
"""The methods of the `Env` protocol, all the collector calls besides `max_turns`."""


def protocol_gaps(env: object) -> list[str]:
    """What `env` lacks of the `Env` protocol's shape (missing methods, a `max_turns` that is not a
    positive int); empty when it has it all. `check_env` checks the behaviour on an episode."""
    gaps = [f"{name}()" for name in ENV_METHODS if not callable(getattr(env, name, None))]
    turns = getattr(env, "max_turns", None)
    if not (isinstance(turns, int) and not isinstance(turns, bool) and turns >= 1):
        gaps.append(f"max_turns (a positive int, not {turns!r})")
    return gaps


def check_env(env: Env, task: Task, actions: Sequence[str], *, seed: int = 0) -> list[StepResult]:
    """The `Env` contract, checked on one recorded episode; raises AssertionError naming the broken rule.

    `actions` must end the episode. Checks: a replay gives identical steps; stepping after the end
    raises RuntimeError; for every intermediate state, `restore(snapshot)` (in this env and in a
    `spawn`ed one) continues exactly as the unbroken run, and a snapshot stays valid after the env
    moves on; `stop_strings` and `messages` answer. Returns the unbroken run's steps.
    """
    assert env.stop_strings() and all(isinstance(s, str) and s for s in env.stop_strings()), "stop_strings() must be non-empty strings"
    assert env.messages(task), "messages(task) must not be empty"
    env.reset(task, seed=seed)
    snapshots = [env.snapshot()]
    unbroken = []
    for action in actions:
        unbroken.append(env.step(action))
        snapshots.append(env.snapshot())
    ends_at_last = bool(unbroken) and unbroken[-1].done and not any(s.done for s in unbroken[:-1])
    assert ends_at_last, "the actions must end the episode exactly at the last one"
    try:
        env.step(actions[-1])
    except RuntimeError:
        pass
    else:
        raise AssertionError("step() after the end of the episode must raise RuntimeError")
    env.reset(task, seed=seed)
    assert [env.step(action) for action in actions] == unbroken, "replaying the same actions gave different steps"
    for t in range(len(actions)):
        for where, other in (("this env", env), ("a spawned env", env.spawn())):
            other.restore(snapshots[t])
            continued = [other.step(action) for action in actions[t:]]
            assert continued == unbroken[t:], f"continuing after restore() of the state after {t} actions in {where} differs"
    return unbroken


def default_scorer(task: Task, answer: str) -> float:
    """Score with the function `task.scorer` names in `trace_rl.agent.scoring.SCORERS`."""
    from trace_rl.agent.scoring import score

    return score(task, answer)


__all__ = ["ENV_METHODS", "Env", "EnvSnapshot", "Scorer", "StepInfo", "StepResult", "ToolEnv", "check_env", "default_scorer", "protocol_gaps"]
