"""ReAct turn formats: prompts, parsing of every malformed case, round trips, observations."""

from __future__ import annotations

import json

import pytest

from trace_rl.agent.protocol import (
    ANSWER,
    FORMATS,
    JsonFormat,
    TagFormat,
    ToolParam,
    ToolSpec,
    check_arguments,
    get_format,
    tool_schema,
)
from trace_rl.agent.types import Task, ToolCall

SEARCH = ToolSpec("search", "Search the corpus.", (ToolParam("query", "string", "what to look for"),))
CALC = ToolSpec("calculator", "Do arithmetic.", (ToolParam("expression", "string", "an expression"),))
PYTHON = ToolSpec("python", "Run Python code.", (ToolParam("code", "string", "a program"),))
TOPK = ToolSpec(
    "lookup",
    "Look something up.",
    (ToolParam("query", "string"), ToolParam("k", "integer", required=False), ToolParam("exact", "boolean", required=False)),
)
TOOLS = (SEARCH, CALC, PYTHON)
TASK = Task("t0", "Who wrote Hamlet?", ("Shakespeare",), "test", tools=("search", "calculator", "python"))

TAG = TagFormat()
JSON = JsonFormat()

CALLS = [
    ToolCall("search", {"query": "author of Hamlet"}),
    ToolCall("calculator", {"expression": "(3 + 4) * 2"}),
    ToolCall("python", {"code": "x = 3\nif x:\n    print(x * 2)"}),
    ToolCall(ANSWER, {"answer": "William Shakespeare"}),
]


# ---------------------------------------------------------------- shared behaviour


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=list(FORMATS))
@pytest.mark.parametrize("call", CALLS, ids=[c.name for c in CALLS])
def test_render_call_parses_back_to_the_same_call(fmt, call):
    text = fmt.render_call(call, thought="Let me think.")
    parsed = fmt.parse_turn(text, TOOLS)
    assert parsed.error is None
    assert parsed.call == call
    assert parsed.thought == "Let me think."
    assert parsed.action and parsed.action in text
    assert parsed.trailing == ""


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=list(FORMATS))
def test_prompt_lists_only_the_tasks_tools_and_the_question(fmt):
    messages = fmt.messages(TASK, [SEARCH])
    assert [m["role"] for m in messages] == ["system", "user"]
    system, user = messages[0]["content"], messages[1]["content"]
    assert "search" in system and "Search the corpus." in system
    assert "calculator" not in system
    assert "<answer>" in system
    assert user == "Question: Who wrote Hamlet?"
    text = fmt.render_prompt(TASK, [SEARCH])
    assert text.startswith(system) and "Question: Who wrote Hamlet?" in text


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=list(FORMATS))
def test_task_without_tools_can_only_answer(fmt):
    assert fmt.stop_strings([]) == ("</answer>",)
    parsed = fmt.parse_turn("<search>x</search>", [])
    assert parsed.call is None and "not an action" in parsed.error
    assert fmt.parse_turn("<answer>42</answer>", []).call == ToolCall(ANSWER, {"answer": "42"})


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=list(FORMATS))
def test_every_stop_string_ends_a_parseable_action(fmt):
    for call in CALLS:
        text = fmt.render_call(call)
        assert any(text.endswith(stop) for stop in fmt.stop_strings(TOOLS))


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=list(FORMATS))
def test_first_action_wins_and_the_rest_is_kept_as_trailing(fmt):
    first = fmt.render_call(CALLS[0])
    second = fmt.render_call(CALLS[3])
    text = f"<think>two at once</think>{first}\n{second}"
    parsed = fmt.parse_turn(text, TOOLS)
    assert parsed.call == CALLS[0]
    assert parsed.trailing == "\n" + second


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=list(FORMATS))
def test_text_after_the_action_is_ignored_and_recorded(fmt):
    text = fmt.render_call(CALLS[0]) + " and some chatter <information>made up</information>"
    parsed = fmt.parse_turn(text, TOOLS)
    assert parsed.call == CALLS[0]
    assert parsed.trailing.startswith(" and some chatter")


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=list(FORMATS))
def test_action_inside_the_thought_is_ignored(fmt):
    text = "<think>I could write <answer>Marlowe</answer> but no.</think>" + fmt.render_call(CALLS[0])
    parsed = fmt.parse_turn(text, TOOLS)
    assert parsed.call == CALLS[0]
    assert "Marlowe" in parsed.thought


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=list(FORMATS))
def test_closing_think_without_opening_one_is_a_thought(fmt):
    # Chat templates (Qwen3, R1 distills) open <think> in the prompt, so the turn starts inside it.
    parsed = fmt.parse_turn("reasoning here</think>\n<answer>Shakespeare</answer>", TOOLS)
    assert parsed.thought == "reasoning here"
    assert parsed.call == ToolCall(ANSWER, {"answer": "Shakespeare"})


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=list(FORMATS))
def test_unclosed_think_still_finds_the_action(fmt):
    parsed = fmt.parse_turn("<think>hmm, I know this <answer>Shakespeare</answer>", TOOLS)
    assert parsed.call == ToolCall(ANSWER, {"answer": "Shakespeare"})
    assert parsed.thought == "hmm, I know this"


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=list(FORMATS))
def test_free_text_without_think_tags_is_the_thought(fmt):
    parsed = fmt.parse_turn("I am confident.\n<answer>Shakespeare</answer>", TOOLS)
    assert parsed.thought == "I am confident."


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=list(FORMATS))
@pytest.mark.parametrize("text", ["", "   ", "Shakespeare", "<think>only thinking</think>", "answer: Shakespeare"])
def test_turn_without_action_is_an_error_that_says_how_to_act(fmt, text):
    parsed = fmt.parse_turn(text, TOOLS)
    assert parsed.call is None and not parsed.ok
    assert parsed.error.startswith("no action found")
    assert "<answer>…</answer>" in parsed.error
    assert parsed.action == ""


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=list(FORMATS))
def test_unclosed_action_is_an_error_naming_the_closing_tag(fmt):
    opener = "<search>" if fmt.name == "tag" else "<tool_call>"
    parsed = fmt.parse_turn(f"<think>x</think>{opener}author of Hamlet", TOOLS)
    assert parsed.call is None
    assert parsed.error.startswith(f"unclosed {opener}")
    assert opener.replace("<", "</") in parsed.error
    assert parsed.action == f"{opener}author of Hamlet"


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=list(FORMATS))
@pytest.mark.parametrize("body", ["", "   ", "\n\n"])
def test_empty_answer_is_an_error(fmt, body):
    parsed = fmt.parse_turn(f"<answer>{body}</answer>", TOOLS)
    assert parsed.call is None and parsed.error.startswith("empty answer")


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=list(FORMATS))
def test_unknown_tag_before_the_action_is_an_error(fmt):
    parsed = fmt.parse_turn("<wikipedia>Hamlet</wikipedia>", TOOLS)
    assert parsed.call is None
    assert parsed.error.startswith("<wikipedia> is not an action")


