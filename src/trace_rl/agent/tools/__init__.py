"""Agent tools: typed functions the model calls (`base.py`: `Tool`, its errors and `run_tool`, the one
place they run), the bundled ones (`search.py`, `calculator.py`, `python_tool.py`) and `build_tools`,
the registry of the bundled ones by name."""

from __future__ import annotations

from collections.abc import Sequence

from trace_rl.agent.tools.base import (
    Tool,
    ToolError,
    ToolErrorKind,
    ToolInputError,
    ToolParam,
    ToolResult,
    ToolSpec,
    ToolTimeoutError,
    ToolUnavailableError,
    run_tool,
)
from trace_rl.agent.types import Passage
from trace_rl.infra.config import SandboxConfig

TOOL_NAMES = ("search", "calculator", "python")
"""The tools `build_tools` knows, in the order prompts list them."""


def build_tools(
    names: Sequence[str] = TOOL_NAMES,
    *,
    corpus: Sequence[Passage] | None = None,
    search_url: str | None = None,
    topk: int = 3,
    search_timeout_s: float = 10.0,
    python_timeout_s: float = 5.0,
    sandbox: SandboxConfig | None = None,
) -> dict[str, Tool]:
    """The standard tool registry.

    `search` runs BM25 over `corpus` in process, or asks the Search-R1-style retrieval server at
    `search_url` (exactly one of the two). `python` runs code in the sandbox `sandbox` chooses (default:
    the best level this machine has) and raises `SandboxUnavailable` now when none can run.
    """
    tools: dict[str, Tool] = {}
    for name in names:
        if name == "search":
            from trace_rl.agent.tools.search import RetrievalClient, search_tool

            if (corpus is None) == (search_url is None):
                raise ValueError("the search tool needs exactly one of corpus= and search_url=")
            if search_url is not None:
                tools[name] = RetrievalClient(search_url, topk=topk, timeout_s=search_timeout_s).tool()
            else:
                tools[name] = search_tool(corpus, topk=topk)  # type: ignore[arg-type]
        elif name == "calculator":
            from trace_rl.agent.tools.calculator import calculator_tool

            tools[name] = calculator_tool()
        elif name == "python":
            from trace_rl.agent.tools.python_tool import python_tool

            box = sandbox or SandboxConfig()
            tools[name] = python_tool(timeout_s=python_timeout_s, isolation=box.isolation, interpreter=box.python)
        else:
            raise ValueError(f"unknown tool {name!r} (known: {', '.join(TOOL_NAMES)})")
    return tools


__all__ = [
    "TOOL_NAMES",
    "Tool",
    "ToolError",
    "ToolErrorKind",
    "ToolInputError",
    "ToolParam",
    "ToolResult",
    "ToolSpec",
    "ToolTimeoutError",
    "ToolUnavailableError",
    "build_tools",
    "run_tool",
]
