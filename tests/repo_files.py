"""The repository's scripts and benchmarks are files, not modules of a package: their tests load them."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]


def load(relative: str) -> ModuleType:
    """The module in `REPO / relative` (e.g. `experiments/brier_floor.py`), executed afresh."""
    path = REPO / relative
    if str(path.parent) not in sys.path:  # as `python <file>` has it: the file's siblings import (benchmarks/common.py)
        sys.path.append(str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