def test_answer_as_a_tool_name_is_reserved():
    with pytest.raises(ValueError, match="reserved"):
        TAG.parse_turn("<answer>x</answer>", [ToolSpec(ANSWER, "no", (ToolParam("answer"),))])


def test_get_format_suggests_the_closest_name():
    assert get_format("tag") is FORMATS["tag"]
    with pytest.raises(ValueError, match="did you mean 'json'"):
        get_format("jsn")


# ---------------------------------------------------------------- tag format


def test_tag_format_strips_and_dedents_contents():
    parsed = TAG.parse_turn("<python>\n    x = 1\n    print(x)\n</python>", TOOLS)
    assert parsed.call == ToolCall("python", {"code": "x = 1\nprint(x)"})
    assert TAG.parse_turn("<search>  Hamlet  </search>", TOOLS).call == ToolCall("search", {"query": "Hamlet"})


@pytest.mark.parametrize("tag", ["search", "calculator", "python"])
def test_tag_format_empty_argument_is_an_error(tag):
    parsed = TAG.parse_turn(f"<think>x</think><{tag}> </{tag}>", TOOLS)
    assert parsed.call is None
    assert parsed.error.startswith(f"empty <{tag}>")


def test_tag_format_tool_not_available_for_the_task_is_an_error():
    parsed = TAG.parse_turn("<python>print(1)</python>", [SEARCH])
    assert parsed.call is None
    assert "<python> is not an action" in parsed.error
    assert "<search>…</search>" in parsed.error and "<python>" not in parsed.error.split("one of:")[1]


def test_tag_format_unclosed_unknown_tag_is_not_an_action():
    parsed = TAG.parse_turn("I think a<b then <search>Hamlet</search>", TOOLS)
    assert parsed.call == ToolCall("search", {"query": "Hamlet"})


def test_tag_format_mismatched_closing_tag_is_unclosed():
    parsed = TAG.parse_turn("<search>Hamlet</answer>", TOOLS)
    assert parsed.error.startswith("unclosed <search>")


def test_tag_format_stop_strings_close_every_action():
    assert TAG.stop_strings(TOOLS) == ("</search>", "</calculator>", "</python>", "</answer>")


def test_tag_format_observation_is_wrapped_in_information():
    assert TAG.render_observation("Doc 1") == "\n\n<information>Doc 1</information>\n\n"
    assert TAG.observation_message("Doc 1") == {"role": "user", "content": "<information>Doc 1</information>"}


