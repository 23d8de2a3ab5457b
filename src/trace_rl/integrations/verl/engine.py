"""`LLMServerEngine`: trace-rl's `Engine` over verl's `LLMServerClient` (vLLM / SGLang replicas).

verl's client is async and answers one sample per call: `await client.generate(request_id, *,
prompt_ids, sampling_params) -> TokenOutput` (token ids and, with `logprobs`, their log-probs; no
text, no finish reason). The collector is synchronous and asks for `n` samples of many prompts at
once, so `generate` sends all of them as concurrent calls on an event loop of its own (a daemon
thread; the caller may itself run inside verl's loop) and waits for the lot.

- **Sticky routing.** `request_id` is verl's sticky-session key (`GlobalRequestLoadBalancer`): the
  collector passes each rollout's tree as its route key (`routes_by_key`), so a tree's turns and
  Stage-2 branches land on the replica whose prefix cache holds its trunk (called without keys, a
  prompt's key is a hash of its first `route_prefix_tokens` tokens). verl sends vLLM a fresh request id per call unless
  `rollout.full_determinism` is set, when it passes ours through; concurrent branches would then
  share one vLLM request id, so `TraceAgentLoopManager` refuses that setting.
- **Seeds.** The j-th of n samples of a prompt is seeded `seed + j` and the r-th repeat of an
  identical prompt in one call `seed + r * n`, as `OpenAIEngine` seeds vLLM's samples.
- **Text and finish reason**, which `TokenOutput` lacks, are rebuilt as vLLM would report them with
  `include_stop_str_in_output=True` (which the request sets): the text is the tokens decoded without
  special tokens (`engine.base.detokenize`) and cut after the first stop string; the finish reason
  is `stop` when one occurs, `eos` when the last token is the tokenizer's end-of-sequence token,
  `length` otherwise. A call verl aborted (`stop_reason == "aborted"`, weights being swapped) or one
  without log-probs raises `EngineError`.
- **Log-probs** are what the replica reports: vLLM's raw (temperature-1) log-probs unless it runs
  with `logprobs_mode=processed_logprobs`. verl recomputes the old policy's log-probs before its
  update, so they only feed its rollout-correction figures, never the ratio.
- **vLLM or SGLang.** The request's sampling keys are vLLM's; for SGLang replicas
  (`actor_rollout_ref.rollout.name=sglang`) they are translated to SGLang's names
  (`include_stop_str_in_output` -> `no_stop_trim`, `seed` -> `sampling_seed`); verl's SGLang server
  itself maps `max_tokens` and `logprobs` (`sampling_request`). Other backends are refused.
- **Weights** belong to verl: its checkpoint engine syncs the replicas after every optimiser step,
  so this engine takes none (`accepts_weights = False`).
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections.abc import Sequence
from typing import Any

from trace_rl.engine.base import (
    Completion,
    EngineError,
    FinishReason,
    SamplingParams,
    check_prompts,
    cut_at_stop,
    detokenize,
    server_seeds,
)

BACKENDS = ("vllm", "sglang")
"""verl rollout backends (`actor_rollout_ref.rollout.name`) whose request keys `sampling_request` writes."""

_SGLANG_NAMES = {"include_stop_str_in_output": "no_stop_trim", "seed": "sampling_seed"}
"""vLLM sampling keys and SGLang's names for them (SGLang's `SamplingParams` refuses unknown keys)."""


def sampling_request(params: SamplingParams, seed: int | None, backend: str = "vllm") -> dict[str, Any]:
    """The `sampling_params` of one verl `generate` call: vLLM's keys, or SGLang's for `backend="sglang"`
    (verl's SGLang server maps `max_tokens` -> `max_new_tokens` and pops `logprobs` into `return_logprob`)."""
    sampling: dict[str, Any] = {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": -1,
        "max_tokens": params.max_new_tokens,
        "stop": list(params.stop),
        "include_stop_str_in_output": True,
        "ignore_eos": params.ignore_eos,
        "logprobs": True,
    }
    if seed is not None:
        sampling["seed"] = seed
    if backend == "sglang":
        sampling = {_SGLANG_NAMES.get(key, key): value for key, value in sampling.items()}
    return sampling


class LLMServerEngine:
    """`trace_rl.engine.base.Engine` over any object with verl's `LLMServerClient.generate` (module docstring)."""

    accepts_weights = False
    weight_version = 0
    routes_by_key = True

    def __init__(
        self, client: Any, tokenizer: Any, *, backend: str = "vllm", route_prefix_tokens: int = 64, timeout_s: float = 3600.0
    ) -> None:
        if route_prefix_tokens < 1 or not timeout_s > 0:
            raise ValueError(f"need route_prefix_tokens >= 1 and timeout_s > 0, got {route_prefix_tokens!r}, {timeout_s!r}")
        if backend not in BACKENDS:
            raise ValueError(f"verl rollout backend {backend!r} is not supported by trace-rl's manager (supported: {', '.join(BACKENDS)})")
        self.backend = backend
        self.client = client
        self.tokenizer = tokenizer
        self.route_prefix_tokens = route_prefix_tokens
        self.timeout_s = timeout_s
        self.vocab_size = len(tokenizer)
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="trace-rl-verl-engine", daemon=True).start()

    def update_weights(self, model: Any, *, version: int) -> None:
        raise EngineError("verl syncs its rollout replicas' weights itself (its checkpoint engine); LLMServerEngine takes none")

    def route_key(self, key: str | Sequence[int]) -> str:
        """verl's sticky-session id for a route key (a tree's) or, for a prompt, a hash of its first
        `route_prefix_tokens` tokens."""
        data = key.encode() if isinstance(key, str) else repr([int(t) for t in key[: self.route_prefix_tokens]]).encode()
        return "trace-" + hashlib.blake2b(data, digest_size=8).hexdigest()

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, *, route_keys: Sequence[str] | None = None
    ) -> list[list[Completion]]:
        prompts = check_prompts(prompts, self.vocab_size)
        calls = []
        for index, (prompt, seed) in enumerate(zip(prompts, server_seeds(prompts, params, route_keys))):
            request_id = self.route_key(route_keys[index] if route_keys is not None else prompt)
            calls += [(request_id, prompt, None if seed is None else seed + j) for j in range(params.n)]
        future = asyncio.run_coroutine_threadsafe(self._all(calls, params), self._loop)
        try:
            outputs = future.result(timeout=self.timeout_s)
        except TimeoutError:
            future.cancel()
            raise EngineError(f"verl's servers did not answer {len(calls)} calls within {self.timeout_s} s") from None
        completions = [self._completion(output, params) for output in outputs]
        return [completions[i * params.n : (i + 1) * params.n] for i in range(len(prompts))]

    async def _all(self, calls: list[tuple[str, list[int], int | None]], params: SamplingParams) -> list[Any]:
        return await asyncio.gather(*(self._one(request_id, prompt, seed, params) for request_id, prompt, seed in calls))

    async def _one(self, request_id: str, prompt: list[int], seed: int | None, params: SamplingParams) -> Any:
        sampling = sampling_request(params, seed, self.backend)
        return await self.client.generate(request_id, prompt_ids=list(prompt), sampling_params=sampling)

    def _completion(self, output: Any, params: SamplingParams) -> Completion:
        if getattr(output, "stop_reason", None) == "aborted":
            raise EngineError("verl aborted a generation (its replicas were paused mid-batch)")
        token_ids = [int(t) for t in output.token_ids]
        if output.log_probs is None or len(output.log_probs) != len(token_ids):
            raise EngineError(f"verl's server returned {len(token_ids)} tokens with log-probs {output.log_probs!r}; the request asks for them")
        for token in token_ids:
            if not 0 <= token < self.vocab_size:
                raise EngineError(f"verl's server returned token id {token}, outside the vocabulary [0, {self.vocab_size})")
        text, stop = cut_at_stop(detokenize(self.tokenizer, token_ids), params.stop)
        finish: FinishReason = "stop" if stop is not None else "eos" if token_ids and token_ids[-1] == self.tokenizer.eos_token_id else "length"
        cached = (getattr(output, "extra_fields", None) or {}).get("num_cached_tokens")
        return Completion(
            token_ids=token_ids,
            logprobs=[float(v) for v in output.log_probs],
            text=text,
            finish_reason=finish,
            stop_reason=stop,
            cached_tokens=int(cached) if isinstance(cached, int) and cached >= 0 else 0,
        )
