"""The `hf` engine: sampling, log-probs, stop strings, batching and prefix sharing on a tiny model."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from trace_rl.engine.base import Completion, Engine, SamplingParams, cut_at_stop  # noqa: E402
from trace_rl.engine.hf import HFEngine  # noqa: E402
from trace_rl.models import Policy, TinyConfig, load_policy, score_batch  # noqa: E402

TEXTS = [
    "Question: Which river flows through Paris? <think> search it </think> <search> river Paris </search>",
    "<information> The Seine flows through Paris. </information> <answer> Seine </answer>",
] * 4
PROMPTS = [
    [2, 40, 41, 42, 43, 44, 45, 46, 47],
    [2, 50, 51],
    [2, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75],
]


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Policy:
    config = TinyConfig(vocab_size=600, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128)
    return load_policy("tiny", seed=0, tokenizer_texts=TEXTS, tiny=config, cache_dir=tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def engine(policy: Policy) -> HFEngine:
    return HFEngine.from_policy(policy)


def _assert_logprobs_match_teacher_forcing(
    policy: Policy, prompts: list[list[int]], results: list[list[Completion]], temperature: float = 1.0
) -> None:
    pairs = [(prompt, c.token_ids) for prompt, group in zip(prompts, results) for c in group]
    expected = score_batch(policy.model, pairs, temperature=temperature)
    got = [c.logprobs for group in results for c in group]
    for exp, out in zip(expected, got):
        assert out == pytest.approx(exp, abs=1e-4)


def _tokens(results: list[list[Completion]]) -> list[list[list[int]]]:
    return [[c.token_ids for c in group] for group in results]


def test_engine_satisfies_the_protocol(engine: HFEngine) -> None:
    assert isinstance(engine, Engine)


def test_generate_returns_n_completions_per_prompt(engine: HFEngine) -> None:
    results = engine.generate(PROMPTS, SamplingParams(n=3, max_new_tokens=6, seed=0, ignore_eos=True))
    assert [len(group) for group in results] == [3, 3, 3]
    for group in results:
        for completion in group:
            assert len(completion.token_ids) == len(completion.logprobs) == 6
            assert completion.finish_reason == "length"
        assert len({tuple(c.token_ids) for c in group}) > 1  # independent samples


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_teacher_forced_recomputation(policy: Policy, engine: HFEngine, temperature: float) -> None:
    params = SamplingParams(n=2, temperature=temperature, max_new_tokens=12, seed=1)
    results = engine.generate(PROMPTS, params)
    _assert_logprobs_match_teacher_forcing(policy, PROMPTS, results, temperature)


def test_different_length_prompts_batch_like_one_by_one(engine: HFEngine) -> None:
    params = SamplingParams(n=2, max_new_tokens=10, seed=7, ignore_eos=True)
    batched = engine.generate(PROMPTS, params)
    for prompt, group in zip(PROMPTS, batched):
        [alone] = engine.generate([prompt], params)
        assert [c.token_ids for c in alone] == [c.token_ids for c in group]
        for a, b in zip(alone, group):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_shared_prefill_draws_the_same_samples_as_separate_prefills(policy: Policy, engine: HFEngine) -> None:
    prompt = PROMPTS[2]
    params = dict(max_new_tokens=10, seed=3, ignore_eos=True)
    shared = engine.generate([prompt], SamplingParams(n=4, **params))[0]  # one prefill, cache repeated
    separate = [g[0] for g in engine.generate([prompt] * 4, SamplingParams(n=1, **params))]  # four prefills
    assert [c.token_ids for c in shared] == [c.token_ids for c in separate]
    for a, b in zip(shared, separate):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    _assert_logprobs_match_teacher_forcing(policy, [prompt], [shared])


def test_rows_that_finish_at_different_steps_get_what_they_get_alone(policy: Policy, engine: HFEngine) -> None:
    """Finished rows stay in the batch until they are half of it, then leave it together
    (`_COMPACT_AT`): neither may change what the rows still generating draw, nor what a finished
    row returns."""
    params = SamplingParams(n=6, max_new_tokens=16, seed=2, stop=("e",))
    batched = engine.generate(PROMPTS, params)
    lengths = {len(c.token_ids) for group in batched for c in group}
    assert len(lengths) >= 4 and {c.finish_reason for group in batched for c in group} >= {"stop", "length"}
    one_by_one = HFEngine.from_policy(policy, max_batch_size=1, prefix_cache_mb=0)
    for prompt, group in zip(PROMPTS, batched):
        # The same six samples (a prompt's n draws are its first n occurrences), each in its own batch.
        single = [g[0] for g in one_by_one.generate([prompt] * 6, dataclasses.replace(params, n=1))]
        assert [c.token_ids for c in single] == [c.token_ids for c in group]
        assert [c.finish_reason for c in single] == [c.finish_reason for c in group]
        for a, b in zip(single, group):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    _assert_logprobs_match_teacher_forcing(policy, PROMPTS, batched)


def test_small_batches_give_the_same_results(policy: Policy, engine: HFEngine) -> None:
    params = SamplingParams(n=3, max_new_tokens=8, seed=11)
    small = HFEngine.from_policy(policy, max_batch_size=2)
    assert _tokens(small.generate(PROMPTS, params)) == _tokens(engine.generate(PROMPTS, params))


def test_seed_reproduces_and_different_seeds_differ(engine: HFEngine) -> None:
    params = SamplingParams(n=2, max_new_tokens=8, seed=5, ignore_eos=True)
    first = engine.generate(PROMPTS, params)
    assert _tokens(first) == _tokens(engine.generate(PROMPTS, params))
    other = engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=8, seed=6, ignore_eos=True))
    assert _tokens(first) != _tokens(other)
    unseeded = SamplingParams(n=2, max_new_tokens=8, ignore_eos=True)
    assert _tokens(engine.generate(PROMPTS, unseeded)) != _tokens(engine.generate(PROMPTS, unseeded))


def test_greedy_takes_the_argmax_and_reports_raw_logprobs(policy: Policy, engine: HFEngine) -> None:
    [[completion]] = engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True))
    sequence = PROMPTS[0] + completion.token_ids
    with torch.no_grad():
        logits = policy.model(torch.tensor([sequence])).logits[0, len(PROMPTS[0]) - 1 : -1]
    assert completion.token_ids == logits.argmax(-1).tolist()
    _assert_logprobs_match_teacher_forcing(policy, [PROMPTS[0]], [[completion]])


def test_top_p_samples_only_from_the_nucleus(policy: Policy, engine: HFEngine) -> None:
    top_p = 0.3
    [group] = engine.generate([PROMPTS[1]], SamplingParams(n=4, top_p=top_p, max_new_tokens=8, seed=2, ignore_eos=True))
    for completion in group:
        sequence = PROMPTS[1] + completion.token_ids
        with torch.no_grad():
            logits = policy.model(torch.tensor([sequence])).logits[0, len(PROMPTS[1]) - 1 : -1]
        probs = torch.softmax(logits.double(), -1)
        for step, token in enumerate(completion.token_ids):
            mass_above = probs[step][probs[step] > probs[step, token]].sum().item()
            assert mass_above < top_p  # the token is inside the smallest set reaching top_p
    _assert_logprobs_match_teacher_forcing(policy, [PROMPTS[1]] , [group])  # log-probs stay untruncated


def test_stop_string_ends_generation_and_stays_in_the_output(engine: HFEngine) -> None:
    params = dict(n=3, max_new_tokens=40, seed=4, ignore_eos=True)
    free = engine.generate([PROMPTS[0]], SamplingParams(**params))[0]
    # A stop string from the middle of the first free-running completion (printable, so no
    # half-decoded bytes); the same seed then reproduces that completion up to the stop.
    text = free[0].text
    start = next(i for i in range(8, len(text) - 3) if text[i : i + 3].isascii() and text[i : i + 3].isprintable())
    stop = text[start : start + 3]
    stopped = engine.generate([PROMPTS[0]], SamplingParams(stop=(stop, "never-produced"), **params))[0]
    first = stopped[0]
    assert first.finish_reason == "stop" and first.stop_reason == stop
    assert first.text.endswith(stop) and stop not in first.text[:-1]
    assert first.token_ids == free[0].token_ids[: len(first.token_ids)]
    assert stop not in engine.decode(first.token_ids[:-1])  # it stopped at the first token completing it
    for other, reference in zip(stopped[1:], free[1:]):  # the other samples stop only if they produce it
        assert other.token_ids == reference.token_ids[: len(other.token_ids)]
        assert (other.finish_reason == "stop") == (stop in reference.text)


def test_eos_ends_generation_and_is_kept_in_tokens_not_text(policy: Policy, engine: HFEngine) -> None:
    params = SamplingParams(n=4, max_new_tokens=12, seed=9, ignore_eos=True)
    free = engine.generate([PROMPTS[2]], params)[0]
    eos = free[0].token_ids[3]  # declare a token the first sample draws to be the end of sequence
    with_eos = HFEngine.from_policy(policy, eos_token_ids=[eos])
    ended = with_eos.generate([PROMPTS[2]], SamplingParams(n=4, max_new_tokens=12, seed=9))[0]
    first = ended[0]
    assert first.finish_reason == "eos"
    assert first.token_ids == free[0].token_ids[: free[0].token_ids.index(eos) + 1]
    assert first.text == with_eos.decode(first.token_ids[:-1])
    # rows finishing at different steps leave the batch; the rest must be unaffected
    _assert_logprobs_match_teacher_forcing(policy, [PROMPTS[2]], [ended])
    for done, reference in zip(ended, free):
        assert done.token_ids == reference.token_ids[: len(done.token_ids)]


def test_bad_inputs_raise_clear_errors(engine: HFEngine) -> None:
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[2, 3], []], SamplingParams())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[2, 10**6]], SamplingParams())
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=0)
    assert SamplingParams(stop="</search>").stop == ("</search>",)


@pytest.mark.parametrize("vocab", [49152, 1000, 7])
def test_the_two_level_sampler_draws_what_one_cumulative_sum_draws(vocab: int) -> None:
    from trace_rl.engine.hf import inverse_cdf_sample

    generator = torch.Generator().manual_seed(vocab)
    scores = torch.randn(512, vocab, generator=generator) * 4
    scores[:8, 1:] = -float("inf")  # all mass on one token, the first
    scores[8:16, :-1] = -float("inf")  # ... on the last
    uniform = torch.rand(512, generator=generator, dtype=torch.float64)
    uniform[16:24] = torch.tensor([0.0, 1 - 2**-53] * 4, dtype=torch.float64)
    tokens, logp = inverse_cdf_sample(scores * 0.7, 0.7, uniform)

    reference_logp = torch.log_softmax(scores.double(), dim=-1)
    cdf = reference_logp.exp().cumsum(dim=-1)
    reference = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True).squeeze(-1).clamp(max=vocab - 1)
    assert (tokens == reference).float().mean() >= 0.995  # fp32 weights move only draws at a boundary
    assert torch.all(scores.gather(-1, tokens[:, None]) > -float("inf"))  # never a token without mass
    assert torch.equal(tokens[:8], torch.zeros(8, dtype=torch.long)) and torch.equal(tokens[8:16], torch.full((8,), vocab - 1))
    torch.testing.assert_close(logp.double(), reference_logp.gather(-1, tokens[:, None]).squeeze(-1), atol=1e-5, rtol=0)


def test_cut_at_stop_keeps_the_earliest_ending_stop_string() -> None:
    assert cut_at_stop("a <search> q </search> tail", ("</search>", "tail")) == ("a <search> q </search>", "</search>")
    assert cut_at_stop("no stop here", ("</answer>",)) == ("no stop here", None)


def test_lora_policy_generates(tmp_path: Path) -> None:
    pytest.importorskip("peft")
    from trace_rl.models import LoraSpec

    config = TinyConfig(vocab_size=400, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    policy = load_policy("tiny", tokenizer_texts=TEXTS, tiny=config, cache_dir=tmp_path, lora=LoraSpec(r=2))
    results = HFEngine.from_policy(policy).generate(PROMPTS[:2], SamplingParams(n=2, max_new_tokens=5, seed=0))
    _assert_logprobs_match_teacher_forcing(policy, PROMPTS[:2], results)


def test_update_weights_samples_from_the_new_weights_and_names_their_version(policy: Policy) -> None:
    import copy

    own = HFEngine.from_policy(policy)
    own.update_weights(policy.model, version=3)  # the trainer's own module: shared, nothing to copy
    assert own.weight_version == 3 and own.model is policy.model
    other = copy.deepcopy(policy.model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.01)
    engine = HFEngine(copy.deepcopy(policy.model), policy.tokenizer)
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=8)
    prompt = [policy.tokenizer.encode("Question: who", add_special_tokens=False)]
    engine.update_weights(other, version=1)
    after = engine.generate(prompt, params)[0][0]
    reference = HFEngine(other, policy.tokenizer).generate(prompt, params)[0][0]
    assert engine.weight_version == 1
    assert after.token_ids == reference.token_ids and after.logprobs == pytest.approx(reference.logprobs, abs=1e-6)


# ---------------------------------------------------------------- the prefix cache


def _turns(engine: HFEngine, prompts: list[list[int]], params: SamplingParams, observation: list[int], turns: int = 3):
    """Multi-turn rollouts as the collector runs them: each turn's prompt is the last context plus the
    completion plus an observation; returns every turn's completions."""
    contexts, history = [list(p) for p in prompts], []
    for turn in range(turns):
        out = engine.generate(contexts, SamplingParams(**{**params.__dict__, "seed": 100 + turn}))
        history.append(out)
        contexts = [c + group[0].token_ids + observation for c, group in zip(contexts, out)]
    return history


