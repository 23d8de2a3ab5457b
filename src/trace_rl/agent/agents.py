"""Agents that write turn TEXT without a model, and `run_episode`, the loop that records an episode.

- `OracleAgent` wraps a taskset's scripted `OraclePolicy`: each `ToolCall` it picks is written as turn
  text in the env's format, so the oracle goes through the real parser, tools and scorer. Solving
  every task this way proves the tasks, tools, format and scorer agree; its episodes are also the
  SFT demonstrations.
- `RandomAgent` calls random tools with random words (from the question and the corpus) and gives
  random answers, now and then writing a malformed turn: the floor every policy must beat.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from trace_rl.agent.env import StepInfo, StepResult, ToolEnv
from trace_rl.agent.protocol import ANSWER, ToolSpec, TurnFormat, WorkedExample
from trace_rl.agent.types import OraclePolicy, Passage, Task, ToolCall


class Agent(Protocol):
    """A policy over turn text. `turns` are this episode's steps so far; `rng` is seeded per episode."""

    def act(self, task: Task, turns: Sequence[StepResult], rng: np.random.Generator) -> str: ...


@dataclass
class Episode:
    """One finished episode: the prompt, every turn's text and result, the outcome."""

    task: Task
    prompt: str
    actions: list[str]
    """The turn texts, in order: `env.replay(task, actions[:t])` rebuilds the state after turn t."""
    steps: list[StepResult]
    seed: int
    context: str
    """Prompt + turns + observations, the whole transcript as the policy saw it."""

    @property
    def reward(self) -> float:
        return self.steps[-1].reward if self.steps else 0.0

    @property
    def terminated(self) -> bool:
        return bool(self.steps) and self.steps[-1].terminated

    @property
    def truncated(self) -> bool:
        return bool(self.steps) and self.steps[-1].truncated

    @property
    def num_turns(self) -> int:
        return len(self.steps)

    @property
    def answer(self) -> str | None:
        return self.steps[-1].info.answer if self.steps else None

    @property
    def infos(self) -> list[StepInfo]:
        return [step.info for step in self.steps]


def run_episode(env: ToolEnv, task: Task, agent: Agent, *, seed: int = 0) -> Episode:
    """Reset `env` on `task` and let `agent` act until the episode ends (answer or turn limit)."""
    rng = np.random.default_rng(seed)
    prompt = env.reset(task, seed=seed)
    actions: list[str] = []
    steps: list[StepResult] = []
    while True:
        action = agent.act(task, tuple(steps), rng)
        result = env.step(action)
        actions.append(action)
        steps.append(result)
        if result.done:
            break
    return Episode(task=task, prompt=prompt, actions=actions, steps=steps, seed=seed, context=env.context)


def worked_examples(env: ToolEnv, tasks: Sequence[Task], oracle: OraclePolicy, count: int, *, candidates: int = 32) -> list[WorkedExample]:
    """`count` solved episodes to show before each question (`task.few_shot`): the oracle plays the first
    `candidates` tasks in `env` (without examples of its own; further tasks while fewer than `count` are
    solved, so a few recorded demonstrations anywhere in the split serve), and the shortest episodes that
    earn the full reward are kept, in task order. Short ones cost the fewest prompt tokens, and SmolLM2
    copied the format from a 1-hop episode as well as from a 3-hop one. ValueError when fewer than
    `count` succeed."""
    plain = env.spawn()
    plain.examples = ()
    solved = []
    for index, task in enumerate(tasks):
        if index >= candidates and len(solved) >= count:
            break
        try:
            episode = run_episode(plain, task, OracleAgent(oracle, plain.format))
        except ValueError:  # the oracle wrote a turn the format cannot carry: not an example
            continue
        if episode.terminated and episode.reward >= 1.0:
            text = plain.format.opener + "".join(action + step.observation for action, step in zip(episode.actions, episode.steps))
            solved.append((len(text), index, WorkedExample(task, text)))
    if len(solved) < count:
        raise ValueError(f"the oracle (or the demonstrations) solved {len(solved)} of the {len(tasks)} train tasks, "
                         f"{count} worked example(s) needed")
    return [example for _, _, example in sorted(sorted(solved)[:count], key=lambda item: item[1])]


class OracleAgent:
    """Writes the oracle policy's chosen calls as turns in `turn_format` (thought + action)."""

    def __init__(self, policy: OraclePolicy, turn_format: TurnFormat) -> None:
        self.policy = policy
        self.format = turn_format

    def act(self, task: Task, turns: Sequence[StepResult], rng: np.random.Generator) -> str:
        history = []
        for step in turns:
            if step.info.call is None:
                raise ValueError(f"oracle turn {step.info.turn} of task {task.task_id!r} did not parse: {step.info.parse_error}")
            history.append((step.info.call, step.info.observation))
        call = self.policy(task, tuple(history))
        return self.format.render_call(call, thought=_oracle_thought(call))


