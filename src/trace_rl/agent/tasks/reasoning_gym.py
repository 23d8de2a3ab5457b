"""`rg:<dataset>`: tasks from reasoning-gym's procedural datasets, scored by reasoning-gym itself.

Any dataset registered in reasoning-gym works (`gsm_symbolic`, `basic_arithmetic`, `chain_sum`, ...);
options other than the adapter's own (`test_fraction`, `pool_size`, `tools`) go to the dataset's config,
as `reasoning_gym.create_dataset(name, size=..., seed=..., **config)` takes them.

Each task keeps the dataset item (`meta['rg_entry']`: question, answer, metadata) and the config
(`meta['rg_config']`) so `scoring.score_reasoning_gym` can call the dataset's own `score_answer`. The
entry is stored JSON-able (tuples as lists, fractions as strings) when the dataset's scorer gives the
gold the same score on that copy; otherwise the original objects are kept (`meta['json_safe']` False). Those
scores are not always 0/1: the default `score_answer` gives partial credit when the gold is a substring
of the answer, and `gsm_symbolic` gives 0.01 for a wrong number.

Splits: reasoning-gym items are drawn in index order from one seeded dataset; an item goes to test when
a hash of its question text says so (`test_fraction`), and repeated questions are dropped, so train and
test never share a question. Item i depends only on seed + i, so the first n tasks of a split are the
same whatever `num_tasks` or `pool_size` is asked for.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from typing import Any

from trace_rl.agent.scoring import parse_number
from trace_rl.agent.types import Task, TaskSet, ToolCall

_DEFAULT_POOL = 1000
_MAX_SCAN = 20  # scan at most this many items per task asked for before giving up


def _require_reasoning_gym() -> Any:
    try:
        import reasoning_gym
    except ImportError as exc:  # pragma: no cover - the data extra is installed in the project venv
        raise ImportError("rg:<dataset> tasks need reasoning-gym: pip install 'trace-rl[data]' "
                          "(or pip install reasoning-gym)") from exc
    return reasoning_gym


def dataset_names() -> list[str]:
    """Every dataset reasoning-gym registers (for `rg:<name>` suggestions)."""
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def option_names(dataset: str) -> list[str]:
    """The options `load` takes for `dataset`: its own, and the fields of the dataset's config
    (reasoning-gym's `DATASETS` registry) other than `seed` and `size`, which `load` sets."""
    from reasoning_gym.factory import DATASETS

    _, config_class = DATASETS[dataset]
    fields = [f.name for f in dataclasses.fields(config_class)]  # every registered config is a dataclass
    return sorted({"test_fraction", "pool_size", "tools", *fields} - {"seed", "size"})


def _in_test(question: str, test_fraction: float) -> bool:
    digest = hashlib.sha256(question.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < test_fraction


def _json_safe(value: Any) -> Any:
    """A JSON-able copy: tuples and sets become lists, fractions and other objects their str()."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((_json_safe(v) for v in value), key=repr)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def load(
    dataset: str,
    *,
    split: str = "train",
    num_tasks: int | None = None,
    seed: int = 0,
    test_fraction: float = 0.2,
    pool_size: int = _DEFAULT_POOL,
    tools: Sequence[str] = ("calculator", "python"),
    **config: Any,
) -> TaskSet:
    """`split` of reasoning-gym's `dataset`: all of a `pool_size` pool, or its first `num_tasks`."""
    reasoning_gym = _require_reasoning_gym()
    if split not in ("train", "test"):
        raise ValueError(f"rg:{dataset} split must be 'train' or 'test', got {split!r}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"rg:{dataset} test_fraction must be in (0, 1), got {test_fraction!r}")
    names = dataset_names()
    if dataset not in names:
        import difflib

        close = difflib.get_close_matches(dataset, names, n=3)
        hint = f"; did you mean {', '.join('rg:' + c for c in close)}?" if close else ""
        raise ValueError(f"unknown reasoning-gym dataset {dataset!r}{hint}")
    scan = pool_size if num_tasks is None else max(num_tasks * _MAX_SCAN, 100)
    source = reasoning_gym.create_dataset(dataset, size=scan, seed=seed, **config)

    tasks: list[Task] = []
    seen: set[str] = set()
    for index in range(scan):
        if num_tasks is not None and len(tasks) == num_tasks:
            break
        entry = source[index]
        question = entry["question"]
        if question in seen or _in_test(question, test_fraction) != (split == "test"):
            continue
        seen.add(question)
        safe = _json_safe(entry)
        gold = str(entry["answer"])
        if source.score_answer(gold, safe) != source.score_answer(gold, entry):
            safe = entry  # this dataset's scorer needs the original objects: picklable, not JSON-able
        tasks.append(Task(
            task_id=f"rg-{dataset}-s{seed}-{index:06d}",
            question=question,
            answers=(gold,),
            source=f"rg:{dataset}",
            tools=tuple(tools),
            scorer="reasoning_gym",
            meta={"rg_dataset": dataset, "rg_entry": safe, "rg_config": dict(config), "rg_index": index,
                  "json_safe": safe is not entry},
        ))
    if num_tasks is not None and len(tasks) < num_tasks:
        raise ValueError(f"rg:{dataset} {split} split: found {len(tasks)} distinct tasks in {scan} items, "
                         f"asked for {num_tasks}; the dataset's config may allow too few distinct questions")
    return TaskSet(
        name=f"rg:{dataset}",
        tasks=tasks,
        oracle=expression_oracle if dataset in _EXPRESSION_DATASETS else None,
        meta={"split": split, "seed": seed, "scanned": scan, "config": dict(config)},
    )


# Datasets whose items store a calculator-ready `metadata['expression']`, and how to send it.
# basic_arithmetic evaluates '/' as floor division (`eval(expression.replace('/', '//'))`) although its
# questions write '/': about 1% of its items (those with parentheses) have a floor-divided answer.
_EXPRESSION_DATASETS: dict[str, Callable[[str], str]] = {
    "basic_arithmetic": lambda expression: expression.replace("/", "//"),
    "chain_sum": lambda expression: expression,
}


def expression_oracle(task: Task, history: Sequence[tuple[ToolCall, str]]) -> ToolCall:
    """For basic_arithmetic and chain_sum: send the item's expression to the calculator (with the
    dataset's own division semantics), then answer with the number read from the calculator's reply."""
    replies = [obs for call, obs in history if call.name == "calculator"]
    if not replies:
        rewrite = _EXPRESSION_DATASETS[task.meta["rg_dataset"]]
        return ToolCall("calculator", {"expression": rewrite(task.meta["rg_entry"]["metadata"]["expression"])})
    value = parse_number(replies[0])
    if value is None:
        raise ValueError(f"rg oracle: no number in the calculator's reply {replies[0]!r}")
    answer = str(int(value)) if value == int(value) and abs(value) < 2**53 else repr(value)
    return ToolCall("answer", {"answer": answer})
