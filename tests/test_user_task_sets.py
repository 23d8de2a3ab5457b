"""A user's task set made with `task_set`: bad arguments are one line, held-out rows stay out of training
(up to case, spacing and Unicode form), and answers are compared in one Unicode form (issue 63, task sets)."""

from __future__ import annotations

import unicodedata

import pytest

import trace_rl
from trace_rl.agent.scoring import exact_match

ROWS = [{"question": f"What is {i} plus {i}?", "answer": str(2 * i)} for i in range(8)]


def add(a: int, b: int) -> str:
    """Add two whole numbers."""
    return str(a + b)


@pytest.mark.parametrize("num_tasks", [-1, 0, 2.5, True, "3"])
def test_a_bad_num_tasks_is_one_line(num_tasks) -> None:
    with pytest.raises(ValueError, match="num_tasks must be a whole number >= 1"):
        trace_rl.task_set(ROWS, num_tasks=num_tasks)
    assert len(trace_rl.task_set(ROWS, num_tasks=3).tasks) == 3 and len(trace_rl.task_set(ROWS).tasks) == 8


@pytest.mark.parametrize("share", [float("nan"), 0.0, 1.0, -0.2, 1.5, "0.25", float("inf")])
def test_a_bad_test_share_is_one_line(share) -> None:
    with pytest.raises(ValueError, match="test_share must be a number between 0 and 1"):
        trace_rl.task_set(ROWS, test_share=share)


def test_tool_names_in_python_say_to_give_the_functions() -> None:
    with pytest.raises(ValueError, match=r"tools=\['calculator', \.\.\.\]: in Python give the tool functions"):
        trace_rl.task_set(ROWS, tools=["calculator"])
    with pytest.raises(ValueError, match="is not a function"):
        trace_rl.task_set(ROWS, tools=[42])
    assert set(trace_rl.task_set(ROWS, tools=[add]).tools) == {"add"}


def test_test_records_that_are_training_rows_are_refused_even_when_written_differently() -> None:
    with pytest.raises(ValueError, match="8 of its 8 test_records are training rows"):
        trace_rl.task_set(ROWS, test_records=ROWS)
    respelled = [{"question": r["question"].upper().replace("?", " ?"), "answer": r["answer"]} for r in ROWS[:2]]
    with pytest.raises(ValueError, match="2 of its 2 test_records are training rows"):
        trace_rl.task_set(ROWS, test_records=respelled, split="test")
    held = [{"question": "What is 100 plus 100?", "answer": "200"}]
    assert [t.question for t in trace_rl.task_set(ROWS, test_records=held, split="test").tasks] == ["What is 100 plus 100?"]


def test_a_share_split_keeps_one_question_on_one_side_whatever_its_spelling() -> None:
    rows = [*ROWS, {"question": "WHAT IS 3 PLUS 3 ?", "answer": "6"}, {"question": unicodedata.normalize("NFD", "Où est le café ?"), "answer": "ici"},
            {"question": unicodedata.normalize("NFC", "où est le café?"), "answer": "ici"}]
    train = {t.question for t in trace_rl.task_set(rows, test_share=0.5).tasks}
    test = {t.question for t in trace_rl.task_set(rows, test_share=0.5, split="test").tasks}
    keys = lambda qs: {"".join(unicodedata.normalize("NFKC", q).casefold().split()) for q in qs}  # noqa: E731
    assert train and test and not keys(train) & keys(test)


def test_answers_are_compared_in_one_unicode_form() -> None:
    assert exact_match(unicodedata.normalize("NFD", "café"), unicodedata.normalize("NFC", "café")) == 1.0
