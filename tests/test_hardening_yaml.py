"""Config files that cannot be turned against the machine (issue 43, item 3).

A config is YAML a user may have been handed: a few lines of nested aliases (the "billion laughs")
used to expand into billions of values when the config was copied or printed (MemoryError under a
4 GB cap, `train` hanging), a key given twice silently lost its first value, an error message could
print a value of any size, and a misspelt scorer or tool in `task.options` was found only when the
first episode was scored. Each is now refused when the config loads, in one bounded line.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from trace_rl.infra.config import (
    MAX_CONFIG_BYTES,
    MAX_FREEFORM_DEPTH,
    MAX_FREEFORM_NODES,
    ConfigError,
    FieldError,
    TaskConfig,
    _show,
    from_dict,
    load_config,
    load_yaml,
    load_yaml_file,
)
from trace_rl.run import RunConfig

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.yaml"
MESSAGE_BOUND = 400
"""Longest one-line message a refusal may print, whatever the value it refuses."""


def alias_bomb(indent: str = "") -> str:
    """The billion laughs: 9 anchors, each a list of 9 aliases of the one before (9**9 'x' when expanded)."""
    lines = [f"{indent}a: &a [x, x, x, x, x, x, x, x, x]"]
    for previous, name in zip("abcdefgh", "bcdefghi"):
        lines.append(f"{indent}{name}: &{name} [{', '.join([f'*{previous}'] * 9)}]")
    return "\n".join(lines) + "\n"


def shared_bomb(levels: int = 9) -> list:
    """The value an alias bomb builds, made in code: one list shared 9 times at each of `levels` levels."""
    value: list = ["x"] * 9
    for _ in range(levels - 1):
        value = [value] * 9
    return value


def one_line(message: str) -> None:
    assert "\n" not in message and len(message) < MESSAGE_BOUND, (len(message), message[:500])


# ---------------------------------------------------------------- aliases


def test_an_alias_bomb_under_task_options_in_a_file_is_refused_at_once_naming_file_line_and_anchor(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text("seed: 0\ntask:\n  options:\n" + alias_bomb("    "))
    start = time.perf_counter()
    with pytest.raises(ConfigError) as refused:
        load_config(RunConfig, path)
    assert time.perf_counter() - start < 1.0
    message = str(refused.value)
    one_line(message)
    assert message.startswith(f"{path}, line 5: YAML alias *a refused"), message


@pytest.mark.parametrize(
    "override",
    [
        "task.options={a: &a [x, x, x], b: [*a, *a, *a]}",
        "task.options=[&a [x, x], *a]",
        "train.lr=*nowhere",  # an alias with no anchor: refused as an alias, not a YAML error
    ],
)
def test_an_alias_in_an_override_is_refused(override):
    with pytest.raises(ConfigError, match=r"^override '.*', line 1: YAML alias \*(a|nowhere) refused") as refused:
        load_config(RunConfig, None, [override])
    one_line(str(refused.value))


def test_a_merge_key_is_refused_too_since_it_needs_an_alias():
    with pytest.raises(ConfigError, match=r"cfg, line 3: YAML alias \*base refused"):
        load_yaml("base: &base {lr: 1}\ntrain:\n  <<: *base\n", "cfg")


def test_nesting_past_the_bound_is_a_message_not_a_recursion_error(tmp_path):
    path = tmp_path / "deep.yaml"
    path.write_text("task:\n  options:\n    a: " + "[" * 20_000 + "]" * 20_000 + "\n")
    with pytest.raises(ConfigError, match=f"^{path}, line 3: lists and mappings nested over 64 deep$"):
        load_config(RunConfig, path)


def _cap_memory() -> None:
    """preexec_fn of the CLI below: at most 2 GiB of address space, less than the bomb expands into."""
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


@pytest.mark.parametrize("where", ["file", "override"])
def test_the_cli_refuses_an_alias_bomb_in_one_line_under_a_memory_cap(tmp_path, where):
    """The issue's report, as a user runs it: `train` hung (or died of MemoryError under a cap)."""
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(SMOKE.read_text() + "\n" + alias_bomb() if where == "file" else SMOKE.read_text())
    extra = [] if where == "file" else ["task.options={a: &a [x, x, x, x, x, x, x, x, x], b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a], "
                                        "c: [*b, *b, *b, *b, *b, *b, *b, *b, *b]}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TRACE_RL_CACHE": str(tmp_path / "cache")}
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "trace_rl", "train", "--config", str(bomb), "--out", str(tmp_path / "run"), *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, preexec_fn=_cap_memory, check=False,
    )
    seconds = time.perf_counter() - start
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr and "MemoryError" not in done.stderr, done.stderr[-2000:]
    assert "YAML alias *a refused" in done.stderr and len(done.stderr) < MESSAGE_BOUND, done.stderr
    assert seconds < 30  # the interpreter and torch's import, not the config (which takes a millisecond)
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


