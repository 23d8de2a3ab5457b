from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from trace_rl.infra.config import ConfigError, dump_yaml, load_config
from trace_rl.models import PRESETS


@dataclass
class Inner:
    budget: int = 8
    share: float = 0.5
    method: Literal["trace", "grpo"] = "trace"
    name: str | None = None

    def __post_init__(self) -> None:
        if self.budget < 0:
            raise ValueError(f"budget must be >= 0, got {self.budget}")


@dataclass
class Outer:
    seed: int = 0
    inner: Inner = field(default_factory=Inner)
    tags: list[str] = field(default_factory=list)


def test_file_then_overrides_in_order(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("seed: 3\ninner:\n  budget: 16\n")
    config = load_config(Outer, path, ["inner.share=0.25", "inner.method=grpo", "tags=[a, b]", "inner.budget=4"])
    assert config == Outer(seed=3, inner=Inner(budget=4, share=0.25, method="grpo"), tags=["a", "b"])


def test_round_trip_through_yaml(tmp_path):
    config = load_config(Outer, None, ["inner.name=x"])
    dump_yaml(config, tmp_path / "out.yaml")
    assert load_config(Outer, tmp_path / "out.yaml") == config


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("inner.budgt=3", r"unknown config key 'inner.budgt'; did you mean 'budget'\?"),
        ("inner.method=trac", r"inner.method='trac' is not accepted; did you mean 'trace'\? \(accepted: trace, grpo\)"),
        ("inner.budget=2.5", "inner.budget must be an integer, got 2.5"),
        ("inner.budget=-1", "budget must be >= 0"),
        ("seed", "must look like section.key=value"),
        ("inner=3", "inner must be a mapping"),
    ],
)
def test_bad_keys_and_values_are_named(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(Outer, None, [override])


def test_non_mapping_file_is_rejected(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(Outer, path)


@pytest.mark.parametrize("name", sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "configs").glob("*.yaml")))
def test_shipped_configs_load(name):
    from pathlib import Path

    import yaml

    from trace_rl.research.compare import CompareConfig
    from trace_rl.run import RunConfig

    path = Path(__file__).resolve().parents[1] / "configs" / f"{name}.yaml"
    is_compare = "methods" in yaml.safe_load(path.read_text())  # a comparison's config names its methods
    config = load_config(CompareConfig if is_compare else RunConfig, path)  # every key is known
    run = config.run if is_compare else config
    # a shipped config runs from what the repo and its packages hold: a model preset, a bundled task
    assert run.model.name in PRESETS and run.task.name in ("multihop", "toolmath") and run.rollout.budget > 0


def test_estimator_options_are_set_from_the_config_and_checked_when_it_loads():
    from trace_rl.run import RunConfig

    config = load_config(RunConfig, None, ["train.advantage_options={scale_rewards: false, prefix_coef: 0.5}"])
    assert config.train.advantage_options == {"scale_rewards": False, "prefix_coef": 0.5}
    with pytest.raises(ConfigError, match=r"train.advantage_options must be options estimator 'trace' takes, got \{'bogus': 1\}"):
        load_config(RunConfig, None, ["train.advantage_options={bogus: 1}"])
    with pytest.raises(ConfigError, match="options estimator 'grpo' takes"):  # grpo's own estimator has no prefix_coef
        load_config(RunConfig, None, ["rollout.method=grpo", "train.advantage_options={prefix_coef: 0.5}"])
    with pytest.raises(ConfigError, match="eps must be finite and >= 0"):
        load_config(RunConfig, None, ["train.advantage_options={eps: -1}"])
    load_config(RunConfig, None, ["train.advantage=treerl", "train.advantage_options={normalize_by_sqrt_leaves: false}"])



def test_a_demonstration_split_is_disjoint_from_rl_training_and_the_test_split():
    from trace_rl.agent.tasks import load_taskset
    from trace_rl.run import RunConfig, task_splits

    config = load_config(RunConfig, None, ["task.demo_tasks=300", "task.train_tasks=500"])
    demos, train = task_splits(config)
    test = load_taskset("multihop", split="test", seed=0)
    ids = [{t.task_id for t in s.tasks} for s in (demos, train, test)]
    assert len(ids[0]) == 300 and len(ids[1]) == 500
    assert not ids[0] & ids[1] and not ids[0] & ids[2] and not ids[1] & ids[2]
    assert task_splits(config)[0].tasks == demos.tasks  # a seeded draw
    same = task_splits(load_config(RunConfig, None, ["task.train_tasks=40"]))
    assert same[0] is same[1] and len(same[1].tasks) == 40  # no demo split: the warm start demonstrates on RL's tasks
    with pytest.raises(ConfigError, match="task.demo_tasks must be >= 1"):
        load_config(RunConfig, None, ["task.demo_tasks=0"])


