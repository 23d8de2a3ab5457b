"""The `hf` engine's own Llama forward (`trace_rl.engine.decoder`) against transformers' forward.

Models are made here from a seed (no download): `tiny`, and a SmolLM2-shaped small Llama with
grouped-query attention (3 query heads per key/value head, as SmolLM2-135M's 9 / 3).
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from trace_rl.engine.base import SamplingParams  # noqa: E402
from trace_rl.engine.decoder import Decoder  # noqa: E402
from trace_rl.engine.hf import HFEngine, buffered_cache, resolve_precision  # noqa: E402
from trace_rl.models import (  # noqa: E402
    LoraSpec,
    Policy,
    TinyConfig,
    load_policy,
    native_bf16,
    score_batch,
)
from trace_rl.models.policy import _add_lora  # noqa: E402

TEXTS = ["Question: Which river flows through Paris? <search> river Paris </search>", "<answer> Seine </answer>"] * 4
BF16 = any(native_bf16().values())
PROMPTS = [[2, *range(40, 70)], [2, 50, 51, *range(90, 110)], [2, *range(60, 100)]]


def gqa_model(seed: int = 0) -> LlamaForCausalLM:
    """A SmolLM2-shaped Llama, small: 6 query heads over 2 key/value heads, tied embeddings."""
    config = LlamaConfig(
        vocab_size=300, hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=6,
        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
        max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Policy:
    config = TinyConfig(vocab_size=600, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128)
    return load_policy("tiny", seed=0, tokenizer_texts=TEXTS, tiny=config, cache_dir=tmp_path_factory.mktemp("models"))


def forward_both(model, decoder: Decoder, prompt_len: int = 20, steps: int = 6, batch: int = 4):
    """Logits of a left-padded prefill then `steps` decode steps of forced tokens, from transformers'
    forward and from the decoder, each on its own buffered cache."""
    generator = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (batch, prompt_len), generator=generator)
    mask = torch.ones(batch, prompt_len, dtype=torch.long)
    mask[0, :7] = 0  # a left-padded row
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    forced = torch.randint(3, vocab, (batch, steps), generator=generator)
    out = []
    for forward in ("hf", "decoder"):
        cache = buffered_cache(model.config, prompt_len + steps + 3)
        m, p, logits = mask, positions, []
        with torch.no_grad():
            for step in range(steps + 1):
                tokens = ids if step == 0 else forced[:, step - 1 : step]
                if step:
                    m = torch.cat([m, m.new_ones(batch, 1)], dim=1)
                    p = p[:, -1:] + 1
                if forward == "hf":
                    logits.append(model(input_ids=tokens, attention_mask=m, position_ids=p, use_cache=True, logits_to_keep=1, cache=cache).logits[:, -1].float())
                else:
                    logits.append(decoder.forward(tokens, m, p, cache))
        out.append(torch.stack(logits))
    return out


@pytest.mark.parametrize("kind", ["tiny", "gqa"])
def test_the_fp32_decoder_computes_transformers_logits(policy: Policy, kind: str) -> None:
    model = policy.model if kind == "tiny" else gqa_model()
    assert Decoder.supports(model)
    hf, ours = forward_both(model, Decoder(model, torch.float32))
    assert torch.allclose(torch.log_softmax(ours, -1), torch.log_softmax(hf, -1), atol=1e-4, rtol=0)


@pytest.mark.skipif(not BF16, reason="bf16 is emulated on this CPU")
def test_bf16_sampling_distributions_stay_within_the_stated_distance_of_fp32() -> None:
    """The tolerance `engine/decoder.py` states: next-token distributions within 0.02 in total variation
    on average (0.1 at most) of fp32's, and the same greedy token on at least 95% of rows."""
    model = gqa_model()
    hf, ours = forward_both(model, Decoder(model, torch.bfloat16), prompt_len=40, steps=12, batch=8)
    p, q = torch.softmax(hf, -1), torch.softmax(ours, -1)
    tv = 0.5 * (p - q).abs().sum(-1)
    assert tv.mean() < 0.02 and tv.max() < 0.1
    assert (hf.argmax(-1) == ours.argmax(-1)).float().mean() >= 0.95


