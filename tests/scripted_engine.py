"""A scripted engine for collector and trainer tests: real token ids, turns chosen by a script."""

import zlib
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

from trace_rl.agent.types import Task
from trace_rl.engine.base import Completion, SamplingParams


class ScriptedEngine:
    """Samples each turn from a fixed menu of turn texts (searches, right and wrong answers).

    Token ids come from the real tokenizer, log-probs are the log of the menu's uniform choice, so
    the collector's bookkeeping can be checked exactly. `menu_for(context)` may pick the menu from
    the decoded context (for instance, offer the right answer of the question being asked).
    """

    accepts_weights = True

    def __init__(self, tokenizer, turns: Sequence[str] = (), *, menu_for: Callable[[str], Sequence[str]] | None = None) -> None:
        self.tokenizer = tokenizer
        self.menu_for = menu_for or (lambda context: turns)
        self.calls: list[tuple[int, int]] = []  # (prompts, n) per call
        self.weight_version = 0

    def update_weights(self, model, *, version: int) -> None:
        self.weight_version = version  # the menu does not depend on the weights

    def generate(self, prompts, params: SamplingParams) -> list[list[Completion]]:
        rng = np.random.default_rng(params.seed)
        self.calls.append((len(prompts), params.n))
        out = []
        for prompt in prompts:
            menu = list(self.menu_for(self.tokenizer.decode(prompt)))
            group = []
            for _ in range(params.n):
                text = menu[int(rng.integers(len(menu)))]
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                group.append(Completion(ids, [float(-np.log(len(menu)))] * len(ids), text, "stop"))
            out.append(group)
        return out


class KeyedScriptedEngine(ScriptedEngine):
    """The scripted engine with draws keyed as the `hf` engine keys them: on (seed, prompt, occurrence
    of that prompt in the call), never on the other prompts of the call."""

    def generate(self, prompts, params: SamplingParams) -> list[list[Completion]]:
        self.calls.append((len(prompts), params.n))
        seen: Counter[tuple[int, ...]] = Counter()
        out = []
        for prompt in prompts:
            key = tuple(prompt)
            menu = list(self.menu_for(self.tokenizer.decode(prompt)))
            group = []
            for _ in range(params.n):
                rng = np.random.default_rng([params.seed, zlib.crc32(repr(key).encode()), seen[key]])
                seen[key] += 1
                text = menu[int(rng.integers(len(menu)))]
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                group.append(Completion(ids, [float(-np.log(len(menu)))] * len(ids), text, "stop"))
            out.append(group)
        return out


def coin_flip_answers(tasks: Sequence[Task]) -> Callable[[str], Sequence[str]]:
    """A menu that searches once or answers, right or wrong with equal chance: mixed groups are common."""

    def menu_for(context: str) -> Sequence[str]:
        task = next(t for t in tasks if t.question in context)
        return (
            f"<think>look</think>\n<search>{task.meta.get('start', task.question)}</search>",
            f"<think>sure</think>\n<answer>{task.answers[0]}</answer>",
            "<think>guess</think>\n<answer>nobody</answer>",
        )

    return menu_for


def make_world():
    """The collector tests' world: 12 multihop train tasks, their env, a small tokenizer, and a menu of
    turns (searches, right answers, a malformed one that becomes an error observation)."""
    from trace_rl.agent.env import ToolEnv
    from trace_rl.agent.tasks import load_taskset
    from trace_rl.models import build_tokenizer

    taskset = load_taskset("multihop", split="train", num_tasks=12, seed=0)
    env = ToolEnv.for_taskset(taskset, max_turns=4)
    tokenizer = build_tokenizer([p.text for p in taskset.corpus[:50]], vocab_size=600)
    answers = [task.answers[0] for task in taskset.tasks[:3]]
    turns = [
        "<think>look</think>\n<search>" + taskset.tasks[0].meta["start"] + "</search>",
        "<think>look again</think>\n<search>river</search>",
        *[f"<think>done</think>\n<answer>{a}</answer>" for a in answers],
        "I am confused",  # malformed: becomes an error observation and uses up a turn
    ]
    return taskset, env, tokenizer, turns


class FixedValues:
    """A predictor with fixed, distinct values per history (so allocations are not all ties)."""

    def predict(self, histories):
        return np.array([zlib.crc32(f"{h.task_id}|{len(h.turns)}|{h.turns[-1].action if h.turns else ''}".encode()) % 997 / 997 for h in histories])
