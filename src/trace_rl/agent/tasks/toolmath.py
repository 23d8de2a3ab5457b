"""`toolmath`: multi-step arithmetic word problems meant for the calculator (or python) tool.

Each problem is a short story (shopping, travel and fuel, wages and tax, recipes and unit conversion,
tanks and rates, savings) whose answer takes 2 to 5 arithmetic steps. The steps are stored as
calculator expressions over earlier results (`meta['steps']`, e.g. `["3 * 2.45", "2 * 1.2",
"{r0} + {r1}"]`), evaluated exactly with fractions when the problem is made; answers are exact decimals
with at most three places, scored by number (scorer "numeric"). Some problems carry a sentence with an
irrelevant number (`meta['distractor']`).

Splits: one seeded pool, split train/test by a hash of the question text (`test_fraction`).
The oracle (`toolmath_oracle`) runs each step through the calculator, reading every intermediate result
back from the observation, and answers with the last one.
"""

from __future__ import annotations

import ast
import hashlib
import random
import re
from collections.abc import Callable, Sequence
from fractions import Fraction

from trace_rl.agent.scoring import parse_number
from trace_rl.agent.types import Task, TaskSet, ToolCall

_OPERAND = re.compile(r"\{r(\d+)\}|\d+(?:\.\d+)?")
"""An operand of a step expression: an earlier result (`{r1}`) or a literal number."""
_QUESTION_NUMBER = re.compile(r"(\S+)\s+(\$?(\d+(?:\.\d+)?)%?)")
"""A number of the question with the word before it (`earns $24.00`, `works 10`)."""

_NAMES = ["Mia", "Leo", "Ava", "Noah", "Zoe", "Omar", "Lena", "Ravi", "Sara", "Tom", "Ines", "Kai", "Nina",
          "Hugo", "Priya", "Jonas", "Elif", "Marco", "Yuki", "Ana"]
_ITEMS = [("notebook", "notebooks"), ("pen", "pens"), ("apple", "apples"), ("loaf of bread", "loaves of bread"),
          ("candle", "candles"), ("mug", "mugs"), ("bag of rice", "bags of rice"), ("towel", "towels"),
          ("battery", "batteries"), ("plant pot", "plant pots")]
_DISTRACTORS = ["{name}'s sister is {n} years old.", "The shop opened {n} years ago.",
                "{name} has {n} friends at school.", "It was {n} degrees outside that day.",
                "{name}'s bus number is {n}."]


class _Problem:
    """Accumulates a problem's calculator steps and checks them with exact arithmetic."""

    def __init__(self) -> None:
        self.steps: list[str] = []
        self.values: list[Fraction] = []

    def step(self, expression: str) -> str:
        """Add a step; returns its placeholder ('{r2}') for use in later steps."""
        self.values.append(_evaluate(expression, self.values))
        self.steps.append(expression)
        return "{r%d}" % (len(self.steps) - 1)


def _evaluate(expression: str, results: Sequence[Fraction]) -> Fraction:
    """Exact value of a step expression: numbers, + - * / and parentheses, {rN} placeholders."""
    source = expression.format(**{f"r{i}": f"_r{i}" for i in range(len(results))})

    def value(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return Fraction(str(node.value))
        if isinstance(node, ast.Name) and node.id.startswith("_r"):
            return results[int(node.id[2:])]
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp):
            ops: dict[type, Callable[[Fraction, Fraction], Fraction]] = {
                ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
                ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b,
            }
            return ops[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"toolmath: unsupported expression {expression!r}")

    return value(ast.parse(source, mode="eval"))


def _money(cents: int) -> str:
    return f"{cents // 100}.{cents % 100:02d}"


