"""Safe arithmetic for the agent: the expression is parsed with `ast` and walked; nothing is `eval`ed.

Allowed: int and float literals, + - * / // % **, unary + and -, parentheses, the constants pi and e,
and the functions abs, round, min, max, sqrt, floor, ceil, log, exp. Everything else (names,
attributes, calls of anything else, strings, comparisons, ...) is refused with a message saying what.

One call is cheap by construction, not by a timer (a thread cannot stop CPU-bound Python, and a clock
would make replay depend on load): every value, literals included, has at most `MAX_RESULT_DIGITS`
digits, so + - * / // % take microseconds; the two operations whose work grows with a value rather
than its size are bounded before they run (the exponent of **, and round's ndigits: `round(1, -10**9)`
would build 10**(10**9)); nesting is at most `MAX_DEPTH` and the text at most `MAX_EXPRESSION_CHARS`.
The limits are deterministic, so a replayed episode sees the same observations.
"""

from __future__ import annotations

import ast
import math
import operator
import warnings
from collections.abc import Callable

from trace_rl.agent.tools.base import Tool, ToolInputError

MAX_EXPRESSION_CHARS = 500
MAX_EXPONENT = 1000
MAX_RESULT_DIGITS = 100
"""Integers above 10**MAX_RESULT_DIGITS are refused, literals and results alike (floats: above the float range)."""
MAX_NDIGITS = MAX_RESULT_DIGITS
"""round(x, n) needs |n| <= MAX_NDIGITS: round of an int to -n digits computes 10**n first."""
MAX_DEPTH = 200
"""Deepest nesting of operations and calls (a chain 1 + 2 + ... is one level per +): the evaluator
recurses once per level, so this keeps it far from Python's recursion limit wherever it is called."""
_MAX_INT = 10**MAX_RESULT_DIGITS

