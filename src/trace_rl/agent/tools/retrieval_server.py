"""A small HTTP server exposing our BM25 index under the Search-R1 / verl retrieval schema.

    python -m trace_rl.agent.tools.retrieval_server --taskset multihop --port 8000
    python -m trace_rl.agent.tools.retrieval_server --corpus wiki.jsonl --port 8000

`POST /retrieve` `{"queries": [...], "topk": 3, "return_scores": true}` ->
`{"result": [[{"document": {"id": ..., "contents": "\\"Title\\"\\ntext"}, "score": ...}, ...]]}`;
`GET /health` -> `{"status": "ok", "documents": N}`. Bad requests get HTTP 400 with `{"error": ...}`.

In process (tests, notebooks): `with RetrievalServer(passages) as server: RetrievalClient(server.url)`.
It binds 127.0.0.1 and port 0 (a free port) by default. Standard library only (http.server, threading).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from trace_rl.agent.tools.search import BM25Index, get_index, passage_from_document, retrieve_response
from trace_rl.agent.types import Passage

MAX_QUERIES = 1024
MAX_TOPK = 1000
MAX_BODY_BYTES = 10 * 1024 * 1024


class RetrievalServer:
    """Serves one corpus over HTTP in a background thread until `close()`."""

    def __init__(self, passages: Sequence[Passage] | BM25Index, *, host: str = "127.0.0.1", port: int = 0, default_topk: int = 3) -> None:
        self.index = passages if isinstance(passages, BM25Index) else get_index(passages)
        self.default_topk = default_topk
        self._httpd = ThreadingHTTPServer((host, port), _make_handler(self))
        self._httpd.daemon_threads = True
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
        topk = payload.get("topk") or self.default_topk
        if not isinstance(topk, int) or isinstance(topk, bool) or not 1 <= topk <= MAX_TOPK:
            raise ValueError(f"'topk' must be an integer in [1, {MAX_TOPK}], got {topk!r}")
        return_scores = payload.get("return_scores", False)
        if not isinstance(return_scores, bool):
            raise ValueError(f"'return_scores' must be true or false, got {return_scores!r}")
        return retrieve_response(self.index, queries, topk, return_scores)


def _make_handler(server: RetrievalServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path.rstrip("/") != "/retrieve":
                self._send(404, {"error": f"unknown path {self.path!r}; use POST /retrieve"})
                return
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY_BYTES:
                self._send(413, {"error": f"body larger than {MAX_BODY_BYTES} bytes"})
                return
            try:
                payload = json.loads(self.rfile.read(length) or b"null")
                reply = server.handle(payload)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                self._send(400, {"error": f"invalid JSON: {exc}"})
                return
            except ValueError as exc:
                self._send(400, {"error": str(exc)})
                return
            self._send(200, reply)

        def do_GET(self) -> None:  # noqa: N802
            if self.path.rstrip("/") == "/health":
                self._send(200, {"status": "ok", "documents": len(server.index.passages)})
            else:
                self._send(404, {"error": f"unknown path {self.path!r}; use POST /retrieve or GET /health"})

        def _send(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body, ensure_ascii=False).encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

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
    args = parser.parse_args(argv)
    if args.taskset:
        from trace_rl.agent.tasks import load_taskset

        kwargs = {} if args.num_tasks is None else {"num_tasks": args.num_tasks}
        passages = load_taskset(args.taskset, seed=args.seed, **kwargs).corpus
    else:
        passages = load_corpus_jsonl(args.corpus)
    server = RetrievalServer(passages, host=args.host, port=args.port, default_topk=args.topk)
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
