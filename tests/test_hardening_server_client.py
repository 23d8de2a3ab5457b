"""The OpenAI-compatible client against a fake server (http.server on 127.0.0.1, in a thread) that
misbehaves: trickles its reply, drops, resets or cuts short the connection, answers 429, or sends
replies that break the schema. Issue 12, defect class 6."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any

import pytest

from trace_rl.engine import EngineError, OpenAIEngine, SamplingParams
from trace_rl.infra.config import ConfigError, load_config
from trace_rl.run import RunConfig

VOCAB = 50
TOKENS = [5, 6, 7]


class FakeTokenizer:
    """Token t decodes to ' w{t}'; token 0 is the (special) EOS."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join("" if (t == 0 and skip_special_tokens) else f" w{t}" for t in ids)


def choice(index: int, **changes: Any) -> dict[str, Any]:
    """A well-formed vLLM choice: TOKENS, their text, log-probs -0.5, finished by length."""
    base = {"index": index, "text": FakeTokenizer().decode(TOKENS), "token_ids": list(TOKENS),
            "logprobs": {"token_logprobs": [-0.5] * len(TOKENS)}, "finish_reason": "length", "stop_reason": None}
    return {**base, **changes}


Act = Callable[["Handler", dict], None]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Any

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        fake: FakeServer = self.server.fake
        fake.requests += 1
        act = fake.acts.pop(0) if fake.acts else ok
        try:
            act(self, body)
        except OSError:  # the client gave up first (the deadline tests)
            self.close_connection = True


def raw_reply(status: int, payload: Any, headers: dict[str, str] | None = None) -> bytes:
    data = json.dumps(payload).encode()
    lines = [f"HTTP/1.1 {status} X", "Content-Type: application/json", f"Content-Length: {len(data)}",
             *(f"{k}: {v}" for k, v in (headers or {}).items()), "", ""]
    return "\r\n".join(lines).encode() + data


def ok(handler: Handler, body: dict) -> None:
    handler.wfile.write(raw_reply(200, {"choices": [choice(j) for j in range(body["n"])]}))


def reply(payload: Any) -> Act:
    return lambda handler, body: handler.wfile.write(raw_reply(200, payload))


def status(code: int, retry_after: float | None = None) -> Act:
    headers = {} if retry_after is None else {"Retry-After": str(retry_after)}
    return lambda handler, body: handler.wfile.write(raw_reply(code, {"error": {"message": f"status {code}"}}, headers))


def drop(handler: Handler, body: dict) -> None:
    handler.close_connection = True  # closed without a byte of reply


def reset(handler: Handler, body: dict) -> None:
    handler.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    handler.connection.close()  # linger 0: the close sends a TCP RST
    handler.close_connection = True


def cut_short(handler: Handler, body: dict) -> None:
    whole = raw_reply(200, {"choices": [choice(j) for j in range(body["n"])]})
    handler.wfile.write(whole[: len(whole) - 40])  # the body stops 40 bytes before its Content-Length
    handler.close_connection = True


def trickle(seconds_per_byte: float) -> Act:
    def act(handler: Handler, body: dict) -> None:
        for byte in raw_reply(200, {"choices": [choice(j) for j in range(body["n"])]}):  # status line and headers too
            handler.wfile.write(bytes([byte]))
            handler.wfile.flush()
            time.sleep(seconds_per_byte)

    return act


class FakeServer:
    def __init__(self) -> None:
        self.acts: list[Act] = []
        self.requests = 0
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.httpd.fake = self  # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server() -> Iterator[FakeServer]:
    fake = FakeServer()
    yield fake
    fake.close()


def engine(server: FakeServer, **kwargs: Any) -> OpenAIEngine:
    kwargs = {"model": "m", "retry_wait_s": 0.01, **kwargs}
    return OpenAIEngine(server.url, **kwargs)


# ---------------------------------------------------------------- deadlines and retries


def test_a_server_trickling_its_reply_cannot_stretch_a_call_past_its_deadline(server: FakeServer) -> None:
    server.acts = [trickle(0.02)]  # about 400 bytes: 8 s, though no single read waits 1 s
    start = time.monotonic()
    with pytest.raises(EngineError, match=r"did not answer within timeout_s=1 \(1 attempts"):
        engine(server, timeout_s=1.0, retries=0).generate([[1]], SamplingParams(max_new_tokens=3))
    assert time.monotonic() - start < 2.5