# ---------------------------------------------------------------- duplicate keys


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("seed: 1\nprompts_per_step: 4\nseed: 2\n", "duplicate key 'seed' at lines 1 and 3"),
        ("train:\n  lr: 0.001\n  steps: 2\n  lr: 0.1\n", "duplicate key 'train.lr' at lines 2 and 4"),
        ("task:\n  options:\n    num_questions: 10\n    num_questions: 20\n", "duplicate key 'task.options.num_questions' at lines 3 and 4"),
        ("train: {lr: 0.1, lr: 0.2}\n", "duplicate key 'train.lr' twice on line 1"),
        ("seed: 1\n1: a\n0x1: b\n", "duplicate key '1' at lines 2 and 3"),  # the same key spelled two ways
    ],
)
def test_a_key_given_twice_is_refused_naming_it_and_both_lines(tmp_path, text, named):
    path = tmp_path / "twice.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as refused:
        load_config(RunConfig, path)
    message = str(refused.value)
    one_line(message)
    assert message.startswith(f"{path}: {named} "), message


def test_a_key_given_twice_in_an_override_value_is_refused():
    with pytest.raises(ConfigError, match=r"^override 'task.options=\{num_questions: 1, num_questions: 2\}': duplicate key 'num_questions' twice on line 1"):
        load_config(RunConfig, None, ["task.options={num_questions: 1, num_questions: 2}"])


def test_the_same_key_in_different_mappings_is_not_a_duplicate():
    assert load_yaml("a: {x: 1}\nb: {x: 2}\nc: [{x: 1}, {x: 2}]\n", "cfg") == {"a": {"x": 1}, "b": {"x": 2}, "c": [{"x": 1}, {"x": 2}]}


# ---------------------------------------------------------------- sizes, and values printed bounded