def test_the_next_turn_prefills_only_its_new_tokens_and_samples_what_a_full_prefill_samples(policy: Policy) -> None:
    cached, uncached = HFEngine.from_policy(policy), HFEngine.from_policy(policy, prefix_cache_mb=0)
    prompts = [[2, *range(40, 60)], [2, *range(60, 90)]]
    params = SamplingParams(n=2, max_new_tokens=10, seed=0)
    observation = [5, *range(100, 120)]
    with_cache, without = _turns(cached, prompts, params, observation), _turns(uncached, prompts, params, observation)
    assert _tokens(with_cache[0]) == _tokens(without[0])
    for turn, (a, b) in enumerate(zip(with_cache, without)):
        assert _tokens(a) == _tokens(b), f"turn {turn}: the cache changed what was sampled"
        for group_a, group_b in zip(a, b):
            for x, y in zip(group_a, group_b):
                assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)
                assert y.cached_tokens == 0
    contexts = [list(p) for p in prompts]
    for turn in range(1, 3):  # turn t reuses all of turn t-1's context but the completion's last token
        contexts = [c + g[0].token_ids + observation for c, g in zip(contexts, with_cache[turn - 1])]
        for context, group in zip(contexts, with_cache[turn]):
            assert group[0].cached_tokens == len(context) - len(observation) - 1
    final = [c + g[0].token_ids for c, g in zip(contexts, with_cache[-1])]
    _assert_logprobs_match_teacher_forcing(policy, contexts, [[g[0]] for g in with_cache[-1]])
    assert all(len(f) > len(c) for f, c in zip(final, contexts))


