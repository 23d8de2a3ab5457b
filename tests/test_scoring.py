"""Scorers against worked examples from the reference implementations (HotpotQA, Search-R1, GSM8K, MATH)."""

from __future__ import annotations

import pytest

from trace_rl.agent.scoring import (
    SCORERS,
    all_in_text,
    answer_metrics,
    em_check,
    exact_match,
    extract_final_answer,
    f1_score,
    normalize_answer,
    numeric_match,
    parse_number,
    score,
)
from trace_rl.agent.types import Task


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The Quick, Brown Fox!", "quick brown fox"),
        ("An apple a day", "apple day"),
        ("theater anthem", "theater anthem"),  # articles only as whole words
        ("  Washington,   D.C. ", "washington dc"),
        ("U.S.A.", "usa"),
        ("the", ""),
        ("Rock 'n' Roll", "rock n roll"),
    ],
)
def test_normalize_answer_matches_hotpotqa(text: str, expected: str) -> None:
    assert normalize_answer(text) == expected


def test_exact_match_ignores_case_articles_and_punctuation() -> None:
    assert exact_match("The Beatles", "beatles") == 1.0
    assert exact_match("Beatles!", "the beatles") == 1.0
    assert exact_match("Beatle", "Beatles") == 0.0
    assert isinstance(exact_match("a", "b"), float)


def test_f1_score_worked_examples() -> None:
    # pred tokens [cat, sat, on, mat], gold [cat, on, mat]: precision 3/4, recall 1 -> 6/7
    assert f1_score("the cat sat on the mat", "cat on mat") == pytest.approx(6 / 7)
    assert f1_score("Barack Obama", "Obama") == pytest.approx(2 / 3)
    assert f1_score("Paris", "London") == 0.0
    # repeated tokens count with multiplicity (Counter intersection)
    assert f1_score("new new york", "new york") == pytest.approx(0.8)
    assert f1_score("", "") == 0.0  # HotpotQA: no common token -> 0, even for two empties
    assert isinstance(f1_score("x", "x"), float)


def test_f1_score_yes_no_special_case() -> None:
    assert f1_score("yes", "yes") == 1.0
    assert f1_score("Yes.", "yes") == 1.0
    assert f1_score("yes it is", "yes") == 0.0  # gold is yes/no and they differ: no partial credit
    assert f1_score("no", "no way") == 0.0  # prediction is yes/no and they differ
    assert f1_score("noanswer", "no answer") == 0.0


def test_em_check_over_aliases_like_search_r1() -> None:
    assert em_check("Paris", ["paris", "Paris, France"]) == 1.0
    assert em_check("paris france", ["Paris, France"]) == 1.0
    assert em_check("Paris", "the Paris") == 1.0  # a single gold string
    assert em_check("Lyon", ["Paris", "Paris, France"]) == 0.0
    assert em_check("x", []) == 0.0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nAltogether she sold 48+24 = <<48+24=72>>72.\n#### 72", "72"),
        ("#### 1,000", "1000"),
        ("so the answer is\n#### -5\n", "-5"),
        ("#### $18.", "18"),
        ("#### 3/4", "3/4"),  # a fraction or an exponent whole, not its first digits (issue 43)
        ("#### 1e5", "1e5"),
        ("#### 3/4 of the cake", "3"),  # not wholly a number: GSM8K's leading number, as before
        ("The answer is \\boxed{42}.", "42"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("first \\boxed{1} then \\boxed{2^{10}}", "2^{10}"),  # last box, nested braces kept
        ("\\boxed{1,000}", "1000"),
        ("$\\boxed 7$", "7"),
        ("\\fbox{x + 1}", "x + 1"),
        ("It was -3 degrees, then 1,250.50 dollars.", "1250.50"),
        ("the result is -7.", "-7"),
        ("pages 10-20", "20"),  # a hyphen after a digit is not a minus sign
        ("no numbers here", None),
        ("\\boxed{unclosed", None),
    ],
)
def test_extract_final_answer(text: str, expected: str | None) -> None:
    assert extract_final_answer(text) == expected


