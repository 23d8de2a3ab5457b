"""The small types every part of the agent side shares: tasks, tool calls, corpora."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    """One action of the agent: a tool name and its keyword arguments.

    The final answer is the action `ToolCall("answer", {"answer": "..."})`.
    """

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Passage:
    """One searchable document."""

    doc_id: str
    title: str
    text: str


@dataclass(frozen=True)
class Task:
    """One question for the agent, with what is needed to grade it.

    `answers` holds every accepted gold answer (aliases); the first is canonical. `scorer` names a
    function in `trace_rl.agent.scoring.SCORERS`. `tools` lists the tools the agent may call.
    """

    task_id: str
    question: str
    answers: tuple[str, ...]
    source: str
    tools: tuple[str, ...] = ()
    scorer: str = "exact_match"
    corpus: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data (tuples as lists); `from_dict` gives the task back."""
        return {"task_id": self.task_id, "question": self.question, "answers": list(self.answers), "source": self.source,
                "tools": list(self.tools), "scorer": self.scorer, "corpus": self.corpus, "meta": dict(self.meta)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Task:
        """The task `to_dict` wrote (data from elsewhere: unknown keys and wrong types raise ValueError)."""
        if not isinstance(data, dict):
            raise ValueError(f"a task is a JSON object, got {type(data).__name__}")
        unknown = set(data) - {"task_id", "question", "answers", "source", "tools", "scorer", "corpus", "meta"}
        if unknown:
            raise ValueError(f"unknown task keys {sorted(unknown)}")
        strings = {"task_id": data.get("task_id"), "question": data.get("question"), "source": data.get("source"), "scorer": data.get("scorer", "exact_match")}
        lists = {"answers": data.get("answers"), "tools": data.get("tools", [])}
        if not all(isinstance(v, str) for v in strings.values()) or not all(isinstance(v, list) and all(isinstance(x, str) for x in v) for v in lists.values()):
            raise ValueError(f"a task needs strings task_id, question, source, scorer and lists of strings answers, tools; got {data!r}"[:300])
        corpus, meta = data.get("corpus"), data.get("meta", {})
        if (corpus is not None and not isinstance(corpus, str)) or not isinstance(meta, dict):
            raise ValueError("a task's corpus is a string or null and its meta an object")
        return cls(**strings, answers=tuple(lists["answers"]), tools=tuple(lists["tools"]), corpus=corpus, meta=dict(meta))


OraclePolicy = Callable[[Task, Sequence[tuple[ToolCall, str]]], ToolCall]
"""A scripted agent: given the task and the (action, observation) pairs so far, the next action.

Oracles must act on what the tools return (for example read the bridge entity out of a search
result), never on the gold answer alone, so that solving a task proves tools and scorer agree.
"""

Rationale = Callable[[Task, Sequence[tuple[ToolCall, str]]], str]
"""Why the oracle takes its next action, in words a policy can imitate (a demonstration's thought).

Like the oracle, it reads only the task and the tool results so far; "" when there is nothing to say.
"""


@dataclass
class TaskSet:
    """A list of tasks plus what their tools need: the search corpus, a scripted oracle, and any tools of
    the task set's own (`trace_rl.agent.tools.Tool` by name; the env adds the bundled ones it names)."""

    name: str
    tasks: list[Task]
    corpus: list[Passage] = field(default_factory=list)
    oracle: OraclePolicy | None = None
    rationale: Rationale | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    tools: dict[str, Any] = field(default_factory=dict)
