"""Task files checked on load, every row, before any work (issue 43, item 2).

Each defect a user found in `trace_rl.agent.tasks.loaders` is either correct behaviour now or a one-line
`TaskFileError` (a ValueError) naming the file, the row (index, JSONL line, id) and the field: null and
list golds, GSM8K golds misread ('#### 3/4' as 3), duplicate ids merged, questions that are not text,
rows that are not objects, huge lines, lazy checking, a file task's test split measured on its training
rows, and `trace-rl tasks` showing a traceback for a bad file. Real small files are written to tmp_path.
"""

from __future__ import annotations

import importlib.util
import json
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

from trace_rl.agent.scoring import score
from trace_rl.agent.tasks import load_taskset, loaders, option_names
from trace_rl.agent.tasks.loaders import (
    MAX_ANSWER_CHARS,
    MAX_FIELD_CHARS,
    MAX_LINE_BYTES,
    MAX_PASSAGE_CHARS,
    TaskFileError,
    TaskFileWarning,
    load_file,
    number_text,
    read_number,
)


def jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def json_file(path: Path, data: Any) -> Path:
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def gsm(question: str = "How many?", answer: str = "so\n#### 72", **extra: Any) -> dict[str, Any]:
    return {"question": question, "answer": answer, **extra}


def hotpot(_id: str = "h0", question: str = "Who?", answer: Any = "Ann", title: str = "Ann") -> dict[str, Any]:
    return {"_id": _id, "question": question, "answer": answer, "type": "bridge", "level": "easy",
            "supporting_facts": [[title, 0]], "context": [[title, [f"{title} is the answer."]]]}


def verl(question: str = "who?", ground_truth: Any = None, **extra: Any) -> dict[str, Any]:
    row = {"data_source": "nq", "prompt": [{"role": "user", "content": f"Question: {question}"}],
           "reward_model": {"style": "rule", "ground_truth": {"target": ["Ann"]} if ground_truth is None else ground_truth},
           "extra_info": {"index": 0, "question": question}}
    return {**row, **extra}


def refused(match: str) -> Any:
    """pytest.raises for a TaskFileError whose message matches `match` (a regex) and is one line."""
    return pytest.raises(TaskFileError, match=match)


def one_line(excinfo: pytest.ExceptionInfo) -> str:
    text = str(excinfo.value)
    assert "\n" not in text, text
    return text


# --------------------------------------------------------------------------------------------------
# 1. gold answers: null/empty refused, lists as aliases, never str() of a container
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("answer", [None, "", "   ", {"text": "Ann"}, True])
def test_a_hotpotqa_answer_that_is_null_empty_or_an_object_is_refused_naming_file_row_id_and_field(tmp_path, answer):
    path = json_file(tmp_path / "dev.json", [hotpot("a1"), hotpot("a2", answer=answer)])
    with refused(r"dev\.json: row 1 \(id 'a2'\), field 'answer': a gold answer must (be|not be empty)") as excinfo:
        load_file(path)
    assert str(excinfo.value).startswith(str(path))
    one_line(excinfo)


def test_a_hotpotqa_list_answer_gives_aliases_each_checked(tmp_path):
    path = json_file(tmp_path / "dev.json", [hotpot("a1", answer=["Ann Lee", "Ann", 1966])])
    (task,) = load_file(path).tasks
    assert task.answers == ("Ann Lee", "Ann", "1966")
    assert score(task, "ann") == 1.0 and score(task, "None") == 0.0
    bad = json_file(tmp_path / "bad.json", [hotpot("a1", answer=["Ann", None])])
    with refused(r"bad\.json: row 0 \(id 'a1'\), field 'answer\[1\]': a gold answer must be a non-empty string or a number, got None"):
        load_file(bad)
    with refused(r"field 'answer': the list of gold answers is empty"):
        load_file(json_file(tmp_path / "empty.json", [hotpot("a1", answer=[])]))


