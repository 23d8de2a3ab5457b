"""Answer scoring with the standard semantics, and the scorer registry tasks name in `Task.scorer`.

Normalisation, exact match and F1 follow HotpotQA's official `hotpot_evaluate_v1.py` (itself SQuAD v1.1
plus a yes/no/noanswer rule for F1); `em_check` follows Search-R1's `qa_em.py` (EM against a list of gold
aliases); `extract_final_answer` follows GSM8K's '#### 42' convention, then MATH's last `\\boxed{...}`
(balanced braces), then the last number in the text.

Every scorer returns a float in [0, 1]. A wrong or unparseable *prediction* scores 0.0; anything wrong
with the *task* (no gold answers, a gold answer that is not a number, an unknown scorer, a reasoning-gym
task without its entry) raises, so a broken scorer never passes for a failed rollout.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import json
import math
import numbers
import re
import string
import unicodedata
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from trace_rl.agent.types import Task
from trace_rl.infra.config import ConfigError
from trace_rl.infra.references import is_reference, resolve

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_YES_NO = ("yes", "no", "noanswer")

# A number as people write it: optional sign, thousands separators, decimals, exponent.
# The sign only counts when it does not follow a word character ("10-20" is two numbers, not 10 and -20).
_NUMBER = re.compile(
    r"(?:(?<![\w.])[-−])?(?<![\d.])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?(?![\d])"
)
_GSM8K_NUMBER = re.compile(r"^\s*\$?\s*([-−]?[0-9.,]*[0-9])")
_FRACTION = re.compile(  # LaTeX \frac{a}{b} (also \dfrac, \tfrac) or a plain a/b
    r"^\\[dt]?frac\{\s*([-−]?[\d.]+)\s*\}\{\s*([-−]?[\d.]+)\s*\}$|^([-−]?[\d.]+)\s*/\s*([-−]?[\d.]+)$"
)


# --------------------------------------------------------------------------------------------------
# HotpotQA / SQuAD: normalisation, exact match, F1
# --------------------------------------------------------------------------------------------------


def normalize_answer(s: str) -> str:
    """Unicode NFC, lower-case, drop ASCII punctuation, drop the articles a/an/the, collapse whitespace
    (HotpotQA's, after NFC).

    >>> normalize_answer("The  Eiffel Tower!")
    'eiffel tower'
    """
    text = unicodedata.normalize("NFC", s).lower()  # "café" typed as e + combining accent is "café"
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match(prediction: str, gold: str) -> float:
    """1.0 when the normalised strings are equal, else 0.0 (HotpotQA `exact_match_score`)."""
    return float(normalize_answer(prediction) == normalize_answer(gold))


def f1_score(prediction: str, gold: str) -> float:
    """Token-level F1 of the normalised strings (HotpotQA `f1_score`, the F1 of its returned triple).

    HotpotQA's special case: when either side normalises to "yes", "no" or "noanswer" and the two differ,
    F1 is 0 (partial overlap with a yes/no answer earns nothing). Two empty strings score 0, as there.
    """
    pred_norm, gold_norm = normalize_answer(prediction), normalize_answer(gold)
    if (pred_norm in _YES_NO or gold_norm in _YES_NO) and pred_norm != gold_norm:
        return 0.0
    pred_tokens, gold_tokens = pred_norm.split(), gold_norm.split()
    num_same = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(pred_tokens)
    recall = num_same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def em_check(prediction: str, golds: str | Sequence[str]) -> float:
    """1.0 when the prediction exactly matches any gold alias after normalisation (Search-R1 `em_check`)."""
    if isinstance(golds, str):
        golds = [golds]
    pred_norm = normalize_answer(prediction)
    return float(any(normalize_answer(gold) == pred_norm for gold in golds))


# --------------------------------------------------------------------------------------------------
# Final-answer extraction and numbers
# --------------------------------------------------------------------------------------------------


def _strip_thousands(number: str) -> str:
    return number.replace(",", "").replace("−", "-")


def _last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` (braces balanced), or of `\\boxed 42`."""
    idx, command = max((text.rfind(cmd), cmd) for cmd in ("\\boxed", "\\fbox"))
    if idx < 0:
        return None
    rest = text[idx + len(command) :]
    if rest.startswith(" "):  # MATH's "\boxed 42" form: up to the closing '$' or the end
        return rest.strip().split("$")[0].strip() or None
    if not rest.startswith("{"):
        return None
    depth = 0
    for pos, ch in enumerate(rest):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return rest[1:pos].strip()
    return None  # unbalanced: no boxed answer


def extract_final_answer(text: str) -> str | None:
    """The final answer in a model's or a dataset's solution text, or None when there is none.

    In order: GSM8K's '#### 42' (the number after the last '####', commas dropped: '#### 1,000' -> '1000';
    a fraction or an exponent whole: '#### 3/4' -> '3/4', '#### 1e5' -> '1e5');
    the last `\\boxed{...}` with nested braces kept (`\\boxed{\\frac{1}{2}}` -> '\\frac{1}{2}'); the last
    number in the text (commas dropped, sign kept: 'it costs -1,250.5 now' -> '-1250.5').
    """
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip().split("\n", 1)[0]
        whole = tail.strip("$ ")
        if _FRACTION.match(whole) or _NUMBER.fullmatch(whole):  # '3/4' and '1e5' whole, not their first digits
            return _strip_thousands(whole)
        match = _GSM8K_NUMBER.match(tail)
        if match:
            return _strip_thousands(match.group(1)).rstrip(".")
        if tail:
            return tail
    boxed = _last_boxed(text)
    if boxed is not None:
        if _NUMBER.fullmatch(boxed):
            return _strip_thousands(boxed)
        return boxed
    numbers = _NUMBER.findall(text)
    if numbers:
        return _strip_thousands(numbers[-1])
    return None


def parse_number(text: str) -> float | None:
    """The number a short answer states, or None: '$1,234.50' -> 1234.5, '12 km' -> 12.0, '3/4' -> 0.75.

    Commas between digits, currency signs, '%' and units are ignored; when several numbers appear the last
    one counts (as in GSM8K's last-number fallback); LaTeX `\\frac{a}{b}` and 'a/b' are fractions.
    """
    text = text.strip().replace("\\$", "$").replace("−", "-")
    fraction = _FRACTION.match(text.strip("$ "))
    if fraction:
        num, den = (g for g in fraction.groups() if g is not None)
        try:
            return float(num) / float(den)
        except (ValueError, ZeroDivisionError):
            return None
    numbers = _NUMBER.findall(text)
    if not numbers:
        return None
    return float(_strip_thousands(numbers[-1]))


def numeric_match(prediction: str, gold: str | float, *, rel_tol: float = 1e-6, abs_tol: float = 0.0) -> float:
    """1.0 when the prediction states the gold number, compared as numbers ('12.0' == '12', '$1,000' == 1000).

    A prediction holding '####' or '\\boxed' goes through `extract_final_answer` first; any other is read
    by `parse_number` (so '3/4' is a fraction and 'about 12 km' is 12).
    Raises ValueError when the *gold* is not a number: that is a broken task, not a wrong answer.
    """
    gold_value = float(gold) if isinstance(gold, (int, float)) else parse_number(gold)
    if gold_value is None or not math.isfinite(gold_value):
        raise ValueError(f"numeric_match: gold answer {gold!r} is not a number")
    if "####" in prediction or "\\boxed" in prediction or "\\fbox" in prediction:
        extracted = extract_final_answer(prediction)
        value = None if extracted is None else parse_number(extracted)
    else:
        value = parse_number(prediction)
    if value is None:
        return 0.0
    return float(math.isclose(value, gold_value, rel_tol=rel_tol, abs_tol=abs_tol))


def all_in_text(prediction: str, required: Sequence[str]) -> float:
    """1.0 when every required string occurs, word-bounded, in the prediction after `normalize_answer`.

    FanOutQA's `answer_in_text` "found" flag for list/dict answers, with HotpotQA normalisation in place of
    its spaCy lemmatiser (which needs a model download); numbers lose their thousands commas on both sides.
    """
    if not required:
        raise ValueError("all_in_text: no required strings")
    candidate = normalize_answer(_strip_number_commas(prediction))
    for item in required:
        needle = normalize_answer(_strip_number_commas(item))
        if not needle:
            raise ValueError(f"all_in_text: required string {item!r} normalises to nothing")
        if not re.search(rf"(?<!\w){re.escape(needle)}(?!\w)", candidate):
            return 0.0
    return 1.0


def _strip_number_commas(text: str) -> str:
    return re.sub(r"(?<=\d),(?=\d{3}\b)", "", text)


# --------------------------------------------------------------------------------------------------
# Scorer registry: Task -> float
# --------------------------------------------------------------------------------------------------


def _golds(task: Task) -> tuple[str, ...]:
    if not task.answers:
        raise ValueError(f"task {task.task_id!r} has no gold answers")
    return task.answers


def score_exact_match(task: Task, answer: str) -> float:
    """Max normalised EM over the task's aliases."""
    return em_check(answer, _golds(task))


def score_f1(task: Task, answer: str) -> float:
    """Max HotpotQA F1 over the task's aliases (reported beside EM; partial credit)."""
    return max(f1_score(answer, gold) for gold in _golds(task))


def score_numeric(task: Task, answer: str) -> float:
    """Numbers compared as numbers; tolerances from `task.meta['rel_tol']` / `['abs_tol']` if set."""
    rel_tol = float(task.meta.get("rel_tol", 1e-6))
    abs_tol = float(task.meta.get("abs_tol", 0.0))
    return max(numeric_match(answer, gold, rel_tol=rel_tol, abs_tol=abs_tol) for gold in _golds(task))


def score_all_in_text(task: Task, answer: str) -> float:
    """Every string in `task.meta['required']` must appear in the answer (FanOutQA-style)."""
    if "required" not in task.meta:
        raise KeyError(f"task {task.task_id!r} uses scorer 'all_in_text' but has no meta['required']")
    return all_in_text(answer, task.meta["required"])


@functools.lru_cache(maxsize=64)
def _reasoning_gym_scorer(dataset: str, config_json: str) -> Callable[[str | None, dict], float]:
    import reasoning_gym  # optional extra: pip install 'trace-rl[data]'

    config = json.loads(config_json)
    return reasoning_gym.create_dataset(dataset, **config).score_answer


def score_reasoning_gym(task: Task, answer: str) -> float:
    """reasoning-gym's own `score_answer(answer, entry)` for the dataset that made the task.

    Needs `task.meta['rg_dataset']` and `task.meta['rg_entry']` (the dataset item: question, answer,
    metadata); `task.meta['rg_config']` (the dataset's config kwargs) when the scorer depends on it.
    Some reasoning-gym scorers give partial credit, so the result may lie strictly between 0 and 1.
    """
    for key in ("rg_dataset", "rg_entry"):
        if key not in task.meta:
            raise KeyError(f"task {task.task_id!r} uses scorer 'reasoning_gym' but has no meta[{key!r}]")
    config_json = json.dumps(task.meta.get("rg_config", {}), sort_keys=True)
    scorer = _reasoning_gym_scorer(task.meta["rg_dataset"], config_json)
    result = float(scorer(answer, task.meta["rg_entry"]))
    if not 0.0 <= result <= 1.0:
        raise ValueError(f"reasoning-gym scorer for {task.meta['rg_dataset']!r} returned {result!r}")
    return result


SCORERS: dict[str, Callable[[Task, str], float]] = {
    "exact_match": score_exact_match,
    "f1": score_f1,
    "numeric": score_numeric,
    "reasoning_gym": score_reasoning_gym,
    "all_in_text": score_all_in_text,
}


class RewardError(ConfigError):
    """A reward function that cannot be called as `reward(task, answer)` or returned something other
    than a real number in [0, 1]: one line naming the function, its file and line, and what it must do."""


_CONTRACT = "a reward takes (task, answer) and returns a real number in [0, 1]"


def describe_function(fn: Any) -> str:
    """`name (file.py:line)` of a user's function, for one-line errors (its repr where it has no code)."""
    code = getattr(fn, "__code__", None) or getattr(getattr(fn, "__call__", None), "__code__", None)
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    return f"{name} ({code.co_filename}:{code.co_firstlineno})" if code is not None else str(name)


def check_reward_signature(fn: Any, name: str) -> None:
    """Refuse a scorer that cannot be called as `fn(task, answer)` (RewardError, one line)."""
    if not callable(fn):
        raise RewardError(f"scorer {name!r} is {type(fn).__name__}, not a function: {_CONTRACT}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: its first call tells
        return
    try:
        signature.bind(None, None)
    except TypeError:
        raise RewardError(f"scorer {name!r} = {describe_function(fn)} has the signature {signature}: {_CONTRACT}") from None


def checked_reward(value: Any, fn: Any, task: Task) -> float:
    """`value`, what the reward `fn` returned for `task`, as a float if it is a real number in [0, 1]
    (a bool, an int and numpy's scalars count); RewardError naming `fn` otherwise."""
    if isinstance(value, (numbers.Real, np.bool_)):
        reward = float(value)
        if math.isfinite(reward) and 0.0 <= reward <= 1.0:
            return reward
    raise RewardError(f"the reward {describe_function(fn)} returned {value!r} ({type(value).__name__}) for task "
                      f"{task.task_id!r}: {_CONTRACT}")


def get_scorer(name: str) -> Callable[[Task, str], float]:
    """The scorer registered under `name`, or the function a `module:function` reference names (a user's
    reward, `trace_rl.infra.references`), checked to take (task, answer); a miss raises ValueError
    suggesting the closest name."""
    if is_reference(name):
        fn = _resolved(name)
        check_reward_signature(fn, name)
        return fn
    if name not in SCORERS:
        close = difflib.get_close_matches(name, SCORERS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown scorer {name!r}{hint} (known: {sorted(SCORERS)})")
    return SCORERS[name]


@functools.lru_cache(maxsize=64)
def _resolved(name: str) -> Any:
    return resolve(name, "scorer")


def call_reward(fn: Callable[[Task, str], Any], task: Task, answer: str) -> float:
    """A user's reward `fn(task, answer)`, checked (`checked_reward`); an exception it raises becomes a
    RewardError naming it, the task and the answer (a reward must take any text a model writes)."""
    try:
        value = fn(task, answer)
    except RewardError:
        raise
    except Exception as exc:
        shown = answer if len(answer) <= 60 else answer[:57] + "..."
        raise RewardError(f"the reward {describe_function(fn)} raised {type(exc).__name__}: {exc} for task {task.task_id!r} "
                          f"and the answer {shown!r}: a reward must take any text a model writes") from exc
    return checked_reward(value, fn, task)


def score(task: Task, answer: str) -> float:
    """The task's reward for a final answer: `SCORERS[task.scorer](task, answer)`, a float in [0, 1].
    A user's reward (`module:function`) is called through `call_reward`: whatever goes wrong in it is
    one line naming it."""
    if not isinstance(answer, str):
        raise TypeError(f"answer must be a str, got {type(answer).__name__}")
    fn = get_scorer(task.scorer)
    if is_reference(task.scorer):
        return call_reward(fn, task, answer)
    return checked_reward(fn(task, answer), fn, task)


def dry_run_reward(task: Task) -> None:
    """Call the task's reward once on an empty answer and once on its first gold answer, before any run:
    a reward of the wrong shape, or one that fails on text a model may write, is one line now rather
    than a traceback during the warm start."""
    for answer in ("", *task.answers[:1]):
        score(task, str(answer))


def answer_metrics(task: Task, answer: str) -> dict[str, float]:
    """The reward plus the text metrics worth logging beside it: {'score', 'exact_match', 'f1'}.

    EM and F1 are reported for text-answer tasks (scorers 'exact_match' and 'f1'); other scorers get
    only 'score'.
    """
    metrics = {"score": score(task, answer)}
    if task.scorer in ("exact_match", "f1"):
        metrics["exact_match"] = score_exact_match(task, answer)
        metrics["f1"] = score_f1(task, answer)
    return metrics
