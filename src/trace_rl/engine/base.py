"""The engine contract: token ids in, sampled token ids with their log-probs out.

Every engine (transformers in-process, an OpenAI-compatible vLLM / SGLang server, a scripted fake
in tests) answers `generate(prompts, params)` with `params.n` completions per prompt. The rollout
collector builds prompts as token ids, so a branch from an intermediate prefix is simply a longer
prompt, and an engine may reuse the prefix's computation (the `hf` engine prefills each prompt
once for all its `n` continuations; a vLLM server's prefix cache does the same across requests).

Log-probs, one per generated token, are `log softmax(logits / T)[token]` of the model at the
sampling temperature T, over the full vocabulary, before any top-p truncation (at T = 0, greedy,
T is taken as 1). This is what a PPO / GRPO ratio needs: the trainer recomputes the same quantity
for the current policy (`trace_rl.models.score(..., temperature=T)`), so the ratio starts at
exactly 1 for on-policy data. With `top_p == 1` (the RL default) it is exactly the log-prob of the
distribution the token was drawn from. vLLM returns raw (T = 1) log-probs unless the server runs
with `--logprobs-mode processed_logprobs`; see `engine/openai_server.py`.

Stop strings end a completion as soon as the decoded continuation contains one, and the stop
string stays in the output (vLLM's `include_stop_str_in_output=True`), so the ReAct parser sees
the closing tag: `text` ends exactly with the stop string, and `token_ids` hold every sampled
token (the last one may decode to a few characters past the stop string when one token straddles
it). `text` is decoded without special tokens (vLLM's default `skip_special_tokens=True`; the
`tiny` tokenizer's protocol tags are ordinary tokens and stay). An end-of-sequence token is kept
in `token_ids` and `logprobs` (the policy learns to stop), never in `text`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length", "eos"]
"""`stop`: a stop string was produced; `length`: `max_new_tokens` reached; `eos`: end-of-sequence token."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample; names and meanings follow vLLM's `SamplingParams`."""

    n: int = 1
    """Completions per prompt, sampled independently from the same prefix."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 keeps the whole vocabulary (the RL default)."""
    max_new_tokens: int = 256
    """Most tokens generated per completion (the end-of-sequence token included)."""
    stop: tuple[str, ...] = ()
    """Stop strings; generation ends after the first one produced, which is kept in the output."""
    seed: int | None = None
    """Makes sampling reproducible; None draws fresh randomness."""
    ignore_eos: bool = False
    """Keep sampling after an end-of-sequence token (benchmarks use it to fix lengths)."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # a bare string would be split into characters
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n!r}")
        if not self.temperature >= 0.0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens!r}")
        if any(not s for s in self.stop):
            raise ValueError(f"SamplingParams.stop must not contain empty strings, got {self.stop!r}")


@dataclass(frozen=True)
class Completion:
    """One sampled continuation of a prompt."""

    token_ids: list[int]
    logprobs: list[float]
    """One per token in `token_ids`: log softmax(logits / T) of the sampled token (see module doc)."""
    text: str
    """Decoded continuation, cut right after the stop string when one ended it; no EOS text."""
    finish_reason: FinishReason
    stop_reason: str | None = field(default=None)
    """The stop string that ended the completion when `finish_reason == "stop"`."""
    cached_tokens: int = 0
    """Tokens of the prompt the engine took from its prefix cache instead of prefilling them (vLLM's
    `usage.prompt_tokens_details.cached_tokens`); the same for every completion of one prompt."""

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(
                f"Completion needs one log-prob per token, got {len(self.token_ids)} tokens "
                f"and {len(self.logprobs)} log-probs"
            )


class EngineError(RuntimeError):
    """Generation failed outside our control: a server unreachable, timing out or answering badly."""


@runtime_checkable
class Engine(Protocol):
    """Token-in / token-out generation from a policy whose weights the trainer updates.

    `accepts_weights` says whether `update_weights` works: an engine that cannot receive new weights
    would keep sampling from the starting policy while the trainer trains another, so training refuses
    to start on it (rollouts and evaluation still work).

    Optional: an engine in front of several servers sets `routes_by_key = True` and takes
    `generate(..., route_keys=)`, one key per prompt, sending every prompt with one key to one server;
    the collector then passes each rollout's tree (its task id), so a tree's turns and branches meet
    the prefix cache that holds its trunk (a prompt-prefix hash would send every tree to one server,
    as they all open with the same system prompt).

    Optional: an engine that holds memory the coming update makes stale (a prefix cache, a copy of the
    weights) has `release_memory() -> int` (the bytes freed), which the trainer calls after a step's
    rollouts and before its update, so the update's peak does not carry it; the engine rebuilds what
    it needs when it next generates.
    """

    accepts_weights: bool
    weight_version: int
    """The version of the weights it samples from now (the trainer's step that made them; 0: the start)."""

    def update_weights(self, model: Any, *, version: int) -> None:
        """Sample from `model`'s current weights from now on; `version` names them. Raises EngineError
        when the engine cannot receive weights (`accepts_weights` is False)."""
        ...

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        """`params.n` completions for each prompt, in prompt order.

        Each prompt is a non-empty list of token ids. Prompts may differ in length. Raises
        ValueError for an empty prompt or a token id outside the vocabulary.
        """
        ...


def check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int | None = None) -> list[list[int]]:
    """Prompts as lists of ints; raises ValueError naming the first bad prompt."""
    checked = []
    for index, prompt in enumerate(prompts):
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError(f"prompt {index} is empty; every prompt needs at least one token")
        if vocab_size is not None and (min(ids) < 0 or max(ids) >= vocab_size):
            bad = next(t for t in ids if t < 0 or t >= vocab_size)
            raise ValueError(f"prompt {index} has token id {bad}, outside the vocabulary [0, {vocab_size})")
        checked.append(ids)
    return checked


def server_seeds(prompts: Sequence[Sequence[int]], params: SamplingParams, route_keys: Sequence[str] | None = None) -> list[int | None]:
    """The seed of each prompt's first sample when a server seeds the j-th of n samples `seed + j`
    (vLLM): the r-th repeat of an identical prompt in one call starts at `seed + r * n`, so repeats
    differ, as in the `hf` engine; None without `params.seed`. Also checks `route_keys` (one per prompt)."""
    if route_keys is not None and len(route_keys) != len(prompts):
        raise ValueError(f"route_keys has {len(route_keys)} entries for {len(prompts)} prompts")
    if params.seed is None:
        return [None] * len(prompts)
    repeats: Counter[tuple[int, ...]] = Counter()
    seeds = []
    for prompt in prompts:
        seeds.append(params.seed + repeats[tuple(prompt)] * params.n)
        repeats[tuple(prompt)] += 1
    return seeds


def cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, str | None]:
    """`text` cut right after the earliest-ending stop string, and that string (None if none occurs)."""
    best_end, best = None, None
    for s in stop:
        index = text.find(s)
        if index >= 0 and (best_end is None or index + len(s) < best_end):
            best_end, best = index + len(s), s
    return (text, None) if best_end is None else (text[:best_end], best)


def detokenize(tokenizer: Any, token_ids: Sequence[int]) -> str:
    """Text of tokens without special tokens, as vLLM detokenizes by default (a fast tokenizer's Rust
    decoder, without transformers' Python clean-up of spaces)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.decode(list(token_ids), skip_special_tokens=True)
    return tokenizer.decode(list(token_ids), skip_special_tokens=True)
