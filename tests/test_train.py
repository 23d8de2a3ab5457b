"""The trainer end to end: updates, logs, checkpoints, resume (in process and after SIGKILL), compare."""

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from scripted_engine import ScriptedEngine, coin_flip_answers

from trace_rl.agent.tasks import load_taskset
from trace_rl.infra.config import ConfigError, load_config
from trace_rl.models import TinyConfig, build_tiny, load_policy
from trace_rl.research.compare import CompareConfig, run_compare, write_start
from trace_rl.rollout.collector import TreeRolloutCollector
from trace_rl.run import (
    Parts,
    RunConfig,
    build_env,
    build_parts,
    build_predictor,
    build_trainer,
    lora_spec,
)
from trace_rl.storage.rundir import RunDir
from trace_rl.training.trainer import StopRequest, held_out_accuracy

REPO = Path(__file__).resolve().parents[1]
SMALL_TINY = TinyConfig(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128, vocab_size=512)
TIMING = ("timing_s/",)


def scripted_parts(config: RunConfig, cache: Path) -> Parts:
    """Real tasks, env, tiny model, predictor and collector; the engine samples from a fixed menu of
    turns holding right and wrong answers, so groups are mixed and the policy really updates."""
    train = load_taskset("multihop", split="train", num_tasks=16, seed=0)
    test = load_taskset("multihop", split="test", num_tasks=4, seed=0)
    env = build_env(config, train)
    texts = [p.text for p in train.corpus[:80]]
    policy = load_policy("tiny", seed=config.seed, tokenizer_texts=texts, tiny=SMALL_TINY, cache_dir=cache, lora=lora_spec(config.model))
    engine = ScriptedEngine(policy.tokenizer, menu_for=coin_flip_answers([*train.tasks, *test.tasks]))
    predictor = build_predictor(config)
    collector = TreeRolloutCollector(engine, policy.tokenizer, env, predictor, config.rollout, seed=config.seed)
    return Parts(train=train, test=test, env=env, policy=policy, engine=engine, predictor=predictor, collector=collector)


def small_config(**train) -> RunConfig:
    overrides = [
        "prompts_per_step=4",
        "task.max_turns=3",
        "rollout.budget=12",
        "rollout.max_new_tokens=16",
        "train.eval_every=2",
        "train.eval_samples=2",
        "train.micro_batch_size=4",
        "train.lr=0.001",
        *[f"train.{k}={v}" for k, v in train.items()],
    ]
    return load_config(RunConfig, None, overrides)


def metrics_without_timing(run_dir: Path) -> list[dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in m.items() if not k.startswith(TIMING)} for m in lines]


def test_training_updates_the_policy_and_writes_the_run_folder(tmp_path):
    config = small_config(steps=2, checkpoint_every=1)
    parts = scripted_parts(config, tmp_path / "cache")
    before = [p.detach().clone() for p in parts.policy.model.parameters()]
    trainer = build_trainer(config, parts, tmp_path / "run")
    history = trainer.run()
    assert len(history) == 2
    assert any(m["actor/grad_norm"] > 0 for m in history), "mixed groups must give a gradient"
    assert any(not torch.equal(a, b) for a, b in zip(before, parts.policy.model.parameters()))
    for m in history:
        assert m["rollout/leaves"] == 12 and 0.0 <= m["tree/effective_ratio"] <= 1.0
        assert 0.0 <= m["timing_s/allocation_overhead_share"] < 1.0
    assert "val/accuracy_greedy" in history[-1] and "val/accuracy_sampled" in history[-1]
    assert 0.0 <= history[-1]["val/accuracy_sampled_se"] <= 0.5 and "val/accuracy_sampled_se_tasks" in history[-1]
    run = tmp_path / "run"
    assert sorted(p.name for p in (run / "trees").iterdir()) == ["step_0001.jsonl", "step_0002.jsonl"]
    assert (run / "checkpoints" / "latest").read_text() == "step_0002.pt"
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged] == [1, 2] and logged[0]["method"] == "trace"
    assert [m["rollout/weight_version"] for m in logged] == [0, 1]  # each step samples from the last update
    assert parts.engine.weight_version == 2


