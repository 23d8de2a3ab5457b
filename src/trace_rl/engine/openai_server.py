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
a route key, so a tree's continuations land on the server that already caches its prefix, and
adding a server moves only the keys it wins. The collector passes each rollout's tree as the key
(`routes_by_key`); called without keys, a prompt's key is its first `route_prefix_tokens` tokens.

Seeds: vLLM seeds the j-th of n samples with `seed + j`; the r-th repeat of an identical prompt
within one call gets `seed + r * n`, so repeats differ, as in the `hf` engine.

Failures: every attempt at a request must end within `timeout_s`, from connecting to the reply's
last byte (`trace_rl.infra.http_deadline.exchange`: a timer cuts the socket at the deadline, so a server
trickling bytes cannot stretch it).
What may pass by itself is retried `retries` times, waiting `retry_wait_s`, 2x, 4x, ... (a 429's
`Retry-After`, up to `timeout_s`, when longer): refused or reset connections, a server closing the
connection before or while answering (a reply shorter than its Content-Length included), a missed
deadline, HTTP 429 and 5xx. Other 4xx answers and replies that break the schema are not retried: they
raise `EngineError` saying what was wrong (non-finite or positive log-probs, token ids that are not
integers of the vocabulary, choice indices that are not 0..n-1 once each, and, when the tokenizer is
known, text that is not what the token ids decode to). A request thus returns or raises within about
`(retries + 1) * timeout_s` plus the waits.

Weights (`weight_sync`): after each update `update_weights` writes the model as a Hugging Face
checkpoint into `weight_dir` (a LoRA model merged first) and asks every server to load it: vLLM
through its development routes (`VLLM_SERVER_DEV_MODE=1`): `POST /collective_rpc` calling the
workers' `reload_weights(weights_path=...)`, then `POST /reset_prefix_cache` so no cached prefix
of the old weights is reused; SGLang through `POST /update_weights_from_disk` and `/flush_cache`.
The push returns once every server has answered, so the next batch samples the new weights. The
servers must have been started from a checkpoint of the same architecture (the same parameter names).

HTTP uses the standard library only (servers are reached directly, without proxies), one thread per
request in flight.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import math
import re
import shutil
import ssl
import tempfile
import time
import urllib.parse
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

from trace_rl.infra.http_deadline import exchange

from .base import (
    Completion,
    EngineError,
    FinishReason,
    SamplingParams,
    check_prompts,
    detokenize,
    server_seeds,
)

MAX_TOKEN_ID = 2**31 - 1
"""Largest token id believed without a known vocabulary (vLLM's ids are int32)."""
_PUSHED = re.compile(r"v\d+")
"""The folder names `update_weights` writes its checkpoints under (`v<version>`)."""
_MAX_ERROR_BYTES = 64 * 1024
"""How much of an error reply's body is read for its message."""