def test_verl_targets_are_aliases_and_a_container_inside_them_is_refused(tmp_path):
    good = jsonl(tmp_path / "nq.jsonl", [verl(ground_truth={"target": ["Charles Darwin", "Darwin", "Darwin"]}, id="q0")])
    (task,) = load_file(good).tasks
    assert task.answers == ("Charles Darwin", "Darwin") and task.scorer == "exact_match"
    bad = jsonl(tmp_path / "nq_bad.jsonl", [verl(ground_truth={"target": ["Darwin", {"a": 1}]}, id="q0")])
    with refused(r"nq_bad\.jsonl: row 0 \(line 1, id 'q0'\), field 'reward_model\.ground_truth\.target\[1\]': .*got dict"):
        load_file(bad)
    null = jsonl(tmp_path / "nq_null.jsonl", [verl(ground_truth={"target": None})])
    with refused(r"field 'reward_model\.ground_truth\.target': missing or null"):
        load_file(null)


# --------------------------------------------------------------------------------------------------
# 2. GSM8K golds read wholly as numbers
# --------------------------------------------------------------------------------------------------


def test_gsm8k_fraction_and_exponent_golds_are_read_exactly_and_scored_as_numbers(tmp_path):
    path = jsonl(tmp_path / "gsm.jsonl", [gsm("a", "... #### 3/4"), gsm("b", "... #### 1e5"), gsm("c", "#### 1/3"),
                                           gsm("d", "#### -1,250.50"), gsm("e", "#### 1.5e-3")])
    quarter, big, third, negative, small = load_file(path).tasks
    assert [t.answers for t in (quarter, big, third, negative, small)] == [("0.75",), ("100000",), ("1/3",), ("-1250.5",), ("0.0015",)]
    assert score(quarter, "3/4") == 1.0 and score(quarter, "0.75") == 1.0 and score(quarter, "3") == 0.0
    assert score(big, "100000") == 1.0 and score(big, "100,000") == 1.0 and score(big, "1") == 0.0
    assert score(third, "1/3") == 1.0 and score(third, "0.3333333") == 1.0 and score(third, "0.33") == 0.0
    assert score(negative, "-1250.5") == 1.0 and score(small, "0.0015") == 1.0


@pytest.mark.parametrize("tail", ["12 apples", "3,5", "1/0", "1e400", "$5", "72\nThe end", "", "#"])
def test_gsm8k_text_after_the_marker_that_is_not_wholly_a_number_is_refused(tmp_path, tail):
    path = jsonl(tmp_path / "gsm.jsonl", [gsm("ok"), gsm("bad", f"work\n#### {tail}", id="g9")])
    with refused(r"gsm\.jsonl: row 1 \(line 2, id 'g9'\), field 'answer': the text after '####' must be wholly a number") as excinfo:
        load_file(path)
    one_line(excinfo)


def test_read_number_and_number_text_round_trip():
    from fractions import Fraction

    assert read_number("1,000") == 1000 and read_number("3/4") == Fraction(3, 4) and read_number("1e5") == 100000
    assert read_number(" -2.50 ") == Fraction(-5, 2) and read_number("5.") == 5 and read_number("−7") == -7
    assert [read_number(t) for t in ("12 km", "1,00", "1/0", "1e301", "", "1_000", "0x10")] == [None] * 7
    assert [number_text(Fraction(n, d)) for n, d in ((3, 4), (1, 3), (-5, 2), (100000, 1), (1, 80))] == ["0.75", "1/3", "-2.5", "100000", "0.0125"]


def test_a_verl_ground_truth_that_is_wholly_a_number_is_scored_numerically(tmp_path):
    rows = [verl("a", ground_truth="1,000"), verl("b", ground_truth="3/4", id="x"), verl("c", ground_truth="72 apples", id="y")]
    thousand, quarter, words = load_file(jsonl(tmp_path / "v.jsonl", rows)).tasks
    assert (thousand.scorer, quarter.scorer, words.scorer) == ("numeric", "numeric", "exact_match")
    assert score(quarter, "0.75") == 1.0 and score(quarter, "3") == 0.0


# --------------------------------------------------------------------------------------------------
# 3. duplicate ids made unique, with one warning
# --------------------------------------------------------------------------------------------------


