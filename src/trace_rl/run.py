"""A run's full config, the parts built from it (tasks, env, policy, engine, predictor, collector),
and `train_run`, which trains one run folder.

Commands (`rollout`, `train`, `compare`, `eval`) call `build_parts(config)` so that every run is
assembled the same way from one typed config, and every config value is checked when the config is
loaded, before any of it is built.
"""

from __future__ import annotations

import difflib
import functools
import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from trace_rl.agent.agents import worked_examples
from trace_rl.agent.env import ENV_METHODS, Env, ToolEnv, protocol_gaps
from trace_rl.agent.protocol import WorkedExample
from trace_rl.agent.scoring import dry_run_reward, score
from trace_rl.agent.tasks import (
    TASKSETS,
    available_tasksets,
    load_taskset,
    option_names,
)
from trace_rl.agent.types import Task, TaskSet
from trace_rl.engine.base import Engine
from trace_rl.infra.config import (
    MAX_SEED,
    ConfigError,
    EngineConfig,
    FieldError,
    ModelConfig,
    TaskConfig,
    check_range,
    apply_override,
    did_you_mean,
    from_dict,
    load_config,
    load_yaml,
    load_yaml_file,
    show_value,
)
from trace_rl.infra.references import BadReference, is_reference, resolve
from trace_rl.predictor import BraceBank, PredictorConfig, SuccessPredictor, bank_counts
from trace_rl.predictor import build_predictor as make_predictor
from trace_rl.rollout.collector import (
    Executor,
    RolloutConfig,
    RolloutRunner,
    TreeRolloutCollector,
    encode_prompt,
)
from trace_rl.storage.rundir import RunDir, RunDirError, RunDirWarning
from trace_rl.training.sft import SFTConfig, warm_start
from trace_rl.training.trainer import (
    StopRequest,
    TrainConfig,
    Trainer,
    TrainingSetup,
    held_out_accuracy,
)


