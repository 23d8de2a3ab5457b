"""Tools: the calculator, BM25 search, the retrieval server and its client, and `run_tool`."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
import time
import urllib.request
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import skip_without_sandbox

from trace_rl.agent.tools import (
    Tool,
    ToolInputError,
    ToolTimeoutError,
    ToolUnavailableError,
    build_tools,
    run_tool,
)
from trace_rl.agent.tools.calculator import calculate, calculator_tool
from trace_rl.agent.tools.retrieval_server import RetrievalServer, load_corpus_jsonl
from trace_rl.agent.tools.search import (
    NO_RESULTS,
    BM25Index,
    RetrievalClient,
    format_hits,
    get_index,
    passage_contents,
    passage_from_document,
    search_tool,
)
from trace_rl.agent.types import Passage, ToolCall

CORPUS = [
    Passage("d0", "Paris", "Paris is the capital and largest city of France."),
    Passage("d1", "Berlin", "Berlin is the capital of Germany and its largest city."),
    Passage("d2", "Lake Zurich", "Lake Zurich is a lake in Switzerland, south-east of the city of Zurich."),
    Passage("d3", "Ada Lovelace", "Ada Lovelace was an English mathematician who wrote about the Analytical Engine."),
    Passage("d4", "Twinx", "The lighthouse keeper lived alone."),
    Passage("d5", "Twiny", "The lighthouse keeper lived alone."),
    Passage("d6", "Quote", 'He said "hello"\nthen left.'),
]


# ---------------------------------------------------------------- calculator


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("1 + 2 * 3", "7"),
        ("(1 + 2) * 3", "9"),
        ("7 / 2", "3.5"),
        ("7 // 2", "3"),
        ("-7 % 3", "2"),
        ("2 ** 10", "1024"),
        ("-(3 - 5)", "2"),
        ("+4", "4"),
        ("10 / 4 * 2", "5"),
        ("0.1 + 0.2", "0.3"),
        ("sqrt(16)", "4"),
        ("sqrt(2) ** 2", "2"),
        ("abs(-3.5)", "3.5"),
        ("round(2.675, 1)", "2.7"),
        ("min(3, 1, 2) + max(4, 5)", "6"),
        ("floor(2.7) + ceil(2.1)", "5"),
        ("log(e)", "1"),
        ("2 * pi", "6.28318530718"),
        ("1e3 + 1", "1001"),
        ("1 / 3", "0.333333333333"),
        ("123456789 * 987654321", "121932631112635269"),
        ("2 ** -1", "0.5"),
    ],
)
def test_calculator_evaluates_arithmetic(expression, expected):
    assert calculate(expression) == expected


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("__import__('os')", "cannot call '__import__'"),
        ("__import__('os').system('ls')", "attribute access is not allowed"),
        ("(lambda: 1)()", "cannot call the result of an expression"),
        ("().__class__.__bases__", "attribute access is not allowed"),
        ("(1).real", "attribute access is not allowed"),
        ("os", "unknown name 'os'"),
        ("x + 1", "unknown name 'x'"),
        ("open('/etc/passwd')", "cannot call 'open'"),
        ("'a' * 3", "only numbers are allowed"),
        ("True + 1", "only numbers are allowed"),
        ("1j", "only numbers are allowed"),
        ("[1, 2]", "List is not allowed"),
        ("lambda: 1", "Lambda is not allowed"),
        ("1 if 2 else 3", "IfExp is not allowed"),
        ("1 < 2", "Compare is not allowed"),
        ("9 ** 9 ** 9", "exponent"),
        ("10 ** 101", "result too large"),
        ("2 ** 1000", "result too large"),
        ("10.0 ** 400", "result too large"),
        ("1e308 * 10", "result too large"),
        ("(10 ** 60) * (10 ** 60)", "result too large"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("0 ** -1", "zero cannot be raised"),
        ("(-8) ** 0.5", "not a real number"),
        ("sqrt(-1)", "undefined"),
        ("log(0)", "undefined"),
        ("2 ^ 3", "use ** for powers"),
        ("1,000 + 1", "thousands separators"),
        ("1 +", "not a valid expression"),
        ("", "empty expression"),
        ("1 + " * 200 + "1", "expression too long"),
        ("max()", "max()"),
        ("round(1.5, ndigits=1)", "keyword"),
    ],
)
def test_calculator_refuses_anything_but_bounded_arithmetic(expression, message):
    with pytest.raises(ToolInputError) as excinfo:
        calculate(expression)
    assert message in str(excinfo.value)


def test_calculator_refuses_model_text_without_a_parser_warning_on_stderr():
    # "5is 3" and "3x" make Python's parser warn (SyntaxWarning) before it refuses or accepts: a
    # warning per rollout turn would flood a training run's log.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for text in ("5is 3", "1if 2 else 3", "3x"):
            with pytest.raises(ToolInputError):
                calculate(text)
    assert not caught


def test_calculator_tool_spec_comes_from_the_function():
    tool = calculator_tool()
    assert tool.name == "calculator"
    assert tool.spec.argument == "expression"
    assert tool.spec.description.startswith("Evaluate an arithmetic expression")


# ---------------------------------------------------------------- run_tool


def _echo(text: str, times: int = 1) -> str:
    """Repeat the text."""
    if text == "bad":
        raise ToolInputError("bad text")
    if text == "bug":
        raise KeyError("our bug")
    if text == "slow":
        raise ToolTimeoutError("took too long")
    return text * times


ECHO = {"echo": Tool.from_function(_echo, params={"text": "what to echo"})}


def test_run_tool_returns_the_output():
    result = run_tool(ECHO, ToolCall("echo", {"text": "ab", "times": 2}))
    assert result.ok and result.output == "abab" and result.error_kind is None
    assert result.seconds >= 0


@pytest.mark.parametrize(
    ("call", "kind", "message"),
    [
        (ToolCall("nope", {}), "unknown_tool", "error: no tool named 'nope'; available tools: echo"),
        (ToolCall("echo", {"txt": "a"}), "arguments", "error: echo: unexpected argument 'txt'"),
        (ToolCall("echo", {}), "arguments", "error: echo: missing argument 'text'"),
        (ToolCall("echo", {"text": "a", "times": "2"}), "arguments", "error: echo: argument 'times' must be an integer"),
        (ToolCall("echo", {"text": "bad"}), "input", "error: echo: bad text"),
        (ToolCall("echo", {"text": "slow"}), "timeout", "error: echo: took too long"),
    ],
)
def test_run_tool_turns_model_mistakes_into_error_observations(call, kind, message):
    result = run_tool(ECHO, call)
    assert not result.ok
    assert result.error_kind == kind
    assert result.output.startswith(message)
    assert result.timed_out == (kind == "timeout")


def test_run_tool_records_a_crash_and_refuses_the_answer_action():
    crash = run_tool(ECHO, ToolCall("echo", {"text": "bug"}))
    assert crash.error_kind == "crash" and crash.output == "error: echo: the tool crashed (KeyError: 'our bug')"
    with pytest.raises(ValueError, match="handled by the env"):
        run_tool(ECHO, ToolCall("answer", {"answer": "x"}))


def test_tool_from_function_rejects_untyped_or_undescribed_functions():
    def untyped(x) -> str:  # noqa: ANN001
        """Doc."""
        return x

    def nodoc(x: str) -> str:
        return x

    with pytest.raises(ValueError, match="must be str, int, float or bool"):
        Tool.from_function(untyped)
    with pytest.raises(ValueError, match="needs a description"):
        Tool.from_function(nodoc)
    with pytest.raises(ValueError, match="unknown parameters"):
        Tool.from_function(_echo, params={"y": "no such parameter"})


def test_build_tools_names_the_unknown_tool_and_needs_one_search_backend():
    with pytest.raises(ValueError, match="unknown tool 'browser'"):
        build_tools(["browser"])
    with pytest.raises(ValueError, match="exactly one of corpus= and search_url="):
        build_tools(["search"])
    assert set(build_tools(["search", "calculator"], corpus=CORPUS)) == {"search", "calculator"}


# ---------------------------------------------------------------- BM25 search


def test_search_finds_the_passage_that_answers_the_query():
    index = BM25Index(CORPUS)
    hits = index.search("capital of Germany", 3)
    assert hits[0].passage.doc_id == "d1"
    assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    assert index.search("Analytical Engine mathematician", 1)[0].passage.title == "Ada Lovelace"


def test_search_ties_keep_corpus_order_and_repeat_exactly():
    index = BM25Index(CORPUS)
    hits = index.search("lighthouse keeper", 2)
    assert [h.passage.doc_id for h in hits] == ["d4", "d5"]
    assert hits[0].score == hits[1].score
    assert [index.search("lighthouse keeper", 2) for _ in range(3)] == [hits] * 3
    # a tie straddling the cut-off: the earlier passage wins
    assert [h.passage.doc_id for h in index.search("lighthouse", 1)] == ["d4"]


def test_search_returns_only_matching_passages():
    index = BM25Index(CORPUS)
    assert index.search("zeppelin", 3) == []
    assert index.search("the of and", 3) == []  # stopwords only
    assert [h.passage.doc_id for h in index.search("Zurich", 5)] == ["d2"]
    assert BM25Index([]).search("anything", 3) == []


def test_search_tool_renders_search_r1_style_passages():
    tool = search_tool(CORPUS, topk=2)
    out = tool.fn(query="capital city")
    lines = out.split("\n")
    assert len(lines) == 2
    assert lines[0].startswith("Doc 1 (Title: ")
    assert lines[1].startswith("Doc 2 (Title: ")
    assert tool.fn(query="zeppelin") == NO_RESULTS
    with pytest.raises(ToolInputError, match="empty query"):
        tool.fn(query="  ")


def test_index_is_built_once_per_corpus_object():
    corpus = list(CORPUS)
    assert get_index(corpus) is get_index(corpus)
    assert get_index(list(CORPUS)) is not get_index(corpus)


def test_single_characters_and_digits_are_searchable():
    corpus = [Passage("a", "Route 7", "Route 7 runs north."), Passage("b", "Route 9", "Route 9 runs south.")]
    assert BM25Index(corpus).search("route 9", 1)[0].passage.doc_id == "b"


# ---------------------------------------------------------------- Search-R1 schema, server and client


def test_documents_round_trip_through_search_r1_contents():
    for passage in CORPUS:
        document = {"id": passage.doc_id, "contents": passage_contents(passage)}
        assert passage_from_document(document) == passage
    assert passage_contents(CORPUS[0]) == '"Paris"\nParis is the capital and largest city of France.'
    with pytest.raises(ValueError, match="string 'contents'"):
        passage_from_document({"id": "1"})


def _post(url: str, body: object) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_server_answers_in_the_search_r1_schema():
    with RetrievalServer(CORPUS) as server:
        status, reply = _post(server.url, {"queries": ["capital of France", "zeppelin"], "topk": 2, "return_scores": True})
        assert status == 200
        first, second = reply["result"]
        assert second == []
        assert first[0]["document"] == {"id": "d0", "contents": '"Paris"\nParis is the capital and largest city of France.'}
        assert isinstance(first[0]["score"], float) and first[0]["score"] > first[1]["score"]
        status, reply = _post(server.url, {"queries": ["capital of France"], "topk": 1})
        assert reply["result"] == [[{"id": "d0", "contents": '"Paris"\nParis is the capital and largest city of France.'}]]
        with urllib.request.urlopen(server.url.replace("/retrieve", "/health"), timeout=5) as response:
            assert json.loads(response.read()) == {"status": "ok", "documents": len(CORPUS)}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"topk": 3}, "'queries' must be a list of strings"),
        ({"queries": "capital"}, "'queries' must be a list of strings"),
        ({"queries": ["x"], "topk": 0.5}, "'topk' must be an integer"),
        ({"queries": ["x"], "topk": 100000}, "'topk' must be an integer"),
        ({"queries": ["x"], "return_scores": "yes"}, "'return_scores' must be true or false"),
        (["x"], "must be a JSON object"),
    ],
)
def test_server_rejects_malformed_requests_with_400(body, message):
    with RetrievalServer(CORPUS) as server:
        status, reply = _post(server.url, body)
    assert status == 400
    assert message in reply["error"]


def test_client_gives_the_same_results_as_local_search():
    local = search_tool(CORPUS, topk=3)
    index = get_index(CORPUS)
    queries = ["capital of France", "largest city", "lighthouse keeper", "zeppelin", "lake", 'He said "hello"']
    with RetrievalServer(CORPUS) as server:
        client = RetrievalClient(server.url, topk=3)
        remote = client.tool()
        assert remote.spec == local.spec
        for query in queries:
            assert remote.fn(query=query) == local.fn(query=query)
        assert client.retrieve(queries) == [index.search(q, 3) for q in queries]
        # a bare host:port gets /retrieve appended
        assert RetrievalClient(server.url.removesuffix("/retrieve")).url == server.url


class _SlowOrBrokenHandler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path == "/slow":
            time.sleep(1.0)
            body, status = b'{"result": [[]]}', 200
        elif self.path == "/error":
            body, status = b'{"error": "index not loaded"}', 503
        elif self.path == "/garbage":
            body, status = b"<html>not json</html>", 200
        else:
            body, status = b'{"answer": 42}', 200
        try:
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def log_message(self, *args: object) -> None:
        return


@pytest.fixture
def broken_server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _SlowOrBrokenHandler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.mark.parametrize(
    ("path", "error", "message"),
    [
        ("/slow", ToolTimeoutError, "did not answer within 0.2s"),
        ("/error", ToolUnavailableError, "answered HTTP 503: {\"error\": \"index not loaded\"}"),
        ("/garbage", ToolUnavailableError, "sent invalid JSON"),
        ("/schema", ToolUnavailableError, "sent a malformed reply"),
    ],
)
def test_client_turns_server_failures_into_clear_tool_errors(broken_server, path, error, message):
    client = RetrievalClient(broken_server + path, timeout_s=0.2, retries=0)
    with pytest.raises(error) as excinfo:
        client.search("anything")
    assert message in str(excinfo.value)
    result = run_tool({"search": client.tool()}, ToolCall("search", {"query": "anything"}))
    assert result.output.startswith("error: search: retrieval server at")
    assert result.error_kind == ("timeout" if error is ToolTimeoutError else "unavailable")


def test_client_reports_an_unreachable_server():
    with RetrievalServer(CORPUS) as server:
        url = server.url
    client = RetrievalClient(url, timeout_s=1.0, retries=1)
    with pytest.raises(ToolUnavailableError, match="cannot reach retrieval server"):
        client.search("capital")
    with pytest.raises(ValueError, match="must start with http"):
        RetrievalClient("localhost:8000")


def test_server_runs_as_a_module_on_a_search_r1_corpus_file(tmp_path: Path):
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"id": p.doc_id, "contents": passage_contents(p)}) + "\n" for p in CORPUS))
    assert load_corpus_jsonl(path) == CORPUS
    process = subprocess.Popen(
        [sys.executable, "-m", "trace_rl.agent.tools.retrieval_server", "--corpus", str(path), "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        banner = json.loads(process.stdout.readline())
        assert banner["documents"] == len(CORPUS)
        client = RetrievalClient(banner["url"], topk=2)
        assert client.search("capital of Germany") == search_tool(CORPUS, topk=2).fn(query="capital of Germany")
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_scores_survive_the_json_round_trip_exactly():
    with RetrievalServer(CORPUS) as server:
        (remote,) = RetrievalClient(server.url).retrieve(["capital city of France"], topk=5)
    local = get_index(CORPUS).search("capital city of France", 5)
    assert [h.score for h in remote] == [h.score for h in local]
    assert all(math.isfinite(h.score) for h in remote)
    assert format_hits(remote) == format_hits(local)


def test_python_tool_output_and_timeout_are_recorded_by_run_tool():
    from trace_rl.agent.tools.python_tool import python_tool

    skip_without_sandbox()
    tools = {"python": python_tool(timeout_s=0.5)}
    ok = run_tool(tools, ToolCall("python", {"code": "print(6 * 7)"}))
    assert ok.ok and ok.output == "42"
    slow = run_tool(tools, ToolCall("python", {"code": "while True:\n    pass"}))
    assert slow.timed_out and slow.error_kind == "timeout"
    assert slow.output.startswith("error: python: ") and "timed out" in slow.output


def test_search_gives_the_same_results_from_many_threads():
    from concurrent.futures import ThreadPoolExecutor

    index = get_index(CORPUS)
    queries = ["capital", "largest city", "lighthouse keeper", "lake Zurich", "mathematician", "zeppelin"] * 20
    sequential = [index.search(q, 3) for q in queries]
    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(lambda q: index.search(q, 3), queries)) == sequential