@pytest.mark.parametrize(
    ("prediction", "gold", "expected"),
    [
        ("12.0", "12", 1.0),
        ("12", "12.00", 1.0),
        ("$1,234.50", "1234.5", 1.0),
        ("1,000", "1000", 1.0),
        ("-5", "-5", 1.0),
        ("−5", "-5", 1.0),  # unicode minus
        ("5", "-5", 0.0),
        ("about 12 km", "12", 1.0),
        ("25%", "25", 1.0),
        ("3/4", "0.75", 1.0),
        ("#### 1,000", "1000", 1.0),
        ("\\boxed{42}", "42", 1.0),
        ("no idea", "3", 0.0),
        ("", "3", 0.0),
        ("12.5", "12", 0.0),
    ],
)
def test_numeric_match(prediction: str, gold: str, expected: float) -> None:
    assert numeric_match(prediction, gold) == expected


def test_numeric_match_tolerances_and_bad_gold() -> None:
    assert numeric_match("100.001", "100", rel_tol=1e-3) == 1.0
    assert numeric_match("100.001", "100") == 0.0
    assert numeric_match("3.552713678800501e-15", "0", abs_tol=1e-6) == 1.0
    assert numeric_match("7", 7) == 1.0
    with pytest.raises(ValueError, match="not a number"):
        numeric_match("3", "three")


def test_parse_number() -> None:
    assert parse_number("$1,234.50") == 1234.5
    assert parse_number("\\frac{1}{4}") == 0.25
    assert parse_number("1e-05") == 1e-05
    assert parse_number("n/a") is None


def test_all_in_text_needs_every_string() -> None:
    required = ["Uranus", "Sir William Herschel", "Neptune", "Johann Galle"]
    assert all_in_text("Uranus (Sir William Herschel) and Neptune (Johann Galle)", required) == 1.0
    assert all_in_text("Uranus was found by Sir William Herschel", required) == 0.0
    assert all_in_text("about 9,596,961 km2", ["9596961 km2"]) == 1.0
    assert all_in_text("Uranusx", ["Uranus"]) == 0.0  # word-bounded
    with pytest.raises(ValueError):
        all_in_text("x", [])


def _task(scorer: str, answers: tuple[str, ...] = ("Paris", "Paris, France"), **meta) -> Task:
    return Task(task_id="t1", question="q", answers=answers, source="test", scorer=scorer, meta=meta)


def test_score_dispatches_on_task_scorer() -> None:
    assert score(_task("exact_match"), "paris, france") == 1.0
    assert score(_task("exact_match"), "Lyon") == 0.0
    assert score(_task("f1"), "Paris city") == pytest.approx(2 / 3)
    assert score(_task("numeric", ("1000",)), "#### 1,000") == 1.0
    assert score(_task("numeric", ("0",), abs_tol=1e-6), "1e-9") == 1.0
    assert score(_task("all_in_text", ("x",), required=["x", "y"]), "x and y") == 1.0
    assert set(SCORERS) >= {"exact_match", "numeric", "reasoning_gym", "f1", "all_in_text"}


def test_answer_metrics_reports_em_and_f1_for_text_tasks() -> None:
    metrics = answer_metrics(_task("exact_match"), "Paris city")
    assert metrics == {"score": 0.0, "exact_match": 0.0, "f1": pytest.approx(2 / 3)}
    assert answer_metrics(_task("numeric", ("3",)), "3") == {"score": 1.0}


def test_scorer_errors_are_loud() -> None:
    with pytest.raises(ValueError, match="did you mean 'exact_match'"):
        score(_task("exact_mach"), "Paris")
    with pytest.raises(ValueError, match="no gold answers"):
        score(_task("exact_match", ()), "Paris")
    with pytest.raises(ValueError, match="not a number"):
        score(_task("numeric", ("Paris",)), "3")
    with pytest.raises(KeyError, match="rg_entry"):
        score(_task("reasoning_gym", ("3",), rg_dataset="chain_sum"), "3")
    with pytest.raises(KeyError, match="required"):
        score(_task("all_in_text", ("3",)), "3")
    with pytest.raises(TypeError):
        score(_task("exact_match"), None)  # type: ignore[arg-type]


def test_reasoning_gym_scorer_uses_the_dataset_score_answer() -> None:
    reasoning_gym = pytest.importorskip("reasoning_gym")
    dataset = reasoning_gym.create_dataset("chain_sum", size=3, seed=7)
    entry = dataset[0]
    task = _task("reasoning_gym", (entry["answer"],), rg_dataset="chain_sum", rg_entry=entry, rg_config={})
    assert score(task, entry["answer"]) == 1.0
    assert score(task, str(int(entry["answer"]) + 1)) == 0.0
    # chain_sum's own scorer tolerates commas and trailing decimals
    assert score(task, f"{int(entry['answer'])}.0") == 1.0