class OpenAIEngine:
    """`Engine` backed by one or more OpenAI-compatible `/v1/completions` servers.

    `base_urls`: e.g. "http://127.0.0.1:8000/v1" (or several; a bare "http://host:port" gets
    "/v1" appended, as vLLM and SGLang serve the API there). `model`: the served model name; by
    default the first one `GET /models` lists. `timeout_s`, `retries`, `retry_wait_s`: see the module
    docstring. `tokenizer` (the policy's) lets replies be checked against it: their text must be what
    their token ids decode to. `vocab_size` bounds the token ids (default: `MAX_TOKEN_ID`).
    """

    weight_version = 0
    """The version of the weights the servers last loaded (0: the ones they were started with)."""
    routes_by_key = True
    """`generate` takes `route_keys` (the collector passes each rollout's tree)."""

    @property
    def accepts_weights(self) -> bool:
        return self.weight_sync != "none"

    def update_weights(self, model: Any, *, version: int) -> None:
        """Write `model` to `weight_dir` and have every server load it (see the module docstring)."""
        if self.weight_sync == "none":
            raise EngineError(
                "OpenAIEngine has weight_sync=none, so the servers would keep sampling from the starting policy while "
                "training moves on (off-policy without saying so); set engine.weight_sync to vllm or sglang"
            )
        folder = self._weight_root() / f"v{version}"
        _save_checkpoint(model, folder)
        with ThreadPoolExecutor(max_workers=len(self.base_urls)) as pool:
            list(pool.map(lambda url: self._load_weights(url, folder), self.base_urls))
        for old in self._weight_root().iterdir():  # only the checkpoints this engine writes: a weight_dir may hold other things
            if old != folder and old.is_dir() and _PUSHED.fullmatch(old.name):
                shutil.rmtree(old, ignore_errors=True)
        self.weight_version = version

    def _weight_root(self) -> Path:
        if self.weight_dir is None:
            self.weight_dir = tempfile.mkdtemp(prefix="trace-rl-weights-")
        root = Path(self.weight_dir)
        root.mkdir(parents=True, exist_ok=True)
        return root

    def _load_weights(self, url: str, folder: Path) -> None:
        server = url.removesuffix("/v1")  # the development and SGLang routes sit at the root
        path = str(folder.resolve())
        if self.weight_sync == "vllm":
            self._request(server, "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}}, json_reply=False)
            reply = self._request(server, "/reset_prefix_cache", {})
            if isinstance(reply, dict) and reply.get("success") is False:
                raise EngineError(f"{server}/reset_prefix_cache did not reset (blocks still held); the old weights' prefixes could be reused")
        else:
            reply = self._request(server, "/update_weights_from_disk", {"model_path": path})
            if isinstance(reply, dict) and reply.get("success") is False:
                raise EngineError(f"{server}/update_weights_from_disk failed: {_clip(reply.get('message', reply))}")
            self._request(server, "/flush_cache", {}, json_reply=False)

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
        tokenizer: Any = None,
        vocab_size: int | None = None,
        weight_sync: Literal["none", "vllm", "sglang"] = "none",
        weight_dir: str | Path | None = None,
    ) -> None:
        urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
        if weight_sync not in ("none", "vllm", "sglang"):
            raise ValueError(f"weight_sync must be none, vllm or sglang, got {weight_sync!r}")
        if not urls:
            raise ValueError("OpenAIEngine needs at least one base URL")
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"base URL {url!r} must start with http:// or https://")
        if not (0 < timeout_s < math.inf and 0 <= retry_wait_s < math.inf):
            raise ValueError(f"need finite timeout_s > 0 and retry_wait_s >= 0; got {timeout_s!r}, {retry_wait_s!r}")
        if retries < 0 or max_concurrency < 1 or route_prefix_tokens < 1 or (vocab_size is not None and vocab_size < 1):
            raise ValueError(
                "need retries >= 0, max_concurrency >= 1, route_prefix_tokens >= 1, vocab_size >= 1; got "
                f"{retries!r}, {max_concurrency!r}, {route_prefix_tokens!r}, {vocab_size!r}"
            )
        self.base_urls = [_api_base(url) for url in urls]
        self.model = model
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.retries = retries
        self.retry_wait_s = retry_wait_s
        self.max_concurrency = max_concurrency
        self.route_prefix_tokens = route_prefix_tokens
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.weight_sync = weight_sync
        self.weight_dir = None if weight_dir is None else str(weight_dir)
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
        prompts = check_prompts(prompts, self.vocab_size)
        jobs = []
        for index, (prompt, seed) in enumerate(zip(prompts, server_seeds(prompts, params, route_keys))):
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
        indices = [choice.get("index") if isinstance(choice, dict) else None for choice in choices]
        if not all(_is_int(i) for i in indices) or sorted(indices) != list(range(params.n)):
            raise EngineError(
                f"{url}/completions answered with choice indices {_clip(indices)}; expected each of 0..{params.n - 1} once"
            )
        ordered = sorted(choices, key=lambda c: c["index"])
        cached = _cached_tokens(response)
        check = _ReplyCheck(url, self.vocab_size or MAX_TOKEN_ID + 1, self.tokenizer)
        return [check.completion(choice, cached) for choice in ordered]

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

    def _request(self, url: str, path: str, body: dict[str, Any] | None, *, json_reply: bool = True) -> Any:
        """GET (body None) or POST JSON; retries what may pass by itself (module docstring). With
        `json_reply=False` a 200's body is returned as bytes, unparsed (control routes may answer text)."""
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode("utf-8")
        start = time.monotonic()
        for attempt in range(self.retries + 1):
            wait = self.retry_wait_s * 2**attempt
            try:
                reply = exchange(url + path, data, headers, self.timeout_s, max_error_bytes=_MAX_ERROR_BYTES)
                status, retry_after, raw = reply.status, _retry_after(reply.retry_after), reply.body
            except TimeoutError:
                failure = f"did not answer within timeout_s={self.timeout_s:g}"
            except ssl.SSLCertVerificationError as exc:  # will not pass by itself
                raise EngineError(f"cannot reach {url}{path}: {exc}") from None
            except (OSError, http.client.HTTPException) as exc:
                failure = _connection_failure(exc)
            else:
                if status == 200 and not json_reply:
                    return raw
                if status == 200:
                    try:
                        return json.loads(raw)
                    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
                        raise EngineError(f"{url}{path} answered with invalid JSON: {raw[:200]!r}") from None
                failure = f"answered HTTP {status}: {_error_message(raw)}"
                if status != 429 and status < 500:
                    raise EngineError(f"{url}{path} {failure}")
                if retry_after is not None:
                    wait = max(wait, min(retry_after, self.timeout_s))
            if attempt < self.retries:
                time.sleep(wait)
        elapsed = time.monotonic() - start
        raise EngineError(f"{url}{path} {failure} ({self.retries + 1} attempts in {elapsed:.1f}s)")