def test_a_branch_from_an_intermediate_prefix_reuses_the_rollout_that_made_it(policy: Policy) -> None:
    engine = HFEngine.from_policy(policy)
    prompt = [2, *range(40, 70)]
    first = engine.generate([prompt], SamplingParams(n=1, max_new_tokens=12, seed=1, ignore_eos=True))[0][0]
    prefix = prompt + first.token_ids[:5]  # a prefix inside the cached sequence
    branches = engine.generate([prefix], SamplingParams(n=3, max_new_tokens=8, seed=2))[0]
    assert all(b.cached_tokens == len(prefix) - 1 for b in branches)
    fresh = HFEngine.from_policy(policy, prefix_cache_mb=0).generate([prefix], SamplingParams(n=3, max_new_tokens=8, seed=2))[0]
    assert [b.token_ids for b in branches] == [b.token_ids for b in fresh]
    _assert_logprobs_match_teacher_forcing(policy, [prefix], [branches])


def test_new_weights_empty_the_cache(policy: Policy) -> None:
    engine = HFEngine.from_policy(policy)
    prompt = [2, *range(40, 70)]
    engine.generate([prompt], SamplingParams(n=1, max_new_tokens=4, seed=1))
    assert engine.cache.entries
    engine.update_weights(policy.model, version=1)
    assert not engine.cache.entries
    assert engine.generate([prompt + [50]], SamplingParams(n=1, max_new_tokens=2, seed=1))[0][0].cached_tokens == 0


