"""Client for OpenAI-compatible completion servers (`vllm serve`, SGLang), token-in / token-out.

Each prompt is one `POST {base_url}/completions` whose `prompt` is a list of token ids, with `n`
continuations. The vLLM extensions we rely on:

- `return_token_ids=True` (vLLM >= 0.10.2) puts the sampled ids in `choices[i].token_ids`; with
  older servers `return_tokens_as_token_ids=True` makes `logprobs.tokens` read `token_id:{id}`,
  which we parse instead;
- `logprobs=1` returns each sampled token's log-prob in `logprobs.token_logprobs`;
- `include_stop_str_in_output=True` keeps the stop string in `text` (see `engine.base`).

Log-probs: vLLM reports raw model log-probs (temperature 1) unless the server is started with
`--logprobs-mode processed_logprobs`, which makes them log-probs after temperature and top-p,
matching `engine.base`'s definition when `top_p == 1`. `scripts/vllm_cpu_server.sh` starts it so.
At temperature 1 both modes agree.

Routing: with several base URLs, every prompt goes to the server chosen by rendezvous hashing of
a route key (by default its first `route_prefix_tokens` tokens, which all branches of one tree
share), so a tree's continuations land on the server that already caches its prefix, and adding
a server moves only the keys it wins.

Seeds: vLLM seeds the j-th of n samples with `seed + j`; the r-th repeat of an identical prompt
within one call gets `seed + r * n`, so repeats differ, as in the `hf` engine.

HTTP uses the standard library only (`urllib`), one thread per request in flight.
"""

from __future__ import annotations

import hashlib
import json
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .base import Completion, EngineError, FinishReason, SamplingParams, check_prompts


class OpenAIEngine:
    """`Engine` backed by one or more OpenAI-compatible `/v1/completions` servers.

    `base_urls`: e.g. "http://127.0.0.1:8000/v1" (or several; a bare "http://host:port" gets
    "/v1" appended, as vLLM and SGLang serve the API there). `model`: the served model name; by
    default the first one `GET /models` lists. `timeout_s` bounds each request. `retries` repeats a
    request that failed to connect, timed out or got a 5xx answer, waiting `retry_wait_s`, 2×, ...
    """

    accepts_weights = False
    """No weight push to the server yet: it samples from the weights it was started with."""
    weight_version = 0

    def update_weights(self, model: Any, *, version: int) -> None:
        raise EngineError(
            "OpenAIEngine cannot send new weights to its server yet, so the server would keep sampling from the "
            "starting policy while training moves on (off-policy without saying so); train with model.engine=hf"
        )

    def __init__(
        self,
        base_urls: str | Sequence[str],
        *,
        model: str | None = None,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        retries: int = 2,
        retry_wait_s: float = 1.0,
        max_concurrency: int = 16,
        route_prefix_tokens: int = 32,
    ) -> None:
        urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
        if not urls:
            raise ValueError("OpenAIEngine needs at least one base URL")
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"base URL {url!r} must start with http:// or https://")
        if timeout_s <= 0 or retries < 0 or max_concurrency < 1 or route_prefix_tokens < 1:
            raise ValueError(
                "need timeout_s > 0, retries >= 0, max_concurrency >= 1, route_prefix_tokens >= 1; got "
                f"{timeout_s!r}, {retries!r}, {max_concurrency!r}, {route_prefix_tokens!r}"
            )
        self.base_urls = [_api_base(url) for url in urls]
        self.model = model
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.retries = retries
        self.retry_wait_s = retry_wait_s
        self.max_concurrency = max_concurrency
        self.route_prefix_tokens = route_prefix_tokens
        self._models: dict[str, str] = {}

    def route(self, key: str | bytes | Sequence[int]) -> str:
        """The base URL serving a route key (a string, bytes or a prompt's token ids)."""
        if isinstance(key, str):
            data = key.encode("utf-8")
        elif isinstance(key, bytes):
            data = key
        else:
            data = repr([int(t) for t in key[: self.route_prefix_tokens]]).encode()
        return max(self.base_urls, key=lambda url: hashlib.blake2b(data + b"@" + url.encode(), digest_size=8).digest())

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        route_keys: Sequence[str] | None = None,
    ) -> list[list[Completion]]:
        """`params.n` completions per prompt. `route_keys` (one per prompt, e.g. the tree's task id)
        override the default routing by prompt prefix."""
        prompts = check_prompts(prompts)
        if route_keys is not None and len(route_keys) != len(prompts):
            raise ValueError(f"route_keys has {len(route_keys)} entries for {len(prompts)} prompts")
        repeats: Counter[tuple[int, ...]] = Counter()
        jobs = []
        for index, prompt in enumerate(prompts):
            seed = None
            if params.seed is not None:
                seed = params.seed + repeats[tuple(prompt)] * params.n
                repeats[tuple(prompt)] += 1
            url = self.route(route_keys[index] if route_keys is not None else prompt)
            jobs.append((url, prompt, seed))
        if len(jobs) == 1:
            return [self._complete(*jobs[0], params)]
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(jobs))) as pool:
            return list(pool.map(lambda job: self._complete(*job, params), jobs))

    # ------------------------------------------------------------ internals

    def _complete(self, url: str, prompt: list[int], seed: int | None, params: SamplingParams) -> list[Completion]:
        body: dict[str, Any] = {
            "model": self._model_name(url),
            "prompt": prompt,
            "n": params.n,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "max_tokens": params.max_new_tokens,
            "stop": list(params.stop),
            "logprobs": 1,
            "echo": False,
            "stream": False,
            "include_stop_str_in_output": True,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "ignore_eos": params.ignore_eos,
        }
        if seed is not None:
            body["seed"] = seed
        response = self._request(url, "/completions", body)
        choices = response.get("choices") if isinstance(response, dict) else None
        if not isinstance(choices, list) or len(choices) != params.n:
            got = len(choices) if isinstance(choices, list) else "no"
            raise EngineError(f"{url}/completions answered with {got} choices, expected n={params.n}: {_clip(response)}")
        ordered = sorted(choices, key=lambda c: c.get("index", 0))
        cached = _cached_tokens(response)
        return [_parse_choice(choice, url, cached) for choice in ordered]

    def _model_name(self, url: str) -> str:
        if self.model is not None:
            return self.model
        if url not in self._models:
            listing = self._request(url, "/models", None)
            try:
                self._models[url] = str(listing["data"][0]["id"])
            except (KeyError, IndexError, TypeError) as exc:
                raise EngineError(f"{url}/models lists no model; pass model=...: {_clip(listing)}") from exc
        return self._models[url]

    def _request(self, url: str, path: str, body: dict[str, Any] | None) -> Any:
        """GET (body None) or POST JSON; retries connection errors, timeouts and 5xx answers."""
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode("utf-8")
        for attempt in range(self.retries + 1):
            request = urllib.request.Request(url + path, data=data, headers=headers, method="GET" if body is None else "POST")
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:
                    raw = answer.read()
                break
            except urllib.error.HTTPError as exc:
                detail = _error_message(exc.read())
                if exc.code < 500 or attempt == self.retries:
                    raise EngineError(f"{url}{path} answered HTTP {exc.code}: {detail}") from None
            except (TimeoutError, socket.timeout) as exc:
                if attempt == self.retries:
                    raise EngineError(
                        f"{url}{path} did not answer within timeout_s={self.timeout_s} ({self.retries + 1} attempts)"
                    ) from exc
            except urllib.error.URLError as exc:
                if attempt == self.retries:
                    raise EngineError(f"cannot reach {url}{path}: {exc.reason} ({self.retries + 1} attempts)") from exc
            time.sleep(self.retry_wait_s * 2**attempt)
        try:
            return json.loads(raw)
        except json.JSONDecodeError as exc:
            raise EngineError(f"{url}{path} answered with invalid JSON: {raw[:200]!r}") from exc


