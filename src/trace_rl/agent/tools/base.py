"""What a tool is and how one runs: `Tool` (a typed function and its spec), its errors, and `run_tool`, the one place tools run.

A tool is a plain function returning the text the model sees, plus a docstring whose first
paragraph is shown to the model. Two kinds of failure are kept apart (STYLE §5):

- `ToolError` and its subclasses: the model misused the tool (`ToolInputError`), the tool ran out of
  time (`ToolTimeoutError`) or its backend failed (`ToolUnavailableError`). `run_tool` turns these
  into an error observation, the episode goes on, and the kind is recorded.
- anything else: a crash, our bug (or a library's) reached by some model output. It is logged with
  its traceback and recorded as kind "crash" (the model sees a one-line error), not raised: one
  input among millions must not end a run. A crash is still a bug to fix, never a way to refuse input.
  The exception: `SETUP_ERRORS` (the machine cannot run the tool at all, whatever the input) raise.

Every tool bounds its own time and output, and the bound is part of its contract: tools that wait
(the retrieval client, the sandboxed python) have a wall-time limit `timeout_s`; in-process tools
(the calculator, BM25 search) refuse, before working, input whose cost would be unbounded (a thread
timeout cannot stop CPU-bound Python, and a clock would make replay depend on load).
"""

from __future__ import annotations

import inspect
import logging
import time
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from trace_rl.agent.protocol import ANSWER, ToolParam, ToolSpec, check_arguments
from trace_rl.agent.sandbox import SandboxUnavailable
from trace_rl.agent.types import ToolCall


class ToolError(Exception):
    """A failure the model should see as an observation (base class; raise a subclass)."""

    kind: str = "error"


class ToolInputError(ToolError, ValueError):
    """The model gave the tool input it cannot use (bad expression, empty query, ...)."""

    kind = "input"


class ToolTimeoutError(ToolError, TimeoutError):
    """The tool did not finish in its time limit."""

    kind = "timeout"


class ToolUnavailableError(ToolError):
    """The tool's backend failed (retrieval server down, HTTP error, malformed reply)."""

    kind = "unavailable"


ToolErrorKind = Literal["input", "timeout", "unavailable", "error", "unknown_tool", "arguments", "crash"]

logger = logging.getLogger(__name__)

SETUP_ERRORS: tuple[type[Exception], ...] = (SandboxUnavailable,)
"""Failures of the machine, not of one input: every later call would fail too, so they stop the run."""

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean"}


@dataclass(frozen=True)
class Tool:
    """A callable tool and the spec the turn formats show to the model."""

    spec: ToolSpec
    fn: Callable[..., str]

    @property
    def name(self) -> str:
        return self.spec.name

    @classmethod
    def from_function(
        cls,
        fn: Callable[..., str],
        *,
        name: str | None = None,
        description: str | None = None,
        params: Mapping[str, str] | None = None,
    ) -> Tool:
        """Build a tool from a typed function: parameters from its signature, description from its docstring.

        `params` describes each parameter for the model (name -> one line). Only str, int, float and
        bool parameters are allowed, so every format can carry them; the first one is the parameter
        the tag format fills (`<search>QUERY</search>`) and must be a required str.
        """
        tool_name = name or fn.__name__
        text = description if description is not None else inspect.getdoc(fn) or ""
        text = text.strip().split("\n\n")[0].replace("\n", " ").strip()
        if not text:
            raise ValueError(f"tool {tool_name!r} needs a description (docstring or description=)")
        hints = typing.get_type_hints(fn)
        docs = dict(params or {})
        out = []
        for param in inspect.signature(fn).parameters.values():
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                raise ValueError(f"tool {tool_name!r}: *args/**kwargs are not allowed ({param.name})")
            py_type = hints.get(param.name)
            if py_type not in _JSON_TYPES:
                raise ValueError(f"tool {tool_name!r}: parameter {param.name!r} must be str, int, float or bool, got {py_type!r}")
            out.append(
                ToolParam(
                    name=param.name,
                    type=_JSON_TYPES[py_type],  # type: ignore[arg-type]
                    description=docs.pop(param.name, ""),
                    required=param.default is inspect.Parameter.empty,
                )
            )
        if docs:
            raise ValueError(f"tool {tool_name!r}: params describes unknown parameters {sorted(docs)}")
        spec = ToolSpec(name=tool_name, description=text, params=tuple(out))
        return cls(spec=spec, fn=fn)


@dataclass(frozen=True)
class ToolResult:
    """What one tool call produced: the text the model sees and how it went."""

    output: str
    """The tool's output, or the error message when `error_kind` is set."""
    error_kind: ToolErrorKind | None = None
    """None on success; otherwise why the call failed (the model still sees `output`)."""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error_kind is None

    @property
    def timed_out(self) -> bool:
        return self.error_kind == "timeout"


def run_tool(tools: Mapping[str, Tool], call: ToolCall) -> ToolResult:
    """Run one call. Model mistakes, tool failures and crashes come back as a result (a crash is
    logged with its traceback and recorded as "crash"); only `SETUP_ERRORS` raise.

    The answer action is not a tool (the env handles it); passing it here is the caller's bug and raises.
    """
    if call.name == ANSWER:
        raise ValueError("the answer action is handled by the env, not by run_tool")
    tool = tools.get(call.name)
    if tool is None:
        available = ", ".join(sorted(tools)) or "none"
        return ToolResult(f"error: no tool named {call.name!r}; available tools: {available}", "unknown_tool")
    problem = check_arguments(tool.spec, call.arguments)
    if problem is not None:
        return ToolResult(f"error: {call.name}: {problem}", "arguments")
    start = time.perf_counter()
    try:
        output = tool.fn(**call.arguments)
    except ToolError as exc:
        return ToolResult(f"error: {call.name}: {exc}", exc.kind, time.perf_counter() - start)  # type: ignore[arg-type]
    except SETUP_ERRORS:
        raise
    except Exception as exc:  # not BaseException: Ctrl-C and SystemExit still stop the run
        logger.exception("tool %r crashed on arguments %.300r", call.name, call.arguments)
        detail = f"{type(exc).__name__}: {str(exc)[:200]}"
        return ToolResult(f"error: {call.name}: the tool crashed ({detail})", "crash", time.perf_counter() - start)
    if not isinstance(output, str):
        logger.error("tool %r returned %s, expected str", call.name, type(output).__name__)
        message = f"error: {call.name}: the tool crashed (it returned {type(output).__name__}, not text)"
        return ToolResult(message, "crash", time.perf_counter() - start)
    return ToolResult(output, None, time.perf_counter() - start)
