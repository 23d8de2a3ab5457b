"""Data flows one way: no module imports one above it (docs/architecture.md, "Layers")."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "trace_rl"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("infra",),
    ("core",),
    ("storage",),
    ("predictor", "planning"),
    ("agent", "engine", "models"),
    ("rollout",),
    ("training",),
    ("report",),
    ("research", "run"),
    ("integrations",),
    ("cli", "__main__"),
)
"""Bottom to top, by folder. A module may import its own layer's modules and any below, never one
above; within a layer the imports form no loop (`test_no_import_loop`)."""


def _layer(module: str) -> int:
    top = module.split(".")[0]
    for rank, names in enumerate(LAYERS):
        if top in names:
            return rank
    raise AssertionError(f"trace_rl.{module} is in no layer: add it to LAYERS (and to docs/architecture.md)")


def _module(path: Path) -> str:
    """`core.tree` for src/trace_rl/core/tree.py, `predictor` for predictor/__init__.py."""
    return ".".join(path.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")


MODULES = {_module(path): path for path in sorted(PACKAGE.rglob("*.py")) if path != PACKAGE / "__init__.py"}


def _imports(path: Path) -> set[str]:
    """trace_rl modules imported anywhere in the file (function-level imports included): a `from
    package import name` counts as importing the submodule `name` when there is one, else the package."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("trace_rl."):
            base = node.module.removeprefix("trace_rl.")
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level and path.parent != PACKAGE:
            found.add(f"{path.parent.relative_to(PACKAGE).as_posix().replace('/', '.')}.{node.module or ''}".rstrip("."))  # `from .base import`
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("trace_rl.") for a in node.names if a.name.startswith("trace_rl.")}
    return found


def test_no_module_imports_one_above_it():
    broken = []
    for module, path in MODULES.items():
        for imported in _imports(path):
            if _layer(imported) > _layer(module):
                broken.append(f"trace_rl.{module} imports trace_rl.{imported}")
    assert not broken, "\n".join(broken)


def _loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, or of one that imports itself
    (Tarjan's algorithm): each is an import loop."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    loops = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                loops.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return loops


def test_no_import_loop():
    """No loop among the modules, inside a layer or a folder either (a package's `__init__` that
    re-exports its modules counts: a module importing its own package's `__init__` closes a loop)."""
    graph = {module: {name for name in _imports(path) if name in MODULES} for module, path in MODULES.items()}
    assert not _loops(graph), _loops(graph)


def test_the_loop_finder_finds_loops():
    assert _loops({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _loops({"a": {"a"}}) == [["a"]] and _loops({"a": {"b"}, "b": set()}) == []


def test_only_the_cli_prints_to_the_terminal():
    printing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name in ("cli.py", "sandbox.py", "retrieval_server.py"):
            continue  # sandbox.py prints inside the sandboxed child; the retrieval server is its own program
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                printing.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not printing, printing