def _oracle_thought(call: ToolCall) -> str:
    if call.name == ANSWER:
        return "I have what I need to answer."
    value = next(iter(call.arguments.values()), "")
    first_line = str(value).split("\n", 1)[0]
    return f"I should use {call.name} on: {first_line}"


_WORD = re.compile(r"[A-Za-z][A-Za-z'\-]+|\d+")
_GARBAGE = (
    "I am not sure what to do.",
    "<search>unfinished query",
    "<think>thinking without an action</think>",
    "<tool_call>{not json}</tool_call>",
    "<answer></answer>",
)


class RandomAgent:
    """Random tool calls and random answers; a baseline that should almost never succeed.

    Each turn: with `malformed_prob` a malformed turn, else with `answer_prob` an answer (1–3 random
    words, or a random integer for tasks whose scorer is numeric), else a random available tool with
    random words (search), a random small expression (calculator) or a print of one (python).
    """

    def __init__(
        self,
        turn_format: TurnFormat,
        *,
        corpus_words: Sequence[str] = (),
        answer_prob: float = 0.3,
        malformed_prob: float = 0.1,
        specs: Mapping[str, ToolSpec] | None = None,
    ) -> None:
        self.format = turn_format
        self.corpus_words = tuple(corpus_words)
        self.answer_prob = answer_prob
        self.malformed_prob = malformed_prob
        self.specs = dict(specs or {})
        """Specs of tools beyond the bundled ones (a user's), called with random arguments of their types."""

    @classmethod
    def for_corpus(cls, turn_format: TurnFormat, passages: Sequence[Passage], *, max_words: int = 5000, **kwargs: Any) -> RandomAgent:
        """A random agent whose words come from the question and (up to `max_words` distinct words of) the corpus."""
        words = sorted({w for p in passages for w in _WORD.findall(f"{p.title} {p.text}")})[:max_words]
        return cls(turn_format, corpus_words=words, **kwargs)

    def act(self, task: Task, turns: Sequence[StepResult], rng: np.random.Generator) -> str:
        if rng.random() < self.malformed_prob:
            return str(rng.choice(_GARBAGE))
        words = _WORD.findall(task.question) + list(self.corpus_words)
        if not task.tools or rng.random() < self.answer_prob:
            return self.format.render_call(ToolCall(ANSWER, {"answer": self._answer(task, words, rng)}), thought="Guessing.")
        name = str(rng.choice(list(task.tools)))
        return self.format.render_call(self._call(name, words, rng), thought=f"Trying {name}.")

    def _answer(self, task: Task, words: Sequence[str], rng: np.random.Generator) -> str:
        if task.scorer == "numeric" or not words:
            return str(int(rng.integers(-10, 1000)))
        return " ".join(_pick(words, rng, int(rng.integers(1, 4))))

    def _call(self, name: str, words: Sequence[str], rng: np.random.Generator) -> ToolCall:
        a, b = (int(x) for x in rng.integers(1, 100, size=2))
        op = str(rng.choice(["+", "-", "*", "/", "%"]))
        if name == "search":
            return ToolCall(name, {"query": " ".join(_pick(words, rng, int(rng.integers(1, 4)))) or "anything"})
        if name == "calculator":
            return ToolCall(name, {"expression": f"{a} {op} {b}"})
        if name == "python":
            return ToolCall(name, {"code": f"print({a} {op} {b})"})
        if name in self.specs:
            return ToolCall(name, {p.name: _random_value(p.type, words, rng) for p in self.specs[name].params if p.required or rng.random() < 0.5})
        raise ValueError(f"RandomAgent does not know how to call tool {name!r} (give its spec: RandomAgent(..., specs=))")


def _random_value(kind: str, words: Sequence[str], rng: np.random.Generator) -> Any:
    """A random argument of a tool parameter's JSON type: words for a string, a small number otherwise."""
    if kind == "integer":
        return int(rng.integers(-10, 100))
    if kind == "number":
        return float(np.round(rng.uniform(-10, 100), 2))
    if kind == "boolean":
        return bool(rng.random() < 0.5)
    return " ".join(_pick(words, rng, int(rng.integers(1, 4)))) or "anything"


def _pick(words: Sequence[str], rng: np.random.Generator, n: int) -> list[str]:
    if not words:
        return []
    return [words[int(i)] for i in rng.integers(0, len(words), size=n)]
