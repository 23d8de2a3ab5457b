"""A small HTTP server exposing our BM25 index under the Search-R1 / verl retrieval schema.

    python -m trace_rl.agent.tools.retrieval_server --taskset multihop --port 8000
    python -m trace_rl.agent.tools.retrieval_server --corpus wiki.jsonl --port 8000

`POST /retrieve` `{"queries": [...], "topk": 3, "return_scores": true}` ->
`{"result": [[{"document": {"id": ..., "contents": "\\"Title\\"\\ntext"}, "score": ...}, ...]]}`;
`GET /health` -> `{"status": "ok", "documents": N}`. `topk` may be left out or null (the server's
default), else it must be an integer in [1, MAX_TOPK].

Every bad request gets a 4xx status and `{"error": ...}`, then the connection is closed: a body that is
not JSON, nested too deeply, or not the schema (400), a Content-Length that is missing on a chunked
body (411), not a number or negative (400) or over MAX_BODY_BYTES (413), a body that does not arrive
within `timeout_s` (408). A client that stalls while sending its headers is disconnected after
`timeout_s` of silence, so no client holds a thread for long; the listen backlog holds
`LISTEN_BACKLOG` connections waiting to be accepted (http.server's default of 5 resets bursts).

In process (tests, notebooks): `with RetrievalServer(passages) as server: RetrievalClient(server.url)`.
It binds 127.0.0.1 and port 0 (a free port) by default. Standard library only (http.server, threading).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import threading
import time
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from trace_rl.agent.tools.search import (
    BM25Index,
    get_index,
    passage_from_document,
    retrieve_response,
)
from trace_rl.agent.types import Passage

MAX_QUERIES = 1024
MAX_TOPK = 1000
MAX_BODY_BYTES = 10 * 1024 * 1024
LISTEN_BACKLOG = 512
"""Connections the kernel queues before the server accepts them (capped by net.core.somaxconn)."""

logger = logging.getLogger(__name__)


class _HTTPServer(ThreadingHTTPServer):
    request_queue_size = LISTEN_BACKLOG
    daemon_threads = True


class _BadRequest(Exception):
    """A request answered with `status` and a JSON error, after which the connection is closed."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class RetrievalServer:
    """Serves one corpus over HTTP in a background thread until `close()`."""

    def __init__(
        self,
        passages: Sequence[Passage] | BM25Index,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        default_topk: int = 3,
        timeout_s: float = 10.0,
    ) -> None:
        """`timeout_s`: how long a client may stay silent, and how long its whole body may take."""
        if not 1 <= default_topk <= MAX_TOPK:
            raise ValueError(f"default_topk must be in [1, {MAX_TOPK}], got {default_topk!r}")
        if not 0 < timeout_s < math.inf:
            raise ValueError(f"timeout_s must be a finite number of seconds > 0, got {timeout_s!r}")
        self.index = passages if isinstance(passages, BM25Index) else get_index(passages)
        self.default_topk = default_topk
        self.timeout_s = timeout_s
        self._httpd = _HTTPServer((host, port), _make_handler(self))
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    @property
    def url(self) -> str:
        """The retrieve endpoint, e.g. http://127.0.0.1:54321/retrieve."""
        host = self._httpd.server_address[0]
        return f"http://{host}:{self.port}/retrieve"

    def start(self) -> RetrievalServer:
        if self._thread is None:
            self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,), name="retrieval-server", daemon=True)
            self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._httpd.serve_forever()

    def close(self) -> None:
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join()
            self._thread = None
        self._httpd.server_close()

    def __enter__(self) -> RetrievalServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def handle(self, payload: Any) -> dict[str, Any]:
        """Answer one decoded request body; raises ValueError (-> HTTP 400) for a malformed one."""
        if not isinstance(payload, dict):
            raise ValueError("the body must be a JSON object")
        queries = payload.get("queries")
        if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
            raise ValueError("'queries' must be a list of strings")
        if len(queries) > MAX_QUERIES:
            raise ValueError(f"at most {MAX_QUERIES} queries per request, got {len(queries)}")
        topk = payload.get("topk")
        topk = self.default_topk if topk is None else topk  # not `or`: 0 is a value, and a wrong one
        if not isinstance(topk, int) or isinstance(topk, bool) or not 1 <= topk <= MAX_TOPK:
            raise ValueError(f"'topk' must be an integer in [1, {MAX_TOPK}], got {topk!r}")
        return_scores = payload.get("return_scores", False)
        if not isinstance(return_scores, bool):
            raise ValueError(f"'return_scores' must be true or false, got {return_scores!r}")
        return retrieve_response(self.index, queries, topk, return_scores)