def _save_checkpoint(model: Any, folder: Path) -> None:
    """`model` as a Hugging Face checkpoint (safetensors) in `folder`; a PEFT (LoRA) model is merged
    into a copy of its base first, since a server loads full weights. Written beside and renamed, so
    a server never reads a half-written checkpoint."""
    import copy

    full = copy.deepcopy(model).merge_and_unload() if hasattr(model, "merge_and_unload") else model
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    full.save_pretrained(partial, safe_serialization=True)
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)


def _connection_failure(exc: BaseException) -> str:
    """What went wrong on the wire, in words (these are all retried)."""
    if isinstance(exc, http.client.IncompleteRead):
        return f"sent a reply cut short ({len(exc.partial)} bytes, {exc.expected} more announced)"
    if isinstance(exc, http.client.RemoteDisconnected):
        return "closed the connection without answering"
    if isinstance(exc, ConnectionRefusedError):
        return f"cannot reach the server: {exc}"
    if isinstance(exc, ConnectionError):
        return f"dropped the connection: {exc}"
    if isinstance(exc, http.client.HTTPException):
        return f"sent a malformed HTTP reply: {type(exc).__name__}: {exc}"
    return f"cannot reach the server: {exc}"


def _retry_after(value: str | None) -> float | None:
    """A Retry-After header in seconds (its HTTP-date form is ignored)."""
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    return seconds if seconds is not None and 0 <= seconds < math.inf else None


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


_TOKEN_ID_STRING = re.compile(r"token_id:(-?[0-9]+)")