def test_twenty_rows_with_one_id_become_twenty_tasks_with_one_warning(tmp_path):
    path = jsonl(tmp_path / "gsm.jsonl", [gsm(f"question {i}", f"#### {i}", id=7) for i in range(20)])
    with pytest.warns(TaskFileWarning) as record:
        tasks = load_file(path).tasks
    assert len(record) == 1
    message = str(record[0].message)
    assert "gsm.jsonl" in message and "19 rows repeat" in message and "'gsm8k-7'" in message and "row 1" in message
    ids = [t.task_id for t in tasks]
    assert ids[:3] == ["gsm8k-7", "gsm8k-7#2", "gsm8k-7#3"] and len(set(ids)) == 20
    assert [t.answers[0] for t in tasks] == [str(i) for i in range(20)]  # every row kept, in order


def test_exact_duplicate_rows_and_a_suffix_already_taken_follow_the_same_rule(tmp_path):
    rows = [gsm("same", "#### 1", id="a"), gsm("same", "#### 1", id="a"), gsm("other", "#### 2", id="a#2")]
    with pytest.warns(TaskFileWarning, match="1 row repeats"):
        tasks = load_file(jsonl(tmp_path / "dup.jsonl", rows)).tasks
    assert [t.task_id for t in tasks] == ["gsm8k-a", "gsm8k-a#3", "gsm8k-a#2"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # unique ids: no warning at all
        load_file(jsonl(tmp_path / "fine.jsonl", [gsm("x", id=1), gsm("y", id=2)]))


# --------------------------------------------------------------------------------------------------
# 4. questions and rows of the wrong type
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("question", [5, ["what?"], "", " \n\t", None])
def test_a_question_that_is_not_a_non_empty_string_is_refused_in_every_format(tmp_path, question):
    with refused(r"g\.jsonl: row 0 \(line 1, id '3'\), field 'question': must be a non-empty string"):
        load_file(jsonl(tmp_path / "g.jsonl", [gsm(question, id=3)]))
    with refused(r"h\.json: row 0 \(id 'h0'\), field 'question': must be a non-empty string"):
        load_file(json_file(tmp_path / "h.json", [hotpot(question=question)]))
    if question is not None:  # a verl row without a question falls back to extra_info / prompt
        row = {**verl("q", id="v0"), "question": question}
        with refused(r"v\.jsonl: row 0 \(line 1, id 'v0'\), field 'question': must be a non-empty string"):
            load_file(jsonl(tmp_path / "v.jsonl", [row]))


def test_rows_missing_fields_or_of_the_wrong_type_are_one_line_errors(tmp_path):
    with refused(r"g\.jsonl: row 1 \(line 3\), field 'question': missing") as excinfo:
        load_file(_with_blank_line(tmp_path / "g.jsonl", [gsm(), {"answer": "#### 1"}]), format="gsm8k")
    one_line(excinfo)
    for bad in (["a", "list"], "a string", 7):
        with refused(r"r\.jsonl: row 1 \(line 2\): a row must be a JSON object, got " + type(bad).__name__):
            load_file(jsonl(tmp_path / "r.jsonl", [gsm(), bad]), format="gsm8k")
    with refused(r"v\.jsonl: row 0 \(line 1, id 'v0'\), field 'reward_model': must be an object holding 'ground_truth', got str"):
        load_file(jsonl(tmp_path / "v.jsonl", [verl(id="v0", reward_model="Darwin")]))
    with refused(r"v2\.jsonl: row 0 \(line 1\), field 'extra_info': must be an object, got list"):
        load_file(jsonl(tmp_path / "v2.jsonl", [verl(extra_info=[1])]), format="verl")
    with refused(r"v3\.jsonl: row 0 \(line 1\), field 'prompt\[0\]\.content': must be a non-empty string, got list"):
        load_file(jsonl(tmp_path / "v3.jsonl", [{"prompt": [{"role": "user", "content": [{"type": "text"}]}],
                                                 "reward_model": {"ground_truth": "1"}}]))
    with refused(r"h\.json: row 0 \(id 'h0'\), field 'context\[0\]': must be a \[title, sentences\] pair"):
        load_file(json_file(tmp_path / "h.json", [{**hotpot(), "context": ["just a title"]}]))
    with refused(r"h2\.json: row 0 \(id 'h0'\), field 'supporting_facts\[0\]': must be a \[title, sentence index\] pair"):
        load_file(json_file(tmp_path / "h2.json", [{**hotpot(), "supporting_facts": [["Ann", "zero"]]}]))
    with refused(r"g2\.jsonl: row 0 \(line 1\), field 'id': must be a string or an integer, got dict"):
        load_file(jsonl(tmp_path / "g2.jsonl", [gsm(id={"n": 1})]))
    with refused(r"e\.jsonl: the file holds no rows"):
        load_file(_with_blank_line(tmp_path / "e.jsonl", []), format="gsm8k")
    with refused(r"o\.json: expected a JSON list of rows, got dict"):
        load_file(json_file(tmp_path / "o.json", {"data": []}))


def _with_blank_line(path: Path, rows: list[Any]) -> Path:
    """`rows` as JSONL with a blank line after the first, so row indices and line numbers differ."""
    lines = [json.dumps(row) for row in rows]
    path.write_text("\n\n".join(lines[:1]) + ("\n\n" if lines else "\n") + "".join(line + "\n" for line in lines[1:]))
    return path


# --------------------------------------------------------------------------------------------------
# 5. size limits, checked before parsing
# --------------------------------------------------------------------------------------------------


def test_a_huge_jsonl_line_is_refused_by_its_length_without_being_parsed(tmp_path):
    path = tmp_path / "huge.jsonl"
    with open(path, "w") as handle:
        handle.write(json.dumps(gsm()) + "\n")
        handle.write(json.dumps(gsm("x" * (8 * MAX_LINE_BYTES))) + "\n")  # an 8 MiB question
    start = time.perf_counter()
    with refused(rf"huge\.jsonl:2: line longer than MAX_LINE_BYTES={MAX_LINE_BYTES} bytes"):
        load_file(path)
    assert time.perf_counter() - start < 2.0
    assert MAX_LINE_BYTES == 1 << 20
    edge = tmp_path / "edge.jsonl"  # a line of exactly MAX_LINE_BYTES is read; one byte more is not
    row = json.dumps(gsm("q"))
    edge.write_text(row[:-1] + " " * (MAX_LINE_BYTES - len(row)) + "}\n")
    assert len(edge.read_bytes()) == MAX_LINE_BYTES + 1
    assert [t.question for t in load_file(edge).tasks] == ["q"]
    edge.write_text(row[:-1] + " " * (MAX_LINE_BYTES - len(row) + 1) + "}\n")
    with refused(r"edge\.jsonl:1: line longer than MAX_LINE_BYTES"):
        load_file(edge)


def test_long_questions_golds_and_passages_are_refused_naming_the_limit(tmp_path):
    with refused(rf"g\.jsonl: row 0 \(line 1\), field 'question': is {MAX_FIELD_CHARS + 1:,} characters, over the limit of {MAX_FIELD_CHARS:,}"):
        load_file(jsonl(tmp_path / "g.jsonl", [gsm("x" * (MAX_FIELD_CHARS + 1))]))
    with refused(rf"h\.json: row 0 \(id 'h0'\), field 'answer': a gold answer of {MAX_ANSWER_CHARS + 1:,} characters"):
        load_file(json_file(tmp_path / "h.json", [hotpot(answer="a" * (MAX_ANSWER_CHARS + 1))]))
    record = hotpot()
    record["context"] = [["Ann", ["x" * MAX_PASSAGE_CHARS, "y"]]]
    with refused(r"h2\.json: row 0 \(id 'h0'\), field 'context\[0\]\[1\]': a paragraph of .* over the limit"):
        load_file(json_file(tmp_path / "h2.json", [record]))
    with refused(r"g2\.jsonl: row 0 \(line 1\), field 'answer': the text after '####' must be wholly a number"):
        load_file(jsonl(tmp_path / "g2.jsonl", [gsm(answer="#### 1e-999")]))


def test_the_limits_are_module_constants_with_reasons():
    for name in ("MAX_LINE_BYTES", "MAX_FIELD_CHARS", "MAX_ANSWER_CHARS", "MAX_PASSAGE_CHARS"):
        assert isinstance(getattr(loaders, name), int)
    source = Path(loaders.__file__).read_text()
    assert 'MAX_LINE_BYTES = 1 << 20\n"""' in source and 'MAX_FIELD_CHARS = 20_000\n"""' in source


# --------------------------------------------------------------------------------------------------
# 6. every row checked, whatever num_tasks keeps
# --------------------------------------------------------------------------------------------------


def test_num_tasks_does_not_skip_checking_the_later_rows(tmp_path):
    path = jsonl(tmp_path / "g.jsonl", [gsm("a"), gsm("b"), gsm("c", "#### 3/0")])
    with refused(r"g\.jsonl: row 2 \(line 3\), field 'answer'"):
        load_file(path, num_tasks=1)
    with refused(r"g\.jsonl: row 2 \(line 3\), field 'answer'"):
        load_taskset(f"file:{path}", num_tasks=1)


# --------------------------------------------------------------------------------------------------
# 7. a file task's test split
# --------------------------------------------------------------------------------------------------


def test_a_test_split_without_a_held_out_option_says_how_to_get_one(tmp_path):
    path = jsonl(tmp_path / "train.jsonl", [gsm(f"q{i}", f"#### {i}") for i in range(8)])
    with refused(r"no test split") as excinfo:
        load_taskset(f"file:{path}", split="test")
    text = one_line(excinfo)
    for fix in ("task.options.test_file=PATH", "task.options.test_share=0.1", "task.options.test_on_train=true"):
        assert fix in text
    assert len(load_taskset(f"file:{path}").tasks) == 8  # the train split needs no option


def test_test_file_gives_that_files_rows_and_is_checked_too(tmp_path):
    train = jsonl(tmp_path / "train.jsonl", [gsm(f"q{i}", f"#### {i}") for i in range(4)])
    test = jsonl(tmp_path / "test.jsonl", [gsm("held out", "#### 99")])
    options = {"test_file": str(test)}
    assert [t.question for t in load_taskset(f"file:{train}", **options).tasks] == ["q0", "q1", "q2", "q3"]
    held = load_taskset(f"file:{train}", split="test", **options)
    assert [t.question for t in held.tasks] == ["held out"] and held.meta["held_out"] == "test_file"
    bad_test = jsonl(tmp_path / "bad_test.jsonl", [gsm("x", "#### seven")])
    with refused(r"bad_test\.jsonl: row 0 \(line 1\), field 'answer'"):
        load_taskset(f"file:{train}", split="test", test_file=str(bad_test))


def test_test_share_holds_out_a_seeded_share_of_distinct_questions(tmp_path):
    rows = [gsm(f"q{i}", f"#### {i}", id=i) for i in range(40)] + [gsm("q0", "#### 0", id="again")]  # q0 twice
    path = jsonl(tmp_path / "all.jsonl", rows)
    train = load_taskset(f"file:{path}", test_share=0.25, seed=3)
    test = load_taskset(f"file:{path}", split="test", test_share=0.25, seed=3)
    assert len({t.question for t in test.tasks}) == 10 and len({t.question for t in train.tasks}) == 30
    assert not {t.question for t in train.tasks} & {t.question for t in test.tasks}  # q0's two rows on one side
    assert len(train.tasks) + len(test.tasks) == 41
    assert [t.task_id for t in test.tasks] == [t.task_id for t in load_taskset(f"file:{path}", split="test", test_share=0.25, seed=3).tasks]
    other = load_taskset(f"file:{path}", split="test", test_share=0.25, seed=4)
    assert {t.task_id for t in other.tasks} != {t.task_id for t in test.tasks}
    ids = [t.task_id for t in test.tasks]
    assert ids == sorted(ids, key=lambda i: [t.task_id for t in load_file(path).tasks].index(i))  # file order


def test_test_on_train_is_the_explicit_old_behaviour(tmp_path):
    path = jsonl(tmp_path / "train.jsonl", [gsm(f"q{i}", f"#### {i}") for i in range(3)])
    test = load_taskset(f"file:{path}", split="test", test_on_train=True)
    assert [t.task_id for t in test.tasks] == [t.task_id for t in load_taskset(f"file:{path}").tasks]
    assert test.meta["held_out"] == "test_on_train"


@pytest.mark.parametrize(("options", "match"), [
    ({"test_share": 0}, r"test_share must be a number between 0 and 1"),
    ({"test_share": 1}, r"test_share must be a number between 0 and 1"),
    ({"test_share": 1.5}, r"test_share must be a number between 0 and 1"),
    ({"test_share": True}, r"test_share must be a number between 0 and 1"),
    ({"test_share": "0.1"}, r"test_share must be a number between 0 and 1"),
    ({"test_share": 0.1}, r"test_share=0.1 of 3 distinct questions holds out 0, leaving 3 to train; each side needs at least one"),
    ({"test_share": 0.9}, r"test_share=0.9 of 3 distinct questions holds out 3, leaving 0 to train"),
    ({"test_share": 0.5, "test_file": "x.jsonl"}, r"give one of test_file, test_share and test_on_train, not test_file and test_share"),
    ({"test_on_train": True, "test_share": 0.5}, r"not test_share and test_on_train"),
    ({"test_file": "missing.jsonl"}, r"test_file='missing.jsonl': no such file"),
    ({"test_on_train": "yes"}, r"test_on_train must be true or false"),
])
def test_test_split_option_values_are_checked_on_either_split(tmp_path, monkeypatch, options, match):
    monkeypatch.chdir(tmp_path)
    path = jsonl(tmp_path / "train.jsonl", [gsm(f"q{i}", f"#### {i}") for i in range(3)])
    for split in ("train", "test"):
        with refused(match):
            load_taskset(f"file:{path}", split=split, **options)


def test_the_train_file_as_its_own_test_file_is_refused(tmp_path):
    path = jsonl(tmp_path / "train.jsonl", [gsm()])
    with refused(r"test_file is the train file itself; to evaluate on the training rows set test_on_train=true"):
        load_taskset(f"file:{path}", split="test", test_file=str(path))


def test_the_test_options_are_task_options_and_reach_the_loader_from_a_run_config(tmp_path):
    assert {"test_file", "test_share", "test_on_train"} <= set(option_names("file:x.jsonl"))
    assert "seed" not in option_names("file:x.jsonl")
    from trace_rl.infra.config import ConfigError, TaskConfig
    from trace_rl.run import load_tasks

    path = jsonl(tmp_path / "train.jsonl", [gsm(f"q{i}", f"#### {i}") for i in range(10)])
    with pytest.raises(ConfigError, match=r"\(test split\): .*task\.options\.test_share=0\.1"):
        load_tasks(TaskConfig(name=f"file:{path}"), "test", None)
    task = TaskConfig(name=f"file:{path}", options={"test_share": 0.3}, seed=5)
    train, test = load_tasks(task, "train", None), load_tasks(task, "test", None)
    assert len(test.tasks) == 3 and len(train.tasks) == 7 and test.meta["seed"] == 5


def test_a_hotpotqa_test_file_shares_one_corpus_with_the_train_split(tmp_path):
    train = json_file(tmp_path / "train.json", [hotpot("t0", "Who is Ann?", "Ann", "Ann")])
    test = json_file(tmp_path / "dev.json", [hotpot("d0", "Who is Bob?", "Bob", "Bob")])
    for split in ("train", "test"):
        taskset = load_file(train, split=split, test_file=str(test))
        assert sorted(p.title for p in taskset.corpus) == ["Ann", "Bob"]
    assert [t.task_id for t in load_file(train, split="test", test_file=str(test)).tasks] == ["hotpotqa-d0"]


# --------------------------------------------------------------------------------------------------
# parquet (verl / Search-R1's own format)
# --------------------------------------------------------------------------------------------------


def test_parquet_rows_are_checked_like_jsonl_rows(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    rows = [verl("who?", id="p0"), {**verl("and who?", id="p1"), "reward_model": {"style": "rule", "ground_truth": {"target": []}}}]
    pq.write_table(pa.Table.from_pylist(rows), path)
    with refused(r"train\.parquet: row 1 \(id 'p1'\), field 'reward_model\.ground_truth\.target': the list of gold answers is empty"):
        load_file(path)
    pq.write_table(pa.Table.from_pylist([verl("who?", id="p0"), verl("who?", id="p0")]), path)
    with pytest.warns(TaskFileWarning, match="train.parquet: 1 row repeats"):
        assert [t.task_id for t in load_file(path).tasks] == ["nq-p0", "nq-p0#2"]


# --------------------------------------------------------------------------------------------------
# 8. `trace-rl tasks`: a bad file is one line and exit 2
# --------------------------------------------------------------------------------------------------


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    from trace_rl.cli import main

    code = main(["tasks", *argv, "--json"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_shows_a_malformed_task_file_as_one_line_and_exits_2(tmp_path, capsys):
    path = jsonl(tmp_path / "bad.jsonl", [gsm(), gsm(["not", "text"], id="g1")])
    code, out, err = run_cli(capsys, f"file:{path}")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("trace-rl tasks: ") and "bad.jsonl: row 1 (line 2, id 'g1'), field 'question'" in err


def test_cli_shows_a_broken_json_line_a_missing_test_option_and_an_unknown_name_as_one_line(tmp_path, capsys):
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"question": "q", "answer": "#### 1"}\n{oops\n')
    good = json_file(tmp_path / "dev.json", [hotpot()])
    for argv, needle in (([f"file:{broken}"], "broken.jsonl:2: not valid JSON"),
                         ([f"file:{good}", "--split", "test"], "task.options.test_share=0.1"),
                         (["multihopp"], "did you mean 'multihop'"),
                         ([f"file:{tmp_path / 'missing.jsonl'}"], "no task file at")):
        code, out, err = run_cli(capsys, *argv)
        assert (code, out, err.count("\n")) == (2, "", 1), (argv, err)
        assert needle in err and "Traceback" not in err


def test_cli_shows_a_renamed_id_warning_as_one_line_and_runs(tmp_path, capsys):
    path = json_file(tmp_path / "dev.json", [hotpot("same", "Who is Ann?", "Ann", "Ann"), hotpot("same", "Who is Bob?", "Bob", "Bob")])
    code, out, err = run_cli(capsys, f"file:{path}")
    assert code == 0, err
    assert err.splitlines() == [f"trace-rl tasks: warning: {path}: 1 row repeats a task id already used (first: 'hotpotqa-same' at row 1); "
                                "renamed with a suffix ('hotpotqa-same#2', ...) so that each row is its own task"]
    summary = json.loads(out.splitlines()[-1])
    assert summary["tasksets"][f"file:{path}"]["tasks"] == 2 and summary["tasksets"][f"file:{path}"]["oracle_success"] == 1.0


def test_cli_says_a_missing_pyarrow_in_one_line(tmp_path, capsys):
    if importlib.util.find_spec("pyarrow") is not None:
        pytest.skip("pyarrow is installed")
    path = tmp_path / "train.parquet"
    path.write_bytes(b"PAR1")
    code, out, err = run_cli(capsys, f"file:{path}")
    assert code == 2 and err.count("\n") == 1 and "pip install pyarrow" in err


def test_cli_takes_loader_options_so_a_file_tasks_held_out_split_can_be_shown(tmp_path, capsys):
    path = json_file(tmp_path / "dev.json", [hotpot(f"h{i}", f"Who is person {i}?", f"P{i}", f"P{i}") for i in range(8)])
    code, out, err = run_cli(capsys, f"file:{path}", "--split", "test", "--option", "test_share=0.25")
    assert code == 0, err
    assert json.loads(out.splitlines()[-1])["tasksets"][f"file:{path}"]["tasks"] == 2
    code, out, err = run_cli(capsys, f"file:{path}", "--option", "test_share")
    assert (code, err.count("\n")) == (2, 1) and "--option 'test_share' must look like KEY=VALUE" in err