def _make_handler(server: RetrievalServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = server.timeout_s  # each read of the socket; `_body` bounds the whole body

        def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
            try:
                if self.path.rstrip("/") != "/retrieve":
                    raise _BadRequest(404, f"unknown path {self.path!r}; use POST /retrieve")
                try:
                    payload = json.loads(self._body() or b"null")
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    raise _BadRequest(400, f"invalid JSON: {exc}") from None
                except RecursionError:
                    raise _BadRequest(400, "invalid JSON: nested too deeply") from None
                try:
                    reply = server.handle(payload)
                except ValueError as exc:
                    raise _BadRequest(400, str(exc)) from None
            except _BadRequest as exc:
                self.close_connection = True  # the rest of a refused body is never read
                self._send(exc.status, {"error": str(exc)})
                return
            except ConnectionError:  # the client went away mid-request: nobody to answer
                self.close_connection = True
                return
            except Exception:  # our bug: answer it, log it, keep serving
                logger.exception("retrieval server: request failed")
                self.close_connection = True
                self._send(500, {"error": "internal error (see the server's log)"})
                return
            self._send(200, reply)

        def do_GET(self) -> None:  # noqa: N802
            if self.path.rstrip("/") == "/health":
                self._send(200, {"status": "ok", "documents": len(server.index.passages)})
            else:
                self._send(404, {"error": f"unknown path {self.path!r}; use POST /retrieve or GET /health"})

        def _body(self) -> bytes:
            """The request body, read in at most `timeout_s` however slowly the client sends it."""
            lengths = self.headers.get_all("Content-Length") or []
            if not lengths:
                if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                    raise _BadRequest(411, "a chunked body is not supported; send Content-Length")
                return b""
            text = lengths[0].strip()
            if len(set(lengths)) > 1 or not (text.isascii() and text.isdigit()):
                raise _BadRequest(400, f"Content-Length must be one non-negative integer, got {', '.join(lengths)!r}")
            length = int(text)
            if length > MAX_BODY_BYTES:
                raise _BadRequest(413, f"body larger than {MAX_BODY_BYTES} bytes")
            deadline = time.monotonic() + server.timeout_s
            chunks, left = [], length
            try:
                while left:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise TimeoutError
                    self.connection.settimeout(remaining)
                    chunk = self.rfile.read1(min(left, 1 << 16))
                    if not chunk:
                        raise ConnectionError("the client closed the connection before sending its body")
                    chunks.append(chunk)
                    left -= len(chunk)
            except TimeoutError:
                raise _BadRequest(408, f"the body did not arrive within {server.timeout_s:g}s "
                                       f"({length - left} of {length} bytes)") from None
            finally:
                self.connection.settimeout(server.timeout_s)
            return b"".join(chunks)

        def _send(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body, ensure_ascii=False).encode("utf-8")
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if self.close_connection:
                    self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(data)
            except OSError:  # the client is gone (or stalled past the timeout while we wrote)
                self.close_connection = True

        def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
            """http.server's own refusals (bad request line, headers too long, unknown method) as JSON too."""
            self.close_connection = True
            self._send(code, {"error": message or self.responses.get(code, ("error",))[0]})

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (quiet by default)
            return

    return Handler


def load_corpus_jsonl(path: str | Path) -> list[Passage]:
    """A corpus in Search-R1's JSONL layout: one `{"id": ..., "contents": "\\"Title\\"\\ntext"}` a line."""
    passages = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if line.strip():
                try:
                    passages.append(passage_from_document(json.loads(line)))
                except ValueError as exc:
                    raise ValueError(f"{path}:{number}: {exc}") from None
    return passages


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trace_rl.agent.tools.retrieval_server", description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--taskset", help="serve the corpus of a registered taskset (e.g. multihop)")
    source.add_argument("--corpus", help="serve a Search-R1 JSONL corpus file")
    parser.add_argument("--num-tasks", type=int, default=None, help="tasks to generate when using --taskset")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--topk", type=int, default=3, help="default topk when a request gives none")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds a client may stay silent or take to send a body")
    args = parser.parse_args(argv)
    if args.taskset:
        from trace_rl.agent.tasks import load_taskset

        kwargs = {} if args.num_tasks is None else {"num_tasks": args.num_tasks}
        passages = load_taskset(args.taskset, seed=args.seed, **kwargs).corpus
    else:
        passages = load_corpus_jsonl(args.corpus)
    server = RetrievalServer(passages, host=args.host, port=args.port, default_topk=args.topk, timeout_s=args.timeout)
    print(json.dumps({"url": server.url, "documents": len(passages)}), flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
