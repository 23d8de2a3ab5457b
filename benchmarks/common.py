"""The speed suite's one JSON shape. Every benchmark in this folder ends with `emit`, which prints its
result as one JSON object on the last line of stdout (progress goes to stderr):

    {"bench": "<script name>",
     "machine": {"cpu_model", "cpus", "cpuinfo_flags", "avx512_bf16", "amx_tile", "cpu_capability",
                 "matmul_gflops_fp32", "torch", "python"},      # hardware.machine()
     "config": {...},      # what was run: the script's arguments (and "quick"), sizes, threads
     "results": {...},     # its own figures, under the names its committed JSON used before
     "baseline": "...",    # what it is compared with, timed in the same run (null: nothing)
     "speedup": 1.23}      # baseline time / its time (> 1: faster), or {case: ratio}; null: nothing

Every script takes `--quick` (`parse_args`): small sizes, seconds to a minute, what `make bench` runs.

Imported by the benchmarks beside it (`from common import ...`: a script's folder is on its path).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from hardware import machine

KEYS = ("bench", "machine", "config", "results", "baseline", "speedup")
"""The top-level keys of every speed benchmark's JSON, in this order."""


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None, **quick: Any) -> argparse.Namespace:
    """`parser`'s arguments plus `--quick`, which makes `quick` the defaults (an argument given
    explicitly still wins): the small run `make bench` makes."""
    shown = ", ".join(f"{key}={value}" for key, value in quick.items())
    parser.add_argument("--quick", action="store_true", help=f"small and fast, as `make bench` runs it ({shown})")
    if "--quick" in (sys.argv[1:] if argv is None else argv):
        parser.set_defaults(**quick)
    return parser.parse_args(argv)


def arguments(args: argparse.Namespace) -> dict[str, Any]:
    """The arguments as JSON values (paths as strings), for `config`."""
    return {key: value if isinstance(value, (bool, int, float, str, list, dict, type(None))) else str(value) for key, value in vars(args).items()}


def emit(bench: str, *, config: Mapping[str, Any], results: Mapping[str, Any], baseline: str | None,
         speedup: float | Mapping[str, float | None] | None) -> dict[str, Any]:
    """Print the result in the suite's shape (`KEYS`) as the last line of stdout, and return it."""
    record = {"bench": bench, "machine": machine(), "config": dict(config), "results": dict(results),
              "baseline": baseline, "speedup": dict(speedup) if isinstance(speedup, Mapping) else speedup}
    print(json.dumps(record), flush=True)
    return record
