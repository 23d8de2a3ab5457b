"""verl adapter (`trace_rl.integrations.verl`, extra `verl`, `make test-verl`), with verl's own classes:
its `LLMServerClient` and sticky load balancer in front of rollout servers, its dataset and collate
function over the parquet files `data.py` writes, TransferQueue, its sync replay buffer, and the
`trace` trainer mode's advantage step. The servers are Ray actors with verl's replica `generate`
signature over trace-rl engines (a real tiny model; a scripted menu where rewards must mix), since
vLLM itself does not run in verl's environment on this CPU."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

verl = pytest.importorskip("verl")
ray = pytest.importorskip("ray")
tq = pytest.importorskip("transfer_queue")
torch = pytest.importorskip("torch")

import scripted_engine
from omegaconf import OmegaConf
from scripted_engine import KeyedScriptedEngine, coin_flip_answers, make_world
from tensordict import TensorDict
from verl.trainer.ppo.padding_utils import upsample_batch_to_divisible_size
from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer
from verl.utils import tensordict_utils as tu
from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn
from verl.workers.rollout.llm_server import LLMServerClient
from verl.workers.rollout.replica import TokenOutput
from verl.workers.rollout.router import GlobalRequestLoadBalancer

from trace_rl.core.advantage import get_estimator
from trace_rl.core.tree import RolloutTree
from trace_rl.engine.base import SamplingParams
from trace_rl.engine.hf import HFEngine
from trace_rl.infra.config import ConfigError
from trace_rl.integrations.rows import ADVANTAGES
from trace_rl.integrations.verl.data import write_parquet
from trace_rl.integrations.verl.engine import LLMServerEngine
from trace_rl.integrations.verl.manager import NODES, TraceAgentLoopManager, put_rows
from trace_rl.integrations.verl.trainer import TracePPOTrainer
from trace_rl.models import TinyConfig, load_policy, token_logprobs
from trace_rl.predictor.base import backup_targets
from trace_rl.run import RunConfig
from trace_rl.storage.rundir import RunDir

pytestmark = pytest.mark.verl

REPO = Path(__file__).resolve().parents[1]


class EngineServer:
    """A rollout server with verl's replica signature (`generate(prompt_ids, sampling_params,
    request_id, ...) -> TokenOutput`, one sample per call, vLLM's sampling keys) over a trace-rl engine."""

    def __init__(self, make_engine) -> None:
        self.engine = make_engine()
        self.prompts: list[tuple[int, ...]] = []

    def generate(self, prompt_ids, sampling_params, request_id, image_data=None, video_data=None, **kwargs):
        self.prompts.append(tuple(prompt_ids))
        params = SamplingParams(
            n=1,
            temperature=sampling_params["temperature"],
            top_p=sampling_params["top_p"],
            max_new_tokens=sampling_params["max_tokens"],
            stop=tuple(sampling_params.get("stop", ())),
            seed=sampling_params.get("seed"),
            ignore_eos=sampling_params.get("ignore_eos", False),
        )
        out = self.engine.generate([prompt_ids], params)[0][0]
        return TokenOutput(token_ids=out.token_ids, log_probs=out.logprobs if sampling_params.get("logprobs") else None,
                           stop_reason="completed", extra_fields={"global_steps": 0, "num_cached_tokens": out.cached_tokens})

    def seen(self) -> list[tuple[int, ...]]:
        return list(self.prompts)


TINY = TinyConfig(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128, vocab_size=600)


def tiny_engine(folder: str) -> HFEngine:
    return HFEngine.from_policy(load_policy(folder))


def scripted_coin_flips():
    """Searches or answers, right or wrong, drawn on (seed, prompt): mixed groups are common."""
    taskset, _, tokenizer, _ = make_world()
    return KeyedScriptedEngine(tokenizer, menu_for=coin_flip_answers(taskset.tasks))


def verl_client(*servers) -> LLMServerClient:
    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "vllm", "full_determinism": False}}})
    balancer = ray.remote(GlobalRequestLoadBalancer).remote(servers={f"server{i}": s for i, s in enumerate(servers)})
    return LLMServerClient(config, balancer)


def verl_config(run_yaml: Path, *, train_batch_size: int = 4, n: int = 4, **trace) -> OmegaConf:
    return OmegaConf.create({
        "data": {"train_batch_size": train_batch_size},
        "actor_rollout_ref": {"model": {"path": "unused"}, "rollout": {
            "n": n, "temperature": 1.0, "full_determinism": False, "val_kwargs": {"n": 2, "temperature": 1.0}}},
        "trace_rl": {"config": str(run_yaml), **trace},
    })


VERL_DEFAULT_CORRECTION = {"rollout_is": None, "rollout_is_threshold": 2.0, "rollout_rs": None, "rollout_rs_threshold": None,
                           "bypass_mode": False, "loss_type": "ppo_clip", "rollout_is_batch_normalize": False}
"""`algorithm.rollout_correction` as verl's ppo_trainer.yaml sets it (metrics only)."""


def advantage_step(meta, correction=None, metrics=None, **trainer):
    """Trainer mode trace's advantage step with `algorithm.rollout_correction` = `correction` (and the
    trainer's `agent_loop_manager` and `global_steps`, when given)."""
    state = SimpleNamespace(config=OmegaConf.create({"algorithm": {"rollout_correction": correction}}), **trainer)
    return TracePPOTrainer._compute_advantage(state, meta, {} if metrics is None else metrics)


def sync_replay_buffer() -> ReplayBuffer:
    """verl's replay buffer as its `sync` trainer builds it (no off-policy bound, no group filter)."""
    return ReplayBuffer(trainer_mode="sync", trainer_config={}, max_off_policy_threshold=None, max_off_policy_strategy="drop",
                        sampler_kwargs={}, poll_interval=0.05)


def submit(tokenizer, parquet: Path, count: int, *, partition: str, step: int, validate: bool = False):
    """The first `count` rows of a parquet file as verl's trainer hands them to the manager: its
    dataset and collate function, a uid per prompt, each group registered as pending in TransferQueue."""
    dataset = RLHFDataset(data_files=[str(parquet)], tokenizer=tokenizer,
                          config=OmegaConf.create({"filter_overlong_prompts": False, "return_raw_chat": True}))
    batch_dict = collate_fn([dataset[i] for i in range(count)])
    batch_dict["uid"] = np.array([str(uuid.uuid4()) for _ in range(count)], dtype=object)
    batch = tu.get_tensordict(batch_dict)
    tu.assign_non_tensor_data(batch, "global_steps", step)
    if validate:
        tu.assign_non_tensor_data(batch, "validate", True)
    tq.kv_batch_put(keys=list(batch["uid"]), partition_id=partition, tags=[{"is_prompt": True, "status": "pending", "global_steps": step}] * count)
    return batch


@pytest.fixture(scope="module", autouse=True)
def ray_and_transfer_queue():
    """One Ray and one TransferQueue for the module; the actors cannot import the tests folder, so its
    helpers travel to them by value."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.cloudpickle.register_pickle_by_value(scripted_engine)
    ray.init(num_cpus=8, include_dashboard=False)  # logical CPUs: TransferQueue's controller and two storage units hold one each
    tq.init()
    yield
    tq.close()
    ray.shutdown()


@pytest.fixture(scope="module")
def world():
    return make_world()


@pytest.fixture(scope="module")
def run_yaml(tmp_path_factory) -> Path:
    """A trace-rl run config over make_world's 12 tasks: 4 prompts a step, 16 leaves (verl: 4 x n=4)."""
    path = tmp_path_factory.mktemp("verl") / "run.yaml"
    path.write_text(
        "seed: 0\nprompts_per_step: 4\n"
        "task: {name: multihop, train_tasks: 12, test_tasks: 4, max_turns: 4}\n"
        "rollout: {method: trace, budget: 16, max_new_tokens: 48}\n"
    )
    return path


def test_the_verl_plugins_entry_point_registers_trainer_mode_trace():
    """verl imports every `verl.plugins` entry point when it is imported, so a fresh verl process
    resolves `trainer.v1.trainer_mode=trace` without importing trace-rl itself; and the manager's
    class path, as verl's config names it, loads."""
    code = (
        "import verl\nfrom verl.trainer.ppo.v1 import get_trainer_cls\nfrom verl.utils.import_utils import load_class_from_fqn\n"
        "load_class_from_fqn('trace_rl.integrations.verl.manager.TraceAgentLoopManager', 'AgentLoopManager')\n"
        "print(get_trainer_cls('trace').__qualname__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "TracePPOTrainer"


def test_the_engine_over_verls_client_returns_teacher_forced_logprobs_and_repeats_with_its_seed(world, tmp_path):
    taskset, env, _, _ = world
    policy = load_policy("tiny", seed=0, tokenizer_texts=[p.text for p in taskset.corpus[:50]], tiny=TINY, cache_dir=tmp_path)
    tokenizer = policy.tokenizer
    folder = str(policy.path)
    server = ray.remote(EngineServer).remote(lambda: tiny_engine(folder))
    engine = LLMServerEngine(verl_client(server), tokenizer)
    prompts = [tokenizer.encode("Question: who built the bridge?"), tokenizer.encode("Question: where is the river?")]
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=12, stop=env.stop_strings(), seed=7)
    first = engine.generate(prompts, params)
    again = engine.generate(prompts, params)
    assert [[c.token_ids for c in g] for g in first] == [[c.token_ids for c in g] for g in again]
    assert len(first) == 2 and all(len(group) == 3 for group in first)
    assert len({tuple(c.token_ids) for c in first[0]}) > 1  # the three samples of a prompt differ (seed + j)
    for prompt, group in zip(prompts, first):
        for c in group:
            with torch.no_grad():
                scored = token_logprobs(policy.model.eval(), torch.tensor([prompt + c.token_ids]))[0, len(prompt) - 1 :]
            np.testing.assert_allclose(c.logprobs, scored.tolist(), atol=1e-5)
            assert c.finish_reason in ("stop", "length", "eos") and (c.finish_reason != "stop" or c.text.endswith(c.stop_reason))


def test_a_trees_calls_all_reach_one_server_through_verls_sticky_balancer(world):
    """The route key (the collector passes the tree's task id) is verl's sticky-session id."""
    taskset, env, tokenizer, _ = world
    servers = [ray.remote(EngineServer).remote(scripted_coin_flips) for _ in range(2)]
    engine = LLMServerEngine(verl_client(*servers), tokenizer)
    prompts = [tokenizer.encode(task.question) for task in taskset.tasks[:6]]
    trees = [task.task_id for task in taskset.tasks[:6]]
    engine.generate(prompts, SamplingParams(n=4, max_new_tokens=16, stop=env.stop_strings(), seed=1), route_keys=trees)
    later = [p + tokenizer.encode(" more") for p in prompts]  # a later turn of each tree
    engine.generate(later, SamplingParams(n=2, max_new_tokens=16, seed=2), route_keys=trees)
    seen = [ray.get(s.seen.remote()) for s in servers]
    assert sum(len(s) for s in seen) == 6 * 4 + 6 * 2
    for prompt in prompts:  # every call of a prompt and of its later turn went to one server
        served = {i for i, calls in enumerate(seen) for call in calls if call[: len(prompt)] == tuple(prompt)}
        assert len(served) == 1


def test_the_manager_writes_one_row_per_leaf_with_its_own_reward_and_tree_advantages(world, run_yaml, tmp_path):
    """verl's data path end to end: parquet -> RLHFDataset -> collate -> the manager -> TransferQueue
    -> the sync replay buffer -> trainer mode trace's advantage step. Every row keeps its leaf's own
    reward (mixed within a prompt's group, never the last leaf's copied) and its tree advantages."""
    _, _, tokenizer, _ = world
    server = ray.remote(EngineServer).remote(scripted_coin_flips)
    config = verl_config(run_yaml, out=str(tmp_path / "trace_run"))
    manager = TraceAgentLoopManager.create(config=config, llm_client=verl_client(server), tokenizer=tokenizer)

    run = manager.run
    paths = write_parquet(run, tmp_path / "data")
    batch = submit(tokenizer, paths["train"], 4, partition="train", step=1)

    manager.generate_sequences(batch)

    meta, _ = sync_replay_buffer().sample(global_steps=1, partition_id="train", batch_size=4)
    logged: dict = {}
    meta = advantage_step(meta, VERL_DEFAULT_CORRECTION, logged, agent_loop_manager=manager, global_steps=1)  # no old_log_probs: no correction
    assert logged == {f"trace/{key}": value for key, value in manager.last_metrics.items()} and "trace/tree/effective_ratio" in logged
    data = tq.kv_batch_get(keys=meta.keys, partition_id="train", select_fields=["rm_scores", "advantages", "response_mask", "responses", NODES, "uid"])

    trees = manager.last_trees
    assert len(meta.keys) == sum(t.leaves().size for t in trees) == run.rollout.budget
    expected = get_estimator("trace")(trees)
    by_uid = dict(zip(batch["uid"], range(4)))
    rewards_by_prompt: dict[str, list[float]] = {}
    trained = 0
    for row, key in enumerate(meta.keys):
        uid, leaf, _ = key.rsplit("_", 2)
        tree, leaf = trees[by_uid[uid]], int(leaf)
        scores = data["rm_scores"][row]
        assert float(scores.sum()) == float(scores[-1]) == tree.nodes[leaf].reward
        rewards_by_prompt.setdefault(uid, []).append(float(scores[-1]))
        nodes = data[NODES][row].tolist()
        mask = data["response_mask"][row]
        adv = data["advantages"][row]
        assert nodes == [n for n in tree.path(leaf)[1:] for _ in tree.nodes[n].token_ids]
        node_adv = expected[by_uid[uid]].advantage
        np.testing.assert_allclose(adv[mask.bool()].numpy(), node_adv[np.array(nodes)][mask.bool().numpy()], atol=1e-6)
        assert float(adv[~mask.bool()].abs().sum()) == 0.0
        trained += int(mask.sum())
    assert trained == sum(sum(n.mask) for t in trees for n in t.nodes[1:])  # every policy token trained once
    assert any(len(set(r)) > 1 for r in rewards_by_prompt.values())  # groups mix: rewards were not copied from one leaf
    assert (tmp_path / "trace_run" / "metrics.jsonl").is_file() and (tmp_path / "trace_run" / "trees").is_dir()


def test_a_resumed_verl_run_restores_the_managers_predictor_and_rng_of_the_step_verl_resumes_from(world, run_yaml, tmp_path):
    """verl's checkpoints hold its models only (issue 44: a resumed run's predictor restarted cold). The
    manager keeps its state per step in trace_rl.out; a new manager (verl restarted from its step-2
    checkpoint) restores step 2's before planning step 3, and refuses a resume it has no state for."""
    _, _, tokenizer, _ = world
    server = ray.remote(EngineServer).remote(scripted_coin_flips)
    config = verl_config(run_yaml, out=str(tmp_path / "trace_run"))
    config.trainer = {"save_freq": 2}
    first = TraceAgentLoopManager.create(config=config, llm_client=verl_client(server), tokenizer=tokenizer)
    paths = write_parquet(first.run, tmp_path / "data")
    for step in (1, 2, 3):
        first.generate_sequences(submit(tokenizer, paths["train"], 4, partition="train", step=step))
        sync_replay_buffer().sample(global_steps=step, partition_id="train", batch_size=4)
        if step == 2:
            histories = backup_targets(first.last_trees)[0]
            estimates, rng = first.predictor.predict(histories), first.collector.rng.bit_generator.state
    assert sorted(RunDir(tmp_path / "trace_run").checkpoint_files()) == [2, 3]  # verl's save step and the newest

    resumed = TraceAgentLoopManager.create(config=config, llm_client=verl_client(server), tokenizer=tokenizer)
    assert not np.allclose(resumed.predictor.predict(histories), estimates)  # a new manager starts cold
    assert resumed.restore(3) == 2
    np.testing.assert_array_equal(resumed.predictor.predict(histories), estimates)
    assert resumed.collector.rng.bit_generator.state == rng
    assert [m["step"] for m in RunDir(tmp_path / "trace_run").metrics()] == [1, 2]

    with pytest.raises(ConfigError, match=r"verl resumed at step 6, but .* holds the manager's state for steps \[2, 3\], not 5"):
        TraceAgentLoopManager.create(config=config, llm_client=verl_client(server), tokenizer=tokenizer).restore(6)


def test_a_validation_batch_gets_val_kwargs_n_plain_rollouts_per_prompt_and_no_predictor_update(world, run_yaml, tmp_path):
    """verl's `_validate` submits the validation set with `validate` set: each prompt gets
    `val_kwargs.n` independent rollouts (no allocation, no Stage 2), in the `val` partition."""
    _, _, tokenizer, _ = world
    server = ray.remote(EngineServer).remote(scripted_coin_flips)
    manager = TraceAgentLoopManager.create(config=verl_config(run_yaml), llm_client=verl_client(server), tokenizer=tokenizer)
    paths = write_parquet(manager.run, tmp_path / "data")
    # the train file: the scripted server answers make_world's questions only
    batch = submit(tokenizer, paths["train"], 3, partition="val", step=0, validate=True)
    state = manager.predictor.state_dict()

    manager.generate_sequences(batch)

    meta, _ = sync_replay_buffer().sample(global_steps=0, partition_id="val", batch_size=3)
    uids = [key.rsplit("_", 2)[0] for key in meta.keys]
    assert sorted(uids.count(uid) for uid in set(uids)) == [2, 2, 2]  # val_kwargs.n = 2 each
    data = tq.kv_batch_get(keys=meta.keys, partition_id="val", select_fields=["rm_scores", "data_source", "reward_model"])
    assert len(data["rm_scores"]) == 6 and list(data["data_source"]) == ["multihop"] * 6
    assert manager.last_trees == [] and str(manager.predictor.state_dict()) == str(state)  # validation teaches nothing


def test_put_rows_keeps_a_hand_worked_trees_rewards_and_advantages(tmp_path):
    """Root [1, 2] -> P (3, 4 | observation 5) -> A (6, reward 1) and B (7, 8, reward 0): A's row
    trains P and A, B's row only B; each row's score is its own leaf's; the padding rows verl adds to
    make a batch divisible get zero advantages."""
    tree = RolloutTree.new("t", "q", [1, 2])
    p = tree.add_turn(0, token_ids=[3, 4, 5], mask=[1, 1, 0], logprobs=[-0.1, -0.2, 0.0])
    a = tree.add_turn(p, token_ids=[6], logprobs=[-0.3], reward=1.0)
    b = tree.add_turn(p, token_ids=[7, 8], logprobs=[-0.4, -0.5], reward=0.0, starts_rollout=True)
    uid = str(uuid.uuid4())
    tq.kv_put(key=uid, partition_id="train", tag={"is_prompt": True, "status": "pending", "global_steps": 3})
    keys = put_rows([tree], get_estimator("trace")([tree]), [uid], {"uid": [uid]}, partition="train", global_steps=3)
    assert keys == [f"{uid}_{a}_0", f"{uid}_{b}_0"]
    meta, _ = sync_replay_buffer().sample(global_steps=3, partition_id="train", batch_size=1)
    meta = upsample_batch_to_divisible_size(meta, 4, eos_token_id=0)  # verl's no-op rows: 2 more, one token each
    meta = advantage_step(meta)
    padding = [key for key, tag in zip(meta.keys, meta.tags) if tag.get("is_padding")]
    assert len(padding) == 2
    pads = tq.kv_batch_get(keys=padding, partition_id="train", select_fields=["advantages", "response_mask"])
    assert [a.tolist() for a in pads["advantages"].unbind()] == [[0.0], [0.0]]
    data = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["rm_scores", "advantages", "response_mask", ADVANTAGES, "num_turns"])
    assert list(data["num_turns"]) == [2, 2]
    adv = (0.5 / (np.sqrt(0.5) + 1e-6)) * 2
    np.testing.assert_allclose(data["rm_scores"][0].numpy(), [0, 0, 0, 1])
    np.testing.assert_allclose(data["rm_scores"][1].numpy(), [0, 0, 0, 0, 0])
    assert data["response_mask"][0].tolist() == [1, 1, 0, 1] and data["response_mask"][1].tolist() == [0, 0, 0, 1, 1]
    np.testing.assert_allclose(data["advantages"][0].numpy(), [0, 0, 0, adv], atol=1e-6)
    np.testing.assert_allclose(data["advantages"][1].numpy(), [0, 0, 0, -adv, -adv], atol=1e-6)


class FlakyServer(EngineServer):
    """A replica whose first call is answered as verl answers while its weights are swapped (`aborted`)."""

    def __init__(self, make_engine) -> None:
        super().__init__(make_engine)
        self.calls = 0

    def generate(self, prompt_ids, sampling_params, request_id, image_data=None, video_data=None, **kwargs):
        self.calls += 1
        if self.calls == 1:
            return TokenOutput(token_ids=[1], log_probs=[-0.1], stop_reason="aborted", extra_fields={})
        return super().generate(prompt_ids, sampling_params, request_id, image_data, video_data, **kwargs)


def test_a_batch_that_fails_marks_its_groups_failed_and_verls_refill_carries_the_step_on(world, run_yaml, tmp_path):
    """One exception in the manager stopped the run and no group was ever marked failed (issue 44)."""
    _, _, tokenizer, _ = world
    server = ray.remote(FlakyServer).remote(scripted_coin_flips)
    manager = TraceAgentLoopManager.create(config=verl_config(run_yaml), llm_client=verl_client(server), tokenizer=tokenizer)
    paths = write_parquet(manager.run, tmp_path / "data")
    failed = submit(tokenizer, paths["train"], 4, partition="train", step=1)
    manager.generate_sequences(failed)  # the aborted call fails the batch, not the process
    assert manager.failed_batches == 1
    tags = tq.kv_list("train")["train"]
    assert [tags[uid]["status"] for uid in failed["uid"]] == ["failure"] * 4

    refilled = []

    def refill(count: int) -> None:  # what verl's trainer does: submit fresh prompts to the manager
        batch = submit(tokenizer, paths["train"], count, partition="train", step=1)
        refilled.extend(batch["uid"])
        manager.generate_sequences(batch)

    buffer = ReplayBuffer(trainer_mode="sync", trainer_config={}, max_off_policy_threshold=None, max_off_policy_strategy="drop",
                          sampler_kwargs={}, poll_interval=0.05, refill_fn=refill, sync_refill_failed_groups=True, gen_batch_size=1)
    meta, metrics = buffer.sample(global_steps=1, partition_id="train", batch_size=4)
    assert len(refilled) == 4 and {key.rsplit("_", 2)[0] for key in meta.keys} == set(refilled)
    assert metrics["training/rollout_failure/evicted_samples"] == 4 and manager.failed_batches == 1


def test_verls_group_filter_drops_a_tree_whose_leaves_all_scored_alike_and_keeps_a_mixed_one():
    """verl's DAPO group filter reads `reward_extra_info` (issue 44: none was written, so it failed)."""
    mixed = RolloutTree.new("m", "q", [1, 2])
    trunk = mixed.add_turn(0, token_ids=[3, 4], logprobs=[-0.1, -0.2])
    mixed.add_turn(trunk, token_ids=[5], logprobs=[-0.3], reward=1.0)
    mixed.add_turn(trunk, token_ids=[6], logprobs=[-0.4], reward=0.0, starts_rollout=True)
    uniform = RolloutTree.new("u", "q2", [1, 7])
    for token in (8, 9):
        uniform.add_turn(0, token_ids=[token], logprobs=[-0.5], reward=0.0)
    uids = [str(uuid.uuid4()), str(uuid.uuid4())]
    for uid in uids:
        tq.kv_put(key=uid, partition_id="train", tag={"is_prompt": True, "status": "pending", "global_steps": 7})
    keys = put_rows([mixed, uniform], get_estimator("trace")([mixed, uniform]), uids, {"uid": uids}, partition="train", global_steps=7)
    extra = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["extra_fields"])["extra_fields"]
    assert [getattr(e, "data", e)["reward_extra_info"]["acc"] for e in extra] == [1.0, 0.0, 0.0, 0.0]

    refills: list[int] = []
    buffer = ReplayBuffer(trainer_mode="sync", trainer_config={}, max_off_policy_threshold=None, max_off_policy_strategy="drop",
                          sampler_kwargs={}, poll_interval=0.05, refill_fn=refills.append, filter_groups_metric="acc",
                          train_batch_size=1, gen_batch_size=1)
    meta, metrics = buffer.sample(global_steps=7, partition_id="train", batch_size=1)
    assert {key.rsplit("_", 2)[0] for key in meta.keys} == {uids[0]}
    assert metrics["training/filter_groups/evicted_samples"] == 1 and refills == []


def test_verls_rollout_correction_runs_on_the_rows_and_its_weights_and_metrics_are_kept(tmp_path):
    """Trainer mode trace replaces verl's advantage step, which also runs the rollout correction (on by
    default): it must still run, on the rows' rollout log-probs against the actor's recomputed ones
    (issue 44: its weights and mismatch metrics vanished without a word)."""
    tree = RolloutTree.new("t", "q", [1, 2])
    p = tree.add_turn(0, token_ids=[3, 4, 5], mask=[1, 1, 0], logprobs=[-0.1, -0.2, 0.0])
    tree.add_turn(p, token_ids=[6], logprobs=[-0.3], reward=1.0)
    tree.add_turn(p, token_ids=[7, 8], logprobs=[-0.4, -0.5], reward=0.0, starts_rollout=True)
    uid = str(uuid.uuid4())
    tq.kv_put(key=uid, partition_id="train", tag={"is_prompt": True, "status": "pending", "global_steps": 5})
    keys = put_rows([tree], get_estimator("trace")([tree]), [uid], {"uid": [uid]}, partition="train", global_steps=5)
    meta, _ = sync_replay_buffer().sample(global_steps=5, partition_id="train", batch_size=1)
    shift = [torch.tensor([0.5, 0.0, 0.0, 1.0]), torch.tensor([0.0, 0.0, 0.0, 0.2, -0.3])]  # the actor's recomputed - the engine's
    rollout = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["rollout_log_probs"])["rollout_log_probs"].unbind()
    old = torch.nested.as_nested_tensor([r + d for r, d in zip(rollout, shift)], layout=torch.jagged)
    tq.kv_batch_put(keys=keys, partition_id="train", fields=TensorDict({"old_log_probs": old}, batch_size=2))

    metrics: dict = {}
    advantage_step(meta, {**VERL_DEFAULT_CORRECTION, "rollout_is": "token"}, metrics)
    weights = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["rollout_is_weights"])["rollout_is_weights"].unbind()
    np.testing.assert_allclose(weights[0].numpy(), [np.exp(0.5), 1.0, 0.0, 2.0], rtol=1e-5)  # masked, truncated at 2
    np.testing.assert_allclose(weights[1].numpy(), [0.0, 0.0, 0.0, np.exp(0.2), np.exp(-0.3)], rtol=1e-5)
    assert any(key.startswith("rollout_corr/") for key in metrics)

    bypass: dict = {}
    advantage_step(meta, {**VERL_DEFAULT_CORRECTION, "bypass_mode": True}, bypass)
    assert bypass == {}, "bypass mode leaves the correction to the actor, as verl's own step does"


def test_the_manager_refuses_a_budget_other_than_verls_rows(run_yaml, world):
    with pytest.raises(ConfigError, match="rollout.budget=16"):
        TraceAgentLoopManager(verl_config(run_yaml, n=8), llm_client=None, tokenizer=world[2])
    too_short = verl_config(run_yaml)
    too_short.data.max_prompt_length, too_short.data.max_response_length = 512, 512
    with pytest.raises(ConfigError, match="max_context_tokens=.* exceeds verl's"):
        TraceAgentLoopManager(too_short, llm_client=None, tokenizer=world[2])
    with pytest.raises(ConfigError, match="trace_rl.config is not set"):
        TraceAgentLoopManager(OmegaConf.create({"data": {}}), llm_client=None, tokenizer=world[2])


def test_the_gpu_recipe_composes_into_verls_config_and_agrees_with_its_trace_rl_config():
    """examples/verl_trace.sh's overrides are keys verl's config has (or adds with +), its rollout
    section still builds verl's dataclass, and the trace-rl config's budget is verl's rows a step."""
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass

    from trace_rl.infra.config import load_config
    from trace_rl.integrations.verl.manager import check_verl_config

    lines = (REPO / "configs/gpu/verl_qwen3_8b.overrides").read_text().splitlines()
    overrides = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
    recipe = REPO / "configs/gpu/qwen3_8b_search.yaml"
    with initialize_config_dir(config_dir=str(Path(verl.__file__).parent / "trainer" / "config"), version_base=None):
        config = compose(config_name="ppo_trainer", overrides=[*overrides, "data.train_files=t.parquet", "data.val_files=v.parquet",
                                                              f"+trace_rl.config={recipe}", "+trace_rl.overrides=['task.name=multihop']"])
    run = load_config(RunConfig, recipe, ["task.name=multihop", "task.options={}"])  # the recipe's file: task needs Search-R1's data
    check_verl_config(config, run)
    assert config.trainer.use_v1 and config.trainer.v1.trainer_mode == "trace"
    rollout = omega_conf_to_dataclass(config.actor_rollout_ref.rollout)
    assert rollout.agent.agent_loop_manager_class == "trace_rl.integrations.verl.manager.TraceAgentLoopManager"
    assert config.actor_rollout_ref.actor.loss_agg_mode == "token-mean"  # each node's tokens once