def test_a_config_file_over_the_size_bound_is_refused_before_parsing(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("seed: 0\n" + "#" * MAX_CONFIG_BYTES + "\n")
    with pytest.raises(ConfigError, match=f"^config {path} is over 256 KiB; no config is this large$"):
        load_config(RunConfig, path)


def test_an_endless_file_is_refused_after_the_size_bound_is_read():
    start = time.perf_counter()
    with pytest.raises(ConfigError, match="^config /dev/zero is over 256 KiB"):
        load_yaml_file("/dev/zero")
    assert time.perf_counter() - start < 5


def test_every_shipped_config_reads_the_same_as_plain_safe_load():
    """The strict loader refuses; it never changes what an accepted file means."""
    paths = sorted((ROOT / "configs").rglob("*.yaml"))
    assert paths
    for path in paths:
        assert load_yaml_file(path) == yaml.safe_load(path.read_text(encoding="utf-8")), path


HUGE_LIST = "[" + ", ".join(["1"] * 5_000) + "]"
HUGE_STRING = "'" + "y" * 50_000 + "'"
HUGE_MAPPING = "{" + ", ".join(f"k{i}: {i}" for i in range(2_000)) + "}"
"""Values whose repr is 15,000 to 50,000 characters: any that an error printed whole would fail the bound."""


@pytest.mark.parametrize(
    ("override", "named"),
    [
        (f"model={HUGE_LIST}", "model must be a mapping, got list: [1, 1, 1"),  # from_dict
        (f"engine.server_urls={HUGE_STRING}", "engine.server_urls must be a list, got 'yyy"),  # _coerce: list
        (f"task.options={HUGE_LIST}", "task.options must be a mapping, got [1, 1"),  # _coerce: mapping
        (f"model.download={HUGE_MAPPING}", "model.download must be true or false, got {'k0': 0"),  # _coerce: bool
        (f"seed={HUGE_LIST}", "seed must be an integer, got [1, 1"),  # _coerce: int
        (f"model.device={HUGE_LIST}", "model.device must be a string, got [1, 1"),  # _coerce: str
        (f"model.dtype={HUGE_STRING}", "model.dtype='yyy"),  # _coerce: Literal
        (f"task.search_url={HUGE_LIST}", "task.search_url must be a string, got [1, 1"),  # _coerce: Optional
        (f"train.lr='{'1' * 30_000}'", "train.lr must be a number, got '111"),  # the exponent regex backtracked over it for 10 s
        ("train.lr=" + "1" * 10_000, "not a usable YAML value: Exceeds the limit (4300 digits)"),  # int() refuses: no traceback
        (f"task.options={{num_questions: {HUGE_LIST}, nope: 1}}", "task.options must be options of multihop"),  # check_task_options
        (f"task.{'z' * 100_000}=1", "unknown config key 'task.zzz"),
        (f"{'s' * 100_000}.x=1", "unknown config key 'sss"),
    ],
)
def test_a_huge_value_is_printed_in_one_bounded_line(override, named):
    start = time.perf_counter()
    with pytest.raises(ConfigError) as refused:
        load_config(RunConfig, None, [override])
    assert time.perf_counter() - start < 2.0
    message = str(refused.value)
    one_line(message)
    assert named in message, message


@pytest.mark.parametrize(
    "value",
    [shared_bomb(), "y" * 10**6, 10**5000, 10**400, {"k" * 10**5: shared_bomb(7)}, list(range(10**5))],
    ids=["alias-bomb", "long-string", "huge-int", "long-int", "mapping", "long-list"],
)
def test_show_is_bounded_whatever_the_value(value):
    start = time.perf_counter()
    text = _show(value)
    assert time.perf_counter() - start < 0.1 and len(text) <= 120 and "\n" not in text, text


def test_show_of_a_value_that_holds_itself_and_of_a_short_value():
    loop: list = []
    loop.append(loop)
    assert _show(loop).startswith("[[")
    assert _show("cdua") == "'cdua'" and _show(-1.0) == "-1.0" and _show([1, 2]) == "[1, 2]"
    assert _show(10**400) == "1" + "0" * 59 + "... (401 characters)"


# ---------------------------------------------------------------- task.options bounded in depth and size


def nested(levels: int) -> object:
    value: object = 1
    for _ in range(levels):
        value = [value]
    return value


def test_task_options_nest_at_most_the_bound():
    TaskConfig(options={"a": nested(MAX_FREEFORM_DEPTH - 1)})  # the options mapping is the first level
    with pytest.raises(FieldError, match=r"^options.a\[0\]\[0\]\[0\]\[0\]\[0\]\[0\]\[0\] must be lists and mappings nested at most 8 deep"):
        TaskConfig(options={"a": nested(MAX_FREEFORM_DEPTH)})


def test_task_options_hold_at_most_the_bound_of_values():
    TaskConfig(options={"a": list(range(MAX_FREEFORM_NODES - 2))})  # the mapping, its list, and the items
    with pytest.raises(FieldError, match=f"^options must be at most {MAX_FREEFORM_NODES} values in all"):
        TaskConfig(options={"a": list(range(MAX_FREEFORM_NODES))})


@pytest.mark.parametrize("build", ["TaskConfig", "from_dict"])
@pytest.mark.parametrize(("levels", "bound"), [(6, "options must be at most 10000 values in all"), (9, r"options.a(\[8\]){7} must be lists and mappings nested at most 8 deep")])
def test_an_alias_bomb_built_in_code_is_refused_without_expanding_it(build, levels, bound):
    """What a YAML alias bomb builds, made without YAML (9**6 or 9**9 values if expanded): refused
    after at most 10,000 steps, never copied; the shallow one by its size, the deep one by its depth."""
    bomb = shared_bomb(levels)
    start = time.perf_counter()
    with pytest.raises(FieldError, match=f"^(task\\.)?{bound}") as refused:
        if build == "TaskConfig":
            TaskConfig(options={"a": bomb})
        else:
            from_dict(RunConfig, {"task": {"options": {"a": bomb}}})
    assert time.perf_counter() - start < 1.0
    one_line(str(refused.value))


def test_task_options_keys_are_names():
    with pytest.raises(ConfigError, match="^task.options must be a mapping with option names for keys, not 1"):
        load_config(RunConfig, None, ["task.options={1: 2}"])


# ---------------------------------------------------------------- scorer and tool names checked when the config loads


@pytest.fixture
def task_file(tmp_path: Path) -> str:
    path = tmp_path / "tasks.jsonl"
    path.write_text('{"question": "1 + 1?", "answer": "2"}\n')
    return f"task.name=file:{path}"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ("{scorer: exact_mach}", "task.options.scorer must be one of all_in_text, exact_match, f1, numeric, reasoning_gym, a module:function of your own or null, got 'exact_mach'; did you mean 'exact_match'?"),
        ("{scorer: 3}", "task.options.scorer must be one of all_in_text, exact_match, f1, numeric, reasoning_gym, a module:function of your own or null, got 3"),
        ("{tools: [python, calculater]}", "task.options.tools[1] must be one of search, calculator, python or a module:function of your own, got 'calculater'; did you mean 'calculator'?"),
        ("{tools: [serch]}", "task.options.tools[0] must be one of search, calculator, python or a module:function of your own, got 'serch'; did you mean 'search'?"),
        ("{tools: python}", "task.options.tools must be a list of tool names from search, calculator, python or null, got 'python'"),
        ("{tools: [python, python]}", "task.options.tools[1] must be a tool not already listed"),
        ("{format: gsm8}", "task.options.format must be one of verl, search_r1, hotpotqa, gsm8k, records or null, got 'gsm8'; did you mean 'gsm8k'?"),
    ],
)
def test_an_unknown_scorer_or_tool_is_refused_when_the_config_loads(task_file, options, message):
    with pytest.raises(FieldError) as refused:
        load_config(RunConfig, None, [task_file, f"task.options={options}"])
    assert str(refused.value).startswith(message), str(refused.value)


