"""The repository's scripts and benchmarks are files, not modules of a package: their tests load them."""

import importlib.util
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]


def load(relative: str) -> ModuleType:
    """The module in `REPO / relative` (e.g. `experiments/brier_floor.py`), executed afresh."""
    path = REPO / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