class _ReplyCheck:
    """Turns one reply's choices into Completions, refusing any that break the schema (module docstring)."""

    def __init__(self, url: str, vocab_size: int, tokenizer: Any) -> None:
        self.url, self.vocab_size, self.tokenizer = url, vocab_size, tokenizer

    def completion(self, choice: dict[str, Any], cached_tokens: int) -> Completion:
        where = f"{self.url} sent a malformed completion (choice {choice['index']})"
        logprobs = choice.get("logprobs") or {}
        if not isinstance(logprobs, dict):
            raise EngineError(f"{where}: logprobs is {_clip(logprobs)}")
        token_ids = self._token_ids(choice, logprobs, where)
        values = logprobs.get("token_logprobs")
        if not isinstance(values, list) or len(values) != len(token_ids):
            raise EngineError(f"{self.url} returned {len(token_ids)} token ids but log-probs {_clip(values)}")
        for position, value in enumerate(values):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -math.inf < value <= 0.0:
                raise EngineError(f"{where}: log-prob {value!r} at position {position}; each must be a finite number <= 0")
        text = choice.get("text", "")
        if not isinstance(text, str):
            raise EngineError(f"{where}: text is {_clip(text)}, not a string")
        finish, stop_reason = self._finish(choice)
        if self.tokenizer is not None:
            self._check_text(token_ids, text, finish, where)
        return Completion(
            token_ids=token_ids,
            logprobs=[float(v) for v in values],
            text=text,
            finish_reason=finish,
            stop_reason=stop_reason,
            cached_tokens=cached_tokens,
        )

    def _token_ids(self, choice: dict[str, Any], logprobs: dict[str, Any], where: str) -> list[int]:
        token_ids = choice.get("token_ids")
        if token_ids is None:  # servers without return_token_ids: parse "token_id:123" strings
            tokens = logprobs.get("tokens")
            matches = [_TOKEN_ID_STRING.fullmatch(t) if isinstance(t, str) else None for t in tokens or []]
            if not isinstance(tokens, list) or not all(matches):
                raise EngineError(
                    f"{self.url} returned no token ids (needs vLLM's return_token_ids or return_tokens_as_token_ids): "
                    f"{_clip(choice)}"
                )
            token_ids = [int(m.group(1)) for m in matches]  # type: ignore[union-attr]
        if not isinstance(token_ids, list):
            raise EngineError(f"{where}: token_ids is {_clip(token_ids)}, not a list")
        for position, token in enumerate(token_ids):
            if not _is_int(token) or not 0 <= token < self.vocab_size:
                raise EngineError(
                    f"{where}: token id {token!r} at position {position} is not an integer in [0, {self.vocab_size})"
                )
        return token_ids

    def _finish(self, choice: dict[str, Any]) -> tuple[FinishReason, str | None]:
        reason, stop_reason = choice.get("finish_reason"), choice.get("stop_reason")
        if reason == "length":
            return "length", None
        if reason == "stop" and isinstance(stop_reason, str):
            return "stop", stop_reason
        if reason == "stop":  # EOS, or a stop token id
            return "eos", None
        raise EngineError(f"{self.url} finished a completion with unexpected finish_reason {reason!r}")

    def _check_text(self, token_ids: list[int], text: str, finish: FinishReason, where: str) -> None:
        """`text` must be what the ids decode to (engine.base's contract). Allowed differences: leading
        spaces (a SentencePiece tokenizer drops one when decoding ids on their own), the part of a last
        token that straddles a stop string, and a trailing character not yet complete in UTF-8."""
        decoded = detokenize(self.tokenizer, token_ids).lstrip(" ")
        said = text.lstrip(" ")
        extra = decoded[len(said):] if decoded.startswith(said) else None
        if extra is not None and finish == "stop" and len(extra) <= len(detokenize(self.tokenizer, token_ids[-1:])):
            return
        if extra is not None and not extra.strip("\ufffd"):
            return
        raise EngineError(f"{where}: its text {_clip(text, 120)} is not what its token ids decode to ({_clip(decoded, 120)})")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _error_message(raw: bytes) -> str:
    """The server's error message: vLLM / OpenAI `{"error": {"message": ...}}` or `{"message": ...}`."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        return raw[:500].decode("utf-8", "replace")
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and "message" in error:
            return _clip(str(error["message"]), 500)
        if "message" in data:
            return _clip(str(data["message"]), 500)
    return _clip(data)


def _clip(value: Any, limit: int = 300) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= limit else text[:limit] + "..."
