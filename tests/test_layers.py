"""Data flows one way: no module imports one above it (docs/architecture.md, "Layers")."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "trace_rl"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("tree", "contrast", "allocate", "mixing", "references", "token_budget", "config", "progress", "rundir", "advantage", "http_deadline"),
    ("predictor", "metrics", "methods", "plan", "evidence", "sim"),
    ("agent", "engine", "models"),
    ("rollout", "bench", "distributed"),
    ("train",),
    ("report",),
    ("run", "compare"),
    ("integrations",),
    ("cli", "__main__"),
)
"""Bottom to top. A module may import its own layer's modules and any below, never one above."""


def _layer(module: str) -> int:
    top = module.split(".")[0]
    for rank, names in enumerate(LAYERS):
        if top in names:
            return rank
    raise AssertionError(f"trace_rl.{module} is in no layer: add it to LAYERS (and to docs/architecture.md)")


def _imports(path: Path) -> set[str]:
    """trace_rl modules imported anywhere in the file (function-level imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("trace_rl."):
            found.add(node.module.removeprefix("trace_rl."))
        elif isinstance(node, ast.ImportFrom) and node.level and path.parent != PACKAGE:
            found.add(f"{path.parent.name}.{node.module or ''}".rstrip("."))  # `from .base import` inside a package
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("trace_rl.") for a in node.names if a.name.startswith("trace_rl.")}
    return found


def test_no_module_imports_one_above_it():
    broken = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")
        if module == "__init__":
            continue
        for imported in _imports(path):
            if _layer(imported) > _layer(module):
                broken.append(f"trace_rl.{module} imports trace_rl.{imported}")
    assert not broken, "\n".join(broken)


def test_only_the_cli_prints_to_the_terminal():
    printing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name in ("cli.py", "sandbox.py", "retrieval_server.py"):
            continue  # sandbox.py prints inside the sandboxed child; the retrieval server is its own program
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                printing.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not printing, printing
