"""Every config value is refused before any work when it is wrong (issue 12, class 3; class 2's
values that used to be accepted silently are in test_hardening_values.py).

The walk covers every field of every section, reached from `RunConfig` and `CompareConfig` through
`dataclasses.fields`, with wrong-type, NaN / inf and out-of-range values, through the real `main`
with the task, model and warm-start loaders replaced by ones that fail the test if called. A field
added without a bad value in `OUT_OF_RANGE` (or a reason in `UNCONSTRAINED`) fails the walk.
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
import time
import types
import typing
from pathlib import Path
from typing import Any, Literal

import pytest

from trace_rl import cli
from trace_rl.infra.config import ConfigError, FieldError, load_config
from trace_rl.research.compare import CompareConfig
from trace_rl.rollout.collector import RolloutConfig
from trace_rl.run import RunConfig
from trace_rl.training.sft import SFTConfig
from trace_rl.training.trainer import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.yaml"
COMPARE = ROOT / "configs" / "compare.yaml"

OUT_OF_RANGE: dict[str, list[str]] = {
    # keys of RunConfig; CompareConfig's `run.*` fields reuse them. Values are override YAML, applied
    # to configs/smoke.yaml (rollout.budget 16, rollout.max_new_tokens 48, prompts_per_step 4).
    "seed": ["-1", "4294967296"],
    "prompts_per_step": ["0"],
    "model.name": ["nope", "./no/such/model/folder"],
    "model.warm_start": ["false"],  # with model.name=tiny
    "model.device": ["cdua", "cuda:99"],
    "engine.name": ["openai"],  # without engine.server_urls
    "engine.server_urls": ["[ftp://host]", "['']"],
    "engine.server_timeout_s": ["0", "-1"],
    "engine.server_retries": ["-1", "101"],
    "engine.server_retry_wait_s": ["-1", "3601"],
    "engine.weight_sync": ["vllm", "nccl"],  # vllm with engine hf: the hf engine shares the weights
    "engine.weight_dir": ["' '"],
    "engine.max_batch_size": ["0"],
    "engine.prefix_cache_mb": ["-1"],
    "engine.generation_precision": ["fp16", "float32"],
    "model.cpu_threads": ["0"],
    "model.lora_rank": ["-1", "4097"],
    "model.lora_alpha": ["0"],
    "task.name": ["nope", "rg:no_such_dataset", "file:/no/such/tasks.jsonl"],
    "task.train_tasks": ["0", "-1"],
    "task.demo_tasks": ["0", "-1"],
    "task.test_tasks": ["0", "-1"],
    "task.max_turns": ["0"],
    "task.few_shot": ["-1", "9", "2.5"],
    "task.topk": ["0", "-1"],
    "task.max_observation_chars": ["0"],
    "task.search_url": ["localhost:8000", "ftp://host"],
    "task.env": ["HintEnv", "file:own_env.py", "no_such_module_xyz:make_env", "tests/no_such_file.py:make_env"],
    "task.seed": ["-1"],
    "task.options": ["{no_such_option: 1}", "[1, 2]"],
    "task.sandbox.python": ["python3"],
    "sft.demos": ["0"],
    "sft.mistake_prob": ["-0.1", "1"],
    "sft.steps": ["0"],
    "sft.batch_size": ["0"],
    "sft.lr": ["0", "-1"],
    "sft.warmup_steps": ["-1"],
    "sft.weight_decay": ["-1"],
    "sft.max_seq_len": ["0"],
    "sft.seed": ["-1"],
    "rollout.budget": ["0", "1", "1000000000"],
    "rollout.budget_unit": ["bytes"],
    "rollout.stage1_share": ["0", "1.5"],
    "rollout.min_per_prompt": ["1"],
    "rollout.max_per_prompt": ["1"],
    "rollout.max_per_prefix": ["0"],
    "rollout.pcl_keep_share": ["0", "1.5"],
    "rollout.brace.group_size": ["1", "0"],
    "rollout.brace.eps": ["-0.1", "1.5"],
    "rollout.brace.temperature": ["0", "-1"],
    "rollout.brace.decay": ["0", "1.5"],
    "rollout.brace.warm_cap_successes": ["-1"],
    "rollout.brace.warm_cap_failures": ["-1"],
    "rollout.brace.concentration": ["0", "-2"],
    "rollout.brace.warm_bank": ["[3]", '[""]'],
    "rollout.max_new_tokens": ["0"],
    "rollout.max_context_tokens": ["0", "48"],
    "rollout.temperature": ["-1"],
    "rollout.top_p": ["0", "1.5"],
    "rollout.success_threshold": ["-0.5", "1"],
    "rollout.env_workers": ["0"],
    "rollout.workers": ["0", "2"],  # 2 with rollout.backend=local: workers are Ray actors
    "predictor.advanced.num_features": ["1", "1000000000000"],
    "predictor.max_ngram": ["0"],
    "predictor.learning_rate": ["0"],
    "predictor.advanced.l2": ["-1"],
    "predictor.advanced.epochs": ["0"],
    "predictor.guard_window": ["0"],
    "predictor.advanced.batch_size": ["0"],
    "predictor.advanced.initial_accumulator": ["0"],
    "predictor.advanced.replay_batches": ["-1"],
    "predictor.advanced.root_epochs": ["0"],
    "predictor.advanced.max_logit_step": ["-1"],
    "predictor.advanced.calibration_batches": ["-1"],
    "predictor.advanced.calibration_prior": ["0"],
    "predictor.advanced.calibration_margin": ["-0.1", "1"],
    "predictor.advanced.calibration_max_slope": ["-1"],
    "train.steps": ["-1"],
    "train.lr": ["0", "-1"],
    "train.weight_decay": ["-1"],
    "train.epochs": ["0"],
    "train.mini_batches": ["0"],
    "train.micro_batch_size": ["0"],
    "train.clip_low": ["-0.1", "1"],
    "train.clip_high": ["-1"],
    "train.kl_coef": ["-1"],
    "train.grad_clip": ["-1", "0"],
    "train.advantage": ["grop"],
    "train.advantage_options": ["{bogus: 1}", "{eps: -1}"],
    "train.eval_every": ["-1"],
    "train.eval_samples": ["0"],
    "train.checkpoint_every": ["0"],
    "train.dapo_max_rounds": ["0"],
    "train.wandb_project": ["''"],
    # CompareConfig's own fields
    "compare:methods": ["[]", "[grpo, grpo]"],
    "compare:seeds": ["[]", "[-1]", "[0, 0]"],
    "compare:accuracy": ["val/accuracy_typo"],
    "compare:workers": ["0"],
    "compare:variants": ["{trace: {rollout.method: trace}}", "{mine: {rollout.budget: 8}}", "{mine: {rollout.method: trace, rollout.budget: 0}}"],
}

UNCONSTRAINED: dict[str, str] = {
    "model.download": "both values are settings (true only lets a hub id through)",
    "model.split_digits": "both values are settings with the smoke config's tiny model; true with another model is refused (its own test)",
    "model.dtype": "a Literal: every choice is a setting; its wrong-type case is its only bad value",
    "task.format": "a Literal: every choice is a setting",
    "task.sandbox.isolation": "a Literal: every choice is a setting (an unusable one fails with its own one-line error)",
    "rollout.method": "a Literal: every method is a setting",
    "rollout.backend": "a Literal: every choice is a setting (ray is refused only where the ray package is missing)",
    "train.update": "a Literal: every choice is a setting",
    "train.precision": "a Literal: every choice is a setting",
    "sft.precision": "a Literal: every choice is a setting",
    "sft.packing": "both values are settings (false: the right-padded rows of the recipe before)",
    "predictor.guard": "both values are settings",
    "predictor.turn_features": "both values are settings",
    "rollout.stage2_objective": "a Literal: every choice is a setting",
    "task.open_thought": "a bool or null (the model's profile): every value is a setting",
    "rollout.stage2_evidence": "a bool: both are settings for the default method (true with a Stage 2 that reads no values is refused: tests/test_evidence.py)",
    "train.eval_on_start": "both values are settings",
    "train.save_trees": "both values are settings",
    "train.tensorboard": "both values are settings; true is refused only where the tensorboard package is missing",
    "compare:evaluate_start": "both values are settings",
    "compare:warm_start_per_seed": "both values are settings",
    "rollout.brace.exclude_certified": "both values are settings",
    "rollout.stage2_expected": "a bool: true without stage2_evidence is refused (tests/test_stage2_expected.py)",
}


def leaf_fields(cls: type, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, type hint) of every non-section field below `cls`."""
    hints = typing.get_type_hints(cls)
    found = []
    for item in dataclasses.fields(cls):
        hint = hints[item.name]
        if dataclasses.is_dataclass(hint):
            found += leaf_fields(hint, f"{prefix}{item.name}.")
        else:
            found.append((prefix + item.name, hint))
    return found


