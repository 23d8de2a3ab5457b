"""The warm start: demonstrations and their thoughts, the loss mask, the copy-ready init, the cache."""

import json
import re
from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import skip_without_sandbox_for
from transformers import LlamaConfig, LlamaForCausalLM

from trace_rl.agent.agents import OracleAgent, run_episode
from trace_rl.agent.tasks import load_taskset
from trace_rl.agent.tasks.multihop import RELATIONS, read_fact
from trace_rl.models import TinyConfig, load_policy, token_logprobs
from trace_rl.rollout.collector import encode_prompt
from trace_rl.run import RunConfig, build_env
from trace_rl.training import sft
from trace_rl.training.sft import (
    SFTConfig,
    bucket_pack,
    copy_ready_init,
    demonstrations,
    episode_tokens,
    length_batches,
    masked_nll,
    pack_sft_batch,
    packed_nll,
    pad_sft_batch,
    sft_cache_key,
    sft_stats,
    train_sft,
    warm_start,
)

THOUGHT = re.compile(r"<think>(.*?)</think>")


@pytest.fixture(scope="module")
def multihop():
    taskset = load_taskset("multihop", split="test", num_tasks=60)
    return taskset, build_env(RunConfig(), taskset)


def small_policy(taskset, tmp_path):
    texts = [p.text for p in taskset.corpus[:80]] + [t.question for t in taskset.tasks]
    config = TinyConfig(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128, vocab_size=512)
    return load_policy("tiny", seed=0, tokenizer_texts=texts, tiny=config, cache_dir=tmp_path)


def test_multihop_rationale_states_the_fact_whose_object_the_oracle_writes_next(multihop):
    taskset, env = multihop
    checked = 0
    for task in taskset.tasks:
        episode = run_episode(env, task, OracleAgent(taskset.oracle, env.format))
        history = [(step.info.call, step.info.observation) for step in episode.steps]
        relations, chain = task.meta["relations"], task.meta["chain"]
        assert taskset.rationale(task, []) == ""  # the start entity is in the question
        for made, (call, _) in enumerate(history):
            why = taskset.rationale(task, history[:made])
            obj = next(iter(call.arguments.values()))
            if obj not in chain[1:]:
                continue  # the first search, or a retry with extra keywords
            hop = chain.index(obj)
            tail = RELATIONS[relations[hop - 1]].sentences[0].split("{o}")[1]  # "." or " kilometres long."
            assert read_fact(f"{why} {obj}{tail}", chain[hop - 1], relations[hop - 1]) == obj, (why, obj)
            assert why.count(chain[hop - 1]) == 1
            checked += 1
    assert checked >= 100


def test_clean_demonstrations_count_their_steps_and_state_each_fact(multihop):
    taskset, env = multihop
    episodes = demonstrations(taskset, env, SFTConfig(demos=60, mistake_prob=0.0), seed=0)
    clean = [e for e in episodes if e.reward == 1.0 and e.num_turns == e.task.meta["hops"] + 1]
    assert len(clean) >= 50
    for episode in clean:
        hops, chain = episode.task.meta["hops"], episode.task.meta["chain"]
        thoughts = [THOUGHT.search(action).group(1) for action in episode.actions]
        assert thoughts[0] == f"Step 1 of {hops}."
        for step, thought in enumerate(thoughts[1:-1], start=2):
            assert thought.startswith(f"Step {step} of {hops}: ") and chain[step - 2] in thought
        assert thoughts[-1].startswith("Done: ") and chain[-2] in thoughts[-1]


def test_mistakes_appear_at_about_the_configured_rate(multihop):
    taskset, env = multihop
    episodes = demonstrations(taskset, env, SFTConfig(demos=60, mistake_prob=0.3), seed=1)
    thoughts = [THOUGHT.search(a).group(1) for e in episodes for a in e.actions]
    random_moves = sum(not (t.startswith("Step ") or t.startswith("Done")) for t in thoughts)
    assert 0.15 < random_moves / len(thoughts) < 0.45
    assert 0.3 < np.mean([e.reward for e in episodes]) < 1.0


