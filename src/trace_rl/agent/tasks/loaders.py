"""Task files users already have: verl / Search-R1 rows (parquet or JSONL), HotpotQA JSON, GSM8K JSONL.

`load_file(path, format=None)` picks the reader from `format` or, when None, from the file:
  - `verl` (also `search_r1`): rows with `prompt` (chat messages), `reward_model.ground_truth`
    (`{"target": [...]}` in Search-R1, a plain string such as "72" in verl's GSM8K), `data_source`,
    `extra_info`; `.parquet` (needs pyarrow), `.jsonl`, or `.json` holding a list of rows;
  - `hotpotqa`: a JSON list of `{_id, question, answer, supporting_facts, context, type, level}`; the
    `context` paragraphs become the search corpus (one Passage per distinct title);
  - `gsm8k`: JSONL `{question, answer}` with the solution ending in '#### <number>';
  - `records`: rows of `{question (or prompt), answer?, id?, tools?, ...}`, every other field kept in
    `task.meta` for a reward of the user's own (`trace_rl.task_set` makes them in Python).

Every row is checked when the file loads, before any work, and a bad one is refused with one line
(`TaskFileError`, a ValueError) naming the file, the row (its index, its JSONL line, its id) and the
field: a gold answer that is null, empty, a dict or over `MAX_ANSWER_CHARS`; a question that is not a
non-empty string; a GSM8K answer whose text after '####' is not wholly a number; a row that is not an
object; a line, question or passage over the size limits below. Rows that repeat a task id are kept
under a suffixed id (`gsm8k-7#2`) with one `TaskFileWarning`, since per-task state (the predictor's
history) is keyed by task id.

A file holds the training rows. The test split comes from one of three options (also `task.options`):
`test_file` (a second file, read by the same rules), `test_share` (a seeded share of this file's
distinct questions, held out of the train split), or `test_on_train` (evaluate on the training rows,
said explicitly). Asking for split="test" with none of them is refused, since held-out accuracy
measured on the training rows is not held out.
"""

from __future__ import annotations

import json
import math
import re
import unicodedata
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import Any

from trace_rl.agent.tasks.wiki import evidence_oracle
from trace_rl.agent.types import Passage, Task, TaskSet

FORMATS = ("verl", "search_r1", "hotpotqa", "gsm8k", "records")
SPLITS = ("train", "test")

MAX_LINE_BYTES = 1 << 20
"""Longest JSONL line read (1 MiB), checked before it is parsed. A task row is a question and its
answers, a few KB even with a chat prompt; a longer line is a mistake (a corpus or a whole dataset
on one line) that would otherwise be parsed, then tokenized for minutes."""
MAX_FIELD_CHARS = 20_000
"""Longest question (and GSM8K solution) in characters: about 5,000 tokens, more than any QA or math
benchmark's question and beyond what a rollout's context leaves room for."""
MAX_ANSWER_CHARS = 1_000
"""Longest gold answer (each alias) in characters: golds are short spans or numbers; a longer one is
a wrong field (a passage or a solution) that exact match could never reward."""
MAX_ALIASES = 256
"""Most gold aliases a row may list (Search-R1's `target` lists hold a handful)."""
MAX_PASSAGE_CHARS = 100_000
"""Longest HotpotQA context paragraph (its sentences joined): Wikipedia lead paragraphs are a few
thousand characters; search returns whole passages, so a longer one would flood the observation."""
MAX_NAME_CHARS = 1_000
"""Longest id, data source or passage title: they name things in logs and keys, they hold no text."""
MAX_EXPONENT = 300
"""Largest power of ten in a GSM8K gold ('1e5'): beyond it the number is no finite float."""


class TaskFileError(ValueError):
    """A task file, or a file task's options, that cannot be used as they are. The message is one line
    naming the file, the row (index, JSONL line, id) and the field, so a user can fix the file."""


class TaskFileWarning(UserWarning):
    """A task file was made usable by a change the user should know of (duplicate ids renamed)."""


# --------------------------------------------------------------------------------------------------
# Where a row is, for messages
# --------------------------------------------------------------------------------------------------


def _short(value: Any, limit: int = 60) -> str:
    """`repr(value)` cut to `limit` characters: messages stay one short line whatever the row holds."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _keys(mapping: dict[str, Any]) -> str:
    """A row's keys for a message, sorted and cut short (a row may have thousands)."""
    return _short(sorted(map(str, mapping)), 200)


def _describe(value: Any) -> str:
    """'int 5', 'list [1, 2]', 'None': what a wrong field holds, with its type."""
    return "None" if value is None else f"{type(value).__name__} {_short(value)}"