def test_a_missed_deadline_is_retried(server: FakeServer) -> None:
    server.acts = [trickle(0.02)]
    [[completion]] = engine(server, timeout_s=1.0, retries=1).generate([[1]], SamplingParams(max_new_tokens=3))
    assert completion.token_ids == TOKENS and server.requests == 2


@pytest.mark.parametrize(
    ("act", "message"),
    [(drop, "closed the connection without answering"), (reset, "dropped the connection"),
     (cut_short, "sent a reply cut short")],
    ids=["dropped", "reset", "cut-short"],
)
def test_lost_connections_are_retried_then_named(server: FakeServer, act: Act, message: str) -> None:
    server.acts = [act, act]
    [[completion]] = engine(server, retries=2).generate([[1]], SamplingParams(max_new_tokens=3))
    assert completion.token_ids == TOKENS and server.requests == 3
    server.acts = [act] * 3
    with pytest.raises(EngineError, match=rf"/completions {message}.*\(3 attempts"):
        engine(server, retries=2).generate([[1]], SamplingParams(max_new_tokens=3))


def test_429_is_retried_after_the_wait_the_server_asks_for(server: FakeServer) -> None:
    server.acts = [status(429, retry_after=0.4)]
    start = time.monotonic()
    [[completion]] = engine(server, retries=1).generate([[1]], SamplingParams(max_new_tokens=3))
    assert completion.token_ids == TOKENS and server.requests == 2
    assert time.monotonic() - start >= 0.4
    server.acts = [status(429)] * 2
    with pytest.raises(EngineError, match=r"HTTP 429: status 429 \(2 attempts"):
        engine(server, retries=1).generate([[1]], SamplingParams(max_new_tokens=3))


# ---------------------------------------------------------------- the config reaches the client


def fake_policy() -> Any:
    weight = SimpleNamespace(shape=(VOCAB, 8))
    return SimpleNamespace(tokenizer=FakeTokenizer(), model=SimpleNamespace(get_output_embeddings=lambda: SimpleNamespace(weight=weight)))


def test_timeout_and_retries_are_set_from_the_config(server: FakeServer) -> None:
    from trace_rl.run import build_engine

    config = load_config(RunConfig, overrides=[
        "engine.name=openai", f"engine.server_urls=['{server.url}']", "engine.server_timeout_s=1.5",
        "engine.server_retries=4", "engine.server_retry_wait_s=0.01",
    ])
    client = build_engine(config.engine, fake_policy())
    assert isinstance(client, OpenAIEngine)
    assert (client.timeout_s, client.retries, client.retry_wait_s, client.vocab_size) == (1.5, 4, 0.01, VOCAB)
    client.model = "m"
    server.acts = [drop] * 4  # a fifth attempt is needed: only the configured retries allow it
    [[completion]] = client.generate([[1]], SamplingParams(max_new_tokens=3))
    assert completion.token_ids == TOKENS and server.requests == 5


@pytest.mark.parametrize(
    "override",
    ["engine.server_timeout_s=0", "engine.server_timeout_s=.nan", "engine.server_timeout_s=.inf",
     "engine.server_retries=-1", "engine.server_retry_wait_s=-1", "engine.server_retry_wait_s=.nan"],
)
def test_bad_client_settings_are_refused_naming_the_key(override: str) -> None:
    key = override.split("=")[0].split(".")[1]
    with pytest.raises(ConfigError, match=rf"{key} must be .*got"):
        load_config(RunConfig, overrides=[override])


# ---------------------------------------------------------------- malformed replies


def one_choice(**changes: Any) -> dict[str, Any]:
    return {"choices": [choice(0, **changes)]}


def logprobs(*values: Any) -> dict[str, Any]:
    return {"logprobs": {"token_logprobs": list(values)}}


