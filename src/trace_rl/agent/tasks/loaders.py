"""Task files users already have: verl / Search-R1 rows (parquet or JSONL), HotpotQA JSON, GSM8K JSONL.

`load_file(path, format=None)` picks the reader from `format` or, when None, from the file:
  - `verl` (also `search_r1`): rows with `prompt` (chat messages), `reward_model.ground_truth`
    (`{"target": [...]}` in Search-R1, a plain string such as "72" in verl's GSM8K), `data_source`,
    `extra_info`; `.parquet` (needs pyarrow), `.jsonl`, or `.json` holding a list of rows;
  - `hotpotqa`: a JSON list of `{_id, question, answer, supporting_facts, context, type, level}`; the
    `context` paragraphs become the search corpus (one Passage per distinct title);
  - `gsm8k`: JSONL `{question, answer}` with the solution ending in '#### <number>'.

Files are taken as they are: a file is one split, so `split` only labels the TaskSet.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from trace_rl.agent.scoring import extract_final_answer, parse_number
from trace_rl.agent.tasks.wiki import evidence_oracle
from trace_rl.agent.types import Passage, Task, TaskSet

FORMATS = ("verl", "search_r1", "hotpotqa", "gsm8k")


# --------------------------------------------------------------------------------------------------
# Reading rows
# --------------------------------------------------------------------------------------------------


def read_parquet(path: str | Path) -> list[dict[str, Any]]:
    """All rows of a parquet file as dicts (needs pyarrow)."""
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ImportError(f"reading {path} needs pyarrow, which is not installed: pip install pyarrow "
                          "(or convert the file to JSONL)") from exc
    return pq.read_table(path).to_pylist()


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """One JSON object per non-empty line; a bad line raises naming the file and line number."""
    rows = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not valid JSON ({exc.msg})") from exc
    return rows


def _read_rows(path: Path) -> list[dict[str, Any]]:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return read_parquet(path)
    if suffix == ".jsonl":
        return read_jsonl(path)
    if suffix == ".json":
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON list of rows, got {type(data).__name__}")
        return data
    raise ValueError(f"{path}: unknown file type {suffix!r}; expected .parquet, .jsonl or .json")


# --------------------------------------------------------------------------------------------------
# verl / Search-R1
# --------------------------------------------------------------------------------------------------


def _golds(ground_truth: Any, where: str) -> list[str]:
    if isinstance(ground_truth, dict):
        if "target" not in ground_truth:
            raise ValueError(f"{where}: reward_model.ground_truth has no 'target' (keys: {sorted(ground_truth)})")
        ground_truth = ground_truth["target"]
    if isinstance(ground_truth, (str, int, float)) and not isinstance(ground_truth, bool):
        golds = [str(ground_truth)]
    elif isinstance(ground_truth, (list, tuple)):
        golds = [str(g) for g in ground_truth]
    else:
        raise ValueError(f"{where}: unsupported reward_model.ground_truth {ground_truth!r}")
    if not golds:
        raise ValueError(f"{where}: reward_model.ground_truth holds no answers")
    return golds


def _question(row: dict[str, Any], where: str) -> str:
    """The bare question: `question`, else `extra_info.question`, else the last user message."""
    if isinstance(row.get("question"), str):
        return row["question"]
    extra = row.get("extra_info") or {}
    if isinstance(extra.get("question"), str):
        return extra["question"]
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        return prompt
    users = [m.get("content", "") for m in (prompt or []) if isinstance(m, dict) and m.get("role") == "user"]
    if not users:
        raise ValueError(f"{where}: no question: no 'question' field and no user message in 'prompt'")
    return users[-1]


def _is_number(text: str) -> bool:
    return parse_number(text) is not None and extract_final_answer(text) == text.replace(",", "").strip()


_DEFAULT_TOOLS = {True: ("calculator", "python"), False: ("search",)}  # keyed by "is numeric"


def tasks_from_verl_rows(rows: Sequence[dict[str, Any]], *, source: str = "file",
                         scorer: str | None = None, tools: Sequence[str] | None = None) -> list[Task]:
    """Tasks from verl-style rows (Search-R1's NQ/HotpotQA parquet, verl's GSM8K parquet).

    The scorer, unless given: 'numeric' when the ground truth is a plain number string (verl GSM8K),
    'exact_match' otherwise (Search-R1's `{"target": [...]}`, scored by EM over aliases as its `qa_em`).
    The original chat prompt is kept in `meta['prompt']`.
    """
    tasks = []
    for index, row in enumerate(rows):
        where = f"{source} row {index}"
        if "reward_model" not in row:
            raise ValueError(f"{where}: no 'reward_model' field (keys: {sorted(row)})")
        ground_truth = (row["reward_model"] or {}).get("ground_truth")
        golds = _golds(ground_truth, where)
        numeric = not isinstance(ground_truth, dict) and all(_is_number(g) for g in golds)
        chosen = scorer or ("numeric" if numeric else "exact_match")
        extra = row.get("extra_info") or {}
        data_source = str(row.get("data_source", source))
        row_id = row.get("id", extra.get("index", index))
        tasks.append(Task(
            task_id=f"{data_source}-{row_id}",
            question=_question(row, where),
            answers=tuple(golds),
            source=data_source,
            tools=tuple(tools) if tools is not None else _DEFAULT_TOOLS[chosen == "numeric"],
            scorer=chosen,
            meta={"prompt": row.get("prompt"), "extra_info": extra, "ability": row.get("ability")},
        ))
    return tasks


# --------------------------------------------------------------------------------------------------
# HotpotQA
# --------------------------------------------------------------------------------------------------


def tasks_from_hotpotqa(
    records: Sequence[dict[str, Any]], *, source: str = "hotpotqa"
) -> tuple[list[Task], list[Passage]]:
    """HotpotQA records -> tasks (EM over the answer) and a corpus of their context paragraphs.

    Each distinct context title becomes one Passage (doc_id 'hotpot:<title>', sentences joined). The
    supporting-fact titles go to `meta['evidence']`, which the evidence oracle searches.
    """
    tasks: list[Task] = []
    corpus: dict[str, Passage] = {}
    for index, record in enumerate(records):
        where = f"{source} record {index}"
        for key in ("question", "answer"):
            if key not in record:
                raise ValueError(f"{where}: no {key!r} field (HotpotQA test files carry no answers)")
        for title, sentences in record.get("context", []):
            if title not in corpus:
                corpus[title] = Passage(f"hotpot:{title}", title, "".join(sentences).strip())
        supporting = [list(fact) for fact in record.get("supporting_facts", [])]
        tasks.append(Task(
            task_id=f"hotpotqa-{record.get('_id', index)}",
            question=record["question"],
            answers=(str(record["answer"]),),
            source=source,
            tools=("search",),
            scorer="exact_match",
            corpus=source,
            meta={"type": record.get("type"), "level": record.get("level"), "supporting_facts": supporting,
                  "evidence": list(dict.fromkeys(title for title, _ in supporting))},
        ))
    return tasks, list(corpus.values())


# --------------------------------------------------------------------------------------------------
# GSM8K
# --------------------------------------------------------------------------------------------------


def tasks_from_gsm8k(records: Sequence[dict[str, Any]], *, source: str = "gsm8k") -> list[Task]:
    """GSM8K records -> numeric tasks; the gold is the number after '####' (commas dropped)."""
    tasks = []
    for index, record in enumerate(records):
        where = f"{source} record {index}"
        solution = record.get("answer")
        if not isinstance(solution, str) or "####" not in solution:
            raise ValueError(f"{where}: 'answer' must be a solution ending in '#### <number>', got {solution!r}")
        gold = extract_final_answer(solution)
        if gold is None or parse_number(gold) is None:
            raise ValueError(f"{where}: no number after '####' in {solution[-80:]!r}")
        tasks.append(Task(
            task_id=f"gsm8k-{record.get('id', index)}",
            question=record["question"],
            answers=(gold,),
            source=source,
            tools=("calculator", "python"),
            scorer="numeric",
            meta={"solution": solution},
        ))
    return tasks


# --------------------------------------------------------------------------------------------------
# One entry point
# --------------------------------------------------------------------------------------------------


def detect_format(path: str | Path, rows: Sequence[dict[str, Any]] | None = None) -> str:
    """Guess the format from the suffix and the first row; raises when it cannot tell."""
    path = Path(path)
    if path.suffix.lower() == ".parquet":
        return "verl"
    rows = _read_rows(path) if rows is None else rows
    first = rows[0] if rows else {}
    if not isinstance(first, dict):
        raise ValueError(f"{path}: rows must be JSON objects, got {type(first).__name__}")
    if "reward_model" in first:
        return "verl"
    if "context" in first and "supporting_facts" in first:
        return "hotpotqa"
    if isinstance(first.get("answer"), str) and "####" in first["answer"]:
        return "gsm8k"
    raise ValueError(f"{path}: cannot tell the format from the first row (keys: {sorted(first)}); "
                     f"pass format= one of {FORMATS}")


def load_file(
    path: str | Path,
    *,
    format: str | None = None,
    split: str = "train",
    num_tasks: int | None = None,
    scorer: str | None = None,
    tools: Sequence[str] | None = None,
) -> TaskSet:
    """A TaskSet from a file on disk (see the module docstring for formats); the first `num_tasks`.

    `scorer` and `tools` override what the format implies, for every task.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no task file at {path}")
    if format is not None and format not in FORMATS:
        import difflib

        close = difflib.get_close_matches(format, FORMATS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown task file format {format!r}{hint} (known: {', '.join(FORMATS)})")
    rows = _read_rows(path)
    format = format or detect_format(path, rows)
    corpus: list[Passage] = []
    oracle = None
    if format in ("verl", "search_r1"):
        tasks = tasks_from_verl_rows(rows, source=path.name, scorer=scorer, tools=tools)
    elif format == "hotpotqa":
        tasks, corpus = tasks_from_hotpotqa(rows, source=path.name)
        oracle = evidence_oracle
    else:
        tasks = tasks_from_gsm8k(rows, source=path.name)
    if format != "verl" and format != "search_r1" and (scorer is not None or tools is not None):
        tasks = [replace(t, scorer=scorer or t.scorer, tools=tuple(tools) if tools is not None else t.tools)
                 for t in tasks]
    if num_tasks is not None:
        tasks = tasks[:num_tasks]
    return TaskSet(name=f"file:{path}", tasks=tasks, corpus=corpus, oracle=oracle,
                   meta={"split": split, "format": format, "path": str(path)})