def test_resume_reaches_the_same_metrics_and_weights_as_an_unbroken_run(tmp_path):
    cache = tmp_path / "cache"
    config = small_config(steps=4, checkpoint_every=2)
    unbroken = build_trainer(config, scripted_parts(config, cache), tmp_path / "unbroken")
    unbroken.run()

    class Killed(Exception):
        pass

    def die_after_step_3(step, metrics):
        if step == 3:  # logged, but the next checkpoint (step 4) is never written
            raise Killed

    first = build_trainer(config, scripted_parts(config, cache), tmp_path / "broken")
    with pytest.raises(Killed):
        first.run(on_step=die_after_step_3)
    with open(tmp_path / "broken" / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 4, "method": "tr')  # the kill also cut a line short
    resumed = build_trainer(config, scripted_parts(config, cache), tmp_path / "broken")
    assert resumed.load_checkpoint() == 2
    resumed.run()

    assert metrics_without_timing(tmp_path / "broken") == metrics_without_timing(tmp_path / "unbroken")
    for a, b in zip(unbroken.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)


def test_eval_on_start_logs_the_starting_policys_accuracy_as_step_0_once(tmp_path):
    cache = tmp_path / "cache"
    config = small_config(steps=2, checkpoint_every=1, eval_on_start=True)
    trainer = build_trainer(config, scripted_parts(config, cache), tmp_path / "run")
    trainer.run()
    logged = metrics_without_timing(tmp_path / "run")
    assert [m["step"] for m in logged] == [0, 1, 2]
    assert {k for k in logged[0] if k != "method"} == {"step", "val/accuracy_greedy", "val/accuracy_sampled", "val/accuracy_sampled_se", "val/accuracy_sampled_se_tasks"}
    resumed = build_trainer(replace(config, train=replace(config.train, steps=3)), scripted_parts(config, cache), tmp_path / "run")
    assert resumed.load_checkpoint() == 2
    resumed.run()  # a resumed run began long ago: no second step-0 line
    assert [m["step"] for m in metrics_without_timing(tmp_path / "run")] == [0, 1, 2, 3]
    folder = RunDir(tmp_path / "run")
    folder.rewind(-1)  # a resume with no checkpoint starts again from step 0, its evaluation included
    assert folder.metrics() == [] and folder.tree_files() == {}


def test_a_run_on_the_hf_engine_resumed_after_an_evaluation_matches_the_unbroken_run(tmp_path):
    """The real engine keeps a prefix cache; a resumed run starts with an empty one, so an unbroken run
    must not carry an evaluation's entries into its next step (nor break ties by its past), or the two
    part at float noise and drift apart."""
    from trace_rl.engine.hf import HFEngine

    def hf_parts(config: RunConfig) -> Parts:
        parts = scripted_parts(config, tmp_path / "cache")
        engine = HFEngine.from_policy(parts.policy, prefix_cache_mb=64)
        collector = TreeRolloutCollector(engine, parts.policy.tokenizer, parts.env, parts.predictor, config.rollout, seed=config.seed)
        return replace(parts, engine=engine, collector=collector)

    class Killed(Exception):
        pass

    def die_after_step_3(step, metrics):
        if step == 3:
            raise Killed

    config = small_config(steps=4, checkpoint_every=2)  # evaluations at steps 2 and 4
    unbroken = build_trainer(config, hf_parts(config), tmp_path / "unbroken")
    unbroken.run()
    first = build_trainer(config, hf_parts(config), tmp_path / "broken")
    with pytest.raises(Killed):
        first.run(on_step=die_after_step_3)
    resumed = build_trainer(config, hf_parts(config), tmp_path / "broken")
    assert resumed.load_checkpoint() == 2
    resumed.run()
    logged = metrics_without_timing(tmp_path / "unbroken")
    assert metrics_without_timing(tmp_path / "broken") == logged


def test_a_lora_run_trains_only_its_adapters_and_resumes_to_the_same_weights(tmp_path):
    pytest.importorskip("peft")
    cache = tmp_path / "cache"
    config = small_config(steps=2, checkpoint_every=1)
    config = replace(config, model=replace(config.model, lora_rank=4, lora_alpha=8))
    parts = scripted_parts(config, cache)
    before = {name: p.detach().clone() for name, p in parts.policy.model.named_parameters()}
    trainer = build_trainer(config, parts, tmp_path / "run")
    history = trainer.run()
    assert any(m["actor/grad_norm"] > 0 for m in history)
    after = dict(parts.policy.model.named_parameters())
    moved = {name for name in before if not torch.equal(before[name], after[name])}
    assert moved and all("lora_" in name for name in moved)
    assert len(trainer.optimizer.param_groups[0]["params"]) == sum(p.requires_grad for p in after.values())

    resumed = build_trainer(config, scripted_parts(config, cache), tmp_path / "run")
    assert resumed.load_checkpoint() == 2
    for name, p in resumed.model.named_parameters():
        assert torch.equal(p, after[name]), name


def test_model_lora_rank_puts_adapters_on_the_run_policy(tmp_path):
    pytest.importorskip("peft")
    folder = build_tiny(["Ana Berg studied at Oslo."] * 4, config=SMALL_TINY, cache_dir=tmp_path)
    overrides = ["prompts_per_step=2", "task.train_tasks=8", "task.test_tasks=2", f"model.name={folder}", "model.warm_start=false", "model.lora_rank=2"]
    parts = build_parts(load_config(RunConfig, None, overrides))
    trainable = [name for name, p in parts.policy.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)


def test_a_run_killed_with_sigkill_resumes_to_the_same_metrics(tmp_path):
    env = {**os.environ, "TRACE_RL_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(REPO / "src")}
    overrides = ["train.steps=3", "train.checkpoint_every=1", "train.eval_every=0", "rollout.budget=8", "prompts_per_step=2"]
    command = [sys.executable, "-m", "trace_rl", "train", "--config", str(REPO / "configs" / "smoke.yaml")]
    subprocess.run([*command, "--out", str(tmp_path / "unbroken"), *overrides], env=env, check=True, capture_output=True, timeout=900)

    killed = tmp_path / "killed"
    process = subprocess.Popen([*command, "--out", str(killed), *overrides], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latest = killed / "checkpoints" / "latest"
    deadline = time.monotonic() + 600
    while not (latest.exists() and latest.read_text() == "step_0002.pt"):
        assert process.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    resumed = subprocess.run([*command[:3], "train", "--resume", str(killed)], env=env, check=True, capture_output=True, text=True, timeout=900)
    assert json.loads(resumed.stdout.strip().splitlines()[-1])["steps"] == 3
    assert metrics_without_timing(killed) == metrics_without_timing(tmp_path / "unbroken")
    code = json.loads((killed / "code.json").read_text())
    assert [r["step"] for r in code["resumes"]] == [2] and code["resumes"][0]["commit"] == code["commit"]
    assert "resumes" not in json.loads((tmp_path / "unbroken" / "code.json").read_text())


def test_compare_trains_every_method_and_seed_and_writes_the_summary(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    trained = []

    def train_one(run: RunConfig, run_dir: Path, stop: StopRequest | None) -> None:
        trained.append((run.rollout.method, run.seed))
        build_trainer(run, scripted_parts(run, cache), run_dir).run(stop=stop)

    def evaluate_one(run: RunConfig, run_dir: Path, stop: StopRequest | None) -> None:
        trained.append(("start", run.seed))
        _evaluate_scripted(run, run_dir)

    config = CompareConfig(methods=["grpo", "trace"], seeds=[0, 1], run=small_config(steps=2))
    summary = run_compare(config, tmp_path / "cmp", train_one, evaluate_one)
    assert sorted(trained) == [("grpo", 0), ("grpo", 1), ("start", 0), ("start", 1), ("trace", 0), ("trace", 1)]
    assert set(summary["methods"]) == {"grpo", "trace"}
    for figures in summary["methods"].values():
        assert {"effective_ratio", "mixed_budget_share", "final_accuracy", "final_accuracy_std", "rollouts", "tokens", "accuracy_gain"} <= set(figures)
        assert figures["rollouts"] == 2 * 12
    assert summary["react"]["seeds"] == 2 and 0.0 <= summary["react"]["final_accuracy"] <= 1.0
    assert RunDir(tmp_path / "cmp" / "react" / "seed_1").metrics()[0]["step"] == 0
    assert json.loads((tmp_path / "cmp" / "summary.json").read_text())["methods"].keys() == {"grpo", "trace"}
    table = (tmp_path / "cmp" / "summary.md").read_text()
    assert "| trace |" in table and "| react (start, no RL) |" in table
    run_compare(config, tmp_path / "cmp", train_one, evaluate_one)  # finished runs and evaluations are not redone
    assert len(trained) == 6


def test_dapo_resamples_until_its_groups_are_mixed_and_counts_every_rollout(tmp_path):
    config = small_config(steps=1, dapo_max_rounds=3)
    config.rollout.method = "dapo"
    trainer = build_trainer(config, scripted_parts(config, tmp_path / "cache"), tmp_path / "run")
    metrics = trainer.train_step()
    rounds = metrics["rollout/leaves"] / 12
    assert rounds == int(rounds) and 1 <= rounds <= 3
    assert metrics["rollout/dapo_kept_prompts"] <= 4


def test_unknown_keys_and_values_are_refused_by_name():
    with pytest.raises(ConfigError, match=r"unknown config key 'train.stpes'; did you mean 'steps'\?"):
        load_config(RunConfig, None, ["train.stpes=3"])
    with pytest.raises(ConfigError, match=r"rollout.method='tarce' is not accepted; did you mean 'trace'\?"):
        load_config(RunConfig, None, ["rollout.method=tarce"])
    with pytest.raises(ConfigError, match="advantage"):
        load_config(RunConfig, None, ["train.advantage=grop"])


def test_cli_reports_a_bad_key_without_a_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "trace_rl", "train", "--config", str(REPO / "configs" / "smoke.yaml"), "--out", str(tmp_path / "r"), "sft.stepz=1"],
        env={**os.environ, "PYTHONPATH": str(REPO / "src")},
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert "unknown config key 'sft.stepz'; did you mean 'steps'?" in result.stderr
    assert "Traceback" not in result.stderr


def _train_scripted(run: RunConfig, run_dir: Path, stop: StopRequest | None = None) -> None:
    """A compare worker (module level, so a spawned process can unpickle it)."""
    build_trainer(run, scripted_parts(run, run_dir.parents[2] / "cache"), run_dir).run(stop=stop)


def _evaluate_scripted(run: RunConfig, run_dir: Path, stop: StopRequest | None = None) -> None:
    """The starting policy's evaluation, on the scripted engine (module level, like `_train_scripted`)."""
    parts = scripted_parts(run, run_dir.parents[2] / "cache")
    write_start(run, run_dir, held_out_accuracy(parts.collector, parts.test.tasks, run.train.eval_samples))


def test_compare_with_parallel_workers_gives_the_same_summary_as_one_at_a_time(tmp_path):
    config = CompareConfig(methods=["grpo", "trace"], seeds=[0, 1], run=small_config(steps=2))
    one = run_compare(config, tmp_path / "one" / "cmp", _train_scripted, _evaluate_scripted)
    config.workers = 2
    two = run_compare(config, tmp_path / "two" / "cmp", _train_scripted, _evaluate_scripted)
    for method in ("grpo", "trace"):
        for key in ("effective_ratio", "mixed_budget_share", "final_accuracy", "rollouts", "tokens", "accuracy_gain"):
            assert one["methods"][method][key] == two["methods"][method][key], (method, key)
    assert one["react"] == two["react"]


def _train_or_fail(run: RunConfig, run_dir: Path, stop: StopRequest | None = None) -> None:
    """A compare worker whose `trace` run fails once its `grpo` sibling is training (module level,
    for a spawned process)."""
    if run.rollout.method == "trace":
        grpo = RunDir(run_dir.parents[1] / "grpo" / run_dir.name)
        deadline = time.monotonic() + 300
        while grpo.finished_steps() < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        raise ValueError("trace broke on purpose")
    _train_scripted(run, run_dir, stop)


def test_a_failed_parallel_job_stops_the_others_after_their_step_and_raises_its_error(tmp_path):
    config = CompareConfig(methods=["grpo", "trace"], seeds=[0], run=small_config(steps=6, checkpoint_every=100), workers=2, evaluate_start=False)
    with pytest.raises(ValueError, match="trace broke on purpose"):
        run_compare(config, tmp_path / "cmp", _train_or_fail, _evaluate_scripted)
    grpo = RunDir(tmp_path / "cmp" / "grpo" / "seed_0")
    done = grpo.finished_steps()
    assert 1 <= done < 6, "grpo was stopped at a step boundary, not run to the end nor killed"
    assert list(grpo.checkpoint_files()) == [done], "and checkpointed where it stopped"
    assert not (tmp_path / "cmp" / "summary.json").exists()


def test_eval_scores_a_runs_latest_checkpoint_or_the_starting_policy(tmp_path):
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "trace_rl"]
    small = ["task.test_tasks=4", "rollout.budget=8", "prompts_per_step=2"]
    subprocess.run([*command, "train", "--config", str(REPO / "configs" / "smoke.yaml"), "--out", str(run_dir), "train.steps=1", *small],
                   check=True, capture_output=True, text=True, timeout=900)
    trained = subprocess.run([*command, "eval", str(run_dir), "--samples", "2"], check=True, capture_output=True, text=True, timeout=900)
    result = json.loads(trained.stdout.strip().splitlines()[-1])
    assert result["step"] == 1 and result["tasks"] == 4 and result["samples"] == 2
    assert 0.0 <= result["val/accuracy_greedy"] <= 1.0 and 0.0 <= result["val/accuracy_sampled"] <= 1.0
    start = subprocess.run([*command, "eval", "--config", str(REPO / "configs" / "smoke.yaml"), *small], check=True, capture_output=True, text=True, timeout=900)
    assert json.loads(start.stdout.strip().splitlines()[-1])["step"] == 0
    missing = subprocess.run([*command, "eval", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert missing.returncode != 0 and "config.yaml" in missing.stderr and "Traceback" not in missing.stderr