MALFORMED = {
    "nan log-prob": (one_choice(**logprobs(-0.5, float("nan"), -0.5)), "log-prob nan at position 1"),
    "+inf log-prob": (one_choice(**logprobs(-0.5, -0.5, float("inf"))), "log-prob inf at position 2"),
    "-inf log-prob": (one_choice(**logprobs(float("-inf"), -0.5, -0.5)), "log-prob -inf at position 0"),
    "positive log-prob": (one_choice(**logprobs(-0.5, 0.25, -0.5)), "log-prob 0.25 at position 1"),
    "string log-prob": (one_choice(**logprobs(-0.5, "-0.5", -0.5)), "log-prob '-0.5' at position 1"),
    "token id -1": (one_choice(token_ids=[5, -1, 7]), r"token id -1 at position 1 is not an integer in \[0, 50\)"),
    "token id 10**12": (one_choice(token_ids=[5, 6, 10**12]), "token id 1000000000000 at position 2"),
    "beyond the vocabulary": (one_choice(token_ids=[5, 6, VOCAB]), "token id 50 at position 2"),
    "float token id": (one_choice(token_ids=[5, 6.0, 7]), "token id 6.0 at position 1"),
    "legacy token id -1": (one_choice(token_ids=None, logprobs={"tokens": ["token_id:5", "token_id:-1", "token_id:7"],
                                                                 "token_logprobs": [-0.5] * 3}), "token id -1 at position 1"),
    "text disagrees with its ids": (one_choice(text=" w5 w6 w8"), "is not what its token ids decode to"),
    "text shorter than its ids": (one_choice(text=" w5"), "is not what its token ids decode to"),
    "non-string text": (one_choice(text=None), "text is null, not a string"),
    "duplicate choice index": ({"choices": [choice(0), choice(0)]}, r"choice indices \[0, 0\]"),
    "missing choice index": ({"choices": [choice(0), {k: v for k, v in choice(1).items() if k != "index"}]},
                             r"choice indices \[0, null\]"),
    "float choice index": ({"choices": [choice(0), choice(1.0)]}, r"choice indices \[0, 1.0\]"),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_replies_are_refused_saying_what_was_wrong(server: FakeServer, name: str) -> None:
    payload, message = MALFORMED[name]
    n = len(payload["choices"])
    server.acts = [reply(payload)]
    client = engine(server, retries=2, tokenizer=FakeTokenizer(), vocab_size=VOCAB)
    with pytest.raises(EngineError, match=message):
        client.generate([[1]], SamplingParams(n=n, max_new_tokens=3))
    assert server.requests == 1  # a malformed reply is the server's bug: asking again will not help


def test_well_formed_replies_pass_the_checks(server: FakeServer) -> None:
    """The allowed differences between text and ids: a stop string inside the last token, EOS, a
    character not yet complete, and a leading space."""
    server.acts = [
        reply(one_choice(text=" w5 w6 w", finish_reason="stop", stop_reason=" w6 w")),
        reply(one_choice(token_ids=[5, 6, 0], text=" w5 w6", finish_reason="stop")),
        reply(one_choice(token_ids=[5, 6], text=" w5 w6", logprobs={"token_logprobs": [0.0, -1e-9]})),
        reply(one_choice(text="w5 w6 w7")),
    ]
    tokenizer = FakeTokenizer()
    tokenizer_with_partial = SimpleNamespace(decode=lambda ids, skip_special_tokens=False: tokenizer.decode(ids) + "\ufffd")
    client = engine(server, tokenizer=tokenizer, vocab_size=VOCAB)
    straddling = client.generate([[1]], SamplingParams(max_new_tokens=3, stop=(" w6 w",)))[0][0]
    assert (straddling.finish_reason, straddling.stop_reason, straddling.token_ids) == ("stop", " w6 w", TOKENS)
    assert client.generate([[1]], SamplingParams(max_new_tokens=3))[0][0].finish_reason == "eos"
    assert client.generate([[1]], SamplingParams(max_new_tokens=3))[0][0].logprobs == [0.0, -1e-9]
    partial = engine(server, tokenizer=tokenizer_with_partial, vocab_size=VOCAB)
    assert partial.generate([[1]], SamplingParams(max_new_tokens=3))[0][0].text == "w5 w6 w7"