def test_released_memory_is_rebuilt_by_the_next_generate_which_draws_the_same(policy: Policy) -> None:
    """The trainer frees the prefix cache and the decoder's weight copy before an update
    (`release_memory`); an engine that generates again without new weights samples what it did."""
    engine = HFEngine.from_policy(policy)
    params = SamplingParams(n=2, max_new_tokens=6, seed=3)
    prompt = [2, *range(40, 70)]
    before = engine.generate([prompt], params)
    assert engine.cache.entries and engine.decoder is not None and not engine.decoder.released
    held = engine.cache.nbytes + engine.decoder.nbytes
    linear = sum(m.weight.numel() * 4 for m in policy.model.modules() if isinstance(m, torch.nn.Linear))
    assert engine.decoder.nbytes == linear  # fp32: every linear layer transposed (the tied output layer too), the embedding shared
    assert engine.release_memory() == held
    assert not engine.cache.entries and engine.cache.nbytes == 0 and engine.decoder.released and engine.decoder.nbytes == 0
    after = engine.generate([prompt], params)
    assert not engine.decoder.released
    assert _tokens(after) == _tokens(before)
    assert [c.logprobs for c in after[0]] == [c.logprobs for c in before[0]]


def test_a_bf16_engine_counts_and_releases_its_weight_copy(policy: Policy) -> None:
    """In bf16 on a CPU with native bf16 the decoder's weights are oneDNN's prepacked, opaque tensors
    (no storage to ask): releasing them after an evaluation raised NotImplementedError and ended a
    SmolLM2 run. Every weight is then the decoder's own, in 2 bytes (the tied output layer too)."""
    engine = HFEngine.from_policy(policy, precision="bf16")
    engine.generate([[2, *range(40, 70)]], SamplingParams(n=1, max_new_tokens=4, seed=3))
    decoder = engine.decoder
    assert decoder is not None
    linear = sum(m.weight.numel() * 2 for m in policy.model.modules() if isinstance(m, torch.nn.Linear))
    embedding = policy.model.get_input_embeddings().weight.numel() * 2
    assert decoder.nbytes == linear + embedding  # the bf16 embedding is a copy too
    held = engine.cache.nbytes + decoder.nbytes
    assert engine.release_memory() == held
    assert decoder.released and decoder.nbytes == 0