def test_episode_tokens_mask_exactly_the_policy_turns(multihop, tmp_path):
    taskset, env = multihop
    policy = small_policy(taskset, tmp_path)
    episode = demonstrations(taskset, env, SFTConfig(demos=1, mistake_prob=0.0), seed=0)[0]
    ids, mask = episode_tokens(policy.tokenizer, env, episode)
    prompt = encode_prompt(policy.tokenizer, env, episode.task)
    assert ids[: len(prompt)] == prompt and not any(mask[: len(prompt)])
    policy_text = policy.tokenizer.decode([i for i, m in zip(ids, mask) if m])
    assert policy_text.replace(" ", "") == "".join(episode.actions).replace(" ", "")
    observations = policy.tokenizer.decode([i for i, m in zip(ids[len(prompt):], mask[len(prompt):]) if not m])
    assert "<information>" in observations and "<think>" not in observations


def test_masked_nll_is_the_mean_over_masked_tokens_only(multihop, tmp_path):
    policy = small_policy(multihop[0], tmp_path)
    torch.manual_seed(0)
    sequences = [([5, 9, 14, 7, 30, 2], [0, 0, 1, 1, 0, 1]), ([8, 3, 11], [0, 1, 1])]
    ids, attention, loss_mask = pad_sft_batch(sequences)
    assert ids.shape == (2, 6) and attention[1].tolist() == [1, 1, 1, 0, 0, 0] and loss_mask[1, 3:].sum() == 0
    loss = masked_nll(policy.model, ids, attention, loss_mask)
    logp = token_logprobs(policy.model, ids, attention)
    expected = -(logp[0, 1] + logp[0, 2] + logp[0, 4] + logp[1, 0] + logp[1, 1]) / 5
    assert torch.allclose(loss, expected, atol=1e-6)
    # the output layer runs at the scored positions only: the same gradients as the full forward
    params = [p for p in policy.model.parameters() if p.requires_grad]
    fast = torch.autograd.grad(loss, params)
    full = torch.autograd.grad(expected, params)
    for a, b in zip(fast, full):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)


def test_a_packed_batch_holds_the_shared_prefix_once_and_scores_the_same_tokens():
    batch = [([1, 2, 3, 7, 8], [0, 0, 0, 1, 1]), ([1, 2, 3, 9], [0, 0, 1, 1]), ([1, 2, 5, 6], [0, 1, 0, 1])]
    ids, positions, nodes, sources, targets = pack_sft_batch(batch)
    assert ids[0].tolist() == [1, 2, 3, 7, 8, 3, 9, 5, 6]  # [1, 2] once, then each row's own tokens
    assert positions[0].tolist() == [0, 1, 2, 3, 4, 2, 3, 2, 3]
    assert nodes == [(0, 2, -1), (2, 5, 0), (5, 7, 0), (7, 9, 0)]
    # row 1 scores its 3 from the shared 2 (index 1), row 2 its 2 from the shared 1 (index 0), its 6 from its 5
    assert sources.tolist() == [2, 3, 1, 5, 0, 7] and targets.tolist() == [7, 8, 3, 9, 2, 6]
    assert len(targets) == sum(sum(mask[1:]) for _, mask in batch)


def test_packed_nll_equals_the_padded_loss_and_its_gradients(multihop, tmp_path):
    taskset, env = multihop
    policy = small_policy(taskset, tmp_path)
    episodes = demonstrations(taskset, env, SFTConfig(demos=4), seed=0)
    batch = [episode_tokens(policy.tokenizer, env, e) for e in episodes]
    assert pack_sft_batch(batch)[2][0][1] > 50  # the system prompt is shared
    params = [p for p in policy.model.parameters() if p.requires_grad]
    padded = masked_nll(policy.model, *pad_sft_batch(batch))
    packed = packed_nll(policy.model, pack_sft_batch(batch))
    assert torch.allclose(packed, padded, atol=1e-5)
    for a, b in zip(torch.autograd.grad(packed, params), torch.autograd.grad(padded, params)):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)