@dataclass(frozen=True)
class RowRef:
    """Where a row is: the file, its 0-based index among the file's rows, its JSONL line, its id."""

    file: str
    index: int
    line: int | None = None
    row_id: Any = None

    def __str__(self) -> str:
        extra = [f"line {self.line}"] if self.line is not None else []
        if self.row_id is not None:
            extra.append(f"id {_short(self.row_id)}")
        return f"{self.file}: row {self.index}" + (f" ({', '.join(extra)})" if extra else "")

    def error(self, field: str, problem: str) -> TaskFileError:
        """The one-line refusal of this row's `field`."""
        return TaskFileError(f"{self}, field {field!r}: {problem}")


def _rows_as_objects(rows: Sequence[Any], file: str, lines: Sequence[int] | None) -> list[RowRef]:
    """A RowRef per row, refusing a row that is not an object (a list or a string in a JSONL line)."""
    refs = []
    for index, row in enumerate(rows):
        ref = RowRef(file, index, lines[index] if lines is not None else None)
        if not isinstance(row, dict):
            raise TaskFileError(f"{ref}: a row must be a JSON object, got {_describe(row)}")
        refs.append(ref)
    return refs


# --------------------------------------------------------------------------------------------------
# Reading rows
# --------------------------------------------------------------------------------------------------


def read_parquet(path: str | Path) -> list[dict[str, Any]]:
    """All rows of a parquet file as dicts (needs pyarrow)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ImportError(f"reading {path} needs pyarrow, which is not installed: pip install pyarrow "
                          "(or convert the file to JSONL)") from exc
    try:
        return pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as exc:
        raise TaskFileError(f"{path}: not a readable parquet file ({' '.join(str(exc).split())[:200]})") from exc


def _jsonl_rows(path: str | Path) -> tuple[list[Any], list[int]]:
    """(rows, their line numbers) of a JSONL file. Each line's length is checked before it is parsed
    (`MAX_LINE_BYTES`): a line is read at most that far, so a huge one costs no parsing and no memory."""
    rows: list[Any] = []
    lines: list[int] = []
    with open(path, "rb") as handle:
        number = 0
        while raw := handle.readline(MAX_LINE_BYTES + 1):
            number += 1
            content = raw.rstrip(b"\r\n")
            if len(content) > MAX_LINE_BYTES:
                raise TaskFileError(f"{path}:{number}: line longer than MAX_LINE_BYTES={MAX_LINE_BYTES} bytes "
                                    "(a row is one task: a question and its answers)")
            if number == 1:
                content = content.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte order mark
            if not content.strip():
                continue
            try:
                rows.append(json.loads(content.decode("utf-8")))
            except UnicodeDecodeError as exc:
                raise TaskFileError(f"{path}:{number}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
            except json.JSONDecodeError as exc:
                raise TaskFileError(f"{path}:{number}: not valid JSON ({exc.msg})") from exc
            except (ValueError, RecursionError) as exc:  # a number of 5,000 digits, nesting 100,000 deep
                raise TaskFileError(f"{path}:{number}: not usable JSON ({type(exc).__name__}: {str(exc)[:100]})") from exc
            lines.append(number)
    return rows, lines


def read_jsonl(path: str | Path) -> list[Any]:
    """One JSON value per non-empty line; a bad or over-long line raises naming the file and line number."""
    return _jsonl_rows(path)[0]


def _read_json(path: Path) -> list[Any]:
    try:
        with open(path, encoding="utf-8-sig") as handle:
            data = json.load(handle)
    except UnicodeDecodeError as exc:
        raise TaskFileError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    except json.JSONDecodeError as exc:
        raise TaskFileError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg}, column {exc.colno})") from exc
    except (ValueError, RecursionError) as exc:
        raise TaskFileError(f"{path}: not usable JSON ({type(exc).__name__}: {str(exc)[:100]})") from exc
    if not isinstance(data, list):
        raise TaskFileError(f"{path}: expected a JSON list of rows, got {type(data).__name__}")
    return data


def _read_rows(path: Path) -> tuple[list[Any], list[int] | None]:
    """(rows, JSONL line numbers or None) of a task file, by its suffix."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return read_parquet(path), None
    if suffix == ".jsonl":
        return _jsonl_rows(path)
    if suffix == ".json":
        return _read_json(path), None
    raise TaskFileError(f"{path}: unknown file type {suffix!r}; expected .parquet, .jsonl or .json")


# --------------------------------------------------------------------------------------------------
# Fields
# --------------------------------------------------------------------------------------------------