def test_known_scorers_and_tools_and_nulls_load(task_file):
    config = load_config(RunConfig, None, [task_file, "task.options={scorer: numeric, tools: [calculator, python], format: gsm8k}"])
    assert config.task.options == {"scorer": "numeric", "tools": ["calculator", "python"], "format": "gsm8k"}
    assert load_config(RunConfig, None, [task_file, "task.options={scorer: null, tools: null}"]).task.options == {"scorer": None, "tools": None}
    assert load_config(RunConfig, None, [task_file, "task.options={tools: []}"]).task.options == {"tools": []}


def test_a_reasoning_gym_task_s_tools_are_checked_and_cannot_be_null():
    pytest.importorskip("reasoning_gym")
    with pytest.raises(FieldError, match=r"^task.options.tools\[0\] must be one of search, calculator, python, got 'pyton'; did you mean 'python'\?"):
        load_config(RunConfig, None, ["task.name=rg:chain_sum", "task.options={tools: [pyton]}"])
    with pytest.raises(FieldError, match="^task.options.tools must be a list of tool names from search, calculator, python, got None"):
        load_config(RunConfig, None, ["task.name=rg:chain_sum", "task.options={tools: null}"])


def test_a_comparison_names_the_run_s_bad_tool_under_run(task_file):
    from trace_rl.research.compare import CompareConfig

    with pytest.raises(FieldError, match=r"^run.task.options.tools\[0\] must be one of search, calculator, python or a module:function of your own, got 'nope'"):
        load_config(CompareConfig, ROOT / "configs" / "compare.yaml", ["run." + task_file, "run.task.options={tools: [nope]}"])


def test_the_cli_refuses_an_unknown_scorer_before_any_work(tmp_path, task_file):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TRACE_RL_CACHE": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, "-m", "trace_rl", "train", "--config", str(SMOKE), "--out", str(tmp_path / "run"), task_file, "task.options={scorer: numerc}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "task.options.scorer must be one of" in done.stderr and "got 'numerc'; did you mean 'numeric'?" in done.stderr, done.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()
