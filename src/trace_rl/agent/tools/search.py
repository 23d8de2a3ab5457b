"""Search over a corpus: BM25 in process (`bm25s`), or a Search-R1 / verl retrieval server over HTTP.

Both give the model the same text for the same corpus and query, Search-R1 style:

    Doc 1 (Title: Paris) Paris is the capital of France.
    Doc 2 (Title: ...) ...

Ranking is deterministic: by BM25 score, ties broken by the passage's position in the corpus. Passages
that share no term with the query are not returned.

The server schema (Search-R1's `retrieval_server.py`, verl's `search_r1_like_utils.py`):
`POST /retrieve` with `{"queries": [...], "topk": k, "return_scores": true}` answers
`{"result": [[{"document": {"id": ..., "contents": "\\"Title\\"\\ntext"}, "score": ...}, ...], ...]}`
(one list per query; without `return_scores` the items are the documents themselves).
"""

from __future__ import annotations

import http.client
import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from trace_rl.agent.tools.base import (
    Tool,
    ToolInputError,
    ToolTimeoutError,
    ToolUnavailableError,
)
from trace_rl.agent.types import Passage
from trace_rl.infra.http_deadline import exchange

TOKEN_PATTERN = r"(?u)\b\w+\b"
"""Single characters and digits are tokens too (bm25s's default drops them): '7', 'X' matter in our tasks."""
NO_RESULTS = "No results found."
MAX_QUERY_CHARS = 1000
"""Longer queries are refused before any work (BM25 and the server take time linear in the query)."""
MAX_REPLY_BYTES = 8 * 2**20
"""A retrieval server reply larger than this is refused unread: topk passages are far smaller."""


@dataclass(frozen=True)
class Hit:
    """One retrieved passage with its BM25 score."""

    passage: Passage
    score: float


class BM25Index:
    """A BM25 index over a fixed list of passages (title and text are both indexed)."""

    def __init__(self, passages: Sequence[Passage]) -> None:
        import bm25s  # optional dependency (extra `agent`)

        self.passages = list(passages)
        self._bm25s = bm25s
        self._retriever = bm25s.BM25()
        if self.passages:
            tokens = self._tokenize([f"{p.title} {p.text}" for p in self.passages])
            self._retriever.index(tokens, show_progress=False)

    def _tokenize(self, texts: list[str]) -> list[list[str]]:
        return self._bm25s.tokenize(
            texts, stopwords="english", token_pattern=TOKEN_PATTERN, return_ids=False, show_progress=False
        )

    def search(self, query: str, k: int) -> list[Hit]:
        """Top-k passages with a positive score, best first; equal scores keep corpus order."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        (tokens,) = self._tokenize([query])
        if not tokens or not self.passages:
            return []
        scores = np.asarray(self._retriever.get_scores(tokens), dtype=np.float64)  # (N,)
        if len(scores) > k:
            kth = -np.partition(-scores, k - 1)[k - 1]
            candidates = np.flatnonzero(scores >= kth)  # ascending index: ties keep corpus order
        else:
            candidates = np.arange(len(scores))
        candidates = candidates[scores[candidates] > 0]
        order = candidates[np.argsort(-scores[candidates], kind="stable")][:k]
        return [Hit(self.passages[i], float(scores[i])) for i in order]


_CACHE: OrderedDict[int, tuple[Sequence[Passage], BM25Index]] = OrderedDict()
_CACHE_SIZE = 8
_CACHE_LOCK = threading.Lock()


def get_index(passages: Sequence[Passage]) -> BM25Index:
    """The index of a corpus, built once per corpus object (corpora are treated as immutable).

    The cache holds the corpus itself, so its id cannot be reused while the entry lives.
    """
    key = id(passages)
    with _CACHE_LOCK:
        entry = _CACHE.get(key)
        if entry is not None and entry[0] is passages and len(entry[1].passages) == len(passages):
            _CACHE.move_to_end(key)
            return entry[1]
        index = BM25Index(passages)
        _CACHE[key] = (passages, index)
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
        return index


def format_hits(hits: Sequence[Hit]) -> str:
    """Search-R1's rendering of retrieved passages, one per line."""
    if not hits:
        return NO_RESULTS
    return "\n".join(f"Doc {i} (Title: {hit.passage.title}) {hit.passage.text}" for i, hit in enumerate(hits, 1))


def _check_query(query: str) -> str:
    query = query.strip()
    if not query:
        raise ToolInputError("empty query")
    if len(query) > MAX_QUERY_CHARS:
        raise ToolInputError(f"query too long ({len(query)} characters; at most {MAX_QUERY_CHARS})")
    return query


def search_tool(passages: Sequence[Passage], *, topk: int = 3) -> Tool:
    """The `search` tool over `passages` (BM25, in process)."""
    index = get_index(passages)

    def search(query: str) -> str:
        """Search the knowledge base and return the most relevant passages with their titles."""
        return format_hits(index.search(_check_query(query), topk))

    return Tool.from_function(search, params={"query": "what to search for, e.g. an entity name"})


# ---------------------------------------------------------------- Search-R1 schema


def passage_contents(passage: Passage) -> str:
    """A passage in the Search-R1 corpus layout: the quoted title, a newline, the text."""
    return f'"{passage.title}"\n{passage.text}'