def test_a_bucketed_pack_pads_to_the_multiple_and_keeps_the_loss_and_gradients(multihop, tmp_path):
    taskset, env = multihop
    policy = small_policy(taskset, tmp_path)
    episodes = demonstrations(taskset, env, SFTConfig(demos=3), seed=1)
    batch = [episode_tokens(policy.tokenizer, env, e) for e in episodes]
    pack = pack_sft_batch(batch)
    padded, scored = bucket_pack(pack, 64)
    assert padded[0].shape[1] % 64 == 0 and len(padded[4]) % 64 == 0 and scored == len(pack[4])
    assert padded[2][:-1] == pack[2] and padded[2][-1][2] == -1  # one more root: nothing attends to it
    params = [p for p in policy.model.parameters() if p.requires_grad]
    plain = packed_nll(policy.model, pack)
    bucketed = packed_nll(policy.model, padded, scored=scored)
    assert torch.allclose(bucketed, plain, atol=1e-6)
    for a, b in zip(torch.autograd.grad(bucketed, params), torch.autograd.grad(plain, params)):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)
    # already a multiple of the tokens but not of the scores: a pad node is added for the scores to sit on
    length = pack[0].shape[1]
    exact, _ = bucket_pack(pack, length)
    assert exact[0].shape[1] == 2 * length and int(exact[3].max()) < 2 * length and len(exact[4]) == length


def test_the_bf16_step_keeps_the_tree_attention_in_fp32_and_stays_near_the_fp32_loss(multihop, tmp_path, monkeypatch):
    taskset, env = multihop
    policy = small_policy(taskset, tmp_path)
    batch = [episode_tokens(policy.tokenizer, env, e) for e in demonstrations(taskset, env, SFTConfig(demos=3), seed=2)]
    calls = []  # (query dtype, autocast on): autocast would run an fp32 query's attention in bf16
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda q, *a, **k: calls.append((q.dtype, torch.is_autocast_enabled("cpu"))) or sdpa(q, *a, **k))
    fp32, _ = sft.batch_loss(policy.model, batch, packed=True)
    bf16, tokens = sft.batch_loss(policy.model, batch, packed=True, precision="bf16")
    assert calls and set(calls) == {(torch.float32, False)} and tokens % sft.BF16_BUCKET == 0
    assert abs(bf16.item() - fp32.item()) < 0.02 * fp32.item()


def test_masked_nll_of_a_model_with_another_head_takes_the_full_forward(multihop, tmp_path):
    policy = small_policy(multihop[0], tmp_path)
    ids, attention, loss_mask = pad_sft_batch([([5, 9, 14, 7, 30, 2], [0, 0, 1, 1, 0, 1])])
    plain = masked_nll(policy.model, ids, attention, loss_mask)
    policy.model.config.model_type = "gemma2"  # soft-capped logits: not lm_head(hidden) alone
    policy.model.get_output_embeddings = lambda: pytest.fail("the full forward needs no separate head")
    assert torch.allclose(masked_nll(policy.model, ids, attention, loss_mask), plain, atol=1e-6)


def test_copy_ready_init_adds_an_orthogonal_identity_to_each_value_output_product(multihop, tmp_path):
    model = small_policy(multihop[0], tmp_path).model
    before = [(l.self_attn.v_proj.weight.clone(), l.self_attn.o_proj.weight.clone()) for l in model.model.layers]
    copy_ready_init(model, seed=3)
    for layer, (value, output) in zip(model.model.layers, before):
        added_value = layer.self_attn.v_proj.weight - value
        added_output = layer.self_attn.o_proj.weight - output
        assert torch.allclose(added_output @ added_value, torch.eye(value.shape[1]), atol=1e-5)
    grouped = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(ValueError, match="key/value heads"):
        copy_ready_init(grouped, seed=0)


