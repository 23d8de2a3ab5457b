"""benchmarks/ is the speed suite: every script prints one JSON shape (benchmarks/common.py) and
`make bench` runs every one (`make bench-real` the SmolLM2 one). The quickest runs here; `-m slow`
runs every `make bench` benchmark in its `--quick` mode."""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys

import pytest
from repo_files import REPO, load

BENCHMARKS = REPO / "benchmarks"
HELPERS = {"common", "hardware"}
"""Modules the benchmarks import, not benchmarks themselves."""
SPEED = sorted(p.stem for p in BENCHMARKS.glob("*.py") if p.stem not in HELPERS)


def make_rule(target: str) -> list[str]:
    """The recipe lines of `target` in the Makefile."""
    lines = (REPO / "Makefile").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(rf"{re.escape(target)}\s*:(?!=)", line))
    recipe = []
    for line in lines[start + 1 :]:
        if not line.startswith("\t"):
            break
        recipe.append(line.strip())
    return recipe


def scripts_in(recipe: list[str]) -> list[str]:
    return [m.group(1) for line in recipe for m in re.finditer(r"benchmarks/(\w+)\.py", line)]


def run_quick(name: str, *extra: str, timeout: float = 600) -> dict:
    done = subprocess.run([sys.executable, str(BENCHMARKS / f"{name}.py"), "--quick", *extra], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def check_shape(record: dict, name: str) -> None:
    common = load("benchmarks/common.py")
    assert tuple(record) == common.KEYS
    assert record["bench"] == name
    assert {"cpu_model", "cpus", "cpuinfo_flags", "cpu_capability", "matmul_gflops_fp32"} <= record["machine"].keys()
    assert record["machine"]["matmul_gflops_fp32"] > 0
    assert record["config"]["quick"] is True
    assert isinstance(record["results"], dict) and record["results"]
    speedup = record["speedup"]
    assert speedup is None or isinstance(speedup, (int, float)) or all(v is None or isinstance(v, (int, float)) for v in speedup.values())
    assert (record["baseline"] is None) == (speedup is None) or name == "soak"  # soak compares memory, not speed


def test_make_bench_runs_every_speed_benchmark_and_nothing_else():
    """A new script in benchmarks/ must join `make bench` (in --quick mode) or `make bench-real`."""
    bench, real = scripts_in(make_rule("bench")), scripts_in(make_rule("bench-real"))
    assert len(bench) == len(set(bench)), bench
    assert sorted(bench + real) == SPEED, "benchmarks/ and the Makefile's bench / bench-real lists differ"
    assert real == ["real_lm_step"]
    assert all("--quick" in line for line in make_rule("bench") if "benchmarks/" in line)
    assert not any("trace-rl bench" in line for line in make_rule("bench")), "allocation quality is an experiment"


@pytest.mark.parametrize("name", SPEED)
def test_every_speed_benchmark_prints_through_the_common_printer(name):
    """Statically: `emit("<its name>", ...)` and no JSON printed to stdout beside it; `--quick` through
    `common.parse_args` for every script `make bench` runs."""
    tree = ast.parse((BENCHMARKS / f"{name}.py").read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
    emits = [c for c in calls if c.func.id == "emit"]
    assert len(emits) == 1, f"{name} must print its result once through common.emit"
    assert isinstance(emits[0].args[0], ast.Constant) and emits[0].args[0].value == name
    assert {k.arg for k in emits[0].keywords} == {"config", "results", "baseline", "speedup"}
    for call in calls:
        if call.func.id == "print" and not any(k.arg == "file" for k in call.keywords):
            dumped = [n for n in ast.walk(call) if isinstance(n, ast.Attribute) and n.attr == "dumps"]
            assert not dumped, f"{name} prints JSON to stdout beside emit (line {call.lineno})"
    if name in scripts_in(make_rule("bench")):
        assert any(c.func.id == "parse_args" for c in calls), f"{name} takes no --quick (common.parse_args)"


def test_emit_prints_one_object_of_the_suites_shape_on_the_last_line(capsys):
    common = load("benchmarks/common.py")
    record = common.emit("x", config={"n": 1}, results={"t": 2.0}, baseline="y", speedup={"a": 3.0})
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed == record
    assert tuple(printed) == common.KEYS == ("bench", "machine", "config", "results", "baseline", "speedup")


def test_quick_sets_defaults_that_explicit_arguments_still_override():
    common = load("benchmarks/common.py")

    def parse(argv):
        parser = argparse.ArgumentParser()
        parser.add_argument("--steps", type=int, default=100)
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("overrides", nargs="*")
        return common.parse_args(parser, argv, steps=3, overrides=["a=1"])

    assert vars(parse([])) == {"steps": 100, "seed": 0, "overrides": [], "quick": False}
    assert vars(parse(["--quick"])) == {"steps": 3, "seed": 0, "overrides": ["a=1"], "quick": True}
    assert vars(parse(["--quick", "--steps", "7", "b=2"])) == {"steps": 7, "seed": 0, "overrides": ["b=2"], "quick": True}


def test_allocate_speed_quick_prints_the_shape_and_exact_objectives():
    """The quickest benchmark, run as `make bench` runs it (a few seconds)."""
    record = run_quick("allocate_speed", timeout=120)
    check_shape(record, "allocate_speed")
    assert record["results"]["expand_prefixes"]["objectives_match"]
    assert record["results"]["allocate_roots"]["max_per_prompt_32"]["objectives_match"]
    assert set(record["speedup"]) == {"allocate_roots_max_per_prompt_32", "allocate_roots_uncapped_at_reference_size", "expand_prefixes"}


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in scripts_in(make_rule("bench")) if n != "allocate_speed"])
def test_every_make_bench_benchmark_runs_quick(name):
    """What `make bench` runs, one script at a time (10-40 s each on 2 cores)."""
    check_shape(run_quick(name), name)