def passage_from_document(document: Any) -> Passage:
    """Read a Search-R1 document `{"id": ..., "contents": "\\"Title\\"\\ntext"}`; raises ValueError."""
    if not isinstance(document, dict) or not isinstance(document.get("contents"), str):
        raise ValueError(f"a document must be an object with a string 'contents', got {str(document)[:200]!r}")
    title, _, text = document["contents"].partition("\n")
    if len(title) >= 2 and title.startswith('"') and title.endswith('"'):
        title = title[1:-1]
    return Passage(doc_id=str(document.get("id", "")), title=title, text=text)


def retrieve_response(index: BM25Index, queries: Sequence[str], topk: int, return_scores: bool) -> dict[str, Any]:
    """The server's reply for one request (shared by the server and tests)."""
    result = []
    for query in queries:
        hits = index.search(query, topk)
        docs = [{"id": hit.passage.doc_id, "contents": passage_contents(hit.passage)} for hit in hits]
        result.append([{"document": d, "score": h.score} for d, h in zip(docs, hits)] if return_scores else docs)
    return {"result": result}


class RetrievalClient:
    """Client of a Search-R1-compatible retrieval server (`POST {url}` with the schema above).

    `url` is the full endpoint (e.g. `http://127.0.0.1:8000/retrieve`); a bare `http://host:port`
    gets `/retrieve` appended. Server errors, timeouts and malformed replies raise `ToolError`
    subclasses, which the env shows the model as error observations. Connection errors, broken
    replies and 5xx are retried `retries` times with a short backoff, timeouts at once.
    `timeout_s` bounds each attempt as a whole (connect, send, every read), not each socket read,
    so a server that trickles its reply cannot stretch a call; replies over `MAX_REPLY_BYTES` are refused.
    """

    def __init__(self, url: str, *, topk: int = 3, timeout_s: float = 10.0, retries: int = 2) -> None:
        if not re.match(r"^https?://", url):
            raise ValueError(f"retrieval url must start with http:// or https://, got {url!r}")
        if re.match(r"^https?://[^/]+/?$", url):
            url = url.rstrip("/") + "/retrieve"
        self.url = url
        self.topk = topk
        self.timeout_s = timeout_s
        self.retries = retries

    def retrieve(self, queries: Sequence[str], topk: int | None = None) -> list[list[Hit]]:
        """Hits for each query, in the server's order."""
        k = self.topk if topk is None else topk
        body = json.dumps({"queries": list(queries), "topk": k, "return_scores": True}).encode()
        reply = self._post(body)
        result = reply.get("result") if isinstance(reply, dict) else None
        if not isinstance(result, list) or len(result) != len(queries):
            raise ToolUnavailableError(f"retrieval server at {self.url} sent a malformed reply: {str(reply)[:200]!r}")
        try:
            return [[self._hit(item) for item in items] for items in result]
        except (ValueError, TypeError) as exc:
            raise ToolUnavailableError(f"retrieval server at {self.url} sent a malformed document: {exc}") from None

    @staticmethod
    def _hit(item: Any) -> Hit:
        if isinstance(item, dict) and "document" in item:
            return Hit(passage_from_document(item["document"]), float(item.get("score", 0.0)))
        return Hit(passage_from_document(item), 0.0)

    def _post(self, body: bytes) -> Any:
        for attempt in range(self.retries + 1):
            retry = attempt < self.retries
            try:
                status, raw = self._exchange(body)
            except TimeoutError:
                if retry:
                    continue
                raise ToolTimeoutError(f"retrieval server at {self.url} did not answer within {self.timeout_s:g}s") from None
            except (OSError, http.client.HTTPException) as exc:  # refused, reset, cut short, not HTTP
                if retry:
                    time.sleep(0.2 * (attempt + 1))
                    continue
                raise ToolUnavailableError(f"cannot reach retrieval server at {self.url}: {type(exc).__name__}: {exc}") from None
            if status >= 500 and retry:
                time.sleep(0.2 * (attempt + 1))
                continue
            if not 200 <= status < 300:
                detail = raw[:200].decode("utf-8", "replace")
                raise ToolUnavailableError(f"retrieval server at {self.url} answered HTTP {status}: {detail}")
            break
        if len(raw) > MAX_REPLY_BYTES:
            raise ToolUnavailableError(f"retrieval server at {self.url} sent a reply over {MAX_REPLY_BYTES} bytes")
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            raise ToolUnavailableError(f"retrieval server at {self.url} sent invalid JSON: {raw[:200]!r}") from None

    def _exchange(self, body: bytes) -> tuple[int, bytes]:
        """One POST: (status, at most MAX_REPLY_BYTES + 1 bytes of body), all within `timeout_s`
        (`trace_rl.infra.http_deadline`); a body cut short raises IncompleteRead, which is retried."""
        limit = MAX_REPLY_BYTES + 1
        reply = exchange(self.url, body, {"Content-Type": "application/json"}, self.timeout_s, max_bytes=limit, max_error_bytes=limit)
        if reply.missing:
            raise http.client.IncompleteRead(reply.body, reply.missing)
        return reply.status, reply.body

    def check(self) -> None:
        """Ask the server one query, as a rollout would, and raise the `ToolError` a rollout would get if it
        does not answer properly: run before any work, so a dead server stops a run at once instead of
        turning every search into an error observation (and a warm start into one trained on them)."""
        self.retrieve(["trace-rl health check"], topk=1)

    def search(self, query: str) -> str:
        """Search the knowledge base and return the most relevant passages with their titles."""
        (hits,) = self.retrieve([_check_query(query)])
        return format_hits(hits)

    def tool(self) -> Tool:
        """The `search` tool backed by this server; same name, description and output as `search_tool`."""
        return Tool.from_function(self.search, name="search", params={"query": "what to search for, e.g. an entity name"})