def _text(value: Any, ref: RowRef, field: str, limit: int = MAX_FIELD_CHARS) -> str:
    """A non-empty string of at most `limit` characters: `str()` of anything else would make a task
    whose question is '5' or '[...]'."""
    if not isinstance(value, str):
        raise ref.error(field, f"must be a non-empty string, got {_describe(value)}")
    if not value.strip():
        raise ref.error(field, f"must be a non-empty string, got {_short(value)}")
    if len(value) > limit:
        raise ref.error(field, f"is {len(value):,} characters, over the limit of {limit:,}")
    return value


def _gold(value: Any, ref: RowRef, field: str) -> str:
    """One gold answer: a non-empty string or a finite number, as text. Never `str()` of None, a list or a
    dict: the scorer would then reward answering 'None'."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ref.error(field, f"a gold answer must be a non-empty string or a number, got {_describe(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ref.error(field, f"a gold answer must be a finite number, got {value!r}")
    text = value.strip() if isinstance(value, str) else str(value)
    if not text:
        raise ref.error(field, f"a gold answer must not be empty (it would reward an empty answer), got {value!r}")
    if len(text) > MAX_ANSWER_CHARS:
        raise ref.error(field, f"a gold answer of {len(text):,} characters is over the limit of {MAX_ANSWER_CHARS:,}")
    return text


def _aliases(value: Any, ref: RowRef, field: str) -> tuple[str, ...]:
    """Gold answers from one value or a list of aliases (each a `_gold`), in order, without repeats."""
    if isinstance(value, (list, tuple)):
        if not value:
            raise ref.error(field, "the list of gold answers is empty")
        if len(value) > MAX_ALIASES:
            raise ref.error(field, f"{len(value):,} gold answers, over the limit of {MAX_ALIASES}")
        return tuple(dict.fromkeys(_gold(item, ref, f"{field}[{i}]") for i, item in enumerate(value)))
    return (_gold(value, ref, field),)


def _name(value: Any, ref: RowRef, field: str) -> str:
    """An id or a data source: a non-empty string or an int, as text."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ref.error(field, f"must be a string or an integer, got {_describe(value)}")
    text = str(value)
    if not text.strip() or len(text) > MAX_NAME_CHARS:
        raise ref.error(field, f"must be a non-empty string of at most {MAX_NAME_CHARS} characters, got {_short(text)}")
    return text


def _object(row: dict[str, Any], key: str, ref: RowRef) -> dict[str, Any]:
    """`row[key]` as an object; absent or null is {} (parquet fills a column missing from a row with null)."""
    value = row.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ref.error(key, f"must be an object, got {_describe(value)}")
    return value