def test_the_cache_stays_within_its_budget_and_keeps_the_newest() -> None:
    from trace_rl.engine.hf import PrefixCache

    def layers(length):
        return [(torch.zeros(2, length, 4), torch.zeros(2, length, 4))]  # 2 * 2*length*4 floats * 4 bytes

    per_token = 2 * 2 * 4 * 4
    cache = PrefixCache(max_bytes=100 * per_token)
    cache.insert(list(range(40)), layers(40))
    cache.insert(list(range(60)), layers(60))  # extends the first: it replaces it
    assert [e.tokens.size for e in cache.entries.values()] == [60]
    cache.insert([7] * 30, layers(30))
    cache.insert([8] * 30, layers(30))  # over budget: the least recently used (60 tokens) leaves
    assert sorted(e.tokens.size for e in cache.entries.values()) == [30, 30] and cache.nbytes <= cache.max_bytes
    entry, length = cache.lookup([7] * 20 + [1])
    assert entry is not None and length == 20
    assert cache.lookup([7] * 30)[1] == 29  # the prompt's last token is always run


def test_after_a_clear_the_cache_answers_as_a_new_one_whatever_came_before() -> None:
    """A resumed run starts with a new engine, an unbroken one with the cache its last update cleared:
    both must pick the same entry among equally long matches, or their log-probs part at float noise
    and the runs drift apart (found when a resumed run left its unbroken twin after an evaluation)."""
    from trace_rl.engine.hf import PrefixCache

    def layers(length):
        return [(torch.zeros(1, length, 2), torch.zeros(1, length, 2))]

    head = list(range(100, 116))  # the 16 tokens entries are indexed by
    used = PrefixCache(max_bytes=10**6)
    for n in range(7):  # an engine with a past: ids and clock have moved on
        used.insert([n] * 20, layers(20))
        used.lookup([n] * 21)
    used.clear()
    fresh = PrefixCache(max_bytes=10**6)
    for cache in (fresh, used):
        cache.insert(head + [1, 2, 3], layers(19))
        cache.insert(head + [1, 2, 4], layers(19))  # ties with the first for a prompt going on 1, 2, 5
    (entry, length), (again, again_length) = (cache.lookup(head + [1, 2, 5, 6]) for cache in (fresh, used))
    assert length == again_length == 18
    assert entry.tokens.tolist() == again.tokens.tolist() == head + [1, 2, 3]  # the earliest of the tie
    assert used._next_id == fresh._next_id and used._clock == fresh._clock


def test_byte_stop_matching_agrees_with_decoding_the_tail(policy: Policy) -> None:
    from trace_rl.engine.hf import StopMatcher, byte_table

    engine = HFEngine.from_policy(policy)
    table = byte_table(policy.tokenizer, engine.vocab_size)
    assert table is not None
    for token_id in range(engine.vocab_size):  # every token's bytes are what decoding gives
        text = engine.decode([token_id])
        if "\ufffd" not in text:
            assert bytes(table[0][token_id, : table[1][token_id]].tolist()) == text.encode("utf-8"), token_id
    rng = np.random.default_rng(0)
    stops = ("</search>", "</answer>", "ab")
    sequences = [rng.integers(0, engine.vocab_size, size=40).tolist() for _ in range(20)]
    spelled = policy.tokenizer.encode("x</sea" + "rch> y </answer> ab", add_special_tokens=False)
    sequences += [spelled + rng.integers(0, engine.vocab_size, size=40 - len(spelled)).tolist()]
    matcher = StopMatcher(*table, stops, len(sequences))
    length = min(len(s) for s in sequences)
    for step in range(length):
        hits = matcher.push(torch.tensor([s[step] for s in sequences])).tolist()
        expected = [engine._ends_in_stop(s[: step + 1], stops, 12) for s in sequences]
        assert hits == expected, step
