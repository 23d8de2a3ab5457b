"""Speed of a training step against an earlier commit's code, on the same config, in one run.

    python benchmarks/step_vs_commit.py --base 145a511 --current-set sft.packing=false   # demo, 2 steps, 2 rounds
    python benchmarks/step_vs_commit.py --base REV --steps 2 --rounds 3 [--config PATH] [key=value ...]
    python benchmarks/step_vs_commit.py --quick   # `make bench`: the working tree against HEAD, smoke config, 1 step

`step_speed.py` compares two paths of today's code (the prefix cache and the packed update on and
off); this compares today's code with the code of `--base` itself, which is what "faster than the
code the issue measured" means. The base commit's `src/` and the config file are taken from git
(`trace_rl.research.reproduce.code_at`) into a temporary folder; each round runs both codes in fresh `trace-rl
train` processes (`train_with`), one after the other (base first), each for `--steps` training steps
from the same cached warm start, with `model.cpu_threads` threads and no evaluation, and keeps each
step's time split. The two codes draw their samples differently (the sampler changed), so their
trees differ: besides step times it prints generated tokens per second of generation, which does not
depend on how many were drawn. Overrides apply to both sides (an older config schema may refuse a
key today's accepts: `--current-set` is for today's side alone). Prints one JSON object
(`common.emit`); the ratios are of the means over rounds and steps.
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

from common import arguments, emit, parse_args

from trace_rl.research.reproduce import code_at, train_with

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("timing_s/step", "timing_s/gen", "timing_s/update", "rollout/tokens_generated")


def run_steps(src: Path, config: Path, steps: int, overrides: list[str]) -> list[dict[str, float]]:
    """`steps` training steps of `config` with the trace_rl package under `src`, in a fresh process."""
    return [{key: row[key] for key in KEYS} for row in train_with(src, config, [f"train.steps={steps}", *overrides])]


def summary(rows: list[dict[str, float]]) -> dict[str, float]:
    mean = {key.split("/")[-1]: sum(r[key] for r in rows) / len(rows) for key in KEYS}
    mean["gen_tokens_per_s"] = sum(r["rollout/tokens_generated"] for r in rows) / sum(r["timing_s/gen"] for r in rows)
    return {key: round(value, 3) for key, value in mean.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", help="the earlier commit (any git revision; required but with --quick, whose is HEAD)")
    parser.add_argument("--config", default="configs/demo.yaml", help="config path inside the repository")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--current-set", action="append", default=[], metavar="KEY=VALUE",
        help="an override for today's code only, e.g. sft.packing=false so that both sides start from the warm start the base made",
    )
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides for both sides")
    args = parse_args(parser, argv, base="HEAD", config="configs/smoke.yaml", steps=1, rounds=1)
    if args.base is None:
        parser.error("--base is required")
    base = subprocess.run(["git", "rev-parse", args.base], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    overrides = [*args.overrides, "train.eval_every=0"]
    with code_at(base, ("src", args.config)) as tree:
        sides = {"base": (tree / "src", tree / args.config), "current": (ROOT / "src", ROOT / args.config)}
        steps: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
        for _ in range(args.rounds):
            for side, (src, config) in sides.items():
                steps[side] += run_steps(src, config, args.steps, overrides + (args.current_set if side == "current" else []))
    result: dict = {side: {"mean": summary(rows), "steps": rows} for side, rows in steps.items()}
    b, c = result["base"]["mean"], result["current"]["mean"]
    result["ratios"] = {
        **{key: round(b[key] / max(c[key], 1e-9), 3) for key in ("step", "gen", "update")},
        "gen_tokens_per_s": round(c["gen_tokens_per_s"] / max(b["gen_tokens_per_s"], 1e-9), 3),
    }
    emit(
        "step_vs_commit",
        config={**arguments(args), "base": base, "overrides": overrides, "current_overrides": args.current_set},
        results=result,
        baseline=f"commit {base[:12]}: its own src/ and config",
        speedup=result["ratios"],
    )


if __name__ == "__main__":
    main()