_DIGITS = r"(?:\d{1,3}(?:,\d{3})+|\d+)"  # commas only as thousands separators: '3,5' is no number
_DECIMAL = re.compile(rf"[-+]?(?:{_DIGITS}(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
_RATIO = re.compile(rf"([-+]?{_DIGITS})\s*/\s*({_DIGITS})")


def read_number(text: str) -> Fraction | None:
    """The number `text` wholly is, exactly, or None: '1,000' -> 1000, '3/4' -> 3/4, '1e5' -> 100000,
    '-2.50' -> -5/2; '12 apples', '3,5', '1/0' and '1e400' (no finite float) are None.

    Stricter than `scoring.parse_number`, which reads the number in a model's answer ('about 12 km'):
    a gold answer must be a number and nothing else, or a misread gold ('#### 3/4' read as 3) goes
    unnoticed and rewards wrong answers.
    """
    text = text.strip().replace("−", "-")
    if _DECIMAL.fullmatch(text):
        mantissa, _, exponent = text.replace(",", "").lower().partition("e")
        power = int(exponent or 0)
        if abs(power) > MAX_EXPONENT:
            return None
        value = Fraction(mantissa) * Fraction(10) ** power
    elif match := _RATIO.fullmatch(text):
        numerator, denominator = (int(g.replace(",", "")) for g in match.groups())
        if denominator == 0:
            return None
        value = Fraction(numerator, denominator)
    else:
        return None
    try:
        return value if math.isfinite(float(value)) else None
    except OverflowError:
        return None


def number_text(value: Fraction) -> str:
    """`value` written so that `scoring.parse_number` reads it back exactly (to float precision): an
    integer ('100000'), a terminating decimal ('0.75', '-2.5'), else a reduced fraction ('1/3')."""
    if value.denominator == 1:
        return str(value.numerator)
    twos = fives = 0
    rest = value.denominator
    while rest % 2 == 0:
        rest //= 2
        twos += 1
    while rest % 5 == 0:
        rest //= 5
        fives += 1
    if rest != 1:
        return f"{value.numerator}/{value.denominator}"
    places = max(twos, fives)
    digits = str(abs(value.numerator) * 10**places // value.denominator).rjust(places + 1, "0")
    sign = "-" if value < 0 else ""
    return f"{sign}{digits[:-places]}.{digits[-places:]}".rstrip("0")


# --------------------------------------------------------------------------------------------------
# verl / Search-R1
# --------------------------------------------------------------------------------------------------


def _verl_question(row: dict[str, Any], extra: dict[str, Any], ref: RowRef) -> str:
    """The bare question: `question`, else `extra_info.question`, else the prompt (a string, or its last
    user message). A present but wrong field is refused, not skipped for the next one."""
    if row.get("question") is not None:
        return _text(row["question"], ref, "question")
    if extra.get("question") is not None:
        return _text(extra["question"], ref, "extra_info.question")
    prompt = row.get("prompt")
    if prompt is None:
        raise ref.error("question", "no question: no 'question', no 'extra_info.question' and no 'prompt'")
    if isinstance(prompt, str):
        return _text(prompt, ref, "prompt")
    if not isinstance(prompt, (list, tuple)):
        raise ref.error("prompt", f"must be a string or a list of chat messages, got {_describe(prompt)}")
    users = []
    for i, message in enumerate(prompt):
        if not isinstance(message, dict):
            raise ref.error(f"prompt[{i}]", f"a chat message must be an object with 'role' and 'content', got {_describe(message)}")
        if message.get("role") == "user":
            users.append(i)
    if not users:
        raise ref.error("prompt", "no question: no 'question' field and no user message in 'prompt'")
    return _text(prompt[users[-1]].get("content"), ref, f"prompt[{users[-1]}].content")


_DEFAULT_TOOLS = {True: ("calculator", "python"), False: ("search",)}  # keyed by "is numeric"


def tasks_from_verl_rows(rows: Sequence[Any], *, source: str = "file", scorer: str | None = None,
                         tools: Sequence[str] | None = None, file: str | None = None,
                         lines: Sequence[int] | None = None) -> list[Task]:
    """Tasks from verl-style rows (Search-R1's NQ/HotpotQA parquet, verl's GSM8K parquet), every row checked.

    The scorer, unless given: 'numeric' when every gold is wholly a number (`read_number`: verl GSM8K's
    "72"), 'exact_match' otherwise (Search-R1's `{"target": [...]}`, scored by EM over aliases as its
    `qa_em`). A `target` list (or a plain list) gives the aliases. The original chat prompt is kept in
    `meta['prompt']`. `file` and `lines` (JSONL line numbers) name rows in errors.
    """
    tasks = []
    for ref, row in zip(_rows_as_objects(rows, file or source, lines), rows):
        extra = _object(row, "extra_info", ref)
        raw_id = row["id"] if row.get("id") is not None else extra.get("index")
        row_id = _name(raw_id, ref, "id" if row.get("id") is not None else "extra_info.index") if raw_id is not None else None
        ref = replace(ref, row_id=row_id)
        if row.get("reward_model") is None:
            raise ref.error("reward_model", f"missing (keys: {_keys(row)}); a verl row needs reward_model.ground_truth")
        reward_model = row["reward_model"]
        if not isinstance(reward_model, dict):
            raise ref.error("reward_model", f"must be an object holding 'ground_truth', got {_describe(reward_model)}")
        if reward_model.get("ground_truth") is None:
            raise ref.error("reward_model.ground_truth", f"missing or null (reward_model keys: {_keys(reward_model)})")
        ground_truth = reward_model["ground_truth"]
        if isinstance(ground_truth, dict):
            if ground_truth.get("target") is None:
                raise ref.error("reward_model.ground_truth.target", f"missing or null (ground_truth keys: {_keys(ground_truth)})")
            golds = _aliases(ground_truth["target"], ref, "reward_model.ground_truth.target")
        else:
            golds = _aliases(ground_truth, ref, "reward_model.ground_truth")
        question = _verl_question(row, extra, ref)
        numeric = not isinstance(ground_truth, dict) and all(read_number(g) is not None for g in golds)
        chosen = scorer or ("numeric" if numeric else "exact_match")
        data_source = _name(row["data_source"], ref, "data_source") if row.get("data_source") is not None else source
        tasks.append(Task(
            task_id=f"{data_source}-{row_id if row_id is not None else ref.index}",
            question=question,
            answers=golds,
            source=data_source,
            tools=tuple(tools) if tools is not None else _DEFAULT_TOOLS[chosen == "numeric"],
            scorer=chosen,
            meta={"prompt": row.get("prompt"), "extra_info": extra, "ability": row.get("ability")},
        ))
    return tasks


# --------------------------------------------------------------------------------------------------
# HotpotQA
# --------------------------------------------------------------------------------------------------


def _hotpot_context(record: dict[str, Any], ref: RowRef) -> list[tuple[str, str]]:
    """(title, paragraph) pairs of `context`: a list of [title, [sentence, ...]]."""
    context = record.get("context")
    if context is None:
        return []
    if not isinstance(context, list):
        raise ref.error("context", f"must be a list of [title, sentences] pairs, got {_describe(context)}")
    pairs = []
    for i, item in enumerate(context):
        field = f"context[{i}]"
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise ref.error(field, f"must be a [title, sentences] pair, got {_describe(item)}")
        title, sentences = item
        title = _text(title, ref, f"{field}[0]", MAX_NAME_CHARS)
        if isinstance(sentences, str):
            sentences = [sentences]
        if not isinstance(sentences, (list, tuple)) or not all(isinstance(s, str) for s in sentences):
            raise ref.error(f"{field}[1]", f"must be a list of sentence strings, got {_describe(sentences)}")
        if sum(len(s) for s in sentences) > MAX_PASSAGE_CHARS:
            raise ref.error(f"{field}[1]", f"a paragraph of {sum(len(s) for s in sentences):,} characters is over the limit of {MAX_PASSAGE_CHARS:,}")
        pairs.append((title, "".join(sentences).strip()))
    return pairs


def _hotpot_supporting(record: dict[str, Any], ref: RowRef) -> list[list[Any]]:
    """`supporting_facts`: [title, sentence index] pairs."""
    facts = record.get("supporting_facts")
    if facts is None:
        return []
    if not isinstance(facts, list):
        raise ref.error("supporting_facts", f"must be a list of [title, sentence index] pairs, got {_describe(facts)}")
    for i, fact in enumerate(facts):
        if (not isinstance(fact, (list, tuple)) or len(fact) != 2 or not isinstance(fact[0], str)
                or isinstance(fact[1], bool) or not isinstance(fact[1], int)):
            raise ref.error(f"supporting_facts[{i}]", f"must be a [title, sentence index] pair, got {_describe(fact)}")
    return [list(fact) for fact in facts]


def tasks_from_hotpotqa(
    records: Sequence[Any], *, source: str = "hotpotqa", file: str | None = None, lines: Sequence[int] | None = None
) -> tuple[list[Task], list[Passage]]:
    """HotpotQA records -> tasks (EM over the answer) and a corpus of their context paragraphs.

    `answer` is a non-empty string or a number; a list is taken as aliases (each a non-empty string or
    a number; HotpotQA itself has one answer, but hand-made files list variants); null, empty or an
    object is refused (a null once became the gold 'None'). Each distinct context title becomes one
    Passage (doc_id 'hotpot:<title>', sentences joined). The supporting-fact titles go to
    `meta['evidence']`, which the evidence oracle searches.
    """
    tasks: list[Task] = []
    corpus: dict[str, Passage] = {}
    for ref, record in zip(_rows_as_objects(records, file or source, lines), records):
        row_id = _name(record["_id"], ref, "_id") if record.get("_id") is not None else None
        ref = replace(ref, row_id=row_id)
        for key in ("question", "answer"):
            if key not in record:
                raise ref.error(key, f"missing (no {key!r} in the record; HotpotQA test files carry no answers)")
        question = _text(record["question"], ref, "question")
        answers = _aliases(record["answer"], ref, "answer")
        for title, text in _hotpot_context(record, ref):
            corpus.setdefault(title, Passage(f"hotpot:{title}", title, text))
        supporting = _hotpot_supporting(record, ref)
        tasks.append(Task(
            task_id=f"hotpotqa-{row_id if row_id is not None else ref.index}",
            question=question,
            answers=answers,
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


_RECORD_FIELDS = ("question", "prompt", "answer", "id", "tools")


def tasks_from_records(rows: Sequence[Any], *, name: str, scorer: str = "exact_match", tools: tuple[str, ...] = (),
                       file: str | None = None, lines: Sequence[int] | None = None) -> list[Task]:
    """Tasks from rows of `{question (or prompt), answer?, id?, tools?, ...}`: `answer` a string, a number
    or a list of accepted answers (optional: a reward of the user's own may need none), `tools` the names
    of `tools` this row may call (default: all), every other field in `task.meta`. Ids default to
    `<name>-<index>`."""
    tasks = []
    for index, (row, ref) in enumerate(zip(rows, _rows_as_objects(rows, file or name, lines))):
        question = _text(row.get("question", row.get("prompt")), ref, "question")
        answers = _aliases(row["answer"], ref, "answer") if row.get("answer") is not None else ()
        task_id = _name(row["id"], ref, "id") if row.get("id") is not None else f"{name}-{index}"
        own = row.get("tools", list(tools))
        if not isinstance(own, (list, tuple)) or any(t not in tools for t in own):
            raise ref.error("tools", f"must list tools of this task set ({', '.join(tools) or 'none'}), got {_short(own)}")
        meta = {k: v for k, v in row.items() if k not in _RECORD_FIELDS}
        tasks.append(Task(task_id, question, answers, source=name, tools=tuple(own), scorer=scorer, meta=meta))
    return tasks


def gsm8k_gold(solution: str) -> str | None:
    """The gold of a GSM8K solution: the text after its last '####', read wholly as a number
    (`read_number`: thousands commas, a/b fractions, exponents) and written by `number_text` ('#### 3/4'
    -> '0.75', '#### 1e5' -> '100000', '#### 1,000' -> '1000'); None when that text is not a number."""
    value = read_number(solution.rsplit("####", 1)[1])
    return None if value is None else number_text(value)


def tasks_from_gsm8k(records: Sequence[Any], *, source: str = "gsm8k", file: str | None = None,
                     lines: Sequence[int] | None = None) -> list[Task]:
    """GSM8K records -> numeric tasks; the gold is `gsm8k_gold` of the solution, every row checked."""
    tasks = []
    for ref, record in zip(_rows_as_objects(records, file or source, lines), records):
        row_id = _name(record["id"], ref, "id") if record.get("id") is not None else None
        ref = replace(ref, row_id=row_id)
        if "question" not in record:
            raise ref.error("question", f"missing (keys: {_keys(record)})")
        question = _text(record["question"], ref, "question")
        solution = record.get("answer")
        if not isinstance(solution, str) or "####" not in solution:
            raise ref.error("answer", f"must be a solution ending in '#### <number>', got {_describe(solution)}")
        _text(solution, ref, "answer")
        gold = gsm8k_gold(solution)
        if gold is None or len(gold) > MAX_ANSWER_CHARS:
            tail = solution.rsplit("####", 1)[1].strip()
            raise ref.error("answer", f"the text after '####' must be wholly a number (such as 72, 1,000, 3/4 or 1e5), got {_short(tail)}")
        tasks.append(Task(
            task_id=f"gsm8k-{row_id if row_id is not None else ref.index}",
            question=question,
            answers=(gold,),
            source=source,
            tools=("calculator", "python"),
            scorer="numeric",
            meta={"solution": solution},
        ))
    return tasks


# --------------------------------------------------------------------------------------------------
# Ids, format, splits
# --------------------------------------------------------------------------------------------------


def unique_ids(tasks: Sequence[Task], file: str) -> list[Task]:
    """`tasks` with every repeated task id made unique by a suffix ('gsm8k-7', 'gsm8k-7#2', 'gsm8k-7#3'),
    said in one `TaskFileWarning`: per-task state (the predictor's history) is keyed by task id, so
    rows sharing one would be merged into one task's record."""
    taken = {task.task_id for task in tasks}
    last: dict[str, int] = {}
    out: list[Task] = []
    renamed: list[tuple[int, str]] = []
    for index, task in enumerate(tasks):
        if task.task_id not in last:
            last[task.task_id] = 1
            out.append(task)
            continue
        number = last[task.task_id]
        while f"{task.task_id}#{number}" in taken or number == 1:
            number += 1
        last[task.task_id] = number
        taken.add(new := f"{task.task_id}#{number}")
        renamed.append((index, task.task_id))
        out.append(replace(task, task_id=new))
    if renamed:
        index, first = renamed[0]
        warnings.warn(TaskFileWarning(
            f"{file}: {len(renamed)} {'row repeats' if len(renamed) == 1 else 'rows repeat'} a task id already used "
            f"(first: {first!r} at row {index}); renamed with a suffix ({first + '#2'!r}, ...) so that each row is "
            "its own task"), stacklevel=4)
    return out


def detect_format(path: str | Path, rows: Sequence[Any] | None = None) -> str:
    """Guess the format from the suffix and the first row; raises when it cannot tell."""
    path = Path(path)
    rows = _read_rows(path)[0] if rows is None else rows
    first = rows[0] if rows else {}
    if not isinstance(first, dict):
        raise TaskFileError(f"{path}: row 0: a row must be a JSON object, got {_describe(first)}")
    if "reward_model" in first:
        return "verl"
    if "context" in first and "supporting_facts" in first:
        return "hotpotqa"
    if isinstance(first.get("answer"), str) and "####" in first["answer"]:
        return "gsm8k"
    if isinstance(first.get("question"), str) or (isinstance(first.get("prompt"), str) and path.suffix.lower() != ".parquet"):
        return "records"
    if path.suffix.lower() == ".parquet":
        return "verl"
    raise TaskFileError(f"{path}: cannot tell the format from the first row (keys: {_keys(first)}); "
                        f"pass format= one of {FORMATS}")


@dataclass
class _FileTasks:
    """One file's checked tasks, its corpus and its format."""

    tasks: list[Task]
    corpus: list[Passage]
    format: str


def _load_one(path: Path, format: str | None, scorer: str | None, tools: Sequence[str] | None) -> _FileTasks:
    """Every row of `path` checked and made a task (ids unique); raises on the first bad row."""
    rows, lines = _read_rows(path)
    if not rows:
        raise TaskFileError(f"{path}: the file holds no rows")
    format = format or detect_format(path, rows)
    corpus: list[Passage] = []
    where = {"source": path.name, "file": str(path), "lines": lines}
    if format in ("verl", "search_r1"):
        tasks = tasks_from_verl_rows(rows, scorer=scorer, tools=tools, **where)
    elif format == "hotpotqa":
        tasks, corpus = tasks_from_hotpotqa(rows, **where)
    elif format == "records":
        tasks = tasks_from_records(rows, name=path.stem, scorer=scorer or "exact_match", tools=tuple(tools or ()), file=str(path), lines=lines)
    else:
        tasks = tasks_from_gsm8k(rows, **where)
    if format not in ("verl", "search_r1") and (scorer is not None or tools is not None):
        tasks = [replace(t, scorer=scorer or t.scorer, tools=tuple(tools) if tools is not None else t.tools)
                 for t in tasks]
    return _FileTasks(unique_ids(tasks, str(path)), corpus, format)


_HOW_TO_TEST = ("set task.options.test_file=PATH (a held-out file in the same format), task.options.test_share=0.1 "
                "(a seeded held-out share of this file's questions) or task.options.test_on_train=true "
                "(evaluate on the training rows)")


def _held_out(path: Path, split: str, test_file: str | Path | None, test_share: float | None,
              test_on_train: bool) -> str | None:
    """Which test-split option is set ('test_file', 'test_share', 'test_on_train' or None), after checking
    their values, whichever split is asked for, so a wrong option is refused when the train split loads."""
    if split not in SPLITS:
        raise TaskFileError(f"file:{path}: split must be one of {SPLITS}, got {split!r}")
    if not isinstance(test_on_train, bool):
        raise TaskFileError(f"file:{path}: test_on_train must be true or false, got {_describe(test_on_train)}")
    given = [name for name, value in (("test_file", test_file), ("test_share", test_share), ("test_on_train", test_on_train or None))
             if value is not None]
    if len(given) > 1:
        raise TaskFileError(f"file:{path}: give one of test_file, test_share and test_on_train, not {' and '.join(given)}")
    if test_share is not None and (isinstance(test_share, bool) or not isinstance(test_share, (int, float))
                                   or not 0 < test_share < 1):
        raise TaskFileError(f"file:{path}: test_share must be a number between 0 and 1 (exclusive), e.g. 0.1, got {_describe(test_share)}")
    if test_file is not None:
        if not isinstance(test_file, (str, Path)) or not str(test_file).strip():
            raise TaskFileError(f"file:{path}: test_file must be the path of a task file, got {_describe(test_file)}")
        if not Path(test_file).is_file():
            raise TaskFileError(f"file:{path}: test_file={str(test_file)!r}: no such file")
        if Path(test_file).resolve() == path.resolve():
            raise TaskFileError(f"file:{path}: test_file is the train file itself; to evaluate on the training rows set test_on_train=true")
    if split == "test" and not given:
        raise TaskFileError(f"file:{path}: a task file holds training rows and has no test split: {_HOW_TO_TEST}")
    return given[0] if given else None


def question_key(question: str) -> str:
    """What makes two questions the same one for a train/test split: Unicode NFKC, case folded, without
    whitespace ("Q1?" and "q1 ?" are one question; so would "a bc" and "ab c" be, which errs on the side
    of keeping a test question out of training)."""
    return "".join(unicodedata.normalize("NFKC", question).casefold().split())


def _share_split(tasks: list[Task], share: float, seed: int, path: Path) -> tuple[list[Task], list[Task]]:
    """(train, test) tasks, test a seeded `share` of the distinct questions (`question_key`); a question
    repeated in the file lands on one side only, so no test question is also a training question. File
    order is kept."""
    import numpy as np

    groups = list(dict.fromkeys(question_key(t.question) for t in tasks))
    count = round(share * len(groups))
    if not 1 <= count <= len(groups) - 1:
        raise TaskFileError(f"file:{path}: test_share={share} of {len(groups)} distinct questions holds out {count}, "
                            f"leaving {len(groups) - count} to train; each side needs at least one question")
    held = {groups[i] for i in np.random.default_rng(seed).permutation(len(groups))[:count]}
    train = [t for t in tasks if question_key(t.question) not in held]
    test = [t for t in tasks if question_key(t.question) in held]
    return train, test


def load_file(
    path: str | Path,
    *,
    format: str | None = None,
    split: str = "train",
    num_tasks: int | None = None,
    scorer: str | None = None,
    tools: Sequence[str] | None = None,
    test_file: str | Path | None = None,
    test_share: float | None = None,
    test_on_train: bool = False,
    seed: int = 0,
) -> TaskSet:
    """A TaskSet from a file on disk (see the module docstring for formats); the first `num_tasks`.

    Every row of each file read is checked before anything is returned (`TaskFileError` on the first
    bad one), whatever `num_tasks` keeps: the file is wrong either way, and checking is cheap.
    `scorer` and `tools` override what the format implies, for every task.

    `path` holds the training rows. split="test" needs one of: `test_file` (that file's rows, read by
    the same rules), `test_share` (a share of `path`'s distinct questions in (0, 1), drawn with `seed`;
    split="train" then gets the rest), or `test_on_train=True` (the training rows, the old behaviour, now
    said explicitly). A HotpotQA corpus serves both splits, so with `test_file` it holds both files'
    paragraphs (the run's env, built on the train split, also answers the test questions).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no task file at {path}")
    if format is not None and format not in FORMATS:
        import difflib

        close = difflib.get_close_matches(str(format), FORMATS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise TaskFileError(f"unknown task file format {format!r}{hint} (known: {', '.join(FORMATS)})")
    held_out = _held_out(path, split, test_file, test_share, test_on_train)
    files = (path, Path(test_file)) if test_file is not None else (path,)
    read = files[-1] if split == "test" else path
    loaded = _load_one(read, format, scorer, tools)
    tasks, corpus = loaded.tasks, loaded.corpus
    if len(files) == 2 and loaded.format == "hotpotqa":  # one corpus for both splits: read the other file too
        other = _load_one(files[0] if read == files[1] else files[1], format, scorer, tools)
        titles = {p.title for p in corpus}
        corpus = corpus + [p for p in other.corpus if p.title not in titles]
    if test_share is not None:
        train, test = _share_split(tasks, float(test_share), seed, path)
        tasks = test if split == "test" else train
    if num_tasks is not None:
        tasks = tasks[:num_tasks]
    oracle = evidence_oracle if loaded.format == "hotpotqa" else None
    meta: dict[str, Any] = {"split": split, "format": loaded.format, "path": str(read), "held_out": held_out}
    if held_out == "test_share":
        meta.update(test_share=test_share, seed=seed)
    elif held_out == "test_file":
        meta["test_file"] = str(test_file)
    own = user_tools(tools or ())
    if own:  # the tasks list the tools by the name the model calls them
        names = {ref: tool.name for ref, tool in own.items()}
        tasks = [replace(t, tools=tuple(names.get(n, n) for n in t.tools)) for t in tasks]
    return TaskSet(name=f"file:{path}", tasks=tasks, corpus=corpus, oracle=oracle, meta=meta, tools={t.name: t for t in own.values()})


def user_tools(names: Sequence[str]) -> dict[str, Any]:
    """The tools that `module:function` references among `names` name, by reference: a `Tool`, or a typed
    function made into one (`Tool.from_function`)."""
    from trace_rl.agent.tools import Tool
    from trace_rl.infra.references import is_reference, resolve

    out = {}
    for name in names:
        if is_reference(name):
            found = resolve(name, "tool")
            out[name] = found if isinstance(found, Tool) else Tool.from_function(found)
    return out