_BINARY: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_FUNCTIONS: dict[str, Callable[..., float]] = {
    "abs": abs,
    "round": round,
    "min": min,
    "max": max,
    "sqrt": math.sqrt,
    "floor": math.floor,
    "ceil": math.ceil,
    "log": math.log,
    "exp": math.exp,
}
_CONSTANTS = {"pi": math.pi, "e": math.e}
_SYMBOLS = {ast.BitXor: "^ (use ** for powers)", ast.BitAnd: "&", ast.BitOr: "|", ast.LShift: "<<", ast.RShift: ">>", ast.MatMult: "@"}


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression, e.g. (3 + 4) * 2 / 7 or sqrt(2) ** 2.

    Supports + - * / // % ** and parentheses, the constants pi and e, and the functions abs, round,
    min, max, sqrt, floor, ceil, log, exp.
    """
    text = expression.strip()
    if not text:
        raise ToolInputError("empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ToolInputError(f"expression too long ({len(text)} characters; at most {MAX_EXPRESSION_CHARS})")
    try:
        with warnings.catch_warnings():  # model text like "5is 3" makes the parser warn on stderr; its error is enough
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise ToolInputError(f"not a valid expression: {exc.msg}") from None
    except (ValueError, RecursionError, MemoryError):
        raise ToolInputError("not a valid expression") from None
    return format_number(_eval(tree.body, 0))


def format_number(value: float) -> str:
    """Integers as integers; floats with 12 significant digits (0.1 + 0.2 -> 0.3), integral ones without '.0'."""
    if isinstance(value, int):
        return str(value)
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return format(value, ".12g")


def _eval(node: ast.AST, depth: int) -> float:
    if depth > MAX_DEPTH:
        raise ToolInputError(f"expression nested too deeply (at most {MAX_DEPTH} levels)")
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise ToolInputError(f"only numbers are allowed, got {node.value!r}")
        return _check(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _eval(node.operand, depth + 1)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        left, right = _eval(node.left, depth + 1), _eval(node.right, depth + 1)
        if isinstance(node.op, ast.Pow):
            return _check(_power(left, right))
        op = _BINARY.get(type(node.op))
        if op is None:
            raise ToolInputError(f"operator {_SYMBOLS.get(type(node.op), type(node.op).__name__)} is not supported")
        try:
            return _check(op(left, right))
        except ZeroDivisionError:
            raise ToolInputError("division by zero") from None
        except OverflowError:
            raise ToolInputError("result too large") from None
    if isinstance(node, ast.Name):
        if node.id in _CONSTANTS:
            return _CONSTANTS[node.id]
        raise ToolInputError(f"unknown name {node.id!r} (known constants: pi, e)")
    if isinstance(node, ast.Call):
        return _call(node, depth)
    if isinstance(node, ast.Tuple):
        raise ToolInputError("a tuple is not a number; write numbers without thousands separators (1000, not 1,000)")
    if isinstance(node, ast.Attribute):
        raise ToolInputError("attribute access is not allowed")
    raise ToolInputError(f"{type(node).__name__} is not allowed in an arithmetic expression")


def _call(node: ast.Call, depth: int) -> float:
    if isinstance(node.func, ast.Attribute):
        raise ToolInputError("attribute access is not allowed")
    if not isinstance(node.func, ast.Name) or node.func.id not in _FUNCTIONS:
        what = repr(node.func.id) if isinstance(node.func, ast.Name) else "the result of an expression"
        raise ToolInputError(f"cannot call {what}; functions: {', '.join(_FUNCTIONS)}")
    if node.keywords:
        raise ToolInputError(f"{node.func.id}() takes no keyword arguments")
    args = [_eval(arg, depth + 1) for arg in node.args]
    if node.func.id == "round" and len(args) == 2 and isinstance(args[1], int) and abs(args[1]) > MAX_NDIGITS:
        raise ToolInputError(f"round(): ndigits must be between {-MAX_NDIGITS} and {MAX_NDIGITS}, got {format_number(args[1])}")
    try:
        return _check(_FUNCTIONS[node.func.id](*args))
    except ToolInputError:  # from _check; a ValueError too, so it must not reach the handler below
        raise
    except TypeError as exc:
        raise ToolInputError(f"{node.func.id}(): {exc}") from None
    except ValueError:
        raise ToolInputError(f"{node.func.id}() is undefined for {', '.join(map(format_number, args))}") from None
    except OverflowError:
        raise ToolInputError("result too large") from None


def _power(base: float, exponent: float) -> float:
    if abs(exponent) > MAX_EXPONENT:
        raise ToolInputError(f"exponent {format_number(exponent)} too large (at most {MAX_EXPONENT} in size)")
    # For ints, 2**b <= |base| with b = bit_length - 1, so the result is at least 2**(b * exponent):
    # refuse before computing a number with far more than MAX_RESULT_DIGITS digits.
    whole = isinstance(base, int) and isinstance(exponent, int) and exponent > 0
    if whole and (abs(base).bit_length() - 1) * exponent > MAX_RESULT_DIGITS * 3.33:
        raise ToolInputError(f"result too large (more than {MAX_RESULT_DIGITS} digits)")
    try:
        result = base**exponent
    except ZeroDivisionError:
        raise ToolInputError("zero cannot be raised to a negative power") from None
    except OverflowError:
        raise ToolInputError("result too large") from None
    if isinstance(result, complex):
        raise ToolInputError("the result is not a real number")
    return result


def _check(value: float) -> float:
    if isinstance(value, int) and abs(value) > _MAX_INT:
        raise ToolInputError(f"result too large (more than {MAX_RESULT_DIGITS} digits)")
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolInputError("result too large" if math.isinf(value) else "the result is not a number")
    return value


def calculator_tool() -> Tool:
    return Tool.from_function(
        calculate,
        name="calculator",
        params={"expression": "an arithmetic expression, e.g. (3 + 4) * 2"},
    )