def _api_base(url: str) -> str:
    url = url.rstrip("/")
    path = urllib.parse.urlsplit(url).path
    return url + "/v1" if path == "" else url


def _cached_tokens(response: dict[str, Any]) -> int:
    """Prompt tokens the server's prefix cache served (vLLM / SGLang `usage.prompt_tokens_details.
    cached_tokens`, sent when the server enables prompt-token details); 0 when it does not say."""
    usage = response.get("usage")
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _parse_choice(choice: dict[str, Any], url: str, cached_tokens: int = 0) -> Completion:
    logprobs = choice.get("logprobs") or {}
    values = logprobs.get("token_logprobs")
    token_ids = choice.get("token_ids")
    if token_ids is None:  # servers without return_token_ids: parse "token_id:123" strings
        tokens = logprobs.get("tokens") or []
        try:
            token_ids = [int(str(t).removeprefix("token_id:")) for t in tokens]
        except ValueError as exc:
            raise EngineError(
                f"{url} returned no token ids (needs vLLM's return_token_ids or return_tokens_as_token_ids): "
                f"{_clip(choice)}"
            ) from exc
    if values is None or len(values) != len(token_ids) or any(v is None for v in values):
        raise EngineError(f"{url} returned {len(token_ids)} token ids but log-probs {_clip(values)}")
    reason = choice.get("finish_reason")
    stop_reason = choice.get("stop_reason")
    finish: FinishReason
    if reason == "length":
        finish = "length"
    elif reason == "stop" and isinstance(stop_reason, str):
        finish = "stop"
    elif reason == "stop":  # EOS, or a stop token id
        finish, stop_reason = "eos", None
    else:
        raise EngineError(f"{url} finished a completion with unexpected finish_reason {reason!r}")
    return Completion(
        token_ids=[int(t) for t in token_ids],
        logprobs=[float(v) for v in values],
        text=str(choice.get("text", "")),
        finish_reason=finish,
        stop_reason=stop_reason if finish == "stop" else None,
        cached_tokens=cached_tokens,
    )


def _error_message(raw: bytes) -> str:
    """The server's error message: vLLM / OpenAI `{"error": {"message": ...}}` or `{"message": ...}`."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return raw[:500].decode("utf-8", "replace")
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if "message" in data:
            return str(data["message"])
    return _clip(data)


def _clip(value: Any, limit: int = 300) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= limit else text[:limit] + "..."