def test_task_options_reach_the_loader_and_unknown_ones_are_refused_when_the_config_loads():
    from trace_rl.run import RunConfig, load_tasks

    pytest.importorskip("reasoning_gym")
    config = load_config(RunConfig, None, ["task.name=rg:chain_sum", "task.options={min_terms: 5, max_terms: 5, pool_size: 50}"])
    tasks = load_tasks(config.task, "train", None).tasks
    assert 30 <= len(tasks) <= 50  # the pool of 50, less its test share
    assert {t.meta["rg_entry"]["metadata"]["num_terms"] for t in tasks} == {5}
    with pytest.raises(ConfigError, match="task.options must be options of rg:chain_sum: .*; did you mean 'max_terms'"):
        load_config(RunConfig, None, ["task.name=rg:chain_sum", "task.options={max_term: 4}"])
    with pytest.raises(ConfigError, match="task.options must be options of multihop: cities, .*num_questions"):
        load_config(RunConfig, None, ["task.options={pool_size: 4}"])
    refused = load_config(RunConfig, None, ["task.name=rg:chain_sum", "task.options={min_terms: 0}"])
    with pytest.raises(ConfigError, match=r"task.name='rg:chain_sum' with task.options=\{'min_terms': 0\} \(train split\): min_terms must be positive"):
        load_tasks(refused.task, "train", 10)  # a value the dataset refuses: when the tasks load, before any model


def test_a_loader_refusal_without_a_message_is_named_by_its_type(monkeypatch):
    import trace_rl.run
    from trace_rl.run import RunConfig, load_tasks

    def bare_assert(*args, **kwargs):
        raise AssertionError

    monkeypatch.setattr(trace_rl.run, "load_taskset", bare_assert)
    with pytest.raises(ConfigError, match=r"\(train split\): AssertionError$"):
        load_tasks(load_config(RunConfig, None, []).task, "train", 10)


@pytest.mark.parametrize("name", sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "configs" / "gpu").glob("*.yaml")))
def test_gpu_recipe_configs_load_with_only_what_this_machine_lacks_replaced(name):
    """The GPU recipes' every key is known and every value accepted; only what needs that machine (a
    CUDA device, Search-R1's data files and their task.options) is swapped for this one's."""
    from trace_rl.run import RunConfig

    path = Path(__file__).resolve().parents[1] / "configs" / "gpu" / f"{name}.yaml"
    config = load_config(RunConfig, path, ["model.device=cpu", "task.name=multihop", "task.options={}"])
    assert config.model.warm_start is False and config.rollout.method == "trace"


def test_engine_settings_moved_from_model_still_load_with_a_warning(tmp_path):
    """A config or run folder written before the `engine` section existed reads its keys there."""
    import warnings

    from trace_rl.infra.config import from_dict
    from trace_rl.run import RunConfig

    old = {"model": {"name": "tiny", "engine": "hf", "max_batch_size": 8, "prefix_cache_mb": 0.0}}
    with pytest.warns(FutureWarning, match=r"model.engine -> engine.name.*model.max_batch_size -> engine.max_batch_size"):
        config = from_dict(RunConfig, old)
    assert (config.engine.name, config.engine.max_batch_size, config.engine.prefix_cache_mb) == ("hf", 8, 0.0)
    assert old["model"]["max_batch_size"] == 8 and "engine" not in old  # the caller's mapping is left as it was
    with pytest.raises(ConfigError, match="model.max_batch_size and engine.max_batch_size are both set"):
        from_dict(RunConfig, {"model": {"max_batch_size": 8}, "engine": {"max_batch_size": 4}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new names load without a word
        assert from_dict(RunConfig, {"engine": {"max_batch_size": 4}}).engine.max_batch_size == 4
    from trace_rl.storage.rundir import read_run_file

    committed = tmp_path / "config.yaml"  # a committed run's config.yaml (packed), written with every model key
    committed.write_bytes(read_run_file(Path(__file__).resolve().parents[1] / "docs/results/paper_main/trace/seed_0/config.yaml"))
    with pytest.warns(FutureWarning):
        assert load_config(RunConfig, committed).engine.prefix_cache_mb >= 0