def test_copy_ready_init_is_the_same_on_any_number_of_threads_and_leaves_the_count():
    """A run's `model.cpu_threads` is set before its warm start and is not in the cache key: the tiny
    policy's init (a QR per layer, which LAPACK rounds differently on 1 and 2 threads at this size) must
    not depend on it."""
    config = LlamaConfig(vocab_size=64, hidden_size=256, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    threads = torch.get_num_threads()
    weights = []
    try:
        for count in (1, 2):
            torch.manual_seed(0)
            model = LlamaForCausalLM(config)
            torch.set_num_threads(count)
            copy_ready_init(model, seed=0)
            assert torch.get_num_threads() == count
            weights.append([l.self_attn.v_proj.weight.clone() for l in model.model.layers])
    finally:
        torch.set_num_threads(threads)
    for one, two in zip(*weights):
        assert torch.equal(one, two)


def test_length_batches_cover_every_sequence_once_per_epoch_in_batches_of_similar_length():
    rng = np.random.default_rng(0)
    lengths = rng.integers(100, 900, size=200)
    batches = length_batches(lengths, 8, np.random.default_rng(1))
    epoch = [next(batches) for _ in range(25)]
    assert sorted(i for batch in epoch for i in batch) == list(range(200))
    spread = np.mean([np.ptp(lengths[batch]) for batch in epoch])
    assert spread < 0.5 * np.ptp(lengths)


def test_warm_start_is_trained_once_and_reused_until_its_recipe_changes(tmp_path):
    train = load_taskset("multihop", split="train", num_tasks=40)
    env = build_env(RunConfig(), train)
    config = SFTConfig(demos=8, steps=3, batch_size=4, warmup_steps=1)
    steps: list[int] = []
    folder = warm_start("tiny", train, env, config, cache_dir=tmp_path, progress=lambda step, loss: steps.append(step))
    assert steps == [0, 1, 2]
    stats = sft_stats(folder)
    assert stats["sft/steps"] == 3 and np.isfinite(stats["sft/final_loss"])
    assert warm_start("tiny", train, env, config, cache_dir=tmp_path, progress=lambda *a: steps.append(-1)) == folder
    assert steps == [0, 1, 2]  # the second call trained nothing
    other = warm_start("tiny", train, env, SFTConfig(demos=8, steps=3, batch_size=4, warmup_steps=1, seed=1), cache_dir=tmp_path)
    assert other != folder
    assert load_policy(folder).model.config.num_hidden_layers == TinyConfig().num_layers


def test_a_split_digits_warm_start_is_cached_apart_and_its_policy_splits_digits(tmp_path):
    train = load_taskset("toolmath", split="train", num_tasks=40)
    skip_without_sandbox_for(train)
    env = build_env(RunConfig(), train)
    config = SFTConfig(demos=8, steps=2, batch_size=4, warmup_steps=1)
    merged = warm_start("tiny", train, env, config, cache_dir=tmp_path)
    split = warm_start("tiny", train, env, config, tiny=TinyConfig(split_digits=True), cache_dir=tmp_path)
    assert split != merged
    assert warm_start("tiny", train, env, config, tiny=TinyConfig(), cache_dir=tmp_path) == merged  # the default keeps its key
    tokenizer = load_policy(split).tokenizer
    assert [tokenizer.decode([i]) for i in tokenizer.encode(" 3900", add_special_tokens=False)] == [" ", "3", "9", "0", "0"]


def test_padded_warm_starts_keep_the_cache_key_they_had_before_packing(tmp_path, monkeypatch):
    """Caches made before `packing` existed were padded (and fp32): the key leaves those values out."""
    train = load_taskset("multihop", split="train", num_tasks=40)
    env = build_env(RunConfig(), train)
    keyed = []
    monkeypatch.setattr(sft, "sft_cache_key", lambda parts: keyed.append(parts["config"]) or sft_cache_key(parts))
    config = SFTConfig(demos=8, steps=2, batch_size=4, warmup_steps=1, precision="fp32")
    packed = warm_start("tiny", train, env, config, cache_dir=tmp_path)
    padded = warm_start("tiny", train, env, replace(config, packing=False), cache_dir=tmp_path)
    assert packed != padded
    assert keyed[0]["packing"] is True and "packing" not in keyed[1] and "precision" not in keyed[1]
    assert sft_stats(packed)["sft/tokens"] < sft_stats(padded)["sft/tokens"]  # the shared prompt once, no padding


@pytest.mark.parametrize(("avx512_bf16", "amx"), [(True, False), (False, False), (True, True)])
def test_an_auto_precision_warm_start_is_bf16_only_where_it_was_measured_faster_and_shares_its_cache(tmp_path, monkeypatch, avx512_bf16, amx):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    native = avx512_bf16
    assert sft.resolved_precision("auto") == ("bf16" if native else "fp32")
    assert sft.resolved_precision("fp32") == "fp32" and sft.resolved_precision("bf16") == "bf16"
    train = load_taskset("multihop", split="train", num_tasks=40)
    env = build_env(RunConfig(), train)
    autocasts = []
    real_autocast = torch.autocast
    monkeypatch.setattr(torch, "autocast", lambda *a, enabled=True, **k: autocasts.append(enabled) or real_autocast(*a, enabled=enabled, **k))
    config = SFTConfig(demos=8, steps=2, batch_size=4, warmup_steps=1, precision="auto")
    folder = warm_start("tiny", train, env, config, cache_dir=tmp_path)
    if native:  # each bf16 step opens one autocast; the tree attention turns it off inside (enabled=False)
        assert autocasts[0] is True and autocasts.count(True) == 2
    else:
        assert autocasts == [False, False]
    assert json.loads((folder / "trace_rl_sft.json").read_text())["config"]["precision"] == ("bf16" if native else "fp32")
    explicit = replace(config, precision="bf16" if native else "fp32")
    seen = len(autocasts)
    assert warm_start("tiny", train, env, explicit, cache_dir=tmp_path) == folder  # the same cache, nothing trained
    assert len(autocasts) == seen


class Killed(Exception):
    pass


def kill_at(at: int):
    def progress(step: int, loss: float) -> None:
        if step == at:
            raise Killed

    return progress


def test_a_killed_sft_run_resumes_from_its_checkpoint_to_the_weights_of_an_uninterrupted_run(multihop, tmp_path):
    sequences = [([5, 9, 14, 7, 30, 2, 11, 40], [0, 0, 1, 1, 0, 1, 1, 1]), ([8, 3, 11, 12], [0, 1, 1, 1]), ([6, 7, 8], [0, 1, 1])] * 3
    config = SFTConfig(demos=1, steps=7, batch_size=2, lr=3e-3, warmup_steps=2)
    whole = small_policy(multihop[0], tmp_path / "a").model
    expected = train_sft(whole, sequences, config, seed=3)

    checkpoint = tmp_path / "run.partial.pt"
    with pytest.raises(Killed):  # killed after step 5 of 7: the checkpoint of step 4 is on disk
        train_sft(small_policy(multihop[0], tmp_path / "b").model, sequences, config, seed=3, checkpoint=checkpoint, checkpoint_every=2, progress=kill_at(4))
    seen: list[int] = []
    resumed = small_policy(multihop[0], tmp_path / "c").model
    stats = train_sft(resumed, sequences, config, seed=3, checkpoint=checkpoint, checkpoint_every=2, progress=lambda step, loss: seen.append(step))
    assert seen == [4, 5, 6]
    assert stats["sft/resumed_at_step"] == 4 and stats["sft/earlier_seconds"] > 0
    assert stats["sft/final_loss"] == expected["sft/final_loss"] and stats["sft/first_loss"] == expected["sft/first_loss"]
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_killed_warm_start_continues_where_it_stopped_and_leaves_no_checkpoint_behind(tmp_path, monkeypatch):
    monkeypatch.setattr(sft, "CHECKPOINT_EVERY", 2)
    train = load_taskset("multihop", split="train", num_tasks=40)
    env = build_env(RunConfig(), train)
    config = SFTConfig(demos=8, steps=5, batch_size=4, warmup_steps=1)
    with pytest.raises(Killed):
        warm_start("tiny", train, env, config, cache_dir=tmp_path, progress=kill_at(2))
    assert len(list(tmp_path.glob("sft-*.partial.pt"))) == 1 and not list(tmp_path.glob("sft-*/trace_rl_sft.json"))
    steps: list[int] = []
    folder = warm_start("tiny", train, env, config, cache_dir=tmp_path, progress=lambda step, loss: steps.append(step))
    assert steps == [2, 3, 4]
    assert sft_stats(folder)["sft/resumed_at_step"] == 2
    assert not list(tmp_path.glob("sft-*.partial.pt"))


def test_an_unreadable_warm_start_checkpoint_is_trained_over_with_a_warning(multihop, tmp_path):
    checkpoint = tmp_path / "run.partial.pt"
    checkpoint.write_bytes(b"cut short")
    sequences = [([5, 9, 14, 7], [0, 1, 1, 1])] * 4
    with pytest.warns(UserWarning, match="unreadable"):
        stats = train_sft(small_policy(multihop[0], tmp_path).model, sequences, SFTConfig(demos=1, steps=2, batch_size=2, warmup_steps=1), checkpoint=checkpoint)
    assert "sft/resumed_at_step" not in stats and stats["sft/steps"] == 2


def test_a_bf16_warm_start_trains_fp32_weights_and_lowers_the_loss(multihop, tmp_path):
    policy = small_policy(multihop[0], tmp_path)
    sequences = [([5, 9, 14, 7, 30, 2, 11, 40], [0, 0, 1, 1, 0, 1, 1, 1]), ([8, 3, 11, 12], [0, 1, 1, 1])] * 4
    config = SFTConfig(demos=1, steps=30, batch_size=4, lr=3e-3, warmup_steps=2, precision="bf16")
    stats = train_sft(policy.model, sequences, config, seed=0)
    assert stats["sft/final_loss"] < 0.5 * stats["sft/first_loss"]
    assert all(p.dtype == torch.float32 for p in policy.model.parameters())


def test_the_warm_start_cache_is_keyed_by_every_task_and_passage_not_a_sample(tmp_path):
    """Editing the answers of 15 of 20 records, or one passage, left the count, the first ids and the
    first transcript as they were, and the old warm start was reused (issue 43)."""
    train = load_taskset("multihop", split="train", num_tasks=20)
    env = build_env(RunConfig(), train)
    config = SFTConfig(demos=8, steps=2, batch_size=4, warmup_steps=1)
    first = warm_start("tiny", train, env, config, cache_dir=tmp_path)
    assert warm_start("tiny", replace(train, tasks=list(train.tasks)), env, config, cache_dir=tmp_path) == first

    answers = [replace(t, answers=("edited",)) if i >= 5 else t for i, t in enumerate(train.tasks)]
    assert sft.taskset_digest(replace(train, tasks=answers)) != sft.taskset_digest(train)
    passage = replace(train.corpus[-1], text=train.corpus[-1].text + " Edited.")
    assert sft.taskset_digest(replace(train, corpus=[*train.corpus[:-1], passage])) != sft.taskset_digest(train)
    assert warm_start("tiny", replace(train, tasks=answers), env, config, cache_dir=tmp_path) != first
