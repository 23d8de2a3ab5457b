"""Model output cannot stall or kill a run (issue 12, class 1).

`parse_turn` is total and linear in both formats, every tool call is bounded in time and output, and
`ToolEnv.step` turns whatever the model writes into an observation. Each example of the issue is a
test through the real entry points; a seeded fuzz test then sends 10,000 generated outputs through
`parse_turn` and `ToolEnv.step` in both formats.
"""

from __future__ import annotations

import json
import logging
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from conftest import skip_without_sandbox

from trace_rl.agent.env import StepResult, ToolEnv
from trace_rl.agent.protocol import (
    FORMATS,
    MAX_JSON_DEPTH,
    ParsedTurn,
    ToolParam,
    ToolSpec,
    get_format,
)
from trace_rl.agent.tools import Tool, build_tools
from trace_rl.agent.tools.python_tool import python_tool
from trace_rl.agent.tools.search import (
    MAX_QUERY_CHARS,
    MAX_REPLY_BYTES,
    RetrievalClient,
)
from trace_rl.agent.types import Passage, Task, ToolCall

CORPUS = [
    Passage("d0", "Paris", "Paris is the capital and largest city of France."),
    Passage("d1", "Ada Lovelace", "Ada Lovelace was an English mathematician who wrote about the Analytical Engine."),
    Passage("d2", "Lake Zurich", "Lake Zurich is a lake in Switzerland, south-east of the city of Zurich."),
]
CAPITAL = Task("capital", "What is the capital of France?", ("Paris",), "toy", tools=("search", "calculator"))
PRODUCT = Task("product", "What is 6 * 7?", ("42",), "toy", tools=("calculator",), scorer="numeric")
FORMAT_NAMES = list(FORMATS)
SPECS = [tool.spec for tool in build_tools(["calculator"]).values()]