def test_lora_adapters_are_merged_into_the_decoders_weights_and_refreshed(policy: Policy) -> None:
    model = _add_lora(copy.deepcopy(policy.model), LoraSpec(r=4, alpha=8), seed=0)
    with torch.no_grad():  # non-zero adapters (peft starts B at 0)
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.1)
    decoder = Decoder(model, torch.float32)
    hf, ours = forward_both(model, decoder)
    assert torch.allclose(torch.log_softmax(ours, -1), torch.log_softmax(hf, -1), atol=1e-4, rtol=0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_A" in name:
                parameter.mul_(-1.5)
    stale = forward_both(model, decoder)[1]
    decoder.refresh()
    hf, ours = forward_both(model, decoder)
    assert not torch.allclose(stale, hf, atol=1e-3)
    assert torch.allclose(torch.log_softmax(ours, -1), torch.log_softmax(hf, -1), atol=1e-4, rtol=0)


def test_models_the_decoder_does_not_run_keep_the_transformers_forward(policy: Policy) -> None:
    model = gqa_model()
    model.config.attention_bias = True
    assert not Decoder.supports(model)
    engine = HFEngine(model, policy.tokenizer, precision="fp32")
    assert engine.decoder is None
    with pytest.raises(ValueError, match="bf16 needs a Llama-family model"):
        HFEngine(model, policy.tokenizer, precision="bf16")


def test_auto_precision_is_bf16_only_where_the_cpu_has_it(monkeypatch: pytest.MonkeyPatch) -> None:
    for avx512_bf16, expected in ((True, "bf16"), (False, "fp32")):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
        assert resolve_precision("auto", torch.device("cpu")) == expected
    assert resolve_precision("fp32", torch.device("cpu")) == "fp32"
    with pytest.raises(ValueError, match="precision must be one of"):
        resolve_precision("fp16", torch.device("cpu"))


@pytest.mark.skipif(not BF16, reason="bf16 is emulated on this CPU")
def test_a_bf16_engine_samples_the_same_tokens_from_a_cached_prefix(policy: Policy) -> None:
    """The prefix cache holds bf16 keys and values: a continuation from a cached prefix draws what a
    full prefill draws, its log-probs within bf16 rounding."""
    params = SamplingParams(n=2, max_new_tokens=8, seed=3, ignore_eos=True)
    cached = HFEngine.from_policy(policy, precision="bf16")
    uncached = HFEngine.from_policy(policy, precision="bf16", prefix_cache_mb=0)
    first = cached.generate(PROMPTS, params)
    follow = [prompt + group[0].token_ids + [7, 8, 9] for prompt, group in zip(PROMPTS, first)]
    a, b = cached.generate(follow, params), uncached.generate(follow, params)
    assert sum(c.cached_tokens for g in a for c in g) > 0
    assert [[c.token_ids for c in g] for g in a] == [[c.token_ids for c in g] for g in b]
    for ga, gb in zip(a, b):
        for ca, cb in zip(ga, gb):
            assert ca.logprobs == pytest.approx(cb.logprobs, abs=2e-2)


@pytest.mark.skipif(not BF16, reason="bf16 is emulated on this CPU")
def test_bf16_engine_logprobs_are_near_teacher_forced_fp32(policy: Policy) -> None:
    engine = HFEngine.from_policy(policy, precision="bf16")
    assert engine.precision == "bf16"
    results = engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=8, seed=0, ignore_eos=True))
    pairs = [(prompt, c.token_ids) for prompt, group in zip(PROMPTS, results) for c in group]
    expected = torch.tensor(score_batch(policy.model, pairs))
    got = torch.tensor([c.logprobs for group in results for c in group])
    assert (got - expected).abs().mean() < 0.02
