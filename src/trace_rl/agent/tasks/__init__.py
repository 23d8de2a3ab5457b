"""Task sets by name: bundled generators, reasoning-gym datasets, FanOutQA over Wikipedia, files on disk.

    load_taskset("multihop", split="test", num_tasks=200, seed=0)
    load_taskset("toolmath")
    load_taskset("rg:gsm_symbolic", num_tasks=100)          # any reasoning-gym dataset, config as options
    load_taskset("wiki_fanoutqa", level="sub")
    load_taskset("file:data/nq_search/train.parquet")       # verl / Search-R1 rows, HotpotQA, GSM8K
    load_taskset("file:gsm8k_test.jsonl", format="gsm8k")
    load_taskset("file:train.jsonl", split="test", test_share=0.1)   # a seeded held-out share of the rows

Names:
  - `multihop`: synthetic world, 1-4 hop questions answered with the search tool (`tasks/multihop.py`);
  - `toolmath`: 2-5 step arithmetic word problems for the calculator / python tools (`tasks/toolmath.py`);
  - `wiki_fanoutqa`: FanOutQA questions over ~10k Wikipedia lead paragraphs (`tasks/wiki.py`);
  - `rg:<dataset>`: a reasoning-gym dataset (`tasks/reasoning_gym.py`);
  - `file:<path>`: a task file in one of `loaders.FORMATS` (`tasks/loaders.py`);
  - `module:function` or `path/to/file.py:function`: a user's own task set, the function called as
    `function(split=..., num_tasks=..., seed=..., **options)` and returning a `TaskSet` (see
    `tasks/records.py`'s `task_set` for one made from rows) or a list of `Task`s.

Every task set is deterministic in (`name`, `split`, `seed`, options). `split` is 'train' or 'test'
(disjoint questions). A file holds training rows; its test split is a second file (`test_file`), a
seeded share of its questions (`test_share`) or, said explicitly, its training rows (`test_on_train`).
Unknown names raise ValueError with the closest known name.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable
from typing import Any

from trace_rl.agent.tasks import loaders, multihop, toolmath, wiki
from trace_rl.agent.types import Task, TaskSet
from trace_rl.infra.references import is_reference, resolve

TASKSETS: dict[str, Callable[..., TaskSet]] = {
    "multihop": multihop.load,
    "toolmath": toolmath.load,
    "wiki_fanoutqa": wiki.load_fanoutqa,
}
"""Plain task-set names and their loaders (keyword arguments: split, num_tasks, seed, **options)."""

PREFIXES = ("rg:", "file:")
"""Parameterised names: `rg:<reasoning-gym dataset>` and `file:<path>`."""


def available_tasksets() -> list[str]:
    """Every name `load_taskset` accepts, with the parameterised forms written as patterns."""
    return [*TASKSETS, "rg:<dataset>", "file:<path>", "<module>:<function>"]


def check_name(name: str) -> None:
    """ValueError, with the closest known name, unless `name` is a plain task-set name or has a known
    prefix (whether an `rg:` dataset or a `file:` path exists is the loader's to say)."""
    if name in TASKSETS or name.startswith(PREFIXES):
        return
    if is_reference(name):
        if not callable(resolve(name, "task set")):
            raise ValueError(f"task set {name!r} is not a function: it must take (split=, num_tasks=, seed=, **options) and return a TaskSet")
        return
    close = difflib.get_close_matches(name, [*TASKSETS, *PREFIXES], n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"unknown task set {name!r}{hint} (known: {', '.join(available_tasksets())})")


def option_names(name: str) -> list[str]:
    """The options `load_taskset(name, **options)` passes on and its loader knows, found without loading
    anything: the loader's own keyword parameters, `multihop`'s world options, or an `rg:` dataset's
    config fields. `name` must be one `load_taskset` accepts."""
    if name.startswith("rg:"):
        from trace_rl.agent.tasks import reasoning_gym

        return reasoning_gym.option_names(name[len("rg:"):])
    if is_reference(name):
        loader = resolve(name, "task set")
        kinds = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        return sorted({p.name for p in inspect.signature(loader).parameters.values() if p.kind in kinds} - {"split", "num_tasks", "seed"})
    loader = loaders.load_file if name.startswith("file:") else TASKSETS[name]
    names = [p.name for p in inspect.signature(loader).parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    if name == "multihop":
        names += list(multihop.WorldConfig.__dataclass_fields__)
    return sorted(set(names) - {"split", "num_tasks", "seed"})


def load_taskset(
    name: str,
    *,
    split: str = "train",
    num_tasks: int | None = None,
    seed: int = 0,
    **options: Any,
) -> TaskSet:
    """The task set called `name` (see the module docstring); `options` go to its loader.

    `num_tasks` keeps the first tasks of the split (each loader orders its tasks so that a prefix is a
    fair sample); None keeps them all.
    """
    if num_tasks is not None and (not isinstance(num_tasks, int) or num_tasks < 1):
        raise ValueError(f"num_tasks must be a positive int or None, got {num_tasks!r}")
    if name.startswith("rg:"):
        from trace_rl.agent.tasks import reasoning_gym

        return reasoning_gym.load(name[len("rg:"):], split=split, num_tasks=num_tasks, seed=seed, **options)
    if name.startswith("file:"):
        return loaders.load_file(name[len("file:"):], split=split, num_tasks=num_tasks, seed=seed, **options)
    check_name(name)
    if is_reference(name):
        return _user_taskset(name, resolve(name, "task set")(split=split, num_tasks=num_tasks, seed=seed, **options), num_tasks)
    return TASKSETS[name](split=split, num_tasks=num_tasks, seed=seed, **options)


def _user_taskset(name: str, made: object, num_tasks: int | None) -> TaskSet:
    """What a user's task-set function returned, as a TaskSet (a list of Tasks is wrapped)."""
    if isinstance(made, list) and made and all(isinstance(t, Task) for t in made):
        made = TaskSet(name=name, tasks=made)
    if not isinstance(made, TaskSet) or not made.tasks:
        raise ValueError(f"task set {name!r} returned {type(made).__name__}{'' if made else ' (empty)'}: it must return a non-empty TaskSet or list of Task")
    made.tasks = made.tasks[:num_tasks]
    return made


__all__ = ["PREFIXES", "TASKSETS", "available_tasksets", "check_name", "load_taskset", "option_names"]