def bad_values(hint: Any) -> list[str]:
    """Override values of the wrong type for `hint`, plus NaN and ±inf for numbers."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = args[0]
    origin = typing.get_origin(hint)
    if origin is Literal:
        return ["no_such_choice", "3"]
    if origin is list:
        return ["3", "{a: 1}"]
    if origin is dict:
        return ["3", "[1]"]
    if hint is bool:
        return ["2", "yes please"]
    if hint is int:
        return ["abc", "1.5", ".nan", ".inf"]
    if hint is float:
        return ["abc", "[1]", ".nan", ".inf", "-.inf"]
    if hint is str:
        return ["3", "[a, b]"]
    raise AssertionError(f"no wrong-type values for {hint!r}: extend bad_values")


def cases() -> list[tuple[str, str, str]]:
    """(command, full dotted key, override value) for every field of both configs."""
    found = []
    for key, hint in leaf_fields(RunConfig):
        found += [("train", key, value) for value in bad_values(hint) + OUT_OF_RANGE.get(key, [])]
    for key, hint in leaf_fields(CompareConfig):
        table_key = key.removeprefix("run.") if key.startswith("run.") else f"compare:{key}"
        found += [("compare", key, value) for value in bad_values(hint) + OUT_OF_RANGE.get(table_key, [])]
    return found


def test_every_field_has_bad_values_or_a_reason_to_have_none():
    keys = {key for key, _ in leaf_fields(RunConfig)} | {f"compare:{k}" for k, _ in leaf_fields(CompareConfig) if not k.startswith("run.")}
    missing = sorted(keys - OUT_OF_RANGE.keys() - UNCONSTRAINED.keys())
    stale = sorted((OUT_OF_RANGE.keys() | UNCONSTRAINED.keys()) - keys)
    both = sorted(OUT_OF_RANGE.keys() & UNCONSTRAINED.keys())
    assert not missing, f"give these fields out-of-range values in OUT_OF_RANGE, or a reason in UNCONSTRAINED: {missing}"
    assert not stale and not both, (stale, both)


@pytest.fixture
def no_work(monkeypatch):
    """Any task, model or warm-start load fails the test: a bad value must be refused before them."""
    import trace_rl.models
    import trace_rl.research.compare
    import trace_rl.run

    def forbidden(*args, **kwargs):
        raise AssertionError("work started before the config was refused")

    for module, name in [(trace_rl.run, "load_taskset"), (trace_rl.run, "warm_start"), (trace_rl.run, "build_parts"),
                         (trace_rl.run, "policy_source"), (trace_rl.run, "train_run"), (trace_rl.models, "load_policy"),
                         (trace_rl.research.compare, "run_compare")]:
        monkeypatch.setattr(module, name, forbidden)


@pytest.mark.parametrize(("command", "key", "value"), cases(), ids=[f"{c}-{k}={v}" for c, k, v in cases()])
def test_a_bad_value_of_any_field_is_refused_in_one_line_naming_its_key_before_any_work(
    no_work, tmp_path, capsys, command, key, value
):
    config = SMOKE if command == "train" else COMPARE
    code = cli.main([command, "--config", str(config), "--out", str(tmp_path / "out"), f"{key}={value}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith(f"trace-rl {command}: "), err
    assert key in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "build",
    [
        lambda: TrainConfig(lr=math.nan),
        lambda: TrainConfig(clip_low=math.nan),
        lambda: TrainConfig(grad_clip=-1.0),
        lambda: SFTConfig(lr=math.inf),
        lambda: RolloutConfig(success_threshold=math.nan),
        lambda: RolloutConfig(temperature=math.inf),
        lambda: RolloutConfig(budget=1),
    ],
    ids=["train.lr", "train.clip_low", "train.grad_clip", "sft.lr", "rollout.success_threshold", "rollout.temperature", "rollout.budget"],
)
def test_a_section_built_in_code_refuses_what_the_loader_refuses(build):
    with pytest.raises(FieldError):  # NaN is refused by the range check itself, not only by the YAML loader
        build()


def test_split_digits_is_refused_for_a_model_that_brings_its_own_tokenizer():
    with pytest.raises(FieldError, match="split_digits"):
        load_config(RunConfig, SMOKE, ["model.name=smollm2-135m", "model.split_digits=true"])


def test_a_cap_per_prompt_that_cannot_hold_stage_1_s_budget_is_refused():
    # Stage 1 gets 8 of the 16 leaves; 3 prompts at most 2 each hold only 6.
    with pytest.raises(ConfigError, match=r"rollout.max_per_prompt must be >= 3 or null \(8 Stage-1 rollouts over at most 3 prompts"):
        load_config(RunConfig, SMOKE, ["prompts_per_step=3", "rollout.max_per_prompt=2"])
    assert load_config(RunConfig, SMOKE, ["prompts_per_step=3", "rollout.max_per_prompt=3"]).rollout.max_per_prompt == 3


def test_knapsack_below_its_floors_is_refused_and_at_them_warned_as_grpo():
    # smoke: 4 prompts a step, 16 leaves. Knapsack-RL's floors (2 a prompt) must fit the budget; once
    # the rates were known a budget below them failed steps into the run.
    with pytest.raises(ConfigError, match=r"rollout.budget must be >= 24 for method knapsack .*prompts_per_step=12"):
        load_config(RunConfig, SMOKE, ["rollout.method=knapsack", "prompts_per_step=12"])
    with pytest.warns(UserWarning, match="floors take the whole budget, so every prompt gets 2 rollouts, exactly what grpo does"):
        load_config(RunConfig, SMOKE, ["rollout.method=knapsack", "prompts_per_step=8"])
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_config(RunConfig, SMOKE, ["rollout.method=knapsack"]).rollout.budget == 16  # 4 floors of 2, 8 to allocate


def test_a_comparison_checks_its_shared_run_config_for_every_method():
    # trace's estimator takes prefix_coef, grpo's does not: the grpo runs would fail after the warm start.
    with pytest.raises(ConfigError, match=r"run.train.advantage_options must be options estimator 'grpo' takes.* for method grpo"):
        load_config(CompareConfig, COMPARE, ["methods=[trace, grpo]", "run.rollout.method=trace", "run.train.advantage_options={prefix_coef: 0.5}"])


class _WordTokenizer:
    """One token per whitespace-separated word of the rendered chat: enough to measure prompts."""

    def apply_chat_template(self, messages, *, add_generation_prompt: bool, tokenize: bool) -> str:
        return " ".join(m["content"] for m in messages)

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return list(range(len(text.split())))


def test_a_context_too_short_for_the_longest_prompt_and_two_turns_is_refused_once_the_tokenizer_is_known():
    from trace_rl.agent.tasks import load_taskset
    from trace_rl.rollout.collector import encode_prompt
    from trace_rl.run import build_env, check_context_room

    config = load_config(RunConfig, SMOKE)
    tasks = load_taskset("multihop", split="test", num_tasks=20)
    env = build_env(config, tasks)
    longest = max(len(encode_prompt(_WordTokenizer(), env, t)) for t in tasks.tasks)
    check_context_room(config, _WordTokenizer(), env, [tasks])  # 2048 tokens hold it
    short = load_config(RunConfig, SMOKE, [f"rollout.max_context_tokens={longest + 2 * 48 - 1}"])
    with pytest.raises(FieldError, match=rf"rollout.max_context_tokens must be >= {longest + 96} \(the longest prompt has {longest} tokens"):
        check_context_room(short, _WordTokenizer(), env, [tasks])
    one_turn = load_config(RunConfig, SMOKE, [f"rollout.max_context_tokens={longest + 48}", "task.max_turns=1"])
    check_context_room(one_turn, _WordTokenizer(), env, [tasks])  # a one-turn task needs room for one turn


def test_an_override_that_is_not_yaml_is_refused_on_one_line(no_work, tmp_path, capsys):
    assert cli.main(["train", "--config", str(SMOKE), "--out", str(tmp_path / "out"), "rollout.budget=[1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "override 'rollout.budget=[1'" in err, err


@pytest.mark.parametrize("samples", ["0", "-2", "x"])
def test_eval_refuses_a_sample_count_below_one_before_any_work(no_work, samples):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["eval", "--config", str(SMOKE), "--samples", samples])
    assert exit_info.value.code == 2


# ---------------------------------------------------------------- the real CLI, as a user runs it


def trace_rl(*args: str, cache: Path) -> tuple[int, str, float]:
    """(exit code, stderr, seconds) of `python -m trace_rl ARGS`, with a private model cache."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TRACE_RL_CACHE": str(cache)}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "trace_rl", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)
    return done.returncode, done.stderr, time.perf_counter() - start


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("rollout.budget=1", "rollout.budget must be >= min_per_prompt=2"),
        ("rollout.budget=1000000000", "rollout.budget must be in [1, 65536]"),
        ("train.checkpoint_every=0", "train.checkpoint_every must be >= 1, got 0"),
        ("task.name=multihopp", "task.name must be one of multihop, toolmath"),
        ("model.name=no-such-model", "model.name must be a preset (tiny, smollm2-135m)"),
    ],
)
def test_the_cli_refuses_the_issue_s_examples_at_once(tmp_path, override, named):
    code, err, seconds = trace_rl("train", "--config", str(SMOKE), "--out", str(tmp_path / "run"), override, cache=tmp_path / "cache")
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert named in err, err
    assert seconds < 60 and not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