def _shopping(rng: random.Random, name: str) -> tuple[str, _Problem]:
    problem = _Problem()
    kinds = rng.sample(_ITEMS, rng.choice([1, 2, 2, 3]))
    parts, placeholders = [], []
    for singular, plural in kinds:
        qty, cents = rng.randint(2, 9), rng.randrange(25, 1000, 5)
        parts.append(f"{qty} {plural} at ${_money(cents)} each")
        placeholders.append(problem.step(f"{qty} * {_money(cents)}"))
    story = f"{name} buys " + (", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0]) + "."
    total = placeholders[0] if len(placeholders) == 1 else problem.step(" + ".join(placeholders))
    ask = "How much does the shopping cost, in dollars?"
    if len(problem.steps) < 5 and rng.random() < 0.6:
        discount = rng.choice([10, 20, 25, 50])
        story += f" The shop takes {discount}% off the whole bill."
        total = problem.step(f"{total} * {100 - discount} / 100")
    if len(problem.steps) < 5 and (len(problem.steps) == 1 or rng.random() < 0.5):
        bill = next(b for b in (10, 20, 50, 100, 200, 500, 1000) if b > problem.values[-1])
        story += f" {name} pays with a ${bill} note."
        problem.step(f"{bill} - {total}")
        ask = f"How much change does {name} get, in dollars?"
    return f"{story} {ask}", problem


def _travel(rng: random.Random, name: str) -> tuple[str, _Problem]:
    problem = _Problem()
    legs = rng.choice([2, 2, 3])
    parts, distances = [], []
    for _ in range(legs):
        speed, hours = rng.randrange(30, 115, 5), rng.choice([0.5, 1, 1.5, 2, 2.5, 3])
        parts.append(f"{speed} km/h for {hours:g} hours")
        distances.append(problem.step(f"{speed} * {hours:g}"))
    story = f"{name} drives at " + ", then at ".join(parts) + "."
    total = problem.step(" + ".join(distances))
    if len(problem.steps) <= 3 and rng.random() < 0.6:
        per_100, price = rng.randint(5, 9), rng.randrange(120, 220, 5)
        story += f" The car uses {per_100} litres of fuel per 100 km and fuel costs ${_money(price)} per litre."
        litres = problem.step(f"{total} * {per_100} / 100")
        problem.step(f"{litres} * {_money(price)}")
        return f"{story} How much does the fuel for the trip cost, in dollars?", problem
    return f"{story} How many kilometres does {name} drive in total?", problem


def _wages(rng: random.Random, name: str) -> tuple[str, _Problem]:
    problem = _Problem()
    wage, hours, days = rng.randrange(24, 81) / 2, rng.randint(4, 10), rng.randint(3, 6)
    story = f"{name} earns ${wage:.2f} an hour and works {hours} hours a day for {days} days."
    daily = problem.step(f"{wage:g} * {hours}")
    gross = problem.step(f"{daily} * {days}")
    if rng.random() < 0.7:
        tax = rng.choice([10, 12, 15, 20, 25])
        story += f" {tax}% of the pay goes to tax."
        withheld = problem.step(f"{gross} * {tax} / 100")
        problem.step(f"{gross} - {withheld}")
        return f"{story} How much does {name} take home, in dollars?", problem
    return f"{story} How much does {name} earn in total, in dollars?", problem


def _recipe(rng: random.Random, name: str) -> tuple[str, _Problem]:
    problem = _Problem()
    grams, loaves, days = rng.randrange(150, 650, 25), rng.randint(6, 30), rng.randint(2, 7)
    story = (f"{name}'s bakery uses {grams} g of flour per loaf and bakes {loaves} loaves a day "
             f"for {days} days.")
    per_day = problem.step(f"{grams} * {loaves}")
    total = problem.step(f"{per_day} * {days}")
    kilos = problem.step(f"{total} / 1000")
    if rng.random() < 0.5:
        price = rng.randrange(80, 400, 5)
        story += f" Flour costs ${_money(price)} per kilogram."
        problem.step(f"{kilos} * {_money(price)}")
        return f"{story} How much does the flour cost, in dollars?", problem
    return f"{story} How many kilograms of flour are used?", problem


def _tank(rng: random.Random, name: str) -> tuple[str, _Problem]:
    problem = _Problem()
    net, minutes = rng.randint(2, 25), rng.randint(4, 60)
    leak = rng.randint(1, 10)
    start = rng.randrange(0, 500, 10)
    capacity = start + net * minutes
    story = (f"A tank holds {capacity} litres and already has {start} litres in it. {name} fills it with a pump "
             f"that adds {net + leak} litres a minute, while a leak drains {leak} litres a minute.")
    missing = problem.step(f"{capacity} - {start}")
    rate = problem.step(f"{net + leak} - {leak}")
    problem.step(f"{missing} / {rate}")
    return f"{story} How many minutes does it take to fill the tank?", problem


def _savings(rng: random.Random, name: str) -> tuple[str, _Problem]:
    problem = _Problem()
    weekly, share, weeks = rng.randrange(100, 600, 10), rng.choice([10, 20, 25, 30, 40, 50]), rng.randint(4, 20)
    story = f"{name} earns ${weekly} a week and saves {share}% of it for {weeks} weeks."
    saved_week = problem.step(f"{weekly} * {share} / 100")
    saved = problem.step(f"{saved_week} * {weeks}")
    if rng.random() < 0.7:
        spend = rng.randrange(10, int(problem.values[-1] * Fraction(9, 10)) + 11, 5)
        parts = rng.choice([2, 4, 5])
        story += f" Then {name} spends ${spend} on a bike and splits the rest equally between {parts} charities."
        rest = problem.step(f"{saved} - {spend}")
        problem.step(f"{rest} / {parts}")
        return f"{story} How much does each charity get, in dollars?", problem
    return f"{story} How much has {name} saved, in dollars?", problem


_FAMILIES: dict[str, Callable[[random.Random, str], tuple[str, _Problem]]] = {
    "shopping": _shopping, "travel": _travel, "wages": _wages, "recipe": _recipe, "tank": _tank,
    "savings": _savings,
}


def _exact_decimal(value: Fraction, places: int = 3) -> str | None:
    """The value as a plain decimal string when it has at most `places` decimals, else None."""
    scaled = value * 10**places
    if scaled.denominator != 1:
        return None
    sign, digits = ("-" if scaled < 0 else ""), str(abs(scaled.numerator)).rjust(places + 1, "0")
    whole, frac = digits[:-places], digits[-places:].rstrip("0")
    return sign + whole + (f".{frac}" if frac else "")


def _in_test(question: str, test_fraction: float) -> bool:
    digest = hashlib.sha256(question.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < test_fraction


def generate_problems(num_problems: int, seed: int) -> list[Task]:
    """`num_problems` distinct problems; families cycle, every answer is an exact short decimal."""
    rng = random.Random(f"toolmath-{seed}")
    families = sorted(_FAMILIES)
    tasks: list[Task] = []
    seen: set[str] = set()
    attempts = 0
    while len(tasks) < num_problems:
        attempts += 1
        if attempts > 50 * num_problems:
            raise ValueError(f"toolmath: could only make {len(tasks)} distinct problems of {num_problems}")
        family = families[len(tasks) % len(families)]
        name = rng.choice(_NAMES)
        question, problem = _FAMILIES[family](rng, name)
        answer = _exact_decimal(problem.values[-1])
        if answer is None or problem.values[-1] <= 0 or not 2 <= len(problem.steps) <= 5:
            continue
        distractor = rng.random() < 0.3
        if distractor:
            sentence = rng.choice(_DISTRACTORS).format(name=name, n=rng.randint(3, 60))
            question = question.replace(". ", f". {sentence} ", 1) if ". " in question else f"{sentence} {question}"
        if question in seen:
            continue
        seen.add(question)
        tasks.append(Task(
            task_id=f"toolmath-s{seed}-{len(tasks):05d}",
            question=question,
            answers=(answer,),
            source="toolmath",
            tools=("calculator", "python"),
            scorer="numeric",
            meta={
                "family": family,
                "num_steps": len(problem.steps),
                "steps": list(problem.steps),
                "distractor": distractor,
                "rel_tol": 1e-6,
                "abs_tol": 1e-6,  # the calculator's float noise (0.1 + 0.2), far below a cent
            },
        ))
    return tasks


def _read_result(observation: str) -> str:
    """The number a calculator reply states, as the reply writes it where it is a bare number (`3900`,
    what a policy would copy), else Python's repr of it; negative numbers in parentheses."""
    value = parse_number(observation)
    if value is None:
        raise ValueError(f"toolmath oracle: no number in the calculator's reply {observation!r}")
    text = observation.strip()
    try:
        written = float(text) == value
    except ValueError:
        written = False
    text = text if written else repr(value)
    return text if value >= 0 else f"({text})"


def toolmath_oracle(task: Task, history: Sequence[tuple[ToolCall, str]]) -> ToolCall:
    """Run `meta['steps']` through the calculator one by one, substituting results read from its replies.

    Literal numbers are written as the question writes them (`15.50`, not the step's `15.5`: the same
    value), so the policy copies them from the question as they stand. Only the replies to the
    oracle's own next step count: a call in the history that is not exactly the step's expression
    (another agent's move, as in the warm start's demonstrations, which mix in random calculator
    calls) is passed over, so the oracle acts from any history. Raises ValueError when the reply to
    one of its own steps holds no number: the tool and the oracle disagree, which is a bug to see, not
    a wrong answer to score.
    """
    steps: list[str] = task.meta["steps"]
    results = _own_results(task, history)
    if len(results) == len(steps):
        answer = results[-1].strip("()")
        return ToolCall("answer", {"answer": answer.removesuffix(".0")})
    return _next_step(task, results)


def toolmath_rationale(task: Task, history: Sequence[tuple[ToolCall, str]]) -> str:
    """Where the numbers of the oracle's next action come from: `earns $15.50, works 6` (each literal
    with the word before it in the question), `step 1 gave 93` (an earlier result), or, before the
    answer, the last result. Numbers the question does not state (`/ 100` for a percentage) are left
    out. It plays the part `multihop_rationale` plays there: a small policy that writes the cue word
    and then copies what follows it in the question picks the right number far more often than one
    asked to choose among all of the question's numbers at once."""
    steps: list[str] = task.meta["steps"]
    results = _own_results(task, history)
    if len(results) == len(steps):
        return f"step {len(steps)} gave {results[-1].strip('()')}"
    cues = _question_numbers(task.question)
    parts = []
    for match in _OPERAND.finditer(steps[len(results)]):
        if match.group(1) is not None:
            index = int(match.group(1))
            parts.append(f"step {index + 1} gave {results[index].strip('()')}")
        elif (cue := cues.get(Fraction(match.group(0)))) is not None:
            parts.append(cue[0])
    return ", ".join(parts)


def _question_numbers(question: str) -> dict[Fraction, tuple[str, str]]:
    """Per value stated in the question (first mention): (the word before it and the number as written,
    the number alone as written), e.g. {Fraction(31, 2): ("earns $15.50", "15.50")}."""
    found: dict[Fraction, tuple[str, str]] = {}
    for match in _QUESTION_NUMBER.finditer(question):
        found.setdefault(Fraction(match.group(3)), (f"{match.group(1)} {match.group(2)}", match.group(3)))
    return found


def _own_results(task: Task, history: Sequence[tuple[ToolCall, str]]) -> list[str]:
    """The calculator's replies to the oracle's own steps, in order (other calls passed over)."""
    steps: list[str] = task.meta["steps"]
    results: list[str] = []
    for call, observation in history:
        if len(results) < len(steps) and call == _next_step(task, results):
            results.append(_read_result(observation))
    return results


def _next_step(task: Task, results: list[str]) -> ToolCall:
    """The calculator call of step `len(results)`: earlier results substituted, literals as the question writes them."""
    written = {value: text for value, (_, text) in _question_numbers(task.question).items()}

    def operand(match: re.Match[str]) -> str:
        if match.group(1) is not None:
            return results[int(match.group(1))]
        return written.get(Fraction(match.group(0)), match.group(0))

    return ToolCall("calculator", {"expression": _OPERAND.sub(operand, task.meta["steps"][len(results)])})


def load(
    *,
    split: str = "train",
    num_tasks: int | None = None,
    seed: int = 0,
    num_problems: int = 2000,
    test_fraction: float = 0.2,
) -> TaskSet:
    """The `toolmath` task set: `split` ('train' or 'test') of a seeded pool of `num_problems`."""
    if split not in ("train", "test"):
        raise ValueError(f"toolmath split must be 'train' or 'test', got {split!r}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"toolmath test_fraction must be in (0, 1), got {test_fraction!r}")
    pool = generate_problems(num_problems, seed)
    tasks = [t for t in pool if _in_test(t.question, test_fraction) == (split == "test")]
    if num_tasks is not None:
        if num_tasks > len(tasks):
            raise ValueError(f"toolmath {split} split holds {len(tasks)} tasks, asked for {num_tasks}; "
                             f"raise num_problems (now {num_problems})")
        tasks = tasks[:num_tasks]
    return TaskSet(name="toolmath", tasks=tasks, oracle=toolmath_oracle, rationale=toolmath_rationale,
                   meta={"split": split, "seed": seed, "pool_size": len(pool)})
