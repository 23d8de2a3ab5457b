"""Allocation quality on the latent-tree simulator: every method at an equal budget, one JSON object.

    python experiments/allocation_quality.py                       # the default regime
    python experiments/allocation_quality.py --stage1-share 0.6    # another Stage 1 / Stage 2 split
    python experiments/allocation_quality.py --table               # also a table for people (on stderr)

The methods, figures and defaults are documented in `trace_rl.research.bench`; `trace-rl bench allocation`
runs the same thing.
"""

from __future__ import annotations

import argparse
import json
import sys

from trace_rl.research.bench import ROWS, run_benchmark, summary_table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, help="independent worlds (default 5)")
    parser.add_argument("--batches", type=int, help="reported batches per seed (default 20)")
    parser.add_argument("--warmup-batches", type=int, help="batches a learned predictor trains on first (default 20)")
    parser.add_argument("--stage1-share", type=float, help="share of the budget in Stage 1 (default 0.5)")
    parser.add_argument("--budget", type=int, help="leaves per batch (default 384)")
    parser.add_argument("--prompts-per-batch", type=int, help="candidate prompts per batch (default 64)")
    parser.add_argument("--noise", type=float, help="log-odds noise of the @noisy rows (default 1.0)")
    parser.add_argument("--workers", type=int, help="processes running seeds side by side (default 2)")
    parser.add_argument("--methods", nargs="+", help=f"rows to run, `method` or `method@oracle|topic|noisy` (default: {' '.join(ROWS)})")
    parser.add_argument("--table", action="store_true", help="also print a table to stderr")
    args = vars(parser.parse_args(argv))
    table = args.pop("table")
    result = run_benchmark(**args)  # None keeps a default
    if table:
        print(summary_table(result), file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