@dataclass
class RunConfig:
    """Everything a run depends on; saved as `config.yaml` in the run folder."""

    seed: int = 0
    """Seeds the policy init, sampling, allocation baselines and the predictor."""
    prompts_per_step: int = 16
    """Candidate prompts drawn per batch (Stage 1 may give some of them no rollouts)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """`rollout.method` is the run's method (`trace_rl.planning.methods.METHODS`)."""
    predictor: PredictorConfig = field(default_factory=PredictorConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    RENAMED_KEYS: ClassVar[dict[str, str]] = {
        "model.engine": "engine.name",
        **{f"model.{key}": f"engine.{key}" for key in (
            "server_urls", "server_timeout_s", "server_retries", "server_retry_wait_s", "weight_sync", "weight_dir",
            "max_batch_size", "generation_precision", "prefix_cache_mb")},
    }
    """Keys that moved (old -> new dotted name): a config or run folder that uses an old one still loads,
    with a warning (`config.from_dict`)."""

    def __post_init__(self) -> None:
        """The checks that span sections or ask the machine; each section checked its own ranges."""
        check_range(self, "seed", ge=0, le=MAX_SEED)
        check_range(self, "prompts_per_step", ge=1)
        check_stage1_cap(self)
        check_knapsack_floors(self)
        try:
            self.train.estimator(self.rollout.spec)  # the options of the method's estimator, which depends on both sections
        except FieldError as exc:
            raise exc.under("train.") from exc
        check_task_name(self.task.name)
        check_task_options(self.task)
        check_task_env(self.task)
        check_model(self.model)
        apply_profile(self)


KEYS_ADDED: dict[str, Any] = {"task.few_shot": 0, "task.open_thought": False}
"""Keys a run folder's config.yaml may predate (it lists every key its trace-rl knew), with what a run
written before them did. In a config of one's own a missing key is left to the model's profile; in a
run folder's it must mean what that run ran with, or a resume would change it."""


def load_run_config(path: str | Path, overrides: Sequence[str] = ()) -> RunConfig:
    """A run folder's config (its config.yaml, or a checkpoint's copy of it), the keys it predates set as
    that run had them (`KEYS_ADDED`), then `overrides`."""
    return from_dict(RunConfig, run_config_data(load_yaml_file(path), overrides))


def run_config_data(data: Any, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """A run folder's config data with the keys it predates filled (`KEYS_ADDED`), then `overrides`."""
    data = dict(data) if isinstance(data, dict) else {}
    for dotted, value in KEYS_ADDED.items():
        section, key = dotted.split(".")
        part = data.get(section)
        if part is None or isinstance(part, dict):
            data[section] = {key: value, **(part or {})}
    for item in overrides:
        apply_override(data, item)
    return data


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
"""A Hugging Face hub id (`org/name` or `name`)."""


def apply_profile(config: RunConfig) -> None:
    """Fill what the config leaves to the model (`task.format: auto`, `task.open_thought: null`,
    `rollout.temperature: null`) from its prompt profile (`trace_rl.models.profiles`), so the saved
    config.yaml says what the run used. `task.few_shot: null` is settled by `build_env`, which sees
    whether the task set can play examples."""
    from trace_rl.models.profiles import profile_for

    profile = profile_for(config.model.name)
    task = config.task
    if task.format == "auto":
        task.format = profile.format  # type: ignore[assignment]
    if task.open_thought is None:
        task.open_thought = profile.open_thought
    if task.few_shot and task.env is not None:
        raise FieldError("task.few_shot", task.few_shot, f"0 with task.env={task.env!r} (worked examples are the bundled ToolEnv's turns)")
    if config.rollout.temperature is None:
        config.rollout.temperature = profile.temperature


def check_stage1_cap(config: RunConfig) -> None:
    """FieldError when `rollout.max_per_prompt` leaves Stage 1's budget no exact split over
    `prompts_per_step` prompts (each gets 0 or [min_per_prompt, max_per_prompt] rollouts). A token
    budget is spent up to what the caps allow, so it needs no exact split."""
    rollout = config.rollout
    if rollout.max_per_prompt is None or rollout.budget_unit == "tokens":
        return
    budget, low = rollout.stage1_budget, rollout.min_per_prompt
    most_prompts = min(config.prompts_per_step, budget // low)
    need = -(-budget // most_prompts)  # the smallest cap that holds the budget on that many prompts
    if rollout.max_per_prompt < need:
        raise FieldError(
            "rollout.max_per_prompt", rollout.max_per_prompt,
            f">= {need} or null ({budget} Stage-1 rollouts over at most {most_prompts} prompts of prompts_per_step={config.prompts_per_step})",
        )


def check_knapsack_floors(config: RunConfig) -> None:
    """Knapsack-RL gives every candidate prompt its floor (`rollout.min_per_prompt`) before it allocates
    the rest, so a budget below `prompts_per_step` floors fails once the prompts' rates are known (a
    FieldError now, not a crash steps into the run), and a budget of exactly that many floors leaves
    nothing to allocate: every prompt gets `min_per_prompt`, which is `grpo` under another name
    (a warning: a comparison may want that row, but nobody should think it allocates)."""
    rollout = config.rollout
    if rollout.method != "knapsack" or rollout.budget_unit != "leaves":
        return
    floors = config.prompts_per_step * rollout.min_per_prompt
    if rollout.budget < floors:
        raise FieldError(
            "rollout.budget", rollout.budget,
            f">= {floors} for method knapsack (its floors: min_per_prompt={rollout.min_per_prompt} for each of prompts_per_step={config.prompts_per_step})",
        )
    if rollout.budget == floors:
        warnings.warn(
            f"rollout.method=knapsack with rollout.budget={rollout.budget} = prompts_per_step={config.prompts_per_step} x "
            f"min_per_prompt={rollout.min_per_prompt}: Knapsack-RL's floors take the whole budget, so every prompt gets "
            f"{rollout.min_per_prompt} rollouts, exactly what grpo does; raise the budget or lower prompts_per_step for it to allocate",
            stacklevel=2,
        )


def check_task_name(name: str) -> None:
    """FieldError unless `task.name` is a task set `load_taskset` can load here, without loading it."""
    if name in TASKSETS:
        return
    if name.startswith("rg:"):
        from trace_rl.agent.tasks.reasoning_gym import dataset_names

        try:
            names = dataset_names()
        except ImportError as exc:
            raise FieldError("task.name", name, "a bundled task set: rg:<dataset> needs reasoning-gym (pip install 'trace-rl[data]')") from exc
        if name[3:] not in names:
            close = difflib.get_close_matches(name[3:], names, n=1)
            raise FieldError("task.name", name, "rg:<a reasoning-gym dataset>", f"; did you mean 'rg:{close[0]}'?" if close else "")
        return
    if name.startswith("file:"):
        if not Path(name[5:]).is_file():
            raise FieldError("task.name", name, "file:<the path of an existing task file>")
        return
    if is_reference(name):
        from trace_rl.agent.tasks import check_name

        try:
            check_name(name)
        except ValueError as exc:
            raise FieldError("task.name", name, f"a function that returns your task set ({exc})") from exc
        return
    close = difflib.get_close_matches(name, list(TASKSETS), n=1)
    raise FieldError("task.name", name, "one of " + ", ".join(available_tasksets()), f"; did you mean {close[0]!r}?" if close else "")


def check_task_options(task: TaskConfig) -> None:
    """FieldError unless every key of `task.options` is an option of `task.name`'s loader, and the
    options that name registered things (`scorer`, `tools`, a file's `format`) name ones that exist.

    Run by `RunConfig.__post_init__`, so when any config loads (train, eval, compare, rollout,
    verl-data, a resumed run's config.yaml), before any model or task: without it a misspelt scorer
    or tool is found only when the first episode is scored or the env is built.
    """
    if not task.options:
        return
    known = option_names(task.name)
    if unknown := sorted(str(key) for key in set(task.options) - set(known)):
        raise FieldError("task.options", task.options, f"options of {task.name}: {', '.join(known) or 'none'}", did_you_mean(unknown[0], known))
    check_registered_options(task.name, task.options)


def check_task_env(task: TaskConfig) -> None:
    """FieldError unless `task.env` is null or names a function that loads here (resolved, not called:
    it is called with each task set when an env is built)."""
    if task.env is None:
        return
    try:
        factory = resolve(task.env, "task.env")
    except BadReference as exc:
        raise FieldError("task.env", task.env, f"a function that returns your Env ({exc})") from exc
    if not callable(factory):
        raise FieldError("task.env", task.env, f"a function that returns your Env, not a {type(factory).__name__}")


def check_registered_options(name: str, options: dict[str, Any]) -> None:
    """FieldError naming `task.options.scorer`, `task.options.tools[i]` or `task.options.format` when
    it names no scorer (`trace_rl.agent.scoring.SCORERS`), tool (`trace_rl.agent.tools.TOOL_NAMES`) or
    task file format (`trace_rl.agent.tasks.loaders.FORMATS`), with the nearest name. null is accepted
    where the loader's default is null (`file:` tasks: what the file's format implies)."""
    from trace_rl.agent.scoring import SCORERS
    from trace_rl.agent.tasks.loaders import FORMATS
    from trace_rl.agent.tools import TOOL_NAMES

    nullable = name.startswith("file:")  # load_file's scorer / tools / format default to None; reasoning-gym's tools do not
    for key, registry in (("scorer", sorted(SCORERS)), ("format", list(FORMATS))):
        value = options.get(key)
        if key == "scorer" and is_reference(value):
            continue  # a user's reward function: checked when it is resolved
        if key in options and not (value is None and nullable) and not (isinstance(value, str) and value in registry):
            own = ", a module:function of your own" if key == "scorer" else ""
            raise FieldError(f"task.options.{key}", value, "one of " + ", ".join(registry) + own + (" or null" if nullable else ""), did_you_mean(value, registry))
    if "tools" not in options or (options["tools"] is None and nullable):
        return
    tools = options["tools"]
    if not isinstance(tools, (list, tuple)):  # a bare string would be read as one tool per character
        raise FieldError("task.options.tools", tools, f"a list of tool names from {', '.join(TOOL_NAMES)}" + (" or null" if nullable else ""))
    for index, tool in enumerate(tools):
        if not (isinstance(tool, str) and (tool in TOOL_NAMES or (nullable and is_reference(tool)))):
            raise FieldError(f"task.options.tools[{index}]", tool, "one of " + ", ".join(TOOL_NAMES) + (" or a module:function of your own" if nullable else ""), did_you_mean(tool, TOOL_NAMES))
        if tool in tools[:index]:
            raise FieldError(f"task.options.tools[{index}]", tool, "a tool not already listed (each is offered to the model once)")


def check_model(model: ModelConfig) -> None:
    """FieldError unless `model.name` loads without a download (a preset whose files are installed, or a
    local model folder; a hub id only with `model.download`) and `model.device` exists on this machine."""
    import torch

    from trace_rl.models import PRESETS, find_smollm2_gguf

    name = model.name
    accepted = f"a preset ({', '.join(PRESETS)}), a local Hugging Face model folder, or a hub id with model.download=true"
    if name == "smollm2-135m":
        try:
            find_smollm2_gguf()
        except FileNotFoundError as exc:
            raise FieldError("model.name", name, f"a preset whose files are installed ({exc})") from exc
    elif Path(name).expanduser().is_dir():
        if not (Path(name).expanduser() / "config.json").is_file():
            raise FieldError("model.name", name, "a Hugging Face model folder (one with config.json)")
    elif name not in PRESETS and not (model.download and HUB_ID.fullmatch(name)):
        close = difflib.get_close_matches(name, PRESETS, n=1)
        raise FieldError("model.name", name, accepted, f"; did you mean {close[0]!r}?" if close else "")
    try:
        device = torch.device(model.device)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda", "mps"):
        raise FieldError("model.device", model.device, "cpu, cuda, cuda:<index> or mps")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise FieldError("model.device", model.device, f"a device of this machine, which has {torch.cuda.device_count()} CUDA devices")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise FieldError("model.device", model.device, "a device of this machine, which has no MPS backend")


def check_context_room(config: RunConfig, tokenizer: Any, env: Env, tasksets: Sequence[TaskSet]) -> None:
    """FieldError unless `rollout.max_context_tokens` holds the longest prompt (of the tasks with the
    longest questions) and two full turns (one when `task.max_turns` is 1): with less room a rollout
    ends, unrewarded, after its first turn. Needs the tokenizer, so it runs once the policy is loaded."""
    rollout = config.rollout
    turns = min(2, config.task.max_turns)
    longest_questions = sorted((t for s in tasksets for t in s.tasks), key=lambda t: len(t.question))[-8:]
    longest = max((len(encode_prompt(tokenizer, env, t)) for t in longest_questions), default=0)
    need = longest + turns * rollout.max_new_tokens
    if rollout.max_context_tokens < need:
        raise FieldError(
            "rollout.max_context_tokens", rollout.max_context_tokens,
            f">= {need} (the longest prompt has {longest} tokens, plus {turns} turns of max_new_tokens={rollout.max_new_tokens})",
        )


@dataclass
class Parts:
    train: TaskSet
    test: TaskSet
    env: Env
    policy: Any  # trace_rl.models.Policy (imports torch, so not at module level)
    engine: Engine
    predictor: SuccessPredictor
    collector: TreeRolloutCollector


def check_search_server(task: TaskConfig) -> None:
    """ConfigError, naming `task.search_url` and what went wrong, unless its retrieval server answers a
    query properly: checked before the tasks, the warm start and the first rollout."""
    if task.search_url is None:
        return
    from trace_rl.agent.tools import ToolError
    from trace_rl.agent.tools.search import RetrievalClient

    try:
        RetrievalClient(task.search_url, retries=1).check()
    except ToolError as exc:
        raise ConfigError(f"task.search_url={task.search_url!r} does not work: {exc}. Start the server "
                          "(python -m trace_rl.agent.tools.retrieval_server, or your own), or unset task.search_url to search the task's own corpus") from None


def build_env(config: RunConfig, taskset: TaskSet) -> Env:
    """The env `taskset`'s episodes run in: the user's own (`task.env`, called with the task set) or
    the bundled ReAct `ToolEnv` with the task set's tools. ConfigError when the user's function returns
    something without the `Env` protocol's methods, naming what it lacks."""
    task = config.task
    if task.env is not None:
        env = resolve(task.env, "task.env")(taskset)
        if gaps := protocol_gaps(env):
            raise ConfigError(f"task.env={task.env!r} returned a {type(env).__name__} without {', '.join(gaps)}: an env "
                              f"of your own needs every method of trace_rl.Env ({', '.join(ENV_METHODS)}) and max_turns")
        return env
    env = ToolEnv.for_taskset(
        taskset,
        turn_format=task.format,
        scorer=score,
        max_turns=task.max_turns,
        max_observation_chars=task.max_observation_chars,
        search_url=task.search_url,
        topk=task.topk,
        sandbox=task.sandbox,
        open_thought=bool(task.open_thought),
    )
    env.examples = tuple(few_shot_examples(config, env))
    return env


def without_examples(train: TaskSet, env: Env) -> TaskSet:
    """`train` without the tasks `env` shows as worked examples: a solved question is not one to learn."""
    shown = {example.task.task_id for example in getattr(env, "examples", ())}
    return replace(train, tasks=[t for t in train.tasks if t.task_id not in shown]) if shown else train


def few_shot_examples(config: RunConfig, env: ToolEnv) -> list[WorkedExample]:
    """The worked examples shown before each question, played by the task set's oracle (or its recorded
    demonstrations) on tasks of the RL train split, the same in every process that builds the env
    (`build_parts` takes those tasks out of RL's pool). How many: `task.few_shot`, or where it is null
    the model profile's count for a run without a warm start. A count the config sets that the task
    set cannot play is a ConfigError; the profile's is dropped with a warning naming the way to give one."""
    from trace_rl.models.profiles import profile_for

    task = config.task
    chosen = task.few_shot is not None
    count = task.few_shot if chosen else profile_for(config.model.name).few_shot if not config.model.warm_start else 0
    if not count:
        return []
    train = task_splits(config)[1]
    how = ("give your task_set demonstrations=[{'question': ..., 'calls': [...]}] for a task or two (or an oracle), "
           "or set task.few_shot=0")
    try:
        if train.oracle is None:
            raise ValueError(f"task.name={task.name!r} has no oracle or demonstrations to play them")
        return worked_examples(env, train.tasks, train.oracle, count)
    except ValueError as exc:
        if chosen:
            raise ConfigError(f"task.few_shot={count} needs worked examples: {exc}; {how}") from exc
        warnings.warn(f"{config.model.name} is prompted with {count} worked examples by its profile when it has no warm start, "
                      f"and none could be made ({exc}): without them it may write few valid actions; {how}", stacklevel=2)
        return []


def build_predictor(config: RunConfig, train: TaskSet | None = None, *, own: Path | None = None) -> SuccessPredictor:
    """The predictor the run's method allocates from (`MethodSpec.predictor`). BRACE's bank decays once
    per pass over the `train` pool and starts from `rollout.brace.warm_bank` (never the run's own folder
    `own`)."""
    kind = config.rollout.spec.predictor
    if kind != "brace_bank":
        return make_predictor(kind, config.predictor, seed=config.seed)
    brace = config.rollout.brace
    pool = len(train.tasks) if train is not None else config.prompts_per_step
    bank = BraceBank(decay=brace.decay, cycle_steps=max(1.0, pool / config.prompts_per_step), concentration=brace.concentration)
    if brace.warm_bank:
        patterns = [pattern.replace("{seed}", str(config.seed)) for pattern in brace.warm_bank]
        tasks = None if train is None else {t.task_id for t in train.tasks}
        bank.add_bank(bank_counts(patterns, config.rollout.success_threshold, tasks=tasks, exclude=own),
                      cap_successes=brace.warm_cap_successes, cap_failures=brace.warm_cap_failures)
    return bank


def certified_useless(tasks: Sequence[Task], scorer: Callable[[Task, str], float], threshold: float) -> dict[str, str]:
    """Task id -> why, for the tasks whose own scorer certifies that training on them teaches nothing:
    it pays an empty answer (`pre-solved`) or does not pay the task's first gold answer (`unsatisfiable`).
    A property of the verifier, decided before any rollout (BRACE's certified exclusion)."""
    useless = {}
    for task in tasks:
        if scorer(task, "") > threshold:
            useless[task.task_id] = "pre-solved"
        elif task.answers and scorer(task, task.answers[0]) <= threshold:
            useless[task.task_id] = "unsatisfiable"
    return useless


def excludes_certified(config: RunConfig) -> bool:
    """Whether the run drops the tasks certified useless before training (BRACE, `rollout.brace.exclude_certified`)."""
    return config.rollout.method == "brace" and config.rollout.brace.exclude_certified


def brace_pool(config: RunConfig, train: TaskSet) -> TaskSet:
    """The RL tasks without those certified useless (`certified_useless`) when BRACE's certified
    exclusion is on, recorded in `meta["brace_excluded"]`; ConfigError when it would leave none.
    `train` unchanged otherwise."""
    if not excludes_certified(config):
        return train
    useless = certified_useless(train.tasks, score, config.rollout.success_threshold)
    if len(useless) == len(train.tasks):
        raise ConfigError(f"rollout.brace.exclude_certified: all {len(train.tasks)} train tasks are certified useless by their scorer (pre-solved or unsatisfiable)")
    return replace(train, tasks=[t for t in train.tasks if t.task_id not in useless], meta={**train.meta, "brace_excluded": useless})


def build_trainer(config: RunConfig, parts: Parts, run_dir: str | Path | RunDir) -> Trainer:
    """A `Trainer` for `config` over `parts`, writing into `run_dir`."""
    setup = TrainingSetup(
        method=config.rollout.spec,
        model=parts.policy.model,
        engine=parts.engine,
        collector=parts.collector,
        predictor=parts.predictor,
        train_tasks=parts.train.tasks,
        test_tasks=parts.test.tasks,
        prompts_per_step=config.prompts_per_step,
        seed=config.seed,
    )
    return Trainer(config.train, setup, run_dir)


def check_trainable(config: RunConfig) -> None:
    """ConfigError unless the configured engine can receive the trainer's weights, a warm start has
    demonstrations to learn from (in an env it can write them for), and BRACE's certified exclusion
    leaves a task to train on (before any work, before the run folder is made)."""
    splits = functools.cache(lambda: task_splits(config))  # loaded once, and only when a check below needs the tasks
    own_tasks = config.task.name.startswith("file:") or is_reference(config.task.name)
    if own_tasks:  # the user's reward, called once on the first training task (RewardError: one line)
        train = splits()[1]
        if train.tasks:
            dry_run_reward(train.tasks[0])
    if config.model.warm_start and own_tasks:
        demos = splits()[0]
        if demos.oracle is None:
            raise ConfigError(
                f"task.name={config.task.name!r} has no oracle or demonstrations, so model.warm_start cannot make a policy "
                "that writes its tool calls: give the task set one (task_set(oracle=...) or task_set(demonstrations=...)), "
                "or start from a pretrained model without a warm start (model.warm_start=false)"
            )
    if config.model.warm_start and config.task.env is not None:
        demo_env(config, splits()[0])
    if excludes_certified(config):
        brace_pool(config, splits()[1])
    if config.engine.name == "openai":
        if config.engine.weight_sync == "none":
            raise ConfigError(
                "engine.name=openai trains only with a weight push: set engine.weight_sync to vllm or sglang (the "
                "servers reload each update's weights from engine.weight_dir); with none the servers would keep "
                "sampling from the starting weights while the local model trains. `rollout` and `eval` work without one."
            )


def run_label(path: Path, method: str) -> str:
    """What a progress line calls a run: a comparison's row and seed (`trace_tokens seed_1`: the row's
    folder, which names a variant where the method would not), else the folder and its method."""
    if path.name.startswith("seed_"):
        return f"{path.parent.name} {path.name}"
    return f"{path.name} {method}"


def build_parts(
    config: RunConfig,
    *,
    source: str | None = None,
    progress: Callable[[int, float], None] | None = None,
    run_dir: Path | None = None,
) -> Parts:
    """Load the task splits, build the env, load the policy and wire the collector. `source` is what
    `policy_source` gave (the warm-start step's folder, or `model.name`): `train_run` takes that step
    first, on its own; None takes it here (cached after the first time, reporting to `progress`).
    `run_dir`: the folder the run writes (a warm bank never reads it)."""
    import torch

    from trace_rl.models import load_policy

    torch.set_num_threads(config.model.cpu_threads)
    check_search_server(config.task)
    demos, train = task_splits(config)
    test = load_tasks(config.task, "test", config.task.test_tasks)
    env = build_env(config, train)
    train = without_examples(train, env)
    train = brace_pool(config, train)
    model = config.model
    name = source if source is not None else policy_source(config, demos, env, progress=progress)
    policy = load_policy(name, seed=config.seed, dtype=model.dtype, device=model.device, lora=lora_spec(model))
    check_context_room(config, policy.tokenizer, env, (train, test))
    engine = build_engine(config.engine, policy)
    predictor = build_predictor(config, train, own=run_dir)
    executor = build_executor(config, name, engine, policy) if config.rollout.backend == "ray" else None
    collector = TreeRolloutCollector(engine, policy.tokenizer, env, predictor, config.rollout, seed=config.seed, executor=executor)
    return Parts(train=train, test=test, env=env, policy=policy, engine=engine, predictor=predictor, collector=collector)


def build_executor(config: RunConfig, policy_name: str, engine: Engine, policy: Any) -> Executor:
    """`rollout.workers` Ray actors (`trace_rl.rollout`), each built by `build_worker`; they sample
    `policy`'s weights, pushed whenever `engine` (the one the trainer updates) gets a new version.
    On CUDA each actor asks Ray for a GPU, or an equal share of the GPUs there are."""
    import torch

    from trace_rl.rollout.ray_workers import RayExecutor

    workers = config.rollout.workers
    gpus = min(1.0, torch.cuda.device_count() / workers) if torch.device(config.model.device).type == "cuda" else 0.0
    weights = policy.model if engine.accepts_weights else None
    return RayExecutor(functools.partial(build_worker, config, policy_name), workers, engine=engine, model=weights, num_gpus=gpus)


def build_worker(config: RunConfig, policy_name: str) -> tuple[RolloutRunner, Any]:
    """One Ray rollout worker's runner and model (`trace_rl.rollout.ray_workers.WorkerBuild`), made inside the
    actor as `build_parts` makes the main process's: the RL split's env, the policy loaded from
    `policy_name` (the warm-started folder, already made by the main process), its engine."""
    import torch

    from trace_rl.models import load_policy

    torch.set_num_threads(config.model.cpu_threads)
    model = config.model
    if torch.device(model.device).type == "cuda":
        model = replace(model, device="cuda")  # Ray makes the actor's GPU its only visible one
    env = build_env(config, task_splits(config)[1])
    policy = load_policy(policy_name, seed=config.seed, dtype=model.dtype, device=model.device, lora=lora_spec(model))
    engine = build_engine(config.engine, policy)
    return RolloutRunner(engine, policy.tokenizer, env, config.rollout), policy.model if engine.accepts_weights else None


def lora_spec(model: ModelConfig) -> Any:
    """The `trace_rl.models.LoraSpec` of `model.lora_rank` (None: no adapters, every weight trains)."""
    from trace_rl.models import LoraSpec

    return LoraSpec(r=model.lora_rank, alpha=model.lora_alpha) if model.lora_rank else None


def build_engine(engine: EngineConfig, policy: Any) -> Engine:
    """The engine `engine.name` names, sampling from `policy` (in process, or the server's copy of it)."""
    if engine.name == "openai":
        from trace_rl.engine.openai_server import OpenAIEngine

        if not engine.server_urls:
            raise ValueError("engine.name=openai needs engine.server_urls (e.g. ['http://127.0.0.1:8000'])")
        return OpenAIEngine(
            engine.server_urls,
            timeout_s=engine.server_timeout_s,
            retries=engine.server_retries,
            retry_wait_s=engine.server_retry_wait_s,
            tokenizer=policy.tokenizer,
            vocab_size=int(policy.model.get_output_embeddings().weight.shape[0]),
            weight_sync=engine.weight_sync,
            weight_dir=engine.weight_dir,
        )
    from trace_rl.engine.hf import HFEngine

    return HFEngine.from_policy(
        policy, max_batch_size=engine.max_batch_size, prefix_cache_mb=engine.prefix_cache_mb, precision=engine.generation_precision
    )


def load_tasks(task: TaskConfig, split: str, num_tasks: int | None) -> TaskSet:
    """`load_taskset` for the run's task set, with `task.options`. A loader's refusal (a missing package,
    fewer tasks than asked for, a malformed task file, an option value it does not take) is about the
    config, so it becomes a ConfigError naming task.name and the options."""
    try:
        return load_taskset(task.name, split=split, num_tasks=num_tasks, seed=task.seed, **task.options)
    except (ImportError, OSError, ValueError, TypeError, AssertionError) as exc:  # reasoning-gym validates with assert
        options = f" with task.options={task.options!r}" if task.options else ""
        raise ConfigError(f"task.name={task.name!r}{options} ({split} split): {str(exc) or type(exc).__name__}") from exc


def task_splits(config: RunConfig) -> tuple[TaskSet, TaskSet]:
    """(tasks the warm start demonstrates on, tasks RL trains on): with `task.demo_tasks`, a seeded
    draw of that many train-split tasks and the rest (cut to `task.train_tasks`), disjoint; without
    it, both are the RL train split. The test split is disjoint from both."""
    task = config.task
    if task.demo_tasks is None:
        train = load_tasks(task, "train", task.train_tasks)
        return train, train
    full = load_tasks(task, "train", None)
    if task.demo_tasks >= len(full.tasks):
        raise ConfigError(f"task.demo_tasks={task.demo_tasks} leaves no RL task: the train split has {len(full.tasks)}")
    order = np.random.default_rng([task.seed, 7]).permutation(len(full.tasks))
    demo_ids = set(order[: task.demo_tasks].tolist())
    rest = [t for i, t in enumerate(full.tasks) if i not in demo_ids][: task.train_tasks]
    demos = [t for i, t in enumerate(full.tasks) if i in demo_ids]
    return replace(full, tasks=demos), replace(full, tasks=rest)


def demo_env(config: RunConfig, demos: TaskSet) -> ToolEnv:
    """The env the warm start's demonstrations run in: `build_env`'s, which must be a `ToolEnv` (the
    demonstrations are its ReAct turns); ConfigError for an env of the user's own that is not one."""
    env = build_env(config, demos)
    if not isinstance(env, ToolEnv):
        raise ConfigError(
            f"task.env={config.task.env!r} makes a {type(env).__name__}, and model.warm_start writes its demonstrations as the "
            "bundled ToolEnv's ReAct turns: start from a model that needs none (model.warm_start=false: a pretrained "
            "instruct model, or a folder an earlier warm start made), or subclass trace_rl.ToolEnv"
        )
    return env


def policy_source(
    config: RunConfig,
    demos: TaskSet | None = None,
    env: Env | None = None,
    *,
    progress: Callable[[int, float], None] | None = None,
) -> str:
    """What `load_policy` loads for this run: the warm-started folder (made now, from demonstrations on
    `demos`, if not cached) or `model.name`."""
    if not config.model.warm_start:  # ModelConfig refuses an untrained tiny model
        return config.model.name
    check_search_server(config.task)  # demonstrations search too: never train on a dead server's errors
    if demos is None:
        demos = task_splits(config)[0]
    from trace_rl.models import TinyConfig

    tiny = TinyConfig(split_digits=True) if config.model.split_digits else None
    return str(warm_start(config.model.name, demos, env if isinstance(env, ToolEnv) else demo_env(config, demos), config.sft, tiny=tiny, progress=progress))


def evaluate_policy(
    config: RunConfig,
    run_dir: str | Path | None = None,
    *,
    samples: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Held-out accuracy of a run's newest readable checkpoint (or, without `run_dir`, of its starting
    policy). The checkpoint is read first, so a refused or missing one stops before any model is built.
    `progress(done, total)` hears the evaluation's rollouts (`held_out_accuracy`)."""
    state = RunDir(run_dir).load_checkpoint() if run_dir is not None else None
    parts = build_parts(config)
    step = 0
    if state is not None:
        parts.policy.model.load_state_dict(state["model"])
        step = int(state["step"])
    samples = config.train.eval_samples if samples is None else samples
    figures = held_out_accuracy(parts.collector, parts.test.tasks, samples, progress)
    return {"step": step, "tasks": len(parts.test.tasks), "samples": samples, **figures}


RESUMABLE_CHANGES = frozenset(
    {
        *(f"train.{k}" for k in ("steps", "eval_every", "eval_samples", "checkpoint_every", "save_trees", "tensorboard", "wandb_project")),
        *(f"model.{k}" for k in ("cpu_threads", "device")),
        *(f"engine.{k}" for k in ("max_batch_size", "prefix_cache_mb", "server_urls", "server_timeout_s", "server_retries", "server_retry_wait_s")),
        "rollout.backend",
        "rollout.workers",
    }
)
"""Config keys a resume may change: how long the run goes, how it is evaluated, recorded and executed.
Any other key (the method, seed, model, task, budget, a hyperparameter) defines what the run is; the
steps before and after such a change would be two runs under one name, so a resume refuses it."""


def config_changes(old: RunConfig, new: RunConfig) -> dict[str, tuple[Any, Any]]:
    """{dotted key: (old value, new value)} for every field that differs."""
    before, after = dict(_fields(old)), dict(_fields(new))
    return {k: (before.get(k), after.get(k)) for k in sorted(before.keys() | after.keys()) if before.get(k) != after.get(k)}


def _fields(config: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every leaf field of a config dataclass."""
    for item in fields(config):
        value = getattr(config, item.name)
        if is_dataclass(value):
            yield from _fields(value, f"{prefix}{item.name}.")
        else:
            yield f"{prefix}{item.name}", value


def train_run(
    config: RunConfig,
    run_dir: str | Path,
    *,
    resume: bool = False,
    bar: Any = None,
    stop: StopRequest | None = None,
) -> Trainer:
    """Train `config` in `run_dir`: a new run, or with `resume` the run there, continued from its newest
    readable checkpoint (from step 0 if it has none yet, with a warning).

    A new run refuses a folder that holds any step's record (its metrics would mix with the new run's);
    resuming rewinds the folder to the checkpoint's step. A resume may change only `RESUMABLE_CHANGES`
    and refuses anything else, naming it, before any work. When it does change something, the config it
    replaces is kept as `config.step_XXXX.yaml` (the config of the steps up to XXXX), and a
    `RunDirWarning` says so: `config.yaml` alone never loses the record of the earlier steps.

    `bar` is a `trace_rl.infra.progress.Bars` for live progress, or None; `stop` stops the run at a step
    boundary (`StopRequest`).
    """
    check_trainable(config)
    folder = RunDir(run_dir)
    with folder.lock():  # one writer per folder: a second train here refuses at once
        state = None
        if resume:
            if not folder.config_path.is_file():
                raise FileNotFoundError(f"{folder.path} has no config.yaml: there is no run to resume there")
            state = folder.load_checkpoint() if folder.has_checkpoint() else None  # before any work: a refused one stops here
            step = int(state["step"]) if state is not None else 0
            trained, text = _trained_config(folder, state)
            _check_resume(folder, trained, text, config, step)
            if state is None and folder.has_records():
                warnings.warn(f"{folder.path} has no checkpoint yet: starting again from step 0 (its logged steps are made again)", RunDirWarning, stacklevel=2)
        elif folder.has_records():
            checkpoints = folder.checkpoint_files()
            held = f"a checkpoint at step {max(checkpoints)}" if checkpoints else f"{folder.finished_steps()} logged steps, no checkpoint"
            raise FileExistsError(f"{folder.path} already holds a run ({held}); continue it with train --resume {folder.path}, or choose another folder")
        elif (foreign := folder.foreign_files()) or (folder.config_path.is_file() and not folder.code_path.is_file()):
            names = ", ".join(foreign[:3] or ["config.yaml"]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
            raise FileExistsError(f"{folder.path} holds files that are not a run's ({names}); a new run would write over or beside them: choose an empty or new folder for --out")
        if (changed := folder.record_code()) is not None:
            warnings.warn(changed, RunDirWarning, stacklevel=2)
        folder.write_config(config)
        from trace_rl.infra.progress import warm_start_progress

        source = policy_source(config, progress=warm_start_progress(bar, config.sft.steps))  # the warm-start step (cached)
        parts = build_parts(config, source=source, run_dir=folder.path)
        trainer = build_trainer(config, parts, folder)
        if state is not None:
            trainer.restore(state)
            folder.record_resume(trainer.step)
        else:
            folder.rewind(-1)  # from the start: a step-0 evaluation (`train.eval_on_start`) is made again too
        steps_bar = bar.task(run_label(folder.path, config.rollout.method), total=config.train.steps, completed=trainer.step) if bar else None

        def on_step(step: int, metrics: dict[str, float]) -> None:
            if bar is not None:
                bar.update(steps_bar, step, headline(metrics))

        def on_phase(text: str) -> None:
            if bar is not None:
                bar.note(steps_bar, text)

        trainer.run(on_step=on_step, stop=stop, on_phase=on_phase)
    return trainer


def _trained_config(folder: RunDir, state: dict[str, Any] | None) -> tuple[RunConfig, str | None]:
    """The config the checkpoint's steps were trained with, and its YAML: the one the checkpoint holds
    (so an edited `config.yaml` cannot pass for it), else `config.yaml` (a checkpoint written before
    they held one, or none yet: nothing trained is kept then)."""
    text = state.get("config") if state is not None else None
    if not isinstance(text, str):
        if state is not None:
            warnings.warn(f"{folder.path}: its checkpoint does not hold the config it was trained with (written before "
                          "checkpoints did), so the resume is checked against config.yaml", RunDirWarning, stacklevel=3)
        return load_run_config(folder.config_path), None
    try:
        return from_dict(RunConfig, run_config_data(load_yaml(text, f"{folder.path}: the checkpoint's config"))), text
    except ConfigError as exc:
        raise RunDirError(f"{exc}: this trace-rl cannot read the config the checkpoint was trained with") from None


def _check_resume(folder: RunDir, saved: RunConfig, saved_text: str | None, config: RunConfig, step: int) -> None:
    """Refuse a resume that changes what the run is; archive the config (`saved_text`, else config.yaml)
    of the steps up to `step` when one that changes less replaces it."""
    changes = config_changes(saved, config)
    refused = {k: v for k, v in changes.items() if k not in RESUMABLE_CHANGES}
    if refused:
        said = ", ".join(f"{k}={show_value(new)} (it was trained with {show_value(old)})" for k, (old, new) in refused.items())
        raise RunDirError(
            f"resuming {folder.path} cannot change {said}: the steps before and after would be two different runs. "
            f"A resume may change only {', '.join(sorted(RESUMABLE_CHANGES))}; to train with the new values, start a "
            f"new run folder from {folder.config_path}"
            + (f" (config.yaml was edited since: the checkpoint holds the config of steps 1-{step})" if saved_text is not None else "")
        )
    if changes:
        archive = folder.archive_config(step, saved_text)
        said = ", ".join(f"{k}={show_value(new)} (was {show_value(old)})" for k, (old, new) in changes.items())
        warnings.warn(f"{folder.path}: resuming at step {step} with {said}; the config of steps 1-{step} is kept as {archive.name}", RunDirWarning, stacklevel=3)


def headline(metrics: dict[str, Any]) -> dict[str, float]:
    """The few figures worth showing live and on a command's last line."""
    keys = ("critic/score/mean", "tree/effective_ratio", "tree/mixed_budget_share", "val/accuracy_greedy", "val/accuracy_sampled")
    shown = {k: round(float(metrics[k]), 4) for k in keys if k in metrics}
    if metrics.get("tool/unavailable_rate"):  # a tool down or timing out: worth seeing live, not only in the report
        shown["tool/unavailable_rate"] = round(float(metrics["tool/unavailable_rate"]), 4)
    return shown


def train(
    config: RunConfig | str | Path | None = None,
    out: str | Path | None = None,
    *,
    overrides: Sequence[str] = (),
    resume: bool = False,
    progress: bool = True,
) -> Trainer:
    """Train from Python as `trace-rl train` does: `config` a `RunConfig`, a YAML file or None (the
    defaults), with `overrides` (`key=value` strings) applied; the run goes to `out` (or, with `resume`,
    continues there). `progress` shows the warm start and the steps on stderr. Returns the Trainer."""
    from trace_rl.infra.config import apply_override, from_dict, load_config, to_dict
    from trace_rl.infra.progress import progress_bar

    if isinstance(config, RunConfig):
        if overrides:
            data = to_dict(config)
            for item in overrides:
                apply_override(data, item)
            config = from_dict(RunConfig, data)
    else:
        config = load_config(RunConfig, None if config is None else str(config), list(overrides))
    if out is None:
        raise ValueError("train() needs out=, the run folder")
    if not progress:
        return train_run(config, out, resume=resume)
    with progress_bar() as bar:
        return train_run(config, out, resume=resume, bar=bar)


def evaluate(config: RunConfig | str | Path | None = None, *, overrides: Sequence[str] = (), run_dir: str | Path | None = None,
             samples: int | None = None) -> dict[str, Any]:
    """Held-out accuracy of `config`'s starting policy, or of `run_dir`'s latest checkpoint (as `trace-rl eval`)."""
    from trace_rl.infra.config import load_config

    if not isinstance(config, RunConfig):
        config = load_config(RunConfig, None if config is None else str(config), list(overrides))
    return evaluate_policy(config, run_dir, samples=samples)