def test_the_cli_refuses_a_config_that_is_a_folder_or_not_utf8(tmp_path):
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("seed: 0  # caf\xe9\n".encode("latin-1"))
    for config, named in [(tmp_path, "is a folder, not a YAML file"), (latin1, "is not UTF-8 text (byte 14 is 0xe9)")]:
        code, err, _ = trace_rl("train", "--config", str(config), "--out", str(tmp_path / "run"), cache=tmp_path / "cache")
        assert code == 2 and err.count("\n") == 1 and "Traceback" not in err and named in err, err


def test_the_cli_checks_out_before_any_work(tmp_path):
    afile = tmp_path / "a_file"
    afile.write_text("")
    for command, out, named in [
        ("rollout", tmp_path / "missing" / "trees.jsonl", "does not exist"),
        ("rollout", tmp_path, "is a folder"),
        ("train", afile, "is a file, not a folder"),
        ("train", afile / "run", "is a file, not a folder"),
    ]:
        code, err, _ = trace_rl(command, "--config", str(SMOKE), "--out", str(out), cache=tmp_path / "cache")
        assert code == 2 and err.count("\n") == 1 and "Traceback" not in err and f"--out {out}" in err and named in err, err
        assert not (tmp_path / "cache").exists()  # refused before the warm start, which would fill the cache
