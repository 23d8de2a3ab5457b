"""The retrieval server over real sockets on 127.0.0.1: every bad request gets a 4xx with a JSON error
(never a connection closed without a status), a stalled client cannot hold a thread, and a burst of
connections waits in the listen backlog instead of being dropped. Issue 12, defect class 8."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from trace_rl.agent.tools.retrieval_server import RetrievalServer
from trace_rl.agent.types import Passage

CORPUS = [Passage("p1", "Paris", "Paris is the capital of France."), Passage("p2", "Berlin", "Berlin is the capital of Germany."),
          Passage("p3", "Rome", "Rome is the capital of Italy."), Passage("p4", "Zeppelin", "A zeppelin is an airship.")]
CLIENT_WAIT_S = 5.0
"""How long the test client waits for an answer before calling it a hang."""


@pytest.fixture
def server() -> Iterator[RetrievalServer]:
    with RetrievalServer(CORPUS, timeout_s=0.5) as running:
        yield running


def connect(server: RetrievalServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=CLIENT_WAIT_S)
    return sock


def read_reply(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of one HTTP reply; status 0 when the server closed without answering."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return 0, {}, data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    while len(body) < int(headers.get("content-length", 0)):
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(status_line.split()[1]), headers, body


def closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def post(server: RetrievalServer, payload: Any) -> tuple[int, Any]:
    body = json.dumps(payload).encode()
    with connect(server) as sock:
        sock.sendall(b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        status, _, reply = read_reply(sock)
    return status, json.loads(reply)


def test_topk_zero_is_refused_not_read_as_the_default(server: RetrievalServer) -> None:
    status, reply = post(server, {"queries": ["capital of France"], "topk": 0})
    assert (status, reply) == (400, {"error": "'topk' must be an integer in [1, 1000], got 0"})
    status, reply = post(server, {"queries": ["capital of France"], "topk": None})  # null: the default, 3
    assert status == 200 and len(reply["result"][0]) == 3


BAD_REQUESTS = {
    "100k-deep JSON": (b"[" * 100_000, {}, 400, "nested too deeply"),
    "not JSON": (b"hello", {}, 400, "invalid JSON"),
    "Content-Length abc": (b"{}", {"Content-Length": "abc"}, 400, "Content-Length must be one non-negative integer"),
    "Content-Length negative": (b"{}", {"Content-Length": "-5"}, 400, "Content-Length must be one non-negative integer"),
    "Content-Length twice": (b"{}", {"Content-Length": ["2", "3"]}, 400, "Content-Length must be one"),
    "Content-Length huge": (b"{}", {"Content-Length": str(10**20)}, 413, "body larger than"),
    "chunked body": (b"2\r\n{}\r\n0\r\n\r\n", {"Transfer-Encoding": "chunked", "Content-Length": None}, 411, "chunked"),
}


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_bad_requests_get_a_4xx_with_a_json_error_then_the_connection_closes(server: RetrievalServer, name: str) -> None:
    body, changes, expected, message = BAD_REQUESTS[name]
    headers: dict[str, Any] = {"Host": "x", "Content-Type": "application/json", "Content-Length": str(len(body)), **changes}
    lines = [f"{k}: {v}" for k, values in headers.items() if values is not None
             for v in (values if isinstance(values, list) else [values])]
    with connect(server) as sock:
        sock.sendall(("POST /retrieve HTTP/1.1\r\n" + "\r\n".join(lines) + "\r\n\r\n").encode() + body)
        status, reply_headers, reply = read_reply(sock)
        assert status == expected, (status, reply)
        assert reply_headers["content-type"] == "application/json" and message in json.loads(reply)["error"]
        assert closed_by_server(sock)  # an unread body must not be parsed as the next request


def test_http_servers_own_refusals_are_json_too(server: RetrievalServer) -> None:
    with connect(server) as sock:
        sock.sendall(b"POST /" + b"x" * 70_000 + b" HTTP/1.1\r\n\r\n")  # a request line past http.server's limit
        status, headers, reply = read_reply(sock)
    assert status == 414 and headers["content-type"] == "application/json" and json.loads(reply)["error"]


def test_a_client_stalled_in_its_headers_is_disconnected_after_the_timeout(server: RetrievalServer) -> None:
    with connect(server) as sock:
        sock.sendall(b"POST /retrieve HTTP/1.1\r\nHost: x\r\n")  # ... and nothing more
        start = time.monotonic()
        assert closed_by_server(sock)
        assert time.monotonic() - start < 2.0


def test_a_body_trickled_byte_by_byte_is_cut_off_with_408(server: RetrievalServer) -> None:
    body = json.dumps({"queries": ["capital of France"], "topk": 1}).encode()  # 40 bytes: 4 s at 0.1 s a byte
    with connect(server) as sock:
        sock.sendall(f"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode())

        def trickle() -> None:
            try:
                for byte in body:
                    sock.sendall(bytes([byte]))
                    time.sleep(0.1)
            except OSError:
                pass  # the server closed the connection, as it should

        sender = threading.Thread(target=trickle, daemon=True)
        start = time.monotonic()
        sender.start()
        status, _, reply = read_reply(sock)
        assert status == 408 and "did not arrive within 0.5s" in json.loads(reply)["error"]
        assert time.monotonic() - start < 2.0
    sender.join(timeout=CLIENT_WAIT_S)


def test_a_burst_of_connections_waits_in_the_backlog_and_is_served() -> None:
    server = RetrievalServer(CORPUS, timeout_s=5.0)  # listening, not yet accepting
    socks = []
    try:
        for _ in range(100):
            socks.append(socket.create_connection(("127.0.0.1", server.port), timeout=0.5))
        server.start()
        request = json.dumps({"queries": ["capital of Germany"], "topk": 1}).encode()
        for sock in socks:
            sock.settimeout(CLIENT_WAIT_S)
            sock.sendall(f"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Length: {len(request)}\r\n\r\n".encode() + request)
        replies = [read_reply(sock) for sock in socks]
        assert [status for status, _, _ in replies] == [200] * 100
        assert json.loads(replies[-1][2])["result"][0][0]["id"] == "p2"
    finally:
        for sock in socks:
            sock.close()
        server.close()