def real_env(fmt: str, **kwargs) -> ToolEnv:
    """The real tools (BM25 search over CORPUS, the calculator) and the real scorers."""
    return ToolEnv(build_tools(["search", "calculator"], corpus=CORPUS), turn_format=fmt, **kwargs)


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def tool_call(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


# ---------------------------------------------------------------- parse_turn: total and linear


def test_json_tool_call_nested_a_thousand_deep_is_a_parse_error_not_a_recursion_error():
    text = tool_call("[" * 1000 + "]" * 1000)
    parsed = get_format("json").parse_turn(text, SPECS)
    assert not parsed.ok and f"nested more than {MAX_JSON_DEPTH} levels" in parsed.error
    env = real_env("json")
    env.reset(CAPITAL)
    result = env.step(text)
    assert result.info.parse_error == parsed.error and result.info.observation == f"error: {parsed.error}"
    brackets = "[" * 5000 + '\\"'  # inside a string, brackets and escaped quotes nest nothing
    quoted = get_format("json").parse_turn(tool_call(json.dumps({"name": "calculator", "arguments": {"expression": brackets}})), SPECS)
    assert quoted.ok and quoted.call.arguments["expression"] == brackets


def test_json_tool_call_with_a_4301_digit_integer_is_a_parse_error_not_a_value_error():
    text = tool_call('{"name": "calculator", "arguments": {"expression": ' + "7" * 4301 + "}}")
    parsed = get_format("json").parse_turn(text, SPECS)
    assert not parsed.ok and "an integer with 4301 digits" in parsed.error
    env = real_env("json")
    env.reset(PRODUCT)
    assert env.step(text).info.parse_error == parsed.error


@pytest.mark.parametrize(
    ("number", "message"),
    [("1e999", "beyond the float range"), ("-1e999", "beyond the float range"), ("NaN", "NaN is not a JSON number"),
     ("Infinity", "Infinity is not a JSON number"), ("-Infinity", "-Infinity is not a JSON number")],
)
def test_json_numbers_no_tool_can_take_are_parse_errors(number, message):
    """NaN / inf would reach a number parameter, and trees are written with allow_nan=False."""
    scale = ToolSpec("scale", "Scale a value.", (ToolParam("query"), ToolParam("factor", "number")))
    parsed = get_format("json").parse_turn(tool_call(f'{{"name": "scale", "arguments": {{"query": "x", "factor": {number}}}}}'), [scale])
    assert not parsed.ok and message in parsed.error


def test_json_string_argument_with_an_unpaired_surrogate_is_a_parse_error():
    """json.loads turns "\\ud800" into a str that has no UTF-8 form: the tree file could not be written."""
    parsed = get_format("json").parse_turn(tool_call(r'{"name": "calculator", "arguments": {"expression": "1\ud800"}}'), SPECS)
    assert not parsed.ok and "unpaired" in parsed.error
    paired = get_format("json").parse_turn(tool_call(r'{"name": "calculator", "arguments": {"expression": "\ud83d\ude00"}}'), SPECS)
    assert paired.ok and paired.call.arguments["expression"] == "\U0001f600"


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
@pytest.mark.parametrize("tail", ["", "<answer>42</answer>"])
def test_unclosed_unknown_tags_parse_in_linear_time(fmt, tail):
    """'<a>' * 100000 took seconds: each opening tag searched the rest of the text for its closing tag."""
    text = "<a>" * 100_000 + tail
    parsed, seconds = timed(lambda: get_format(fmt).parse_turn(text, SPECS))
    assert seconds < 1.0, f"{seconds:.2f}s"
    assert parsed.ok == bool(tail)
    if not tail:
        assert parsed.error.startswith("no action found")


# ---------------------------------------------------------------- the calculator: bounded work


def test_issue_example_round_to_minus_a_billion_digits_is_refused_at_once():
    """`round(1,-10**9)` computed 10**(10**9) for hours, out of reach of any in-process timeout, so
    the step runs in a child process that the test can stop."""
    code = (
        "from trace_rl.agent.env import ToolEnv\n"
        "from trace_rl.agent.tools import build_tools\n"
        "from trace_rl.agent.types import Task\n"
        "env = ToolEnv(build_tools(['calculator']))\n"
        "env.reset(Task('t', 'q', ('1',), 'toy', tools=('calculator',), scorer='numeric'))\n"
        "info = env.step('<calculator>round(1,-10**9)</calculator>').info\n"
        "print(info.tool_error, info.tool_seconds, info.observation, sep='\\n')\n"
    )
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail("ToolEnv.step on <calculator>round(1,-10**9)</calculator> ran for more than 60 s")
    assert done.returncode == 0, done.stderr
    kind, seconds, observation = done.stdout.splitlines()
    assert kind == "input" and float(seconds) < 0.1
    assert observation == "error: calculator: round(): ndigits must be between -100 and 100, got -1000000000"


@pytest.mark.parametrize(
    ("expression", "message", "neighbour", "value"),
    [
        # 10**(10**6) took 0.5 s (10**7: 23 s); the refusal comes before any work
        ("round(1, -10**6)", "round(): ndigits must be between -100 and 100", "round(123456, -3)", "123000"),
        ("floor(1e300)", "result too large (more than 100 digits)", "floor(1e15)", "1000000000000000"),  # was "undefined"
        ("round(1e300)", "result too large (more than 100 digits)", "round(2.5, 100)", "2.5"),
        ("9" * 101, "result too large (more than 100 digits)", "9" * 100, "9" * 100),  # literals obey the value bound
        ("-" * 300 + "1", "expression nested too deeply", "+".join(["1"] * 150), "150"),
    ],
)
def test_calculator_bounds_every_value_and_refuses_unbounded_work_first(expression, message, neighbour, value):
    """Each refusal, and a neighbouring expression just inside the bound that still works."""
    env = real_env("tag")
    env.reset(PRODUCT)
    result, seconds = timed(lambda: env.step(f"<calculator>{expression}</calculator>"))
    assert seconds < 0.1, f"{seconds:.3f}s"
    assert result.info.tool_error == "input"
    assert result.info.observation.startswith(f"error: calculator: {message}")
    assert env.step(f"<calculator>{neighbour}</calculator>").info.observation == value


# ---------------------------------------------------------------- run_tool: crashes are observations


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_a_crashing_tool_is_an_observation_recorded_as_a_crash(fmt, caplog):
    def lookup(query: str) -> str:
        """Look something up."""
        if query == "int":
            return 7  # type: ignore[return-value]
        return {"known": "yes"}[query]

    env = ToolEnv({"search": Tool.from_function(lookup, name="search")}, turn_format=fmt)
    env.reset(Task("t", "q", ("yes",), "toy", tools=("search",)))
    with caplog.at_level(logging.ERROR, logger="trace_rl.agent.tools"):
        crash = env.step(env.format.render_call(ToolCall("search", {"query": "unknown"})))
    assert crash.info.tool_error == "crash" and not crash.done
    assert crash.info.observation == "error: search: the tool crashed (KeyError: 'unknown')"
    assert "Traceback" in caplog.text and "KeyError" in caplog.text  # loud: our bug, with its traceback
    wrong_type = env.step(env.format.render_call(ToolCall("search", {"query": "int"})))
    assert wrong_type.info.tool_error == "crash" and "returned int, not text" in wrong_type.info.observation
    assert env.step(env.format.render_call(ToolCall("search", {"query": "known"}))).info.observation == "yes"


def test_overlong_search_query_is_refused_before_any_work():
    env = real_env("tag")
    env.reset(CAPITAL)
    query = "capital of France " * (MAX_QUERY_CHARS // 18 + 1)
    result = env.step(f"<search>{query}</search>")
    assert result.info.tool_error == "input"
    assert result.info.observation.startswith(f"error: search: query too long ({len(query.strip())} characters")


# ---------------------------------------------------------------- the retrieval client: bounded in time and size


class _MisbehavingServer(BaseHTTPRequestHandler):
    """/trickle: a valid reply, one byte every 50 ms; /short: fewer bytes than Content-Length; /huge: too big."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = json.dumps({"result": [[{"document": {"id": "d0", "contents": '"Paris"\nParis.'}, "score": 1.0}]]}).encode()
        if self.path == "/huge":
            body = b" " * (MAX_REPLY_BYTES + 1) + body
        self.send_response(200)
        self.send_header("Content-Length", str(len(body) + (100 if self.path == "/short" else 0)))
        self.end_headers()
        try:
            if self.path == "/trickle":
                for byte in body:
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                    time.sleep(0.05)
            else:
                self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def log_message(self, *args: object) -> None:
        return


@pytest.fixture
def misbehaving_server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _MisbehavingServer)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.mark.parametrize(
    ("path", "kind", "message", "limit_s"),
    [
        ("/trickle", "timeout", "did not answer within 0.5s", 1.5),  # per-read timeouts let it run ~5 s
        ("/short", "unavailable", "IncompleteRead", 2.0),  # escaped from ToolEnv.step before
        ("/huge", "unavailable", f"sent a reply over {MAX_REPLY_BYTES} bytes", 5.0),
    ],
)
def test_a_misbehaving_retrieval_server_becomes_a_bounded_observation(misbehaving_server, path, kind, message, limit_s):
    client = RetrievalClient(misbehaving_server + path, timeout_s=0.5, retries=1)
    env = ToolEnv({"search": client.tool()}, turn_format="json")
    env.reset(Task("t", "q", ("Paris",), "toy", tools=("search",)))
    result, seconds = timed(lambda: env.step(tool_call('{"name": "search", "arguments": {"query": "capital"}}')))
    assert result.info.tool_error == kind and message in result.info.observation
    assert seconds < limit_s, f"{seconds:.2f}s"


# ---------------------------------------------------------------- fuzz


WORDS = ["Paris", "capital", "France", "Ada", "lake", "42", "6 * 7", "the", "é", "日本", "\n", " ", "\t"]
TAGS = ["think", "search", "calculator", "python", "answer", "tool_call", "information", "tool_response", "a", "b-1", "_"]
CALC_BOMBS = [
    "round(1, -10**7)", "round(1, -10**9 + 1)", "9**9**9", "10**10**10", "2**2**2**2**2", "(10**100)**(10**100)",
    "round(10**99, -10**5)", "round(1.5, 10**9)", "floor(1e308)", "ceil(-1e308)", "exp(1000)", "log(0)", "sqrt(-1)",
    "1/0", "0**-1", "(-1)**0.5", "1e309", "9" * 400, "-" * 400 + "1", "(" * 150 + "1" + ")" * 150, "1" + "*1" * 240,
    "max(" + ",".join(["9" * 90] * 4) + ")", "__import__('os').system('true')", "round(1, 2.5)", "abs(*[1])",
    "10**99 * 10**99", "(10**99) // 1e-300", "99**99 % 7", "log(10**100, 0.5)", "min()",
]


def _size(rng: random.Random) -> int:
    """Mostly short outputs, one in ten long (up to 200,000 characters), as a stuck model writes."""
    return rng.randint(0, 2000) if rng.random() < 0.9 else int(10 ** rng.uniform(3.3, 5.3))


def _json_value(rng: random.Random) -> str:
    return rng.choice([
        json.dumps(rng.choice(WORDS)), str(rng.randint(-10**6, 10**6)), "9" * rng.randint(90, 6000), "1e" + "9" * rng.randint(1, 5),
        "NaN", "-Infinity", "null", "true", "[]", "{}", '"\\ud800"', '"\\udc00x"', '"\\ud83d\\ude00"', json.dumps(rng.choice(CALC_BOMBS)),
        "[" * rng.randint(1, 3000), '{"a": ' * rng.randint(1, 3000), json.dumps("x" * _size(rng)),
    ])


def _bad_tool_call(rng: random.Random) -> str:
    name = rng.choice(['"search"', '"calculator"', '"python"', '"answer"', '"nope"', "7", "null", '"search', ""])
    key = rng.choice(['"query"', '"expression"', '"code"', '"answer"', '"q"', ""])
    bodies = [
        f'{{"name": {name}, "arguments": {{{key}: {_json_value(rng)}}}}}',
        f'{{"name": {name}, "arguments": {_json_value(rng)}}}',
        f'{{"name": {name}, "arguments": {{{key}: {_json_value(rng)}}}, "extra": 1}}',
        f'{{"name": {name}}}', f'[{name}]', f'{{"name": {name}, "arguments": {{{key}: {_json_value(rng)}',
        f'{{"name": {name}, "name": {name}, "arguments": {{}}}}',
    ]
    body = rng.choice(bodies)
    return rng.choice([tool_call(body), f"<tool_call>{body}", f"<think>x</think>{tool_call(body)}trailing</tool_call>"])


def _tag_soup(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(1, 80)):
        tag = rng.choice(TAGS)
        parts.append(rng.choice([f"<{tag}>", f"</{tag}>", f"<{tag}", "<", ">", "</", rng.choice(WORDS), "{", "}", '"', "\\"]))
    return "".join(parts)


def _nested_tags(rng: random.Random) -> str:
    tag, n = rng.choice(TAGS), _size(rng) // 4 + 1
    opened = f"<{tag}>" * n
    return rng.choice([opened, opened + f"</{tag}>" * rng.randint(0, n), f"<think>{opened}</think>", opened + "<answer>x</answer>"])


def _tool_call_text(rng: random.Random, name: str, argument: str, value: str) -> str:
    if rng.random() < 0.5:
        return f"<{name}>{value}</{name}>"
    return tool_call(json.dumps({"name": name, "arguments": {argument: value}}))


def _long_string(rng: random.Random) -> str:
    filler = rng.choice(["x", "Paris ", "<", "</", "\\", "{", "9", " ", "\n"]) * _size(rng)
    name, argument = rng.choice([("search", "query"), ("calculator", "expression"), ("answer", "answer")])
    return rng.choice([filler, _tool_call_text(rng, name, argument, filler), f"<answer>{filler}</answer>", f"<think>{filler}"])


def _valid_or_near(rng: random.Random) -> str:
    name, argument, value = rng.choice([
        ("search", "query", rng.choice(WORDS[:6])), ("calculator", "expression", rng.choice(["6 * 7", "2 ** 10", "sqrt(2)"])),
        ("calculator", "expression", rng.choice(CALC_BOMBS)), ("answer", "answer", rng.choice(["Paris", "42", "42.0", "1e999"])),
        ("python", "code", "print(1)"), ("search", "query", "  "),
    ])
    text = _tool_call_text(rng, name, argument, value) if name != "answer" else f"<answer>{value}</answer>"
    return rng.choice(["", "<think>hmm</think>", "reasoning</think>\n"]) + text + rng.choice(["", "<information>x</information>", "<answer>"])


GENERATORS: dict[str, Callable[[random.Random], str]] = {
    "random_bytes": lambda rng: rng.randbytes(_size(rng)).decode("utf-8", "replace"),  # as a tokenizer decodes
    "tag_soup": _tag_soup,
    "nested_tags": _nested_tags,
    "huge_number": lambda rng: rng.choice([
        f"<calculator>{'9' * _size(rng)}</calculator>", tool_call('{"name": "calculator", "arguments": {"expression": ' + "9" * (_size(rng) + 1) + "}}"),
        f"<answer>{'9' * _size(rng)}</answer>", f"<answer>1e{'9' * rng.randint(1, 400)}</answer>",
    ]),
    "deep_json": lambda rng: tool_call(rng.choice(["[", "{", '{"a": ', '["', "[{"]) * (_size(rng) + 1)),
    "long_string": _long_string,
    "bad_tool_call": _bad_tool_call,
    "valid_or_near": _valid_or_near,
}


def fuzz_outputs(seed: int, count: int) -> Iterator[tuple[str, str]]:
    """`count` generated model outputs as (generator name, text), the same for the same seed."""
    rng = random.Random(seed)
    names = sorted(GENERATORS)
    for _ in range(count):
        name = rng.choice(names)
        yield name, GENERATORS[name](rng)


def _check_step(result: object) -> None:
    assert isinstance(result, StepResult) and isinstance(result.observation, str)
    # What the tree file needs of every step (tree.py writes JSON with these options, in UTF-8).
    json.dumps(result.info.to_dict(), ensure_ascii=False, allow_nan=False).encode("utf-8")


def _parse_and_step(env: ToolEnv, text: str) -> tuple[float, float]:
    """Seconds taken by `parse_turn` and by `ToolEnv.step` on one output, each result checked."""
    parsed, parse_s = timed(lambda: env.format.parse_turn(text, env.tool_specs(env.task)))
    assert isinstance(parsed, ParsedTurn) and parsed.text is text
    assert (parsed.call is None) != (parsed.error is None)
    result, step_s = timed(lambda: env.step(text))
    _check_step(result)
    return parse_s, step_s


def test_fuzzed_model_output_never_raises_and_every_call_is_fast():
    count, limit_s = 10_000, 1.0
    envs = {fmt: real_env(fmt, max_turns=4) for fmt in FORMAT_NAMES}
    tasks = [CAPITAL, PRODUCT]
    failures: list[str] = []
    worst = (0.0, "", "")
    for index, (kind, text) in enumerate(fuzz_outputs(seed=12, count=count)):
        for fmt, env in envs.items():
            if env.done:
                env.reset(tasks[index % len(tasks)])
            try:
                parse_s, step_s = _parse_and_step(env, text)
            except Exception as exc:  # noqa: BLE001 (collected, so one run reports every failing kind)
                failures.append(f"[{fmt}] on {kind} {text[:120]!r}: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            for entry, seconds in (("parse_turn", parse_s), ("ToolEnv.step", step_s)):
                if seconds > worst[0]:
                    worst = (seconds, f"{entry} [{fmt}]", f"{kind}, {len(text)} characters")
    calls = 2 * len(envs) * count
    print(json.dumps({"fuzz_outputs": count, "calls": calls, "seed": 12, "worst_s": round(worst[0], 4), "worst": worst[1:]}))
    assert not failures, f"{len(failures)} failures, first ones:\n" + "\n".join(failures[:8])
    assert worst[0] < limit_s, f"slowest call {worst[0]:.3f}s: {worst[1]} on {worst[2]}"


PROGRAMS = [
    "print(1)", "while True: pass", "print('x' * 10**7)", "x = bytearray(10**10)", "import sys; sys.exit(3)",
    "def f(): return f()\nf()", "raise ValueError('boom')", "print(input())", "print(open('/etc/hostname').read())",
    "import os; os.kill(os.getpid(), 9)", "print('\\ud800')", "1 +", "  ",
]


def test_fuzzed_python_tool_calls_are_bounded_observations():
    skip_without_sandbox()
    timeout_s, count = 0.5, 120
    tools = {"python": python_tool(timeout_s=timeout_s)}
    task = Task("t", "q", ("1",), "toy", tools=("python",))
    envs = {fmt: ToolEnv(tools, turn_format=fmt, max_turns=4) for fmt in FORMAT_NAMES}
    rng = random.Random(12)
    worst = 0.0
    for index in range(count):
        program = rng.choice(PROGRAMS) if index % 3 else rng.randbytes(rng.randint(0, 300)).decode("utf-8", "replace")
        fmt = FORMAT_NAMES[index % 2]
        env = envs[fmt]
        if env.done:
            env.reset(task)
        if fmt == "tag":
            text = f"<python>{program}</python>"
        elif index % 5 == 0:  # the model writes its own escapes, an unpaired surrogate among them
            text = tool_call('{"name": "python", "arguments": {"code": "print(\\"\\ud800\\")"}}')
        else:
            text = tool_call(json.dumps({"name": "python", "arguments": {"code": program}}))
        result, seconds = timed(lambda: env.step(text))  # noqa: B023 (called at once)
        _check_step(result)
        assert len(result.info.observation) <= env.max_observation_chars + 100
        worst = max(worst, seconds)
    print(json.dumps({"python_calls": count, "timeout_s": timeout_s, "worst_s": round(worst, 3)}))
    assert worst < timeout_s + 3.0