def test_tag_format_refuses_to_write_what_it_cannot_parse_back():
    with pytest.raises(ValueError, match="contains '</python>'"):
        TAG.render_call(ToolCall("python", {"code": "print('</python>')"}))
    with pytest.raises(ValueError, match="exactly one argument"):
        TAG.render_call(ToolCall("lookup", {"query": "x", "k": 3}))
    with pytest.raises(ValueError, match="stripped"):
        TAG.render_call(ToolCall("search", {"query": " padded "}))


def test_tag_format_prompt_shows_each_action_with_its_placeholder():
    system = TAG.system_prompt(TOOLS)
    assert "<search>QUERY</search>: Search the corpus." in system
    assert "<calculator>EXPRESSION</calculator>" in system
    assert "<information>" in system


# ---------------------------------------------------------------- json format


def _tool_call(body: str) -> str:
    return f"<think>t</think>\n<tool_call>\n{body}\n</tool_call>"


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("{not json}", "invalid JSON in <tool_call>"),
        ('{"name": "search", "arguments": {"query": "x"}', "invalid JSON in <tool_call>"),
        ("", "invalid JSON in <tool_call>"),
        ('["search", "x"]', "<tool_call> must hold a JSON object"),
        ('{"arguments": {"query": "x"}}', '"name" must be a string'),
        ('{"name": 3, "arguments": {"query": "x"}}', '"name" must be a string'),
        ('{"name": "browse", "arguments": {"url": "x"}}', "unknown tool 'browse'; available tools: search, calculator, python"),
        ('{"name": "answer", "arguments": {"answer": "x"}}', "not a tool call"),
        ('{"name": "search", "arguments": {"query": 5}}', "search: argument 'query' must be a string, got integer"),
        ('{"name": "search", "arguments": {"query": ["a"]}}', "must be a string, got array"),
        ('{"name": "search", "arguments": {"query": "  "}}', "argument 'query' is empty"),
        ('{"name": "search", "arguments": {}}', "missing argument 'query'"),
        ('{"name": "search"}', "missing argument 'query'"),
        ('{"name": "search", "arguments": {"q": "x"}}', "unexpected argument 'q'"),
        ('{"name": "search", "arguments": "{\\"query\\": \\"x\\"}"}', "arguments must be a JSON object, got string"),
        ('{"name": "search", "arguments": {"query": "x"}, "id": 1}', "unexpected key 'id'"),
    ],
)
def test_json_format_malformed_tool_calls_explain_the_problem(body, expected):
    parsed = JSON.parse_turn(_tool_call(body), TOOLS)
    assert parsed.call is None
    assert expected in parsed.error
    assert parsed.action.startswith("<tool_call>") and parsed.action.endswith("</tool_call>")


def test_json_format_checks_integer_and_boolean_parameters():
    ok = JSON.parse_turn(_tool_call('{"name": "lookup", "arguments": {"query": "x", "k": 2, "exact": true}}'), [TOPK])
    assert ok.call == ToolCall("lookup", {"query": "x", "k": 2, "exact": True})
    cases = [('"k": 2.5', "'k' must be an integer"), ('"k": true', "'k' must be an integer"), ('"exact": 1', "'exact' must be a boolean")]
    for bad, message in cases:
        parsed = JSON.parse_turn(_tool_call(f'{{"name": "lookup", "arguments": {{"query": "x", {bad}}}}}'), [TOPK])
        assert parsed.call is None and message in parsed.error


def test_json_format_search_tag_is_not_an_action():
    parsed = JSON.parse_turn("<search>Hamlet</search>", TOOLS)
    assert parsed.call is None
    assert parsed.error.startswith("<search> is not an action")
    assert "<tool_call>" in parsed.error


def test_json_format_observation_is_a_tool_response():
    assert JSON.render_observation("42") == "\n<tool_response>\n42\n</tool_response>\n"
    assert JSON.observation_message("42") == {"role": "tool", "content": "42"}


def test_json_format_prompt_holds_the_tool_schemas():
    system = JSON.system_prompt(TOOLS)
    start, end = system.index("<tools>\n") + len("<tools>\n"), system.index("\n</tools>")
    schemas = [json.loads(line) for line in system[start:end].splitlines()]
    assert schemas == [tool_schema(spec) for spec in TOOLS]
    assert schemas[0]["function"]["parameters"]["required"] == ["query"]
    assert JSON.stop_strings(TOOLS) == ("</tool_call>", "</answer>")


def test_check_arguments_accepts_optional_parameters_left_out():
    assert check_arguments(TOPK, {"query": "x"}) is None
    assert check_arguments(TOPK, {"query": "x", "k": 3}) is None
    assert "must be a JSON object" in check_arguments(TOPK, None)
