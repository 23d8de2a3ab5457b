"""A user's own code named from a config: `module:attribute` or `path/to/file.py:attribute`.

A config names a user's task set, reward function or tool the way verl names a custom reward
function: by where the Python object lives. `package.module:name` imports an installed or importable
module (the current directory and the config's folder are not searched: install the package, or set
PYTHONPATH); `some/file.py:name` loads that file (relative to the current directory). Every process
that reads the config resolves the name itself, so `compare` workers see the same object.

A config names code to run, as a Makefile does: only run configs you trust. Data files (task files,
run folders) are never imported.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from pathlib import Path
from typing import Any

REFERENCE = re.compile(r"(?P<module>[A-Za-z_][\w.]*|[^:\s]+\.py):(?P<attribute>[A-Za-z_]\w*)")
"""`module:attribute` or `file.py:attribute`."""
NOT_REFERENCES = ("file:", "rg:")
"""Prefixes of task-set names that look like references but are not."""


class BadReference(ValueError):
    """A `module:attribute` that names nothing, or something of the wrong kind: bad input, one line."""


def is_reference(name: object) -> bool:
    """Whether `name` is a `module:attribute` / `file.py:attribute` reference (and not a `file:` or `rg:` task name)."""
    return isinstance(name, str) and not name.startswith(NOT_REFERENCES) and REFERENCE.fullmatch(name) is not None


def resolve(reference: str, what: str) -> Any:
    """The object `reference` names; BadReference naming `what` it was for when the module or file
    cannot be loaded or has no such attribute."""
    match = REFERENCE.fullmatch(reference) if isinstance(reference, str) else None
    if match is None:
        raise BadReference(f"{what} {reference!r} is not a reference: write module:attribute or path/to/file.py:attribute")
    module_name, attribute = match["module"], match["attribute"]
    if module_name.endswith(".py"):
        module = _load_file(Path(module_name), what, reference)
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise BadReference(f"{what} {reference!r}: cannot import {module_name!r} ({exc}); install it or put its folder on PYTHONPATH") from exc
    try:
        return getattr(module, attribute)
    except AttributeError:
        names = sorted(n for n in vars(module) if not n.startswith("_"))
        import difflib

        close = difflib.get_close_matches(attribute, names, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise BadReference(f"{what} {reference!r}: {module_name} has no attribute {attribute!r}{hint}") from None


def _load_file(path: Path, what: str, reference: str) -> Any:
    """The module of a .py file, loaded once per process (keyed by its resolved path)."""
    if not path.is_file():
        raise BadReference(f"{what} {reference!r}: no file {str(path)!r} (paths are relative to the current directory {Path.cwd()})")
    resolved = path.resolve()
    key = "trace_rl_user_" + re.sub(r"\W", "_", str(resolved))
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, resolved)
    if spec is None or spec.loader is None:
        raise BadReference(f"{what} {reference!r}: {path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    try:
        spec.loader.exec_module(module)
    except Exception:
        del sys.modules[key]
        raise
    return module


def reference_of(obj: Any, what: str) -> str:
    """The reference that names `obj` in any process: `module:name` for a function of an importable
    module, `/path/file.py:name` for one defined in a script or a file loaded by reference. BadReference
    for what no reference can name (a lambda, a nested function)."""
    qualname = getattr(obj, "__qualname__", "")
    module_name = getattr(obj, "__module__", None)
    if not qualname.isidentifier() or not module_name:
        raise BadReference(f"{what} {obj!r}: give a function defined at the top of a module or script (a lambda or nested function cannot be named from a config)")
    module = sys.modules.get(module_name)
    if module_name == "__main__" or module_name.startswith("trace_rl_user_"):
        file = getattr(module, "__file__", None)
        if not file or any(c.isspace() for c in str(file)):
            raise BadReference(f"{what} {qualname!r} is defined where no reference can name it (an interactive session or a path with spaces): put it in a module")
        return f"{Path(file).resolve()}:{qualname}"
    return f"{module_name}:{qualname}"
